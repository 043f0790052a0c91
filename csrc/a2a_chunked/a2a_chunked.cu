// Chunked all-to-all for Ulysses sequence parallelism: fused pack / unpack kernels around one NCCL
// group of send/recv pairs. See include/allscan/a2a_chunked.h for the contract.
#include <allscan/a2a_chunked.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/acc.cuh"
#include "common/error.h"
#include "common/signature.h"
#include "common/watch.h"

using allscan::detail::Acc;
using allscan::detail::fromAcc;
using allscan::detail::setErrorf;
using allscan::detail::toAcc;

namespace {

constexpr size_t kAlign = 256;
inline size_t alignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int dtypeSize(allscanDataType_t t) { return static_cast<int>(allscanDataTypeSize(t)); }

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// One strided copy: rows (b, s, h) of `row_bytes` bytes each, b < B, s < S, h < n; the head stride
// is row_bytes on both sides (heads are the second innermost dimension everywhere).
struct CopySeg {
  const char* src;
  char* dst;
  int64_t src_sb, src_ss;  // byte strides of b and s
  int64_t dst_sb, dst_ss;
  int S;                   // rows per b: S * n
  int n;
};

constexpr int kMaxCopySegs = 56;  // keeps the parameter block under 4 KB

struct CopyBatch {
  int num;
  int B;
  int64_t row_bytes;
  CopySeg seg[kMaxCopySegs];
};

// I is the index type: 32-bit division when every segment of the launch has < 2^32 vectors.
template <typename V, typename I>
__global__ void copySegmentsKernel(const CopyBatch batch) {
  const CopySeg& sg = batch.seg[blockIdx.y];
  const I vpr = static_cast<I>(batch.row_bytes / sizeof(V));
  const I n = static_cast<I>(sg.n);
  const I S = static_cast<I>(sg.S);
  const I total = static_cast<I>(batch.B) * S * n * vpr;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<I>(gridDim.x) * blockDim.x) {
    const I row = i / vpr;
    const I k = i - row * vpr;
    const I bs = row / n;
    const I h = row - bs * n;
    const I b = bs / S;
    const I s = bs - b * S;
    const char* src = sg.src + static_cast<int64_t>(b) * sg.src_sb + static_cast<int64_t>(s) * sg.src_ss +
                      static_cast<int64_t>(h) * batch.row_bytes;
    char* dst = sg.dst + static_cast<int64_t>(b) * sg.dst_sb + static_cast<int64_t>(s) * sg.dst_ss +
                static_cast<int64_t>(h) * batch.row_bytes;
    reinterpret_cast<V*>(dst)[k] = __ldg(reinterpret_cast<const V*>(src) + k);
  }
}

// Gather with summation (overlapping head maps, or accumulate): every output element of heads
// [h_begin, h_end) is the sum, in rank order, of the pieces that hold its head.
struct SumPiece {
  const char* ptr;  // element (b, s, h - lo, d) at ptr + b*sb + s*ss + (h - lo)*row_bytes + d*es
  int64_t sb, ss;
  int lo, hi;
};

constexpr int kMaxSumPieces = 120;

struct SumBatch {
  int num;
  int B, S, H, D;
  int h_begin, h_end;
  int accumulate;
  char* out;  // [B, S, H, D]
  SumPiece piece[kMaxSumPieces];
};


