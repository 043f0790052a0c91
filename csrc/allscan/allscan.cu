// The All-Scan core: combine kernels, the pipelined / serial / all-gather schedules on NCCL, the
// communicator wrapper and the link model that chooses the block count. No libtorch.
#include "allscan/allscan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <string>

#include "comm.h"
#include "device_path.h"
#include "head_result.h"
#include "pipeline.h"
#include "common/acc.cuh"
#include "decay_combine.cuh"
#include "common/error.h"
#include "common/watch.h"

using namespace allscan::detail;

namespace {

template <typename G, typename A> __device__ __forceinline__ A loadG(const G* g, size_t i) {
  return static_cast<A>(toAcc<G>(g[i]));
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------
constexpr int kThreads = 256;

// out[i] = g[(offset+i)/inner] * y[i] + x[i]  (g == nullptr: 1; g == 0: x[i]), i in [0, n); NaN instead when
// `check` finds that y came from a call with other arguments (signature.h).
// VEC consecutive elements per thread with 16-byte accesses when everything is aligned.
template <typename T, typename G, int VEC>
__global__ void __launch_bounds__(kThreads) combineKernel(const T* __restrict__ x, const T* __restrict__ y,
                                                          const G* __restrict__ g, T* __restrict__ out, size_t n,
                                                          size_t inner, size_t offset, SigCheck check) {
  using A = typename Acc<T>::type;
  const bool poison = check.mismatch();
  const A nan = quietNan(A(0));
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t nvec = n / VEC;
  const bool shared_g = g != nullptr && (inner % VEC == 0) && (offset % VEC == 0);
  for (size_t v = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec; v += stride) {
    const size_t i0 = v * VEC;
    alignas(16) T xs[VEC];
    alignas(16) T ys[VEC];
    alignas(16) T os[VEC];
    if constexpr (VEC > 1) {
      using V = uint4;  // 16 bytes
      *reinterpret_cast<V*>(xs) = reinterpret_cast<const V*>(x)[v];
      *reinterpret_cast<V*>(ys) = reinterpret_cast<const V*>(y)[v];
    } else {
      xs[0] = x[i0];
      ys[0] = y[i0];
    }
    A gs = A(1);
    if (shared_g) gs = loadG<G, A>(g, (offset + i0) / inner);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A gj = gs;
      if (g != nullptr && !shared_g) gj = loadG<G, A>(g, (offset + i0 + j) / inner);
      os[j] = fromAcc<T>(poison ? nan : combineDecay(gj, toAcc<T>(ys[j]), toAcc<T>(xs[j])));
    }
    if constexpr (VEC > 1) {
      reinterpret_cast<uint4*>(out)[v] = *reinterpret_cast<uint4*>(os);
    } else {
      out[i0] = os[0];
    }
  }
  // Scalar tail.
  for (size_t i = nvec * VEC + static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    A gj = g != nullptr ? loadG<G, A>(g, (offset + i) / inner) : A(1);
    out[i] = fromAcc<T>(poison ? nan : combineDecay(gj, toAcc<T>(y[i]), toAcc<T>(x[i])));
  }
}

// The all-gather method's local fold. X: [P][count], Gs: [P][g_count] (or null), init: [count] or
// null. Each element folds the chain up to `rank` in chain order, rounding to T at every boundary,
// exactly as the pipelined method does.
template <typename T, typename G>
__global__ void __launch_bounds__(kThreads) foldKernel(const T* __restrict__ X, const G* __restrict__ Gs,
                                                       const T* __restrict__ init, T* __restrict__ out, size_t count,
                                                       size_t g_count, int nranks, int rank, int reverse, int inclusive) {
  using A = typename Acc<T>::type;
  const size_t inner = Gs != nullptr ? count / g_count : 1;
  const int head = reverse ? nranks - 1 : 0;
  const int step = reverse ? -1 : 1;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const size_t gi = i / inner;
    // y entering the head.
    bool zero = init == nullptr;
    T y = zero ? fromAcc<T>(A(0)) : init[i];
    const int last = inclusive ? rank + step : rank;  // fold ranks head .. last-step
    for (int q = head; q != last; q += step) {
      const T xq = X[static_cast<size_t>(q) * count + i];
      if (zero) {
        y = xq;  // y = 0 at the head without init: it sends x itself
        zero = false;
      } else {
        const A gq = Gs != nullptr ? loadG<G, A>(Gs, static_cast<size_t>(q) * g_count + gi) : A(1);
        y = fromAcc<T>(combineDecay(gq, toAcc<T>(y), toAcc<T>(xq)));
      }
    }
    out[i] = y;
  }
}

