// The matrix All-Scan's combine kernel (M @ y + x, fused add and cast) and the block-layout pack.
#include "matrix_combine.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/acc.cuh"

namespace allscan {
namespace matrix {
namespace {

using detail::Acc;
using detail::fromAcc;
using detail::toAcc;
using detail::quietNan;

// Output tile TILE x TILE per CTA of 256 threads (TILE/16 x TILE/16 outputs per thread), inner
// dimension in steps of BK through shared memory. FFMA in the accumulation dtype: an fp32 state must
// match a float64 chain to ~1e-6 relative, which TF32 tensor cores (10-bit mantissa) cannot give.
// 64 x 64 tiles when there is enough work to fill the GPU with them, else 32 x 32 (4x the CTAs: a
// pipeline block of a few [128, 128] entries is a few dozen CTAs).
constexpr int BK = 16;
constexpr int kThreads = 256;
constexpr size_t kSmallTileBelowCtas = 128;  // fewer 64 x 64 CTAs than this: 32 x 32 tiles

struct Params {
  const void* m;
  bool transpose;
  View y, x, out, out2, ycopy;
  size_t nb, k, vc;
  unsigned col_tiles;
  detail::SigCheck check;
};

template <typename T, typename MT, int TILE>
__global__ void __launch_bounds__(kThreads) combineKernel(Params p) {
  using A = typename Acc<T>::type;
  constexpr int BM = TILE, BN = TILE, TM = TILE / 16, TN = TILE / 16;
  __shared__ A Ms[BK][BM];  // Ms[kk][i] = M[i0 + i][k0 + kk]
  __shared__ A Ys[BK][BN];  // Ys[kk][c] = y[k0 + kk][c0 + c]
  const size_t K = p.k, vc = p.vc;
  const size_t b = blockIdx.x / p.col_tiles;
  const size_t c0 = static_cast<size_t>(blockIdx.x % p.col_tiles) * BN;
  const size_t i0 = static_cast<size_t>(blockIdx.y) * BM;
  const int tid = threadIdx.x;
  const int tx = tid % (BN / TN), ty = tid / (BN / TN);

  const MT* M = static_cast<const MT*>(p.m) + b * K * K;
  const T* Y = static_cast<const T*>(p.y.p) + b * p.y.bstride;
  T* Ycopy = p.ycopy.p != nullptr && blockIdx.y == 0 ? static_cast<T*>(p.ycopy.p) + b * p.ycopy.bstride : nullptr;
  const bool poison = p.check.mismatch();
  const T nan = fromAcc<T>(quietNan(A(0)));

  A acc[TM][TN];
#pragma unroll
  for (int u = 0; u < TM; ++u)
#pragma unroll
    for (int v = 0; v < TN; ++v) acc[u][v] = A(0);

  for (size_t k0 = 0; k0 < K; k0 += BK) {
    for (int e = tid; e < BM * BK; e += kThreads) {
      // Consecutive threads read consecutive addresses of M (or of M^T's rows, M's columns).
      const int i = p.transpose ? e % BM : e / BK;
      const int kk = p.transpose ? e / BM : e % BK;
      const size_t gi = i0 + i, gk = k0 + kk;
      A v = A(0);
      if (gi < K && gk < K) v = toAcc<MT>(M[p.transpose ? gk * K + gi : gi * K + gk]);
      Ms[kk][i] = v;
    }
    for (int e = tid; e < BK * BN; e += kThreads) {
      const int kk = e / BN, c = e % BN;
      const size_t gk = k0 + kk, gc = c0 + c;
      A v = A(0);
      if (gk < K && gc < vc) {
        const T raw = Y[gk * p.y.rstride + gc];
        v = toAcc<T>(raw);
        if (Ycopy != nullptr) Ycopy[gk * p.ycopy.rstride + gc] = poison ? nan : raw;
      }
      Ys[kk][c] = v;
    }
    __syncthreads();
    // Two-level sum: each BK-long slice in its own partial, then added to the total, so the
    // rounding error grows like sqrt(BK) + sqrt(K/BK) instead of sqrt(K) (half at K = 256).
    A part[TM][TN];
#pragma unroll
    for (int u = 0; u < TM; ++u)
#pragma unroll
      for (int v = 0; v < TN; ++v) part[u][v] = A(0);
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      A mv[TM], yv[TN];
#pragma unroll
      for (int u = 0; u < TM; ++u) mv[u] = Ms[kk][ty * TM + u];
#pragma unroll
      for (int v = 0; v < TN; ++v) yv[v] = Ys[kk][tx * TN + v];
#pragma unroll
      for (int u = 0; u < TM; ++u)
#pragma unroll
        for (int v = 0; v < TN; ++v) part[u][v] = fma(mv[u], yv[v], part[u][v]);
    }
#pragma unroll
    for (int u = 0; u < TM; ++u)
#pragma unroll
      for (int v = 0; v < TN; ++v) acc[u][v] += part[u][v];
    __syncthreads();
  }