template <typename T>
__global__ void sumPiecesKernel(const SumBatch batch) {
  using A = typename Acc<T>::type;
  const unsigned nh = static_cast<unsigned>(batch.h_end - batch.h_begin);
  const unsigned D = static_cast<unsigned>(batch.D);
  const unsigned S = static_cast<unsigned>(batch.S);
  const int64_t row_bytes = static_cast<int64_t>(D) * sizeof(T);
  const uint64_t total = static_cast<uint64_t>(batch.B) * S * nh * D;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t row = i / D;
    const unsigned d = static_cast<unsigned>(i - row * D);
    const uint64_t bs = row / nh;
    const int h = batch.h_begin + static_cast<int>(row - bs * nh);
    const uint64_t b = bs / S;
    const unsigned s = static_cast<unsigned>(bs - b * S);
    T* out = reinterpret_cast<T*>(batch.out) + ((b * S + s) * batch.H + h) * D + d;
    A acc = 0;
    bool any = false;
    if (batch.accumulate) {
      acc = toAcc<T>(*out);
      any = true;
    }
    for (int r = 0; r < batch.num; ++r) {
      const SumPiece& p = batch.piece[r];
      if (h >= p.lo && h < p.hi) {
        const T* src = reinterpret_cast<const T*>(p.ptr + b * p.sb + s * p.ss + (h - p.lo) * row_bytes);
        acc = acc + toAcc<T>(src[d]);
        any = true;
      }
    }
    if (any) *out = fromAcc<T>(acc);
  }
}

// The in-band signature check (common/signature.h): n received signatures; on any difference
// every output (up to 4, `count[t]` elements each) becomes NaN. Writes nothing otherwise.
struct PoisonBatch {
  const unsigned long long* got;
  int n;
  unsigned long long expect;
  allscan::detail::MismatchRecord* record;
  int num;
  void* out[ALLSCAN_A2A_MAX_TENSORS];
  uint64_t count[ALLSCAN_A2A_MAX_TENSORS];
};

template <typename T>
__global__ void poisonKernel(const PoisonBatch p) {
  int bad = -1;
  for (int i = 0; i < p.n && bad < 0; ++i)
    if (p.got[i] != p.expect) bad = i;
  if (bad < 0) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.record->expected = p.expect;
    p.record->got = p.got[bad];
    __threadfence_system();
    p.record->set = 1;
  }
  using A = typename Acc<T>::type;
  const T nan = fromAcc<T>(allscan::detail::quietNan(A(0)));
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (int t = 0; t < p.num; ++t)
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count[t]; i += stride)
      static_cast<T*>(p.out[t])[i] = nan;
}

// ------------------------------------------------------------------------------------------------
// Host side: the plan of one call
// ------------------------------------------------------------------------------------------------

struct Transfer {
  int peer;
  const char* send;  // NULL: nothing to send
  size_t send_bytes;
  char* recv;        // NULL: nothing to receive
  size_t recv_bytes;
};

struct Plan {
  size_t workspace_bytes = 0;
  int64_t row_bytes = 0;
  std::vector<CopySeg> pack;    // before the NCCL group
  std::vector<Transfer> xfers;  // the NCCL group, in (tensor, peer) order
  unsigned long long* sig_recv = nullptr;  // [nranks]: the signatures received (when checked)
  std::vector<CopySeg> unpack;  // after the NCCL group
  std::vector<SumBatch> sums;   // after the NCCL group (one per summing tensor)
};

