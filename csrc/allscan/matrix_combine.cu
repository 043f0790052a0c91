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

// An FFMA GEMM in the accumulation dtype: an fp32 state must match a float64 chain to ~1e-6
// relative, which TF32 tensor cores (10-bit mantissa) cannot give; 3xTF32 on tensor cores was
// measured slower than this kernel at every tested size (bench/README.md, "The combine kernel").
// Output tile TILE x TILE per CTA of 256 threads (TILE/16 x TILE/16 outputs per thread): 64 x 64 when
// there are enough of them to fill the GPU, else 32 x 32 (4x the CTAs: a pipeline block of a few
// [128, 128] entries is a few dozen CTAs).
constexpr int BK = 16;  // the inner dimension is summed in partials of BK terms, then those added
constexpr int kThreads = 256;
constexpr size_t kSmallTileBelowCtas = 128;  // fewer 64 x 64 CTAs than this: 32 x 32 tiles

struct Params {
  const void* m;
  View y, x, out, out2, ycopy;
  size_t nb, k, vc;
  unsigned col_tiles;
  detail::SigCheck check;
};

// The inner dimension is loaded in rounds of KC rows (16 KiB of shared memory per operand), every
// thread's share of a round read into registers first (all of its loads in flight at once), then
// stored to shared memory: one global-load latency per round. The result goes through shared memory
// to the epilogue, whose stores are coalesced.
// Two CTAs per SM for fp32 accumulation (else a bf16 state's 32 x 32 tiles took 150 registers, one CTA
// per SM, and a [16, 128, 128] combine ran in two waves); fp64 would spill under that cap.
template <typename T, typename MT, int TILE, bool TRANSPOSE>
__global__ void __launch_bounds__(kThreads, sizeof(typename Acc<T>::type) == 4 ? 2 : 1) combineKernel(Params p) {
  using A = typename Acc<T>::type;
  constexpr int NT = kThreads;
  constexpr int KC = 16384 / (TILE * static_cast<int>(sizeof(A)));
  constexpr int PER = TILE * KC / NT;  // elements of each operand a thread stages per round
  constexpr int TM = TILE / 16;       // FFMA: TM x TM outputs per thread
  static_assert(NT % TILE == 0 && NT % KC == 0, "a thread's staged elements are a fixed stride apart");
  // Ms[kk][i] = M[i0 + i][k0 + kk] (M^T's when transposed), its rows one longer than the tile so that
  // the staging of M (consecutive kk, one i per warp) stores into distinct banks; Ys[kk][c] = y[k0 +
  // kk][c0 + c]; after the last round the same memory holds Os, the tile's M @ y.
  constexpr int kSmem = KC * (TILE + 1) + KC * TILE;
  static_assert(TILE * TILE <= kSmem, "the output tile fits where the operands were staged");
  __shared__ __align__(128) A smem[kSmem];
  A (*Ms)[TILE + 1] = reinterpret_cast<A (*)[TILE + 1]>(smem);
  A (*Ys)[TILE] = reinterpret_cast<A (*)[TILE]>(smem + KC * (TILE + 1));
  A (*Os)[TILE] = reinterpret_cast<A (*)[TILE]>(smem);
  const size_t K = p.k, vc = p.vc;
  const size_t b = blockIdx.x / p.col_tiles;
  const size_t c0 = static_cast<size_t>(blockIdx.x % p.col_tiles) * TILE;
  const size_t i0 = static_cast<size_t>(blockIdx.y) * TILE;
  const int tid = threadIdx.x;

  const MT* M = static_cast<const MT*>(p.m) + b * K * K;
  const T* Y = static_cast<const T*>(p.y.p) + b * p.y.bstride;
  T* Ycopy = p.ycopy.p != nullptr && blockIdx.y == 0 ? static_cast<T*>(p.ycopy.p) + b * p.ycopy.bstride : nullptr;
  const bool poison = p.check.mismatch();
  const T nan = fromAcc<T>(quietNan(A(0)));

  // row_read[i]: row i of the tile's M (of M^T when transposed) has a nonzero entry. A row of zeros
  // takes nothing from y, even a non-finite y (0 * inf is NaN): out = x there, as a diagonal zero
  // decay gives (decay_combine.cuh). A thread stages the same PER rows in every round, so it keeps
  // one bit per row in a register and stores its flags once, before the epilogue (a store per staged
  // element cost a bf16 state's 32 x 32 tiles a register spill).
  static_assert(PER <= 32, "a thread's staged rows fit one word's bits");
  __shared__ int row_read[TILE];
  if (tid < TILE) row_read[tid] = 0;  // ordered before the flags' stores by the rounds' barriers
  unsigned rows_read = 0;             // bit r: this thread staged a nonzero entry of its r-th row

  const int tx = tid % 16, ty = tid / 16;
  A acc[TM][TM];
#pragma unroll
  for (int u = 0; u < TM; ++u)
#pragma unroll
    for (int v = 0; v < TM; ++v) acc[u][v] = A(0);

  for (size_t k0 = 0; k0 < K; k0 += KC) {
    const int kn = static_cast<int>(std::min<size_t>(KC, K - k0));
    const int kp = (kn + BK - 1) / BK * BK;  // the staged rows, zeros past kn up to a whole BK
    A mreg[PER], yreg[PER];
    // Thread tid's elements of a round: a fixed first index plus r times a fixed step (NT is a
    // multiple of TILE and of KC), so the unrolled loads are one base address plus r strides.
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      // Consecutive threads read consecutive addresses of M (or of M^T's rows, M's columns).
      const int i = TRANSPOSE ? tid % TILE : tid / KC + r * (NT / KC);
      const int kk = TRANSPOSE ? tid / TILE + r * (NT / TILE) : tid % KC;
      const size_t gi = i0 + i, gk = k0 + kk;
      mreg[r] = gi < K && kk < kn ? toAcc<MT>(M[TRANSPOSE ? gk * K + gi : gi * K + gk]) : A(0);
      const int ky = tid / TILE + r * (NT / TILE), c = tid % TILE;
      yreg[r] = ky < kn && c0 + c < vc ? toAcc<T>(Y[(k0 + ky) * p.y.rstride + c0 + c]) : A(0);
    }
#pragma unroll
    for (int r = 0; r < PER; ++r) {
      const int i = TRANSPOSE ? tid % TILE : tid / KC + r * (NT / KC);
      const int kk = TRANSPOSE ? tid / TILE + r * (NT / TILE) : tid % KC;
      Ms[kk][i] = mreg[r];
      rows_read |= static_cast<unsigned>(mreg[r] != A(0)) << r;
      const int ky = tid / TILE + r * (NT / TILE), c = tid % TILE;
      Ys[ky][c] = yreg[r];
      // toAcc then fromAcc returns every value it was given (a NaN of a 16-bit dtype may come back
      // as another NaN): not a re-read of y in the measured path
      if (Ycopy != nullptr && ky < kn && c0 + c < vc)
        Ycopy[(k0 + ky) * p.ycopy.rstride + c0 + c] = poison ? nan : fromAcc<T>(yreg[r]);
    }
    __syncthreads();
    // Two-level sum: each BK-long slice in its own partial, then added to the total, so the
    // rounding error grows like sqrt(BK) + sqrt(K/BK) instead of sqrt(K) (half at K = 256).
    for (int kb = 0; kb < kp; kb += BK) {
      A prt[TM][TM];
#pragma unroll
      for (int u = 0; u < TM; ++u)
#pragma unroll
        for (int v = 0; v < TM; ++v) prt[u][v] = A(0);
#pragma unroll
      for (int kk = kb; kk < kb + BK; ++kk) {
        A mv[TM], yv[TM];
#pragma unroll
        for (int u = 0; u < TM; ++u) mv[u] = Ms[kk][ty * TM + u];
#pragma unroll
        for (int v = 0; v < TM; ++v) yv[v] = Ys[kk][tx * TM + v];
#pragma unroll
        for (int u = 0; u < TM; ++u)
#pragma unroll
          for (int v = 0; v < TM; ++v) prt[u][v] = fma(mv[u], yv[v], prt[u][v]);
      }
#pragma unroll
      for (int u = 0; u < TM; ++u)
#pragma unroll
        for (int v = 0; v < TM; ++v) acc[u][v] += prt[u][v];
    }
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < TM; ++u)
#pragma unroll
    for (int v = 0; v < TM; ++v) Os[ty * TM + u][tx * TM + v] = acc[u][v];
