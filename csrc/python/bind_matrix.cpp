// Python bindings of the matrix-transition All-Scan (csrc/allscan/matrix_scan.cu): integers in
// (device pointers, cudaStream_t, allscanComm_t), Python exceptions out. No libtorch.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "allscan/allscan.h"
#include "python/check.h"

namespace py = pybind11;

namespace {

using allscan_py::check;
using allscan_py::ptr;

allscanMatrixScanArgs_t makeArgs(std::uintptr_t x, std::uintptr_t y, size_t batch, size_t k, size_t v, int dtype,
                                 std::uintptr_t m, int m_dtype, bool transpose_m, std::uintptr_t init, bool reverse,
                                 bool inclusive, int num_blocks, int method) {
  allscanMatrixScanArgs_t a{};
  allscan_py::setChainArgs(&a, x, y, dtype, init, reverse, inclusive, num_blocks, method);
  a.batch = batch;
  a.k = k;
  a.v = v;
  a.m = ptr<const void>(m);
  a.m_dtype = static_cast<allscanDataType_t>(m_dtype);
  a.transpose_m = transpose_m ? 1 : 0;
  return a;
}

}  // namespace

void bindMatrix(py::module_& m) {
  m.def("matrix_blocks", [](size_t batch, size_t k, size_t v, int num_blocks) {
    int n = 0;
    size_t cols = 0;
    check(allscanMatrixBlocks(batch, k, v, num_blocks, &n, &cols));
    return py::make_tuple(n, cols);
  });
  m.def("matrix_workspace_size",
        [](std::uintptr_t c, size_t batch, size_t k, size_t v, int dtype, int m_dtype, bool transpose_m, bool has_init,
           bool reverse, bool inclusive, int num_blocks, int method) {
          // Pointers are not dereferenced: distinct non-null placeholders do.
          allscanMatrixScanArgs_t a = makeArgs(16, 32, batch, k, v, dtype, 48, m_dtype, transpose_m, has_init ? 64 : 0,
                                               reverse, inclusive, num_blocks, method);
          size_t bytes = 0;
          check(allscanMatrixWorkspaceSize(ptr<allscanComm>(c), &a, &bytes));
          return bytes;
        });
  m.def("matrix_scan",
        [](std::uintptr_t c, std::uintptr_t x, std::uintptr_t y, size_t batch, size_t k, size_t v, int dtype,
           std::uintptr_t mat, int m_dtype, bool transpose_m, std::uintptr_t init, bool reverse, bool inclusive,
           int num_blocks, int method, std::uintptr_t ws, size_t ws_bytes, std::uintptr_t stream,
           unsigned long long signature) {
          allscanMatrixScanArgs_t a = makeArgs(x, y, batch, k, v, dtype, mat, m_dtype, transpose_m, init, reverse,
                                               inclusive, num_blocks, method);
          a.signature = signature;
          check(allscanMatrixScan(ptr<allscanComm>(c), &a, ptr<void>(ws), ws_bytes, ptr<CUstream_st>(stream)));
        });
}