allscanResult_t checkArgs(int nranks, int rank, allscanA2ADirection_t dir, const allscanA2AArgs_t* a,
                           bool need_pointers) {
  if (a == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2A: args is NULL");
  if (nranks < 1 || nranks > ALLSCAN_A2A_MAX_RANKS)
    return setErrorf(allscanInvalidArgument, "allscanA2A: nranks must be in [1, %d], got %d", ALLSCAN_A2A_MAX_RANKS, nranks);
  if (rank < 0 || rank >= nranks)
    return setErrorf(allscanInvalidArgument, "allscanA2A: rank must be in [0, %d), got %d", nranks, rank);
  if (dir != allscanA2AScatterHeads && dir != allscanA2AGatherHeads)
    return setErrorf(allscanInvalidArgument, "allscanA2A: direction must be allscanA2AScatterHeads (0) or allscanA2AGatherHeads (1), got %d", (int)dir);
  if (a->batch < 1) return setErrorf(allscanInvalidArgument, "allscanA2A: batch must be >= 1, got %d", a->batch);
  if (a->seq_local < 0) return setErrorf(allscanInvalidArgument, "allscanA2A: seq_local must be >= 0, got %d", a->seq_local);
  if (a->head_dim < 1) return setErrorf(allscanInvalidArgument, "allscanA2A: head_dim must be >= 1, got %d", a->head_dim);
  if (dtypeSize(a->dtype) == 0)
    return setErrorf(allscanInvalidArgument, "allscanA2A: dtype must be an allscanDataType_t (0..3), got %d", (int)a->dtype);
  if (a->num_tensors < 1 || a->num_tensors > ALLSCAN_A2A_MAX_TENSORS)
    return setErrorf(allscanInvalidArgument, "allscanA2A: num_tensors must be in [1, %d], got %d", ALLSCAN_A2A_MAX_TENSORS, a->num_tensors);
  const uint64_t es = dtypeSize(a->dtype);
  for (int t = 0; t < a->num_tensors; ++t) {
    const allscanA2ATensor_t& x = a->tensors[t];
    if (x.num_heads < 1) return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].num_heads must be >= 1, got %d", t, x.num_heads);
    if (x.head_lo == nullptr || x.head_hi == nullptr)
      return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].head_lo / head_hi must be host arrays of nranks (%d) ints, got NULL", t, nranks);
    bool overlap = false;
    for (int r = 0; r < nranks; ++r) {
      const int lo = x.head_lo[r], hi = x.head_hi[r];
      if (lo < 0 || hi < lo || hi > x.num_heads)
        return setErrorf(allscanInvalidArgument,
                    "allscanA2A: tensors[%d] head range of rank %d is [%d, %d); expected 0 <= lo <= hi <= num_heads (%d)",
                    t, r, lo, hi, x.num_heads);
      for (int q = 0; q < r && !overlap; ++q)
        if (hi > lo && x.head_hi[q] > x.head_lo[q] && lo < x.head_hi[q] && x.head_lo[q] < hi) overlap = true;
    }
    (void)overlap;
    if (x.accumulate && dir != allscanA2AGatherHeads)
      return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].accumulate is only defined for gather-heads", t);
    // Sizes: the sequence-sharded tensor and the head-sharded one must be addressable.
    const uint64_t n_me = static_cast<uint64_t>(x.head_hi[rank] - x.head_lo[rank]);
    const uint64_t full = static_cast<uint64_t>(a->batch) * a->seq_local * x.num_heads * a->head_dim * es;
    const uint64_t mine = static_cast<uint64_t>(a->batch) * a->seq_local * nranks * n_me * a->head_dim * es;
    if (full / es >= (1ull << 40) || mine / es >= (1ull << 40))
      return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d] is too large (%llu / %llu elements)", t,
                  (unsigned long long)(full / es), (unsigned long long)(mine / es));
    if (need_pointers) {
      const bool in_needed = (dir == allscanA2AScatterHeads) ? full > 0 : mine > 0;
      const bool out_needed = (dir == allscanA2AScatterHeads) ? mine > 0 : full > 0;
      if (in_needed && x.input == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].input is NULL", t);
      if (out_needed && x.output == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].output is NULL", t);
      if (x.input != nullptr && x.output != nullptr) {
        const char* i0 = static_cast<const char*>(x.input);
        const char* o0 = static_cast<const char*>(x.output);
        const uint64_t in_b = (dir == allscanA2AScatterHeads) ? full : mine;
        const uint64_t out_b = (dir == allscanA2AScatterHeads) ? mine : full;
        if (in_b > 0 && out_b > 0 && i0 < o0 + out_b && o0 < i0 + in_b)
          return setErrorf(allscanInvalidArgument, "allscanA2A: tensors[%d].input and .output overlap", t);
      }
    }
  }
  if (a->signature != 0 && a->check_comm == nullptr)
    return setErrorf(allscanInvalidArgument, "allscanA2A: check_comm is NULL but signature is set (the check needs the "
                     "allscan communicator's signature table)");
  return allscanSuccess;
}

bool rangesOverlap(const allscanA2ATensor_t& x, int nranks) {
  // Sort the non-empty ranges by start and look at neighbours.
  std::vector<std::pair<int, int>> v;
  v.reserve(nranks);
  for (int r = 0; r < nranks; ++r)
    if (x.head_hi[r] > x.head_lo[r]) v.emplace_back(x.head_lo[r], x.head_hi[r]);
  std::sort(v.begin(), v.end());
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i].first < v[i - 1].second) return true;
  return false;
}