#pragma unroll
  for (int r = 0; r < PER; ++r)  // any thread may set a row's flag; all store the same value
    if ((rows_read >> r) & 1u) row_read[TRANSPOSE ? tid % TILE : tid / KC + r * (NT / KC)] = 1;
  __syncthreads();

  const T* X = static_cast<const T*>(p.x.p) + b * p.x.bstride;
  T* O = static_cast<T*>(p.out.p) + b * p.out.bstride;
  T* O2 = p.out2.p != nullptr ? static_cast<T*>(p.out2.p) + b * p.out2.bstride : nullptr;
  for (int e = tid; e < TILE * TILE; e += NT) {
    const int i = e / TILE, c = e % TILE;
    const size_t gi = i0 + i, gc = c0 + c;
    if (gi >= K || gc >= vc) continue;
    const T xv = X[gi * p.x.rstride + gc];
    const T r = poison ? nan : (row_read[i] ? fromAcc<T>(Os[i][c] + toAcc<T>(xv)) : xv);
    O[gi * p.out.rstride + gc] = r;
    if (O2 != nullptr) O2[gi * p.out2.rstride + gc] = r;
  }
}

template <typename T, typename MT, int TILE>
cudaError_t launchTile(const CombineArgs& a, cudaStream_t stream) {
  Params p;
  p.m = a.m;
  p.y = a.y;
  p.x = a.x;
  p.out = a.out;
  p.out2 = a.out2;
  p.ycopy = a.ycopy;
  p.nb = a.nb;
  p.k = a.k;
  p.vc = a.vc;
  p.col_tiles = static_cast<unsigned>((a.vc + TILE - 1) / TILE);
  p.check = a.check;
  const size_t gx = static_cast<size_t>(p.col_tiles) * a.nb;
  const size_t gy = (a.k + TILE - 1) / TILE;
  if (gx > 0x7fffffffu || gy > 65535u) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  if (a.transpose) {
    combineKernel<T, MT, TILE, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    combineKernel<T, MT, TILE, false><<<grid, kThreads, 0, stream>>>(p);
  }
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
