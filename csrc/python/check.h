// What every binding file of allscan._C shares: a C API result turned into a Python exception
// (ValueError for a bad argument, RuntimeError otherwise, with the library's last-error message),
// integers turned into pointers, and the fields every scan flavour's arguments have. No libtorch.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "allscan/common.h"

namespace allscan_py {

template <typename T> T* ptr(std::uintptr_t v) { return reinterpret_cast<T*>(v); }

// A communicator that failed (allscanMismatch, allscanRemoteError): Python's
// allscan.CommunicatorError (a RuntimeError); allscanTimeout: allscan.CommunicatorTimeout, a
// CommunicatorError. Registered in bindings.cpp.
struct CommunicatorError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CommunicatorTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void check(allscanResult_t r) {
  if (r == allscanSuccess) return;
  std::string msg = std::string("allscan: ") + allscanGetLastError();
  if (r == allscanInvalidArgument) throw pybind11::value_error(msg);
  if (r == allscanTimeout) throw CommunicatorTimeout(msg);
  if (r == allscanMismatch || r == allscanRemoteError) throw CommunicatorError(msg);
  throw std::runtime_error(msg + " (" + allscanGetErrorString(r) + ")");
}

// The fields of allscanScanArgs_t and allscanMatrixScanArgs_t alike, from Python's values.
template <typename Args>
void setChainArgs(Args* a, std::uintptr_t x, std::uintptr_t y, int dtype, std::uintptr_t init, bool reverse,
                  bool inclusive, int num_blocks, int method) {
  a->x = ptr<const void>(x);
  a->y = ptr<void>(y);
  a->dtype = static_cast<decltype(a->dtype)>(dtype);
  a->init = ptr<const void>(init);
  a->reverse = reverse ? 1 : 0;
  a->inclusive = inclusive ? 1 : 0;
  a->num_blocks = num_blocks;
  a->method = static_cast<decltype(a->method)>(method);
}

}  // namespace allscan_py