// Builds the plan. With workspace == nullptr only sizes are computed (pointers are then garbage
// offsets, never dereferenced).
void buildPlan(int nranks, int me, allscanA2ADirection_t dir, const allscanA2AArgs_t* a, char* ws, Plan* plan) {
  const int64_t es = dtypeSize(a->dtype);
  const int64_t B = a->batch, Sl = a->seq_local, D = a->head_dim;
  const int64_t row = D * es;
  const int64_t S = Sl * nranks;
  plan->row_bytes = row;
  size_t off = 0;
  auto take = [&](size_t bytes) -> char* {
    char* p = ws + off;  // ws may be nullptr for a size query
    off += alignUp(bytes);
    return p;
  };
  for (int t = 0; t < a->num_tensors; ++t) {
    const allscanA2ATensor_t& x = a->tensors[t];
    const int64_t H = x.num_heads;
    const char* in = static_cast<const char*>(x.input);
    char* out = static_cast<char*>(x.output);
    auto n_of = [&](int r) -> int64_t { return x.head_hi[r] - x.head_lo[r]; };
    const int64_t n_me = n_of(me);
    if (dir == allscanA2AScatterHeads) {
      // input [B, Sl, H, D]; output [B, S, n_me, D]
      for (int p = 0; p < nranks; ++p) {
        const int64_t n_p = n_of(p);
        if (p == me) {
          if (n_me > 0 && Sl > 0)
            plan->pack.push_back(CopySeg{in + x.head_lo[me] * row, out + me * Sl * n_me * row, Sl * H * row, H * row,
                                         S * n_me * row, n_me * row, (int)Sl, (int)n_me});
          continue;
        }
        Transfer tr{p, nullptr, 0, nullptr, 0};
        const size_t send_bytes = static_cast<size_t>(B * Sl * n_p * row);
        if (send_bytes > 0) {
          if (n_p == H || B * Sl == 1) {
            tr.send = in + x.head_lo[p] * row;
          } else {
            char* buf = take(send_bytes);
            plan->pack.push_back(CopySeg{in + x.head_lo[p] * row, buf, Sl * H * row, H * row, Sl * n_p * row, n_p * row,
                                         (int)Sl, (int)n_p});
            tr.send = buf;
          }
          tr.send_bytes = send_bytes;
        }
        const size_t recv_bytes = static_cast<size_t>(B * Sl * n_me * row);
        if (recv_bytes > 0) {
          char* dst = out + p * Sl * n_me * row;
          if (B == 1) {
            tr.recv = dst;
          } else {
            char* buf = take(recv_bytes);
            plan->unpack.push_back(CopySeg{buf, dst, Sl * n_me * row, n_me * row, S * n_me * row, n_me * row, (int)Sl,
                                           (int)n_me});
            tr.recv = buf;
          }
          tr.recv_bytes = recv_bytes;
        }
        if (tr.send_bytes || tr.recv_bytes) plan->xfers.push_back(tr);
      }
    } else {
      // input [B, S, n_me, D]; output [B, Sl, H, D]
      const bool sum = x.accumulate || rangesOverlap(x, nranks);
      SumBatch sb;
      std::memset(&sb, 0, sizeof(sb));
      if (sum) {
        sb.B = (int)B;
        sb.S = (int)Sl;
        sb.H = (int)H;
        sb.D = (int)D;
        sb.accumulate = x.accumulate;
        sb.out = out;
        int h_begin = (int)H, h_end = 0;
        for (int r = 0; r < nranks; ++r)
          if (n_of(r) > 0) {
            h_begin = std::min(h_begin, x.head_lo[r]);
            h_end = std::max(h_end, x.head_hi[r]);
          }
        sb.h_begin = h_begin;
        sb.h_end = std::max(h_end, h_begin);
      }
      for (int p = 0; p < nranks; ++p) {
        const int64_t n_p = n_of(p);
        if (p == me) {
          if (n_me > 0 && Sl > 0) {
            const char* src = in + me * Sl * n_me * row;
            if (sum) {
              if (sb.num < kMaxSumPieces) sb.piece[sb.num] = SumPiece{src, S * n_me * row, n_me * row, x.head_lo[me], x.head_hi[me]};
              ++sb.num;
            }
            else
              plan->pack.push_back(CopySeg{src, out + x.head_lo[me] * row, S * n_me * row, n_me * row, Sl * H * row,
                                           H * row, (int)Sl, (int)n_me});
          }
          continue;
        }
        Transfer tr{p, nullptr, 0, nullptr, 0};
        const size_t send_bytes = static_cast<size_t>(B * Sl * n_me * row);
        if (send_bytes > 0) {
          const char* src = in + p * Sl * n_me * row;
          if (B == 1) {
            tr.send = src;
          } else {
            char* buf = take(send_bytes);
            plan->pack.push_back(CopySeg{src, buf, S * n_me * row, n_me * row, Sl * n_me * row, n_me * row, (int)Sl,
                                         (int)n_me});
            tr.send = buf;
          }
          tr.send_bytes = send_bytes;
        }
        const size_t recv_bytes = static_cast<size_t>(B * Sl * n_p * row);
        if (recv_bytes > 0) {
          if (!sum && n_p == H) {
            tr.recv = out;  // the piece is the whole output
          } else {
            char* buf = take(recv_bytes);
            if (sum) {
              if (sb.num < kMaxSumPieces) sb.piece[sb.num] = SumPiece{buf, Sl * n_p * row, n_p * row, x.head_lo[p], x.head_hi[p]};
              ++sb.num;
            }
            else
              plan->unpack.push_back(CopySeg{buf, out + x.head_lo[p] * row, Sl * n_p * row, n_p * row, Sl * H * row,
                                             H * row, (int)Sl, (int)n_p});
            tr.recv = buf;
          }
          tr.recv_bytes = recv_bytes;
        }
        if (tr.send_bytes || tr.recv_bytes) plan->xfers.push_back(tr);
      }
      if (sum && Sl > 0 && (sb.num > 0 || x.accumulate) && sb.h_end > sb.h_begin) plan->sums.push_back(sb);
    }
  }
  if (a->signature != 0 && a->check_comm != nullptr && nranks > 1)
    plan->sig_recv = reinterpret_cast<unsigned long long*>(take(sizeof(unsigned long long) * nranks));
  plan->workspace_bytes = off;
}