int gridFor(size_t work) {
  size_t blocks = (work + kThreads - 1) / kThreads;
  // Enough blocks to fill any current GPU several times over; the loops are grid-strided.
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(blocks, 4096)));
}

template <typename T, typename G>
cudaError_t launchCombineT(const void* x, const void* y, const void* g, void* out, size_t n, size_t inner,
                           size_t offset, const SigCheck& check, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = aligned16(x) && aligned16(y) && aligned16(out);
  if (vec) {
    combineKernel<T, G, VEC><<<gridFor(n / VEC + 1), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<const G*>(g), static_cast<T*>(out), n,
        inner, offset, check);
  } else {
    combineKernel<T, G, 1><<<gridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<const G*>(g), static_cast<T*>(out), n,
        inner, offset, check);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launchCombineG(const void* x, const void* y, const void* g, void* out, size_t n, size_t inner,
                           size_t offset, allscanDataType_t g_dtype, const SigCheck& check, cudaStream_t stream) {
  if (g == nullptr || g_dtype == allscanFloat32)
    return launchCombineT<T, float>(x, y, g, out, n, inner, offset, check, stream);
  return launchCombineT<T, T>(x, y, g, out, n, inner, offset, check, stream);
}

// `check` (default: none) poisons the output when the received y came from a mismatched call.
cudaError_t launchCombine(allscanDataType_t dtype, allscanDataType_t g_dtype, const void* x, const void* y,
                          const void* g, void* out, size_t n, size_t inner, size_t offset, cudaStream_t stream,
                          const SigCheck& check = SigCheck{}) {
  switch (dtype) {
    case allscanFloat32: return launchCombineG<float>(x, y, g, out, n, inner, offset, g_dtype, check, stream);
    case allscanFloat16: return launchCombineG<__half>(x, y, g, out, n, inner, offset, g_dtype, check, stream);
    case allscanBfloat16:
      return launchCombineG<__nv_bfloat16>(x, y, g, out, n, inner, offset, g_dtype, check, stream);
    case allscanFloat64: return launchCombineG<double>(x, y, g, out, n, inner, offset, g_dtype, check, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T, typename G>
cudaError_t launchFoldT(const allscanScanArgs_t& a, const void* X, const void* Gs, int nranks, int rank,
                        cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  foldKernel<T, G><<<gridFor(a.count), kThreads, 0, stream>>>(
      static_cast<const T*>(X), static_cast<const G*>(Gs), static_cast<const T*>(a.init), static_cast<T*>(a.y),
      a.count, a.g_count, nranks, rank, a.reverse, a.inclusive);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launchFoldG(const allscanScanArgs_t& a, const void* X, const void* Gs, int nranks, int rank,
                        cudaStream_t stream) {
  if (Gs == nullptr || a.g_dtype == allscanFloat32) return launchFoldT<T, float>(a, X, Gs, nranks, rank, stream);
  return launchFoldT<T, T>(a, X, Gs, nranks, rank, stream);
}

cudaError_t launchFold(const allscanScanArgs_t& a, const void* X, const void* Gs, int nranks, int rank,
                       cudaStream_t stream) {
  switch (a.dtype) {
    case allscanFloat32: return launchFoldG<float>(a, X, Gs, nranks, rank, stream);
    case allscanFloat16: return launchFoldG<__half>(a, X, Gs, nranks, rank, stream);
    case allscanBfloat16: return launchFoldG<__nv_bfloat16>(a, X, Gs, nranks, rank, stream);
    case allscanFloat64: return launchFoldG<double>(a, X, Gs, nranks, rank, stream);
  }
  return cudaErrorInvalidValue;
}

// ------------------------------------------------------------------------------------------------
// Arguments, blocks and workspace layout
// ------------------------------------------------------------------------------------------------
allscanResult_t checkArgs(const allscanComm* comm, const allscanScanArgs_t* a) {
  ALLSCAN_CHECK(checkTarget(comm, a));
  ALLSCAN_CHECK(checkSchedule(a));
  if (a->count > 0) {
    ALLSCAN_ARG_CHECK(a->x != nullptr, "x: null pointer for a state of " + std::to_string(a->count) + " elements");
    ALLSCAN_ARG_CHECK(a->y != nullptr, "y: null pointer for a state of " + std::to_string(a->count) + " elements");
    ALLSCAN_ARG_CHECK(a->x != a->y, "y: must not alias x");
    ALLSCAN_ARG_CHECK(a->init != a->y, "y: must not alias init");
  }
  if (a->g != nullptr) {
    ALLSCAN_ARG_CHECK(validDtype(a->g_dtype) && (a->g_dtype == allscanFloat32 || a->g_dtype == a->dtype),
                      std::string("g_dtype: expected float32 or the state's dtype (") + dtypeName(a->dtype) + ")");
    ALLSCAN_ARG_CHECK(a->g_count > 0 || a->count == 0, "g_count: expected a positive count for a non-null decay");
    ALLSCAN_ARG_CHECK(a->g_count == 0 ? a->count == 0 : a->count % a->g_count == 0,
                      "g_count: " + std::to_string(a->g_count) + " must divide count " + std::to_string(a->count) +
                          " (the decay has a prefix shape of the state)");
    ALLSCAN_ARG_CHECK(a->g != a->y, "y: must not alias g");
  }
  return allscanSuccess;
}

size_t workspaceBytes(const allscanComm* comm, const allscanScanArgs_t* a) {
  const int P = comm->nranks;
  if (P == 1 || a->count == 0) return 0;
  const size_t es = dtypeSize(a->dtype);
  if (a->method == allscanAllGather) {
    size_t bytes = alignUp(static_cast<size_t>(P) * a->count * es, kAlign);
    if (a->g != nullptr) bytes += alignUp(static_cast<size_t>(P) * a->g_count * dtypeSize(a->g_dtype), kAlign);
    if (a->init != nullptr) bytes += alignUp(a->count * es, kAlign);  // the head's init, broadcast
    return bytes;
  }
  // Pipelined and serial: what this rank's role needs (see allscanScan). The head stages
  // g*init + x when it has an init and an exclusive result; every other rank stages what it sends
  // on (exclusive, not the tail) or what it receives (inclusive). The tail of an exclusive scan
  // receives straight into y and needs nothing.
  const ChainPos pos = chainPos(comm, a->reverse);
  const bool needs = pos.head ? (a->init != nullptr && !a->inclusive) : (pos.has_next || a->inclusive);
  return needs ? alignUp(a->count * es, kAlign) : 0;
}

// ------------------------------------------------------------------------------------------------
// The schedules (allscanScan has checked the arguments and the workspace)
// ------------------------------------------------------------------------------------------------

// The pipeline's partition of a state into blocks (blockElems), as byte offsets into a buffer.
struct Blocks {
  Blocks(size_t count, int K, size_t esize)
      : count(count), elems(blockElems(count, K, esize)), esize(esize), n((count + elems - 1) / elems) {}
  const char* at(const void* base, size_t k) const { return static_cast<const char*>(base) + k * elems * esize; }
  char* at(void* base, size_t k) const { return static_cast<char*>(base) + k * elems * esize; }
  size_t len(size_t k) const { return std::min(elems, count - k * elems); }
  size_t count;  // elements of the state
  size_t elems;  // elements per block (the last may hold fewer)
  size_t esize;  // bytes per element
  size_t n;      // number of blocks
};

size_t gInner(const allscanScanArgs_t* a) { return a->g != nullptr ? a->count / a->g_count : 1; }

// A chain of one: exclusive = init (or 0), inclusive = g*init + x (or x).
allscanResult_t scanOneRank(const allscanScanArgs_t* a, cudaStream_t stream) {
  const size_t bytes = a->count * dtypeSize(a->dtype);
  if (!a->inclusive) return copyOrZero(a->y, a->init, bytes, stream);
  if (a->init == nullptr) return copyOrZero(a->y, a->x, bytes, stream);
  ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, a->x, a->init, a->g, a->y, a->count, gInner(a), 0, stream));
  return allscanSuccess;
}

// LASP-2 pattern: gather every rank's state (and decay), fold locally. init is read on the chain
// head only (as in the other methods): it is broadcast from there.
allscanResult_t scanAllGather(const allscanComm* comm, const allscanScanArgs_t* a, void* workspace, cudaStream_t stream) {
  const int P = comm->nranks;
  const int head = a->reverse ? P - 1 : 0;
  ncclComm_t nc = comm->nccl;
  const ncclDataType_t nt = ncclType(a->dtype);
  const size_t count = a->count;
  char* ws = static_cast<char*>(workspace);
  void* X = ws;
  size_t off = alignUp(static_cast<size_t>(P) * count * dtypeSize(a->dtype), kAlign);
  void* Gs = nullptr;
  void* I = nullptr;
  if (a->g != nullptr) {
    Gs = ws + off;
    off += alignUp(static_cast<size_t>(P) * a->g_count * dtypeSize(a->g_dtype), kAlign);
  }
  if (a->init != nullptr) I = ws + off;
  ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
  ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(a->x, X, count, nt, nc, stream));
  if (Gs != nullptr) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(a->g, Gs, a->g_count, ncclType(a->g_dtype), nc, stream));
  if (I != nullptr) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclBroadcast(a->init, I, count, nt, head, nc, stream));
  ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
  allscanScanArgs_t folded = *a;
  folded.init = I;
  ALLSCAN_CUDA_CHECK(launchFold(folded, X, Gs, P, comm->rank, stream));
  return allscanSuccess;
}

