// The All-Scan core: combine kernels, the pipelined / serial / all-gather schedules on NCCL, the
// communicator wrapper and the link model that chooses the block count. No libtorch.
#include "allscan/allscan.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "common/error.h"

using allscan::detail::setError;

struct allscanComm {
  ncclComm_t nccl = nullptr;  // borrowed, never destroyed here (null for a detached communicator)
  int rank = 0;
  int nranks = 1;
  bool model_set = false;
  double latency_us = 0.0;
  double us_per_byte = 0.0;
  // For states above self_fill_max the chain head writes its own result (zeros or init) off the
  // critical path: forked onto this stream while the send runs, joined back before the call
  // returns (capturable fork/join).
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  int fill_ctas = 8;  // CTAs of the side fill (ALLSCAN_FILL_CTAS; 0: in series after the send)
  // How the chain head writes its own result (ALLSCAN_HEAD_FILL, see allscanScan).
  int head_fill = 0;                 // HeadFill
  size_t self_fill_max = size_t(8) << 20;  // auto: self copy up to this many bytes (ALLSCAN_SELF_FILL_MAX_BYTES)
  void* zeros = nullptr;             // zeroed buffer: an exclusive head's zeros (see ensureZeros)
  size_t zeros_bytes = 0;
  size_t zeros_failed = 0;           // smallest size whose allocation failed (0: none); not retried
  // Buffers replaced by a larger one: graphs captured earlier may still read them, so they live
  // until the communicator goes.
  std::vector<void*> retired;
};

namespace {

// How the chain head writes its own result (init, zeros, or x itself for an inclusive scan).
enum HeadFill { kFillAuto = 0, kFillSelf = 1, kFillSide = 2, kFillSeries = 3 };
constexpr size_t kDefaultSelfFill = size_t(8) << 20;  // auto: the self copy up to 8 MiB
constexpr size_t kMaxSelfFill = size_t(1) << 30;      // ALLSCAN_SELF_FILL_MAX_BYTES at most 1 GiB

// ------------------------------------------------------------------------------------------------
// Element types
// ------------------------------------------------------------------------------------------------
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type toAcc(T v) { return static_cast<typename Acc<T>::type>(v); }
template <> __device__ __forceinline__ float toAcc<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float toAcc<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T fromAcc(typename Acc<T>::type v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half fromAcc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromAcc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// g*y + x as a separate multiply and add (no FMA contraction), so the CPU/torch reference, which
// computes the same two rounded operations, is bitwise equal.
__device__ __forceinline__ float combineOp(float g, float y, float x) { return __fadd_rn(__fmul_rn(g, y), x); }
__device__ __forceinline__ double combineOp(double g, double y, double x) { return __dadd_rn(__dmul_rn(g, y), x); }

template <typename G, typename A> __device__ __forceinline__ A loadG(const G* g, size_t i) {
  return static_cast<A>(toAcc<G>(g[i]));
}

size_t dtypeSize(allscanDataType_t t) { return allscanDataTypeSize(t); }

bool validDtype(int t) { return t >= allscanFloat32 && t <= allscanFloat64; }

const char* dtypeName(allscanDataType_t t) {
  switch (t) {
    case allscanFloat32: return "float32";
    case allscanFloat16: return "float16";
    case allscanBfloat16: return "bfloat16";
    case allscanFloat64: return "float64";
  }
  return "?";
}

ncclDataType_t ncclType(allscanDataType_t t) { return allscanNcclDataType(t); }

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------
constexpr int kThreads = 256;

// out[i] = g[(offset+i)/inner] * y[i] + x[i]  (g == nullptr: 1), i in [0, n).
// VEC consecutive elements per thread with 16-byte accesses when everything is aligned.
template <typename T, typename G, int VEC>
__global__ void __launch_bounds__(kThreads) combineKernel(const T* __restrict__ x, const T* __restrict__ y,
                                                          const G* __restrict__ g, T* __restrict__ out, size_t n,
                                                          size_t inner, size_t offset) {
  using A = typename Acc<T>::type;
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
      os[j] = fromAcc<T>(combineOp(gj, toAcc<T>(ys[j]), toAcc<T>(xs[j])));
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
    out[i] = fromAcc<T>(combineOp(gj, toAcc<T>(y[i]), toAcc<T>(x[i])));
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
        y = fromAcc<T>(combineOp(gq, toAcc<T>(y), toAcc<T>(xq)));
      }
    }
    out[i] = y;
  }
}