template <typename V>
cudaError_t launchCopyV(const CopyBatch& b, uint64_t max_vectors, cudaStream_t stream) {
  const int threads = 256;
  uint64_t blocks = (max_vectors + threads * 4 - 1) / (threads * 4);
  const uint64_t cap = std::max<uint64_t>(1, 4096 / static_cast<uint64_t>(b.num));
  blocks = std::max<uint64_t>(1, std::min(blocks, cap));
  dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(b.num));
  if (max_vectors + static_cast<uint64_t>(blocks) * threads < (1ull << 32))
    copySegmentsKernel<V, uint32_t><<<grid, threads, 0, stream>>>(b);
  else
    copySegmentsKernel<V, uint64_t><<<grid, threads, 0, stream>>>(b);
  return cudaGetLastError();
}

allscanResult_t launchCopies(const std::vector<CopySeg>& segs, int B, int64_t row_bytes, cudaStream_t stream) {
  if (segs.empty()) return allscanSuccess;
  // The widest vector that divides the row and every base pointer.
  uintptr_t bits = static_cast<uintptr_t>(row_bytes);
  for (const CopySeg& s : segs) bits |= reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst);
  int vec = 16;
  while (vec > 1 && (bits & (vec - 1))) vec >>= 1;
  for (size_t i = 0; i < segs.size(); i += kMaxCopySegs) {
    CopyBatch b;
    std::memset(&b, 0, sizeof(b));
    b.num = static_cast<int>(std::min<size_t>(kMaxCopySegs, segs.size() - i));
    b.B = B;
    b.row_bytes = row_bytes;
    uint64_t maxv = 0;
    for (int j = 0; j < b.num; ++j) {
      b.seg[j] = segs[i + j];
      maxv = std::max<uint64_t>(maxv, static_cast<uint64_t>(B) * b.seg[j].S * b.seg[j].n * (row_bytes / vec));
    }
    if (maxv == 0) continue;
    cudaError_t e;
    switch (vec) {
      case 16: e = launchCopyV<uint4>(b, maxv, stream); break;
      case 8: e = launchCopyV<uint2>(b, maxv, stream); break;
      case 4: e = launchCopyV<uint32_t>(b, maxv, stream); break;
      case 2: e = launchCopyV<uint16_t>(b, maxv, stream); break;
      default: e = launchCopyV<uint8_t>(b, maxv, stream); break;
    }
    if (e != cudaSuccess) return setErrorf(allscanCudaError, "allscanA2A: copy kernel launch failed: %s", cudaGetErrorString(e));
  }
  return allscanSuccess;
}