// The chain starts here: y = init (or 0); the value sent on is g*init + x (or x itself), all blocks
// in one group call (headSend).
allscanResult_t scanHead(allscanComm* comm, const allscanScanArgs_t* a, const Blocks& b, const SigSlots& sig,
                         void* workspace, cudaStream_t stream) {
  const void* s = a->x;
  if (a->init != nullptr) {
    void* dst = a->inclusive ? a->y : workspace;
    ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, a->x, a->init, a->g, dst, a->count, gInner(a), 0, stream));
    s = dst;
  }
  // The head's own result: init or zeros (exclusive), x itself (inclusive without init); with an
  // init, the inclusive result is what it sends (written above).
  HeadResult own(comm, a->inclusive && a->init != nullptr ? nullptr : a->y, a->inclusive ? a->x : a->init,
                 a->count * dtypeSize(a->dtype), stream);
  const ncclDataType_t nt = ncclType(a->dtype);
  return headSend(
      comm, a->reverse, b.n, own, sig,
      [&](size_t k, ncclComm_t nc, int next) { return ncclSend(b.at(s, k), b.len(k), nt, next, nc, stream); }, stream);
}

// Inner and tail ranks: receive block k while sending block k-1 on, combine block k. R receives
// y_p; S holds g*y_p + x (what is sent on, or the inclusive result). Exclusive: R = y,
// S = workspace. Inclusive: R = workspace, S = y.
allscanResult_t scanLink(const allscanComm* comm, const allscanScanArgs_t* a, const Blocks& b, const SigSlots& sig,
                         void* workspace, cudaStream_t stream) {
  const size_t inner = gInner(a);
  void* R = a->inclusive ? workspace : a->y;
  void* S = a->inclusive ? a->y : workspace;
  const bool combine = chainPos(comm, a->reverse).has_next || a->inclusive;
  ALLSCAN_CHECK(relayBlocks(
      comm, a->reverse, b.n, ncclType(a->dtype), sig,
      [&](size_t k) { return BlockRef{b.at(S, k), b.len(k)}; },  // sent on
      [&](size_t k) { return BlockRef{b.at(R, k), b.len(k)}; },  // received
      [&](size_t k) -> allscanResult_t {
        if (combine) {
          ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, b.at(a->x, k), b.at(R, k), a->g, b.at(S, k),
                                           b.len(k), inner, k * b.elems, stream, sig.check));
        }
        return allscanSuccess;
      },
      stream));
  // An exclusive result is the received y itself, which no combine writes: checked on its own.
  if (!a->inclusive) ALLSCAN_CUDA_CHECK(launchPoison(a->y, a->count, a->dtype, sig.check, stream));
  return allscanSuccess;
}