// Writes `bytes` of zeros, or a copy of `src`, with a small fixed number of CTAs: the head's own
// result, written beside the send without taking the memory bandwidth the transfer needs.
__global__ void __launch_bounds__(kThreads) fillKernel(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n16) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride)
    dst[i] = src != nullptr ? src[i] : make_uint4(0, 0, 0, 0);
}

int gridFor(size_t work) {
  size_t blocks = (work + kThreads - 1) / kThreads;
  // Enough blocks to fill any current GPU several times over; the loops are grid-strided.
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(blocks, 4096)));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, typename G>
cudaError_t launchCombineT(const void* x, const void* y, const void* g, void* out, size_t n, size_t inner,
                           size_t offset, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = aligned16(x) && aligned16(y) && aligned16(out);
  if (vec) {
    combineKernel<T, G, VEC><<<gridFor(n / VEC + 1), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<const G*>(g), static_cast<T*>(out), n,
        inner, offset);
  } else {
    combineKernel<T, G, 1><<<gridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<const G*>(g), static_cast<T*>(out), n,
        inner, offset);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launchCombineG(const void* x, const void* y, const void* g, void* out, size_t n, size_t inner,
                           size_t offset, allscanDataType_t g_dtype, cudaStream_t stream) {
  if (g == nullptr || g_dtype == allscanFloat32) return launchCombineT<T, float>(x, y, g, out, n, inner, offset, stream);
  return launchCombineT<T, T>(x, y, g, out, n, inner, offset, stream);
}