  const T* X = static_cast<const T*>(p.x.p) + b * p.x.bstride;
  T* O = static_cast<T*>(p.out.p) + b * p.out.bstride;
  T* O2 = p.out2.p != nullptr ? static_cast<T*>(p.out2.p) + b * p.out2.bstride : nullptr;
#pragma unroll
  for (int u = 0; u < TM; ++u) {
    const size_t gi = i0 + ty * TM + u;
    if (gi >= K) continue;
#pragma unroll
    for (int v = 0; v < TN; ++v) {
      const size_t gc = c0 + tx * TN + v;
      if (gc >= vc) continue;
      const T r = poison ? nan : fromAcc<T>(acc[u][v] + toAcc<T>(X[gi * p.x.rstride + gc]));
      O[gi * p.out.rstride + gc] = r;
      if (O2 != nullptr) O2[gi * p.out2.rstride + gc] = r;
    }
  }
}

template <typename T, typename MT, int TILE>
cudaError_t launchTile(const CombineArgs& a, cudaStream_t stream) {
  constexpr int BM = TILE, BN = TILE;
  Params p;
  p.m = a.m;
  p.transpose = a.transpose;
  p.y = a.y;
  p.x = a.x;
  p.out = a.out;
  p.out2 = a.out2;
  p.ycopy = a.ycopy;
  p.nb = a.nb;
  p.k = a.k;
  p.vc = a.vc;
  p.col_tiles = static_cast<unsigned>((a.vc + BN - 1) / BN);
  p.check = a.check;
  const size_t gx = static_cast<size_t>(p.col_tiles) * a.nb;
  const size_t gy = (a.k + BM - 1) / BM;
  if (gx > 0x7fffffffu || gy > 65535u) return cudaErrorInvalidConfiguration;
  combineKernel<T, MT, TILE><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename MT>
cudaError_t launchT(const CombineArgs& a, cudaStream_t stream) {
  const size_t ctas64 = (a.vc + 63) / 64 * a.nb * ((a.k + 63) / 64);
  if (ctas64 < kSmallTileBelowCtas) return launchTile<T, MT, 32>(a, stream);
  return launchTile<T, MT, 64>(a, stream);
}

template <typename T>
cudaError_t launchM(const CombineArgs& a, cudaStream_t stream) {
  if (a.m_dtype == allscanFloat32) return launchT<T, float>(a, stream);
  return launchT<T, T>(a, stream);
}

// Element copies as same-sized unsigned integers: the pack moves bits, whatever the dtype.
template <typename U>
__global__ void packKernel(const U* __restrict__ src, U* __restrict__ dst, size_t batch, size_t k, size_t v, size_t vcw,
                           bool unpack) {
  const size_t n = batch * k * v, kv = k * v;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t e = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const size_t b = e / kv, rem = e % kv, i = rem / v, c = rem % v;
    const size_t c0 = c / vcw * vcw;
    const size_t vcj = v - c0 < vcw ? v - c0 : vcw;
    const size_t q = b * kv + k * c0 + i * vcj + (c - c0);
    if (unpack) {
      dst[e] = src[q];
    } else {
      dst[q] = src[e];
    }
  }
}

template <typename U>
cudaError_t launchPackU(const void* src, void* dst, size_t batch, size_t k, size_t v, size_t vcw, bool unpack,
                        cudaStream_t stream) {
  const size_t n = batch * k * v;
  const int grid = static_cast<int>(std::max<size_t>(1, std::min<size_t>((n + 255) / 256, 4096)));
  packKernel<U><<<grid, 256, 0, stream>>>(static_cast<const U*>(src), static_cast<U*>(dst), batch, k, v, vcw, unpack);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launchCombine(const CombineArgs& a, cudaStream_t stream) {
  if (a.nb == 0 || a.k == 0 || a.vc == 0) return cudaSuccess;
  switch (a.dtype) {
    case allscanFloat32: return launchM<float>(a, stream);
    case allscanFloat16: return launchM<__half>(a, stream);
    case allscanBfloat16: return launchM<__nv_bfloat16>(a, stream);
    case allscanFloat64: return launchM<double>(a, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launchPack(size_t elem_size, const void* src, void* dst, size_t batch, size_t k, size_t v, size_t vcw,
                       bool unpack, cudaStream_t stream) {
  if (batch * k * v == 0) return cudaSuccess;
  switch (elem_size) {
    case 2: return launchPackU<uint16_t>(src, dst, batch, k, v, vcw, unpack, stream);
    case 4: return launchPackU<uint32_t>(src, dst, batch, k, v, vcw, unpack, stream);
    case 8: return launchPackU<uint64_t>(src, dst, batch, k, v, vcw, unpack, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace matrix
}  // namespace allscan