// The NCCL work of the public calls below, run under the communicator's watch (common/watch.h).
allscanResult_t neighborExchange(allscanComm_t comm, const void* sendbuf, void* recvbuf, size_t bytes, int reverse,
                                 int chain, cudaStream_t stream) {
  const int P = comm->nranks, r = comm->rank;
  if (P == 1 || bytes == 0) return allscanSuccess;
  ALLSCAN_ARG_CHECK(sendbuf != nullptr && recvbuf != nullptr, "sendbuf/recvbuf: null pointer");
  const int next = reverse ? (r - 1 + P) % P : (r + 1) % P;
  const int prev = reverse ? (r + 1) % P : (r - 1 + P) % P;
  const bool send = !chain || (reverse ? r > 0 : r < P - 1);
  const bool recv = !chain || (reverse ? r < P - 1 : r > 0);
  ALLSCAN_NCCL_CHECK(comm->nccl, ncclGroupStart());
  if (send) ALLSCAN_NCCL_CHECK_IN_GROUP(comm->nccl, ncclSend(sendbuf, bytes, ncclUint8, next, comm->nccl, stream));
  if (recv) ALLSCAN_NCCL_CHECK_IN_GROUP(comm->nccl, ncclRecv(recvbuf, bytes, ncclUint8, prev, comm->nccl, stream));
  ALLSCAN_NCCL_CHECK(comm->nccl, ncclGroupEnd());
  return allscanSuccess;
}