cudaError_t launchCombine(allscanDataType_t dtype, allscanDataType_t g_dtype, const void* x, const void* y,
                          const void* g, void* out, size_t n, size_t inner, size_t offset, cudaStream_t stream) {
  switch (dtype) {
    case allscanFloat32: return launchCombineG<float>(x, y, g, out, n, inner, offset, g_dtype, stream);
    case allscanFloat16: return launchCombineG<__half>(x, y, g, out, n, inner, offset, g_dtype, stream);
    case allscanBfloat16: return launchCombineG<__nv_bfloat16>(x, y, g, out, n, inner, offset, g_dtype, stream);
    case allscanFloat64: return launchCombineG<double>(x, y, g, out, n, inner, offset, g_dtype, stream);
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
// Blocks and workspace layout
// ------------------------------------------------------------------------------------------------
constexpr size_t kAlign = 256;
size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Elements per pipeline block: ceil(count/K) rounded up to 16 bytes' worth of elements, so every
// block but the last starts 16-byte aligned. The number of blocks is then ceil(count / blockElems)
// (<= K). Every rank computes the same partition from (count, K, dtype).
size_t blockElems(size_t count, int K, size_t esize) {
  const size_t vec = 16 / esize;
  size_t b = (count + static_cast<size_t>(K) - 1) / static_cast<size_t>(K);
  b = alignUp(std::max<size_t>(b, 1), vec);
  return b;
}

allscanResult_t checkArgs(const allscanComm* comm, const allscanScanArgs_t* a) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(a != nullptr, "args: null argument struct");
  ALLSCAN_ARG_CHECK(validDtype(a->dtype), "dtype: expected allscanFloat32, allscanFloat16, allscanBfloat16 or allscanFloat64, got " + std::to_string(static_cast<int>(a->dtype)));
  ALLSCAN_ARG_CHECK(a->method == allscanPipelined || a->method == allscanSerial || a->method == allscanAllGather,
                    "method: expected allscanPipelined, allscanSerial or allscanAllGather, got " + std::to_string(static_cast<int>(a->method)));
  ALLSCAN_ARG_CHECK(a->num_blocks >= 0, "num_blocks: expected 0 (auto) or a positive block count, got " + std::to_string(a->num_blocks));
  ALLSCAN_ARG_CHECK(a->reverse == 0 || a->reverse == 1, "reverse: expected 0 or 1");
  ALLSCAN_ARG_CHECK(a->inclusive == 0 || a->inclusive == 1, "inclusive: expected 0 or 1");
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

int effectiveBlocks(const allscanComm* comm, const allscanScanArgs_t* a) {
  if (a->method == allscanSerial || a->method == allscanAllGather) return 1;
  int K = a->num_blocks;
  if (K == 0) {
    allscanChooseNumBlocks(const_cast<allscanComm*>(comm), a->count * dtypeSize(a->dtype), &K);
  }
  return std::min(K, static_cast<int>(allscanMaxBlocks));  // more blocks only add message latencies
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
  const int head = a->reverse ? P - 1 : 0;
  const bool has_next = a->reverse ? comm->rank > 0 : comm->rank < P - 1;
  const bool needs = comm->rank == head ? (a->init != nullptr && !a->inclusive) : (has_next || a->inclusive);
  return needs ? alignUp(a->count * es, kAlign) : 0;
}

// The communicator's environment settings (read when it is made); a value that does not parse is an
// error naming the variable, never silently the default.
allscanResult_t readEnv(allscanComm* c) {
  auto parseSize = [](const char* v, size_t* out) {
    if (v == nullptr) return false;
    for (const char* p = v; *p; ++p)
      if (*p < '0' || *p > '9') return false;
    errno = 0;
    const unsigned long long n = std::strtoull(v, nullptr, 10);
    if (errno == ERANGE) return false;
    *out = static_cast<size_t>(n);
    return true;
  };
  // An empty value is the same as an unset one.
  auto get = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
  };
  if (const char* v = get("ALLSCAN_FILL_CTAS")) {
    size_t n = 0;
    ALLSCAN_ARG_CHECK(parseSize(v, &n) && n <= 1024,
                      std::string("ALLSCAN_FILL_CTAS: expected the side fill's CTA count, 0 (then it runs in series "
                                  "after the send) to 1024, got '") + v + "'");
    c->fill_ctas = static_cast<int>(n);
  }
  if (const char* v = get("ALLSCAN_HEAD_FILL")) {
    const std::string m(v);
    if (m == "auto") c->head_fill = kFillAuto;
    else if (m == "self") c->head_fill = kFillSelf;
    else if (m == "side") c->head_fill = kFillSide;
    else if (m == "series") c->head_fill = kFillSeries;
    else return setError(allscanInvalidArgument, "ALLSCAN_HEAD_FILL: expected auto, self, side or series, got '" + m + "'");
  }
  if (const char* v = get("ALLSCAN_SELF_FILL_MAX_BYTES")) {
    ALLSCAN_ARG_CHECK(parseSize(v, &c->self_fill_max) && c->self_fill_max <= kMaxSelfFill,
                      std::string("ALLSCAN_SELF_FILL_MAX_BYTES: expected a byte count up to ") +
                          std::to_string(kMaxSelfFill) + ", got '" + v + "'");
  }
  return allscanSuccess;
}

// Makes comm->zeros hold at least `bytes` zero bytes: max(bytes, min(self_fill_max, 8 MiB)) when
// first needed (auto never needs more than self_fill_max, 8 MiB by default), a larger one only
// for a larger state (a raised ALLSCAN_SELF_FILL_MAX_BYTES, or a forced self copy);
// a replaced buffer is kept until the communicator goes (graphs captured before may read it). The
// call that allocates pays one cudaMalloc and one synchronisation of `stream`, outside capture
// only (relaxed capture mode, so another thread's capture is not disturbed). Returns false under
// capture or when the allocation fails (not retried for that size or larger), and the caller
// takes another path.
bool ensureZeros(allscanComm* comm, size_t bytes, cudaStream_t stream) {
  if (comm->zeros_bytes >= bytes) return true;
  if (comm->zeros_failed != 0 && bytes >= comm->zeros_failed) return false;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return false;
  }
  const size_t want = alignUp(std::max(bytes, std::min(comm->self_fill_max, kDefaultSelfFill)), kAlign);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  void* p = nullptr;
  bool ok = cudaMalloc(&p, want) == cudaSuccess;
  // Zeroed and finished before any stream reads it.
  ok = ok && cudaMemsetAsync(p, 0, want, stream) == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (!ok) {
    cudaGetLastError();
    if (p != nullptr) cudaFree(p);
    cudaGetLastError();
    comm->zeros_failed = comm->zeros_failed == 0 ? bytes : std::min(comm->zeros_failed, bytes);
    return false;
  }
  if (comm->zeros != nullptr) comm->retired.push_back(comm->zeros);
  comm->zeros = p;
  comm->zeros_bytes = want;
  return true;
}

}  // namespace

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
  allscanComm settings;
  ALLSCAN_CHECK(readEnv(&settings));
  auto* c = new (std::nothrow) allscanComm(settings);
  if (c == nullptr) return setError(allscanInternalError, "out of host memory");
  c->nccl = nccl;
  c->rank = rank;
  c->nranks = nranks;
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
  if (cur >= 0 && cur != dev) cudaSetDevice(cur);
  if (e != cudaSuccess) {
    allscanCommDestroy(c);
    return setError(allscanCudaError, std::string("allscanCommCreate: stream/event creation failed: ") + cudaGetErrorString(e));
  }
  *comm = c;
  return allscanSuccess;
}

