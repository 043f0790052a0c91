// What every binding file of allscan._C shares: a C API result turned into a Python exception
// (ValueError for a bad argument, RuntimeError otherwise, with the library's last-error message)
// and integers turned into pointers. No libtorch.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "allscan/common.h"

namespace allscan_py {

template <typename T> T* ptr(std::uintptr_t v) { return reinterpret_cast<T*>(v); }

inline void check(allscanResult_t r) {
  if (r == allscanSuccess) return;
  std::string msg = std::string("allscan: ") + allscanGetLastError();
  if (r == allscanInvalidArgument) throw pybind11::value_error(msg);
  throw std::runtime_error(msg + " (" + allscanGetErrorString(r) + ")");
}

}  // namespace allscan_py
