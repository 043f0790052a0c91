// The matrix All-Scan's combine (out = M @ y + x over a block of independent state columns, fused
// with the add and the rounding to the storage dtype) and the pack / unpack between the natural
// [batch, K, V] layout and the block layout of V-column blocks. Internal to the core.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "allscan/common.h"
#include "common/signature.h"

namespace allscan {
namespace matrix {

// A [nb, K, vc] view of a state: element (b, i, c) lives at p[b * bstride + i * rstride + c]
// (strides in elements). A natural-layout block has bstride = K*V, rstride = V; a packed block
// bstride = K*vc, rstride = vc.
struct View {
  void* p = nullptr;
  size_t bstride = 0;
  size_t rstride = 0;
};

struct CombineArgs {
  const void* m = nullptr;  // [nb, K, K] row-major transitions of the block's batch entries
  allscanDataType_t m_dtype = allscanFloat32;
  bool transpose = false;   // use M^T (the backward): read M[j][i] for M^T[i][j]
  View y;                   // input state block (read)
  View x;                   // local state block (read)
  View out;                 // M @ y + x, rounded to dtype
  View out2;                // optional (p == nullptr: none): a second copy of out
  View ycopy;               // optional: a copy of y (unpacks a received packed block into the result)
  size_t nb = 0, k = 0, vc = 0;
  allscanDataType_t dtype = allscanFloat32;
  detail::SigCheck check;   // NaN into out, out2 and ycopy when y came from a mismatched call
};

// One launch over the whole block. Arithmetic: fp32 FFMA (fp64 for fp64 states), the sum over j in
// partials of 16 consecutive terms added in order, then + x, one rounding to the storage dtype.
cudaError_t launchCombine(const CombineArgs& a, cudaStream_t stream);

// Natural [batch, K, V] <-> block layout: batch entry b keeps its K*V elements at b*K*V, as the
// V-column blocks [K, vc_j] (vc_j = min(vcw, V - j*vcw)) one after another. unpack: block -> natural.
cudaError_t launchPack(size_t elem_size, const void* src, void* dst, size_t batch, size_t k, size_t v, size_t vcw,
                       bool unpack, cudaStream_t stream);

}  // namespace matrix
}  // namespace allscan