allscanResult_t allscanCommCreateDetached(int rank, int nranks, allscanComm_t* comm) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null output pointer");
  ALLSCAN_ARG_CHECK(nranks >= 1, "nranks: expected >= 1, got " + std::to_string(nranks));
  ALLSCAN_ARG_CHECK(rank >= 0 && rank < nranks,
                    "rank: expected 0 <= rank < nranks (" + std::to_string(nranks) + "), got " + std::to_string(rank));
  allscanComm settings;
  ALLSCAN_CHECK(readEnv(&settings));
  auto* c = new (std::nothrow) allscanComm(settings);
  if (c == nullptr) return setError(allscanInternalError, "out of host memory");
  c->rank = rank;
  c->nranks = nranks;
  *comm = c;
  return allscanSuccess;
}

allscanResult_t allscanCommDestroy(allscanComm_t comm) {
  if (comm == nullptr) return allscanSuccess;
  if (comm->join) cudaEventDestroy(comm->join);
  if (comm->fork) cudaEventDestroy(comm->fork);
  if (comm->side) cudaStreamDestroy(comm->side);
  if (comm->zeros) cudaFree(comm->zeros);
  for (void* p : comm->retired) cudaFree(p);
  cudaGetLastError();  // nothing left for the caller's next launch check to misreport
  delete comm;  // the NCCL communicator is borrowed: not destroyed here
  return allscanSuccess;
}