allscanResult_t scanIssue(allscanComm* comm, const allscanScanArgs_t* a, void* workspace, cudaStream_t stream) {
  if (a->method == allscanAllGather) return scanAllGather(comm, a, workspace, stream);
  const Blocks blocks(a->count, methodBlocks(comm, a->method, a->num_blocks, a->count * dtypeSize(a->dtype)),
                      dtypeSize(a->dtype));
  SigSlots sig;
  ALLSCAN_CHECK(signatureSlots(comm->signatures, a->signature, stream, &sig));
  if (chainPos(comm, a->reverse).head) return scanHead(comm, a, blocks, sig, workspace, stream);
  return scanLink(comm, a, blocks, sig, workspace, stream);
}
}  // namespace

namespace allscan {
namespace detail {
SignatureTable* signaturesOf(const allscanComm* comm) { return comm != nullptr ? comm->signatures : nullptr; }
ncclComm_t ncclOf(const allscanComm* comm) { return comm != nullptr ? comm->nccl : nullptr; }
allscanResult_t storedFailure(const allscanComm* comm) { return comm != nullptr ? checkNotFailed(comm) : allscanSuccess; }
}  // namespace detail
}  // namespace allscan

// ------------------------------------------------------------------------------------------------
// C API
// ------------------------------------------------------------------------------------------------
extern "C" {

int allscanGetVersion(void) {
  return ALLSCAN_VERSION_MAJOR * 10000 + ALLSCAN_VERSION_MINOR * 100 + ALLSCAN_VERSION_PATCH;
}

allscanResult_t allscanCommCreate(ncclComm_t nccl, allscanComm_t* comm) {
  ALLSCAN_ARG_CHECK(nccl != nullptr, "nccl: null NCCL communicator");
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null output pointer");
  int rank = 0, nranks = 0;
  ALLSCAN_NCCL_CHECK(nccl, ncclCommUserRank(nccl, &rank));
  ALLSCAN_NCCL_CHECK(nccl, ncclCommCount(nccl, &nranks));
  int dev = -1, cur = -1;
  ALLSCAN_NCCL_CHECK(nccl, ncclCommCuDevice(nccl, &dev));
  allscanComm* c = nullptr;
  ALLSCAN_CHECK(newComm(rank, nranks, &c));
  c->nccl = nccl;
  // The side stream and events live on the communicator's device.
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess && cur != dev) e = cudaSetDevice(dev);
  // The side fill runs beside the send and its join gates the caller's stream: the highest
  // priority, so a busy GPU schedules its few CTAs first.
  int prio_low = 0, prio_high = 0;
  if (e == cudaSuccess) e = cudaDeviceGetStreamPriorityRange(&prio_low, &prio_high);
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, prio_high);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->join, cudaEventDisableTiming);
  allscanResult_t st = allscanSuccess;
  if (e == cudaSuccess && nranks > 1) st = createSignatures(&c->signatures);
  if (cur >= 0 && cur != dev) cudaSetDevice(cur);
  if (e != cudaSuccess) {
    allscanCommDestroy(c);
    return setError(allscanCudaError, std::string("allscanCommCreate: stream/event creation failed: ") + cudaGetErrorString(e));
  }
  if (st != allscanSuccess) {
    const std::string why = allscanGetLastError();
    allscanCommDestroy(c);
    return setError(st, "allscanCommCreate: " + why);
  }
  *comm = c;
  return allscanSuccess;
}