allscanResult_t launchSum(const SumBatch& b, allscanDataType_t dtype, cudaStream_t stream) {
  const uint64_t total = static_cast<uint64_t>(b.B) * b.S * (b.h_end - b.h_begin) * b.D;
  if (total == 0) return allscanSuccess;
  const int threads = 256;
  const uint64_t blocks = std::max<uint64_t>(1, std::min<uint64_t>((total + threads * 4 - 1) / (threads * 4), 8192));
  switch (dtype) {
    case allscanFloat32: sumPiecesKernel<float><<<(unsigned)blocks, threads, 0, stream>>>(b); break;
    case allscanFloat64: sumPiecesKernel<double><<<(unsigned)blocks, threads, 0, stream>>>(b); break;
    case allscanFloat16: sumPiecesKernel<__half><<<(unsigned)blocks, threads, 0, stream>>>(b); break;
    case allscanBfloat16: sumPiecesKernel<__nv_bfloat16><<<(unsigned)blocks, threads, 0, stream>>>(b); break;
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return setErrorf(allscanCudaError, "allscanA2A: sum kernel launch failed: %s", cudaGetErrorString(e));
  return allscanSuccess;
}

}  // namespace

extern "C" {

// The same thread-local message as allscanGetLastError (one error state for the whole library).
ALLSCAN_API const char* allscanA2AGetLastError(void) { return allscan::detail::lastError(); }

ALLSCAN_API allscanResult_t allscanA2ASplitHeads(int h0, int h1, int nranks, int* head_lo, int* head_hi) {
  if (nranks < 1) return setErrorf(allscanInvalidArgument, "allscanA2ASplitHeads: nranks must be >= 1, got %d", nranks);
  if (h0 < 0 || h1 < h0) return setErrorf(allscanInvalidArgument, "allscanA2ASplitHeads: need 0 <= h0 <= h1, got [%d, %d)", h0, h1);
  if (head_lo == nullptr || head_hi == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2ASplitHeads: head_lo / head_hi is NULL");
  const int n = h1 - h0, q = n / nranks, rem = n % nranks;
  for (int r = 0; r < nranks; ++r) {
    head_lo[r] = h0 + r * q + std::min(r, rem);
    head_hi[r] = head_lo[r] + q + (r < rem ? 1 : 0);
  }
  return allscanSuccess;
}

ALLSCAN_API allscanResult_t allscanA2AKvHeads(int nranks, const int* q_lo, const int* q_hi, int q_per_kv, int* kv_lo,
                                          int* kv_hi) {
  if (nranks < 1) return setErrorf(allscanInvalidArgument, "allscanA2AKvHeads: nranks must be >= 1, got %d", nranks);
  if (q_per_kv < 1) return setErrorf(allscanInvalidArgument, "allscanA2AKvHeads: q_per_kv must be >= 1, got %d", q_per_kv);
  if (!q_lo || !q_hi || !kv_lo || !kv_hi) return setErrorf(allscanInvalidArgument, "allscanA2AKvHeads: NULL array");
  for (int r = 0; r < nranks; ++r) {
    if (q_lo[r] < 0 || q_hi[r] < q_lo[r])
      return setErrorf(allscanInvalidArgument, "allscanA2AKvHeads: query range of rank %d is [%d, %d)", r, q_lo[r], q_hi[r]);
    if (q_hi[r] == q_lo[r]) {
      kv_lo[r] = kv_hi[r] = q_lo[r] / q_per_kv;
    } else {
      kv_lo[r] = q_lo[r] / q_per_kv;
      kv_hi[r] = (q_hi[r] - 1) / q_per_kv + 1;
    }
  }
  return allscanSuccess;
}

ALLSCAN_API allscanResult_t allscanA2ACheckArgs(int nranks, int rank, allscanA2ADirection_t direction,
                                            const allscanA2AArgs_t* args) {
  return checkArgs(nranks, rank, direction, args, /*need_pointers=*/false);
}

ALLSCAN_API allscanResult_t allscanA2AWorkspaceSize(int nranks, int rank, allscanA2ADirection_t direction,
                                                const allscanA2AArgs_t* args, size_t* bytes) {
  if (bytes == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2AWorkspaceSize: bytes is NULL");
  allscanResult_t r = checkArgs(nranks, rank, direction, args, false);
  if (r != allscanSuccess) return r;
  Plan plan;
  buildPlan(nranks, rank, direction, args, nullptr, &plan);
  *bytes = plan.workspace_bytes;
  return allscanSuccess;
}

// The work of allscanA2A, run under the communicator's watch (common/watch.h).
static allscanResult_t a2aIssue(ncclComm_t comm, allscanA2ADirection_t direction, const allscanA2AArgs_t* args,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  int nranks = 0, rank = 0;
  ALLSCAN_NCCL_CHECK(comm, ncclCommCount(comm, &nranks));
  ALLSCAN_NCCL_CHECK(comm, ncclCommUserRank(comm, &rank));
  allscanResult_t r = checkArgs(nranks, rank, direction, args, true);
  if (r != allscanSuccess) return r;
  Plan plan;
  buildPlan(nranks, rank, direction, args, nullptr, &plan);
  if (plan.workspace_bytes > 0) {
    if (workspace == nullptr || workspace_bytes < plan.workspace_bytes)
      return setErrorf(allscanInvalidArgument, "allscanA2A: workspace of %zu bytes at %p is too small; %zu bytes needed",
                  workspace_bytes, workspace, plan.workspace_bytes);
    if (reinterpret_cast<uintptr_t>(workspace) % kAlign != 0)
      return setErrorf(allscanInvalidArgument, "allscanA2A: workspace must be %zu-byte aligned", kAlign);
  }
  Plan real;
  buildPlan(nranks, rank, direction, args, static_cast<char*>(workspace), &real);
  for (const SumBatch& s : real.sums)
    if (s.num > kMaxSumPieces)
      return setErrorf(allscanInvalidArgument, "allscanA2A: overlapping head maps or accumulate are supported up to %d ranks",
                  kMaxSumPieces);

  allscan::detail::SigSlots sig;
  if (real.sig_recv != nullptr) {
    if (allscan::detail::ncclOf(args->check_comm) != comm)
      return setErrorf(allscanInvalidArgument, "allscanA2A: check_comm wraps another NCCL communicator than comm");
    allscan::detail::SignatureTable* table = allscan::detail::signaturesOf(args->check_comm);
    ALLSCAN_CHECK(allscan::detail::mismatchStatus(table));
    ALLSCAN_CHECK(allscan::detail::signatureSlots(table, args->signature, stream, &sig));
  }
  r = launchCopies(real.pack, args->batch, real.row_bytes, stream);
  if (r != allscanSuccess) return r;
  int received = 0;  // signatures received, in peer order
  if (!real.xfers.empty()) {
    ALLSCAN_NCCL_CHECK(comm, ncclGroupStart());
    ncclResult_t e = ncclSuccess;
    if (sig.on()) {
      // One signature to and from every peer this call exchanges data with, ahead of that data.
      std::vector<char> to(nranks, 0), from(nranks, 0);
      for (const Transfer& t : real.xfers) {
        to[t.peer] |= t.send_bytes > 0;
        from[t.peer] |= t.recv_bytes > 0;
      }
      for (int p = 0; p < nranks && e == ncclSuccess; ++p) {
        if (to[p]) e = ncclSend(sig.send, 1, ncclUint64, p, comm, stream);
        if (from[p] && e == ncclSuccess) e = ncclRecv(real.sig_recv + received++, 1, ncclUint64, p, comm, stream);
      }
    }
    for (const Transfer& t : real.xfers) {
      if (t.send_bytes && e == ncclSuccess) e = ncclSend(t.send, t.send_bytes, ncclUint8, t.peer, comm, stream);
      if (t.recv_bytes && e == ncclSuccess) e = ncclRecv(t.recv, t.recv_bytes, ncclUint8, t.peer, comm, stream);
    }
    ncclResult_t e_end = ncclGroupEnd();
    if (e != ncclSuccess && e != ncclInProgress)
      return setErrorf(allscan::detail::ncclFailure(e), "allscanA2A: ncclSend/ncclRecv failed: %s", ncclGetErrorString(e));
    e = allscan::detail::ncclSettle(comm, e_end);
    if (e != ncclSuccess) return setErrorf(allscan::detail::ncclFailure(e), "allscanA2A: ncclGroupEnd failed: %s", ncclGetErrorString(e));
  }
  r = launchCopies(real.unpack, args->batch, real.row_bytes, stream);
  if (r != allscanSuccess) return r;
  for (const SumBatch& s : real.sums) {
    r = launchSum(s, args->dtype, stream);
    if (r != allscanSuccess) return r;
  }
  if (received > 0) {
    PoisonBatch pb;
    std::memset(&pb, 0, sizeof(pb));
    pb.got = real.sig_recv;
    pb.n = received;
    pb.expect = sig.check.expect;
    pb.record = sig.check.record;
    pb.num = args->num_tensors;
    const int me = rank;
    for (int t = 0; t < args->num_tensors; ++t) {
      const allscanA2ATensor_t& x = args->tensors[t];
      const uint64_t rows = direction == allscanA2AScatterHeads
                                ? static_cast<uint64_t>(args->seq_local) * nranks * (x.head_hi[me] - x.head_lo[me])
                                : static_cast<uint64_t>(args->seq_local) * x.num_heads;
      pb.out[t] = x.output;
      pb.count[t] = x.output != nullptr ? static_cast<uint64_t>(args->batch) * rows * args->head_dim : 0;
    }
    switch (args->dtype) {
      case allscanFloat32: poisonKernel<float><<<32, 256, 0, stream>>>(pb); break;
      case allscanFloat64: poisonKernel<double><<<32, 256, 0, stream>>>(pb); break;
      case allscanFloat16: poisonKernel<__half><<<32, 256, 0, stream>>>(pb); break;
      case allscanBfloat16: poisonKernel<__nv_bfloat16><<<32, 256, 0, stream>>>(pb); break;
    }
    ALLSCAN_CUDA_CHECK(cudaGetLastError());
  }
  if (args->done_event != nullptr) ALLSCAN_CUDA_CHECK(cudaEventRecord(args->done_event, stream));
  return allscanSuccess;
}

ALLSCAN_API allscanResult_t allscanA2A(ncclComm_t comm, allscanA2ADirection_t direction, const allscanA2AArgs_t* args,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  // A failed (or retired: NCCL gone, comm NULL) check_comm reports its failure before anything
  // touches comm. A received mismatch only inside the watch: after an abort, a receive that never
  // completed looks like one, and the watch's timeout comes first.
  if (args != nullptr) ALLSCAN_CHECK(allscan::detail::storedFailure(args->check_comm));
  if (comm == nullptr) return setErrorf(allscanInvalidArgument, "allscanA2A: comm is NULL");
  return allscan::detail::watched(
      comm, stream, [&] { return a2aIssue(comm, direction, args, workspace, workspace_bytes, stream); });
}

}  // extern "C"