allscanResult_t allscanCommRank(allscanComm_t comm, int* rank) {
  ALLSCAN_ARG_CHECK(comm != nullptr && rank != nullptr, "comm/rank: null pointer");
  *rank = comm->rank;
  return allscanSuccess;
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
  ALLSCAN_ARG_CHECK(comm->nccl != nullptr, "comm: a detached communicator has no NCCL communicator");
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

allscanResult_t allscanScan(allscanComm_t comm, const allscanScanArgs_t* a, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
  ALLSCAN_CHECK(checkArgs(comm, a));
  const int P = comm->nranks, r = comm->rank;
  const size_t count = a->count;
  if (count == 0) return allscanSuccess;
  const size_t es = dtypeSize(a->dtype);
  const size_t bytes = count * es;
  const size_t need = workspaceBytes(comm, a);
  ALLSCAN_ARG_CHECK(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                    "workspace: " + std::to_string(need) + " bytes needed (allscanWorkspaceSize), got " +
                        std::to_string(workspace_bytes));
  const size_t inner = a->g != nullptr ? count / a->g_count : 1;
  const void* g = a->g;

  const int head = a->reverse ? P - 1 : 0;
  const bool is_head = r == head;
  const bool has_next = a->reverse ? r > 0 : r < P - 1;
  const int prev = a->reverse ? r + 1 : r - 1;
  const int next = a->reverse ? r - 1 : r + 1;

  if (P == 1) {
    // A chain of one: exclusive = init (or 0), inclusive = g*init + x (or x).
    if (a->inclusive) {
      if (a->init != nullptr) {
        ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, a->x, a->init, g, a->y, count, inner, 0, stream));
      } else {
        ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, a->x, bytes, cudaMemcpyDeviceToDevice, stream));
      }
    } else if (a->init != nullptr) {
      ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, a->init, bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
      ALLSCAN_CUDA_CHECK(cudaMemsetAsync(a->y, 0, bytes, stream));
    }
    return allscanSuccess;
  }
  ALLSCAN_ARG_CHECK(comm->nccl != nullptr, "comm: a detached communicator has no NCCL communicator");
  ncclComm_t nc = comm->nccl;
  const ncclDataType_t nt = ncclType(a->dtype);

  if (a->method == allscanAllGather) {
    // LASP-2 pattern: gather every rank's state (and decay), fold locally.
    // init is read on the chain head only (as in the other methods): it is broadcast from there.
    char* ws = static_cast<char*>(workspace);
    void* X = ws;
    size_t off = alignUp(static_cast<size_t>(P) * bytes, kAlign);
    void* Gs = nullptr;
    void* I = nullptr;
    if (g != nullptr) {
      Gs = ws + off;
      off += alignUp(static_cast<size_t>(P) * a->g_count * dtypeSize(a->g_dtype), kAlign);
    }
    if (a->init != nullptr) I = ws + off;
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(a->x, X, count, nt, nc, stream));
    if (Gs != nullptr) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(g, Gs, a->g_count, ncclType(a->g_dtype), nc, stream));
    if (I != nullptr) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclBroadcast(a->init, I, count, nt, head, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
    allscanScanArgs_t folded = *a;
    folded.init = I;
    ALLSCAN_CUDA_CHECK(launchFold(folded, X, Gs, P, r, stream));
    return allscanSuccess;
  }

  const int K = effectiveBlocks(comm, a);
  const size_t be = blockElems(count, K, es);
  const size_t nblocks = (count + be - 1) / be;
  auto blk = [&](const void* base, size_t k) {
    return static_cast<const char*>(base) + k * be * es;
  };
  auto blkm = [&](void* base, size_t k) { return static_cast<char*>(base) + k * be * es; };
  auto blen = [&](size_t k) { return std::min(be, count - k * be); };

  if (is_head) {
    // The chain starts here: y = init (or 0); the value sent on is g*init + x (or x itself).
    const void* s = a->x;
    if (a->init != nullptr) {
      void* dst = a->inclusive ? a->y : workspace;
      ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, a->x, a->init, g, dst, count, inner, 0, stream));
      s = dst;
    }
    // The head's own result, when it is not what is sent: init or zeros (exclusive), or x itself
    // (inclusive without init). It is off the chain's critical path, but a second kernel on the
    // head costs its launch and join: 2-4 us beside a 15 us send of 2 MiB on 2 H200s (1.10-1.26x
    // the bare send; in series 1.14x; also under a CUDA graph). So up to self_fill_max bytes (auto)
    // it is a self send/recv in the chain's own NCCL group call: one kernel, as in the floor
    // (measured 0.994-1.006x the bare send at 1-4 MiB; bench/README, fourth run). Larger states
    // take a few CTAs on the side stream beside the send, whose bandwidth the self copy would share
    // (16-256 MiB: self 1.01-1.05x, side 1.00-1.03x). Zeros come from the communicator's zeroed
    // buffer, allocated by the first call that needs it (ensureZeros; under capture without it,
    // the side path). The side path runs in series after the send when asked
    // (ALLSCAN_HEAD_FILL=series, or ALLSCAN_FILL_CTAS=0) or when its buffers are not 16-byte aligned.
    const bool need_fill = !a->inclusive || a->init == nullptr;
    const void* fill_src = a->inclusive ? a->x : a->init;  // null: zeros
    int mode = comm->head_fill;
    if (mode == kFillAuto) mode = bytes <= comm->self_fill_max ? kFillSelf : kFillSide;
    if (need_fill && mode == kFillSelf && fill_src == nullptr && !ensureZeros(comm, bytes, stream)) mode = kFillSide;
    if (need_fill && mode == kFillSide &&
        (comm->fill_ctas == 0 || bytes % 16 != 0 || !aligned16(a->y) || (fill_src != nullptr && !aligned16(fill_src))))
      mode = kFillSeries;
    const bool self_fill = need_fill && mode == kFillSelf;
    const bool side_fill = need_fill && mode == kFillSide;
    if (side_fill) {
      ALLSCAN_CUDA_CHECK(cudaEventRecord(comm->fork, stream));
      ALLSCAN_CUDA_CHECK(cudaStreamWaitEvent(comm->side, comm->fork, 0));
      const size_t n16 = bytes / 16;
      const int ctas = static_cast<int>(std::min<size_t>(comm->fill_ctas, (n16 + kThreads - 1) / kThreads));
      fillKernel<<<std::max(ctas, 1), kThreads, 0, comm->side>>>(static_cast<uint4*>(a->y),
                                                               static_cast<const uint4*>(fill_src), n16);
      ALLSCAN_CUDA_CHECK(cudaGetLastError());
      ALLSCAN_CUDA_CHECK(cudaEventRecord(comm->join, comm->side));
    }
    // All blocks in one group call: they go out in order on the same peer connection, so the
    // successor receives block 0 first and starts combining it while the rest is in flight.
    // On an error the side branch is still joined, so a capture never holds an unjoined fork.
    allscanResult_t st = allscanSuccess;
    ncclResult_t nr = ncclGroupStart();
    for (size_t k = 0; k < nblocks && nr == ncclSuccess; ++k) nr = ncclSend(blk(s, k), blen(k), nt, next, nc, stream);
    if (self_fill) {
      const void* src = fill_src != nullptr ? fill_src : comm->zeros;
      if (nr == ncclSuccess) nr = ncclSend(src, bytes, ncclUint8, r, nc, stream);
      if (nr == ncclSuccess) nr = ncclRecv(a->y, bytes, ncclUint8, r, nc, stream);
    }
    ncclResult_t ne = allscan::detail::ncclSettle(nc, ncclGroupEnd());
    if (nr == ncclSuccess) nr = ne;
    if (nr != ncclSuccess) st = setError(allscanNcclError, std::string("ncclSend (chain head): ") + ncclGetErrorString(nr));
    if (side_fill) ALLSCAN_CUDA_CHECK(cudaStreamWaitEvent(stream, comm->join, 0));
    if (st != allscanSuccess) return st;
    if (need_fill && mode == kFillSeries) {
      if (fill_src != nullptr) {
        ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, fill_src, bytes, cudaMemcpyDeviceToDevice, stream));
      } else {
        ALLSCAN_CUDA_CHECK(cudaMemsetAsync(a->y, 0, bytes, stream));
      }
    }
    return st;
  }

  // Inner and tail ranks. R receives y_p; S holds g*y_p + x (what is sent on, or the inclusive
  // result). Exclusive: R = y, S = workspace. Inclusive: R = workspace, S = y.
  void* R = a->inclusive ? workspace : a->y;
  void* S = a->inclusive ? a->y : workspace;
  const bool combine = has_next || a->inclusive;
  for (size_t k = 0; k < nblocks; ++k) {
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    if (has_next && k > 0) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(blk(S, k - 1), blen(k - 1), nt, next, nc, stream));
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclRecv(blkm(R, k), blen(k), nt, prev, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
    if (combine) {
      ALLSCAN_CUDA_CHECK(launchCombine(a->dtype, a->g_dtype, blk(a->x, k), blk(R, k), g, blkm(S, k), blen(k), inner,
                                       k * be, stream));
    }
  }
  if (has_next) {
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(blk(S, nblocks - 1), blen(nblocks - 1), nt, next, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
  }
  return allscanSuccess;
}

allscanResult_t allscanCalibrate(allscanComm_t comm, cudaStream_t stream) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
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
    ncclResult_t nr = allscan::detail::ncclSettle(comm->nccl, ncclAllReduce(dev, dev, 2, ncclFloat64, ncclMax, comm->nccl, stream));
    if (nr != ncclSuccess) {
      fail(setError(allscanNcclError, std::string("allscanCalibrate: ncclAllReduce: ") + ncclGetErrorString(nr)));
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