allscanResult_t allscanCommCreateDetached(int rank, int nranks, allscanComm_t* comm) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null output pointer");
  ALLSCAN_ARG_CHECK(nranks >= 1, "nranks: expected >= 1, got " + std::to_string(nranks));
  ALLSCAN_ARG_CHECK(rank >= 0 && rank < nranks,
                    "rank: expected 0 <= rank < nranks (" + std::to_string(nranks) + "), got " + std::to_string(rank));
  return newComm(rank, nranks, comm);
}

allscanResult_t allscanCommDestroy(allscanComm_t comm) {
  if (comm == nullptr) return allscanSuccess;
  if (comm->join) cudaEventDestroy(comm->join);
  if (comm->fork) cudaEventDestroy(comm->fork);
  if (comm->side) cudaStreamDestroy(comm->side);
  if (comm->zeros) cudaFree(comm->zeros);
  for (void* p : comm->retired) cudaFree(p);
  freeSignatures(comm->signatures);
  devicePathDestroy(comm);
  cudaGetLastError();  // nothing left for the caller's next launch check to misreport
  delete comm;  // the NCCL communicator is borrowed: not destroyed here
  return allscanSuccess;
}

allscanResult_t allscanCommForgetNccl(allscanComm_t comm) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  comm->nccl = nullptr;
  return allscanSuccess;
}

allscanResult_t allscanCommFail(allscanComm_t comm, allscanResult_t code, const char* reason) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(code == allscanTimeout || code == allscanMismatch || code == allscanRemoteError,
                    "code: expected allscanTimeout, allscanMismatch or allscanRemoteError, got " +
                        std::to_string(static_cast<int>(code)));
  if (comm->failure_code != allscanSuccess) return allscanSuccess;  // the first failure stays
  comm->failure = reason != nullptr ? reason : "the communicator failed";
  comm->failure_code = code;
  return allscanSuccess;
}

allscanResult_t allscanCommRank(allscanComm_t comm, int* rank) {
  ALLSCAN_ARG_CHECK(comm != nullptr && rank != nullptr, "comm/rank: null pointer");
  *rank = comm->rank;
  return allscanSuccess;
}

allscanResult_t allscanCommStatus(allscanComm_t comm) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_CHECK(checkNotFailed(comm));
  ALLSCAN_CHECK(devicePathStatus(comm));
  return mismatchStatus(comm->signatures);
}

allscanResult_t allscanCommSize(allscanComm_t comm, int* nranks) {
  ALLSCAN_ARG_CHECK(comm != nullptr && nranks != nullptr, "comm/nranks: null pointer");
  *nranks = comm->nranks;
  return allscanSuccess;
}

allscanResult_t allscanSetLinkModel(allscanComm_t comm, double latency_us, double us_per_byte) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(std::isfinite(latency_us) && latency_us > 0.0,
                    "latency_us: expected a positive finite latency in microseconds");
  ALLSCAN_ARG_CHECK(std::isfinite(us_per_byte) && us_per_byte > 0.0,
                    "us_per_byte: expected a positive finite time per byte in microseconds");
  comm->latency_us = latency_us;
  comm->us_per_byte = us_per_byte;
  comm->model_set = true;
  return allscanSuccess;
}

allscanResult_t allscanGetLinkModel(allscanComm_t comm, double* latency_us, double* us_per_byte, int* is_set) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  if (latency_us) *latency_us = comm->latency_us;
  if (us_per_byte) *us_per_byte = comm->us_per_byte;
  if (is_set) *is_set = comm->model_set ? 1 : 0;
  return allscanSuccess;
}

int allscanChooseNumBlocksModel(int nranks, size_t bytes, double latency_us, double us_per_byte) {
  // Chain of P ranks, K blocks: the first block crosses P-1 links, the other K-1 follow one step
  // behind each other, every step costing one message: T(K) = (P - 2 + K) * (a + b*N/K).
  // dT/dK = 0 at K* = sqrt((P-2) * b*N / a); at P <= 2, K = 1 is best whatever the link.
  if (nranks <= 2 || bytes == 0 || !(latency_us > 0.0) || !(us_per_byte > 0.0)) return 1;
  long kmax = static_cast<long>(std::min<size_t>(allscanMaxBlocks, std::max<size_t>(1, bytes / allscanMinBlockBytes)));
  const double N = static_cast<double>(bytes);
  auto T = [&](long K) { return (nranks - 2 + K) * (latency_us + us_per_byte * N / static_cast<double>(K)); };
  const double kstar = std::sqrt((nranks - 2) * us_per_byte * N / latency_us);
  long k0 = std::max(1L, std::min(kmax, static_cast<long>(std::floor(kstar))));
  long k1 = std::max(1L, std::min(kmax, k0 + 1));
  return static_cast<int>(T(k1) < T(k0) ? k1 : k0);
}

allscanResult_t allscanChooseNumBlocks(allscanComm_t comm, size_t bytes, int* num_blocks) {
  ALLSCAN_ARG_CHECK(comm != nullptr && num_blocks != nullptr, "comm/num_blocks: null pointer");
  *num_blocks = comm->model_set ? allscanChooseNumBlocksModel(comm->nranks, bytes, comm->latency_us, comm->us_per_byte) : 1;
  return allscanSuccess;
}

allscanResult_t allscanCheckArgs(allscanComm_t comm, const allscanScanArgs_t* args) { return checkArgs(comm, args); }

allscanResult_t allscanWorkspaceSize(allscanComm_t comm, const allscanScanArgs_t* args, size_t* bytes) {
  ALLSCAN_CHECK(checkArgs(comm, args));
  ALLSCAN_ARG_CHECK(bytes != nullptr, "bytes: null output pointer");
  *bytes = workspaceBytes(comm, args);
  return allscanSuccess;
}

allscanResult_t allscanNeighborExchange(allscanComm_t comm, const void* sendbuf, void* recvbuf, size_t bytes,
                                        int reverse, int chain, cudaStream_t stream) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_CHECK(checkAttached(comm));
  // a mismatch a scan's kernels found fails every later call on the communicator, this one too
  // (the layers' halo exchange runs on it); inside the watch, as in allscanScan
  return watched(comm->nccl, stream, [&] {
    ALLSCAN_CHECK(mismatchStatus(comm->signatures));
    return neighborExchange(comm, sendbuf, recvbuf, bytes, reverse, chain, stream);
  });
}

allscanResult_t allscanScan(allscanComm_t comm, const allscanScanArgs_t* a, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
  ALLSCAN_CHECK(checkArgs(comm, a));
  if (a->count == 0) return allscanSuccess;
  const size_t need = workspaceBytes(comm, a);
  ALLSCAN_CHECK(checkWorkspace(need, workspace, workspace_bytes, "allscanWorkspaceSize"));
  if (comm->nranks == 1) return scanOneRank(a, stream);
  ALLSCAN_CHECK(checkAttached(comm));
  // Inside the watch: a failed communicator refuses before the device path's (collective) setup,
  // and the watch bounds that setup as it bounds an NCCL call. The watch's failure first: after an
  // abort, a receive that never completed looks like a mismatch.
  return watched(comm->nccl, stream, [&] {
    if (a->method == allscanDevice && devicePathReady(comm, a->count * dtypeSize(a->dtype), stream))
      return devicePathScan(comm, a, stream);
    ALLSCAN_CHECK(mismatchStatus(comm->signatures));
    ALLSCAN_CHECK(devicePathStatus(comm));
    return scanIssue(comm, a, workspace, stream);
  });
}

allscanResult_t allscanDevicePath(allscanComm_t comm, int* state, const char** reason) {
  ALLSCAN_ARG_CHECK(comm != nullptr && state != nullptr, "comm/state: null pointer");
  const char* why = devicePathReason(comm);
  const bool tried = comm->device != nullptr;
  *state = !tried ? 0 : (*why == '\0' ? 1 : -1);
  if (reason != nullptr) *reason = why;
  return allscanSuccess;
}

allscanResult_t allscanDeviceNeighborExchange(allscanComm_t comm, const void* sendbuf, void* recvbuf, size_t bytes,
                                              int reverse, int chain, int num_ctas, cudaStream_t stream) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(reverse == 0 || reverse == 1, "reverse: expected 0 or 1");
  ALLSCAN_ARG_CHECK(num_ctas >= 0, "num_ctas: expected 0 (auto) or a positive CTA count");
  if (comm->nranks == 1 || bytes == 0) return allscanSuccess;
  ALLSCAN_CHECK(checkAttached(comm));
  ALLSCAN_ARG_CHECK(sendbuf != nullptr && recvbuf != nullptr, "sendbuf/recvbuf: null pointer");
  return watched(comm->nccl, stream, [&] {
    if (!devicePathReady(comm, bytes, stream))
      return setError(allscanInvalidArgument, std::string("allscanDeviceNeighborExchange: the device path is not "
                                                          "available: ") + devicePathReason(comm));
    return devicePathExchange(comm, sendbuf, recvbuf, bytes, reverse, chain, num_ctas, stream);
  });
}

allscanResult_t allscanCalibrate(allscanComm_t comm, cudaStream_t stream) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_CHECK(checkNotFailed(comm));
  ALLSCAN_ARG_CHECK(comm->nccl != nullptr, "comm: a detached communicator cannot be calibrated");
  if (comm->nranks == 1) return allscanSuccess;
  constexpr size_t kSmall = 8 << 10, kLarge = 8 << 20;
  constexpr int kWarm = 5, kIters = 20;
  void *sbuf = nullptr, *rbuf = nullptr;
  double* dev = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  allscanResult_t st = allscanSuccess;
  double t[2] = {0, 0};
  const size_t sizes[2] = {kSmall, kLarge};
  double host[2];
  float ms = 0.f;
  auto fail = [&](allscanResult_t s) { st = s; };
  do {
    if (cudaMalloc(&sbuf, kLarge) != cudaSuccess || cudaMalloc(&rbuf, kLarge) != cudaSuccess ||
        cudaMalloc(&dev, 2 * sizeof(double)) != cudaSuccess) {
      fail(setError(allscanCudaError, "allscanCalibrate: cudaMalloc failed"));
      break;
    }
    if (cudaMemsetAsync(sbuf, 0, kLarge, stream) != cudaSuccess || cudaEventCreate(&e0) != cudaSuccess ||
        cudaEventCreate(&e1) != cudaSuccess) {
      fail(setError(allscanCudaError, "allscanCalibrate: CUDA setup failed"));
      break;
    }
    for (int s = 0; s < 2 && st == allscanSuccess; ++s) {
      for (int i = 0; i < kWarm + kIters && st == allscanSuccess; ++i) {
        if (i == kWarm) cudaEventRecord(e0, stream);
        st = allscanNeighborExchange(comm, sbuf, rbuf, sizes[s], 0, 0, stream);
      }
      if (st != allscanSuccess) break;
      cudaEventRecord(e1, stream);
      if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
        fail(setError(allscanCudaError, "allscanCalibrate: timing failed"));
        break;
      }
      t[s] = 1000.0 * ms / kIters;  // microseconds per message
    }
    if (st != allscanSuccess) break;
    double b = (t[1] - t[0]) / static_cast<double>(kLarge - kSmall);
    if (!(b > 0.0)) b = t[1] / static_cast<double>(kLarge);
    double lat = t[0] - b * static_cast<double>(kSmall);
    if (!(lat > 0.1)) lat = 0.1;
    host[0] = lat;
    host[1] = b;
    // Every rank must choose the same block count: agree on the slowest link.
    if (cudaMemcpyAsync(dev, host, sizeof(host), cudaMemcpyHostToDevice, stream) != cudaSuccess) {
      fail(setError(allscanCudaError, "allscanCalibrate: copy failed"));
      break;
    }
    const allscanResult_t ar = watched(comm->nccl, stream, [&] {
      const ncclResult_t nr =
          ncclSettle(comm->nccl, ncclAllReduce(dev, dev, 2, ncclFloat64, ncclMax, comm->nccl, stream));
      if (nr == ncclSuccess) return allscanSuccess;
      return setError(ncclFailure(nr), std::string("allscanCalibrate: ncclAllReduce: ") + ncclGetErrorString(nr));
    });
    if (ar != allscanSuccess) {
      fail(ar);
      break;
    }
    if (cudaMemcpyAsync(host, dev, sizeof(host), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      fail(setError(allscanCudaError, "allscanCalibrate: copy back failed"));
      break;
    }
    comm->latency_us = host[0];
    comm->us_per_byte = host[1];
    comm->model_set = true;
  } while (false);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (sbuf) cudaFree(sbuf);
  if (rbuf) cudaFree(rbuf);
  if (dev) cudaFree(dev);
  return st;
}

}  // extern "C"
