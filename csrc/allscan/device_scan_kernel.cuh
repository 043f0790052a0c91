// The device-initiated All-Scan's kernel and its window protocol (internal): what device_path.cu
// launches on NCCL windows and csrc/allscan/test/device_sim.cu on simulated ranks of one GPU.
//
// Window layout (one per communicator, the same size on every rank, registered with NCCL):
//   [0, kHeaderBytes)   per direction: kMaxCtas flag lines (128 B each: the flag, then the sender's
//                       signature), then three words on lines of their own: the number of calls
//                       finished here (`calls`), the CTAs of the current call that finished
//                       (`done`), and the last call the successor finished (`ack`, written by it)
//   [kHeaderBytes, ..)  per direction: the incoming state, `capacity` bytes
// Call n of a direction (n = calls + 1, the same on every rank: every rank makes every call, and
// `calls` advances only when the previous kernel's last CTA finishes, so graph replays count too):
//   1. a CTA that sends waits until the successor finished call n-1 (ack >= n-1: no CTA of it
//      still reads the incoming region, whatever slice each CTA owned then),
//   2. CTA c (the same slice of the state on every rank this call) per sub-block j: waits for
//      the predecessor's flag (n << 20 | j+1) in its own window, reads the incoming block, writes
//      y and stores g*z + x into the successor's window, then publishes the successor's flag with a
//      release store after the CTA's barrier,
//   3. the last CTA to finish sets calls = n and tells its ring predecessor (whether or not it
//      received from it: a chain's head acknowledges the tail too, so a ring call can follow).
// Every spin is bounded (ALLSCAN_DEVICE_TIMEOUT_S): on expiry the CTA stops waiting, writes NaN
// and records the failure in host-mapped memory, which the next call on the communicator reports.
// Calls in one direction must not run at once: the host orders each eager call after the previous
// one of its direction (device_path.cu); graph replays are ordered by whoever launches them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "allscan/allscan.h"
#include "common/acc.cuh"
#include "allscan/decay_combine.cuh"
#include "common/signature.h"

namespace allscan {
namespace detail {
namespace device {

constexpr int kThreads = 512;
constexpr int kMaxCtas = 128;
constexpr size_t kLine = 128;
constexpr size_t kDirHeader = (kMaxCtas + 3) * kLine;  // flags, then calls, done, ack
constexpr size_t kHeaderBytes = 2 * kDirHeader;
constexpr size_t kSubBytes = size_t(64) << 10;  // a flag per 64 KiB of a CTA's slice
constexpr size_t kMinCapacity = size_t(8) << 20;
constexpr unsigned kErrTimeout = 1u, kErrMismatch = 2u;

// System-scope release store / acquire load (generic addresses: a peer's window over NVLink too).
__device__ __forceinline__ void storeRelease(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long loadAcquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long nowNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *p >= want; false after timeout_ns.
__device__ inline bool waitAtLeast(const unsigned long long* p, unsigned long long want, unsigned long long timeout_ns) {
  if (loadAcquire(p) >= want) return true;
  const unsigned long long t0 = nowNs();
  while (loadAcquire(p) < want) {
    if (nowNs() - t0 > timeout_ns) return false;
    __nanosleep(64);
  }
  return true;
}

struct Params {
  const void* x;
  void* y;         // null: the floor (the incoming bytes go to `recv`)
  void* recv;      // the floor's receive buffer
  const void* g;
  const void* init;
  size_t count;    // elements
  size_t inner;    // elements per decay
  int inclusive;
  int recv_in;     // receives from a predecessor (not the chain head)
  int send_out;    // sends to a successor (not the tail)
  int exchange;    // the floor: send x, receive into recv, no combine
  char* local;     // this rank's window
  char* succ;      // the successor's window (send_out)
  char* pred;      // the ring predecessor's window (acknowledged after every call)
  size_t dir_header;  // this direction's header lines
  size_t dir_data;    // this direction's incoming-state region
  size_t cta_elems;   // elements per CTA (a multiple of 16 bytes' worth)
  size_t sub_elems;   // elements per published sub-block
  unsigned long long sig;
  unsigned long long timeout_ns;
  unsigned* err;      // host-mapped failure word
};


// The incoming state is written by another GPU: read it from L2 (__ldcg), never from a stale L1 line.
template <typename T> __device__ __forceinline__ T loadIncoming(const T* p) { return __ldcg(p); }

// Elements [lo, hi) of the scan: z (incoming, init or 0), w = g*z + x stored into the successor's
// window, y = w (inclusive) or z; NaN for both when `poison`.
template <typename T, typename G, int VEC>
__device__ void combineRange(const Params& p, size_t lo, size_t hi, bool poison) {
  using A = typename Acc<T>::type;
  const T* x = static_cast<const T*>(p.x);
  const T* in = reinterpret_cast<const T*>(p.local + p.dir_data);
  const T* init = static_cast<const T*>(p.init);
  const G* g = static_cast<const G*>(p.g);
  T* out = p.send_out ? reinterpret_cast<T*>(p.succ + p.dir_data) : nullptr;
  T* y = static_cast<T*>(p.y);
  const A nan = quietNan(A(0));
  for (size_t i0 = lo + static_cast<size_t>(threadIdx.x) * VEC; i0 < hi; i0 += static_cast<size_t>(blockDim.x) * VEC) {
    alignas(16) T xs[VEC], zs[VEC], ws[VEC], ys[VEC];
    const bool full = i0 + VEC <= hi;
    if (VEC > 1 && full) {
      *reinterpret_cast<uint4*>(xs) = *reinterpret_cast<const uint4*>(x + i0);
      if (p.recv_in) *reinterpret_cast<uint4*>(zs) = loadIncoming(reinterpret_cast<const uint4*>(in + i0));
      else if (init != nullptr) *reinterpret_cast<uint4*>(zs) = *reinterpret_cast<const uint4*>(init + i0);
    } else {
      for (int j = 0; j < VEC && i0 + j < hi; ++j) {
        xs[j] = x[i0 + j];
        if (p.recv_in) zs[j] = loadIncoming(in + i0 + j);
        else if (init != nullptr) zs[j] = init[i0 + j];
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (!p.recv_in && init == nullptr) {  // the head's zeros: it sends x itself, as the NCCL path does
        zs[j] = fromAcc<T>(A(0));
        ws[j] = poison ? fromAcc<T>(nan) : xs[j];
        ys[j] = p.inclusive ? ws[j] : (poison ? fromAcc<T>(nan) : zs[j]);
        continue;
      }
      const A gj = g != nullptr && i0 + j < hi ? static_cast<A>(toAcc<G>(g[(i0 + j) / p.inner])) : A(1);
      const A w = poison ? nan : combineDecay(gj, toAcc<T>(zs[j]), toAcc<T>(xs[j]));
      ws[j] = fromAcc<T>(w);
      ys[j] = p.inclusive ? ws[j] : (poison ? fromAcc<T>(nan) : zs[j]);
    }
    if (VEC > 1 && full) {
      *reinterpret_cast<uint4*>(y + i0) = *reinterpret_cast<uint4*>(ys);
      if (out != nullptr) *reinterpret_cast<uint4*>(out + i0) = *reinterpret_cast<uint4*>(ws);
    } else {
      for (int j = 0; j < VEC && i0 + j < hi; ++j) {
        y[i0 + j] = ys[j];
        if (out != nullptr) out[i0 + j] = ws[j];
      }
    }
  }
}

// The floor's body: words [lo, hi) of x into the successor's window (send) or of the incoming
// region into recv (receive).
template <typename W> __device__ void copyRange(const W* src, W* dst, size_t lo, size_t hi, bool incoming) {
  for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = incoming ? loadIncoming(src + i) : src[i];
}

// One CTA's slice of the scan (EXCHANGE: of the floor, T the word moved), as the file's header says.
template <typename T, typename G, int VEC, bool EXCHANGE>
__global__ void __launch_bounds__(kThreads) deviceScanKernel(Params params) {
  Params p = params;  // send_out drops to 0 below if the successor never freed its region
  const int c = blockIdx.x;
  const size_t begin = static_cast<size_t>(c) * p.cta_elems;
  const size_t end = p.count < begin + p.cta_elems ? p.count : begin + p.cta_elems;
  auto word = [&](char* base, int line) {  // line < kMaxCtas: a CTA's flag; then calls, done, ack
    return reinterpret_cast<unsigned long long*>(base + p.dir_header + static_cast<size_t>(line) * kLine);
  };
  unsigned long long* calls = word(p.local, kMaxCtas);
  unsigned long long* done = word(p.local, kMaxCtas + 1);
  const unsigned long long n = *calls + 1;
  __shared__ int poison, no_send;
  if (threadIdx.x == 0) {
    poison = no_send = 0;
    if (p.send_out && !waitAtLeast(word(p.local, kMaxCtas + 2), n - 1, p.timeout_ns)) {
      atomicOr(p.err, kErrTimeout);
      poison = no_send = 1;  // the successor may still read its region: write nothing there
    }
  }
  __syncthreads();
  if (no_send) p.send_out = 0;
  unsigned long long j = 0;
  for (size_t lo = begin; lo < end; lo += p.sub_elems, ++j) {
    const size_t hi = end < lo + p.sub_elems ? end : lo + p.sub_elems;
    const unsigned long long tag = (n << 20) | (j + 1);
    if constexpr (EXCHANGE) {  // the floor sends before it waits: no dependency between hops
      if (p.send_out) {
        copyRange(static_cast<const T*>(p.x), reinterpret_cast<T*>(p.succ + p.dir_data), lo, hi, false);
        __syncthreads();
        if (threadIdx.x == 0) storeRelease(word(p.succ, c), tag);
      }
    }
    if (p.recv_in && threadIdx.x == 0 && !poison) {  // after one timeout, no more waiting
      const unsigned long long* flag = word(p.local, c);
      if (!waitAtLeast(flag, tag, p.timeout_ns)) {
        atomicOr(p.err, kErrTimeout);
        poison = 1;
      } else if (j == 0 && p.sig != 0 && flag[1] != p.sig) {
        atomicOr(p.err, kErrMismatch);
        poison = 1;
      }
    }
    __syncthreads();
    if constexpr (EXCHANGE) {
      if (p.recv_in) copyRange(reinterpret_cast<const T*>(p.local + p.dir_data), static_cast<T*>(p.recv), lo, hi, true);
    } else {
      combineRange<T, G, VEC>(p, lo, hi, poison != 0);
      if (p.send_out) {
        __syncthreads();  // every thread's stores into the successor's window precede the flag
        if (threadIdx.x == 0) {
          unsigned long long* flag = word(p.succ, c);
          if (j == 0) flag[1] = p.sig;
          storeRelease(flag, tag);
        }
      }
    }
  }
  __syncthreads();  // every thread of this CTA has read its incoming slice
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done, 1ull) == gridDim.x - 1) {  // the call's last CTA
      __threadfence();  // every other CTA's reads (before its atomic) precede the acknowledgement
      *done = 0;
      *calls = n;
      storeRelease(word(p.pred, kMaxCtas + 2), n);  // the predecessor may overwrite the region now
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------
template <typename T, typename G>
cudaError_t launchTyped(const Params& p, int ctas, cudaStream_t stream) {
  const bool vec = ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.y) |
                     reinterpret_cast<uintptr_t>(p.init)) & 15u) == 0;
  if (vec && sizeof(T) < 16) {
    deviceScanKernel<T, G, 16 / sizeof(T), false><<<ctas, kThreads, 0, stream>>>(p);
  } else {
    deviceScanKernel<T, G, 1, false><<<ctas, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T> cudaError_t launchG(const Params& p, allscanDataType_t g_dtype, int ctas, cudaStream_t stream) {
  if (p.g == nullptr || g_dtype == allscanFloat32) return launchTyped<T, float>(p, ctas, stream);
  return launchTyped<T, T>(p, ctas, stream);
}

inline cudaError_t launch(const Params& p, allscanDataType_t dtype, allscanDataType_t g_dtype, int ctas, cudaStream_t stream) {
  switch (dtype) {
    case allscanFloat32: return launchG<float>(p, g_dtype, ctas, stream);
    case allscanFloat16: return launchG<__half>(p, g_dtype, ctas, stream);
    case allscanBfloat16: return launchG<__nv_bfloat16>(p, g_dtype, ctas, stream);
    default: return launchG<double>(p, g_dtype, ctas, stream);
  }
}


// CTAs for a state of `bytes`: one per 64 KiB, at most kMaxCtas, or the caller's count.
inline int ctasFor(size_t bytes, int requested) {
  if (requested > 0) return std::min(requested, kMaxCtas);
  const size_t n = (bytes + kSubBytes - 1) / kSubBytes;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(n, kMaxCtas)));
}

// Every rank's CTAs own the same slices: elements per CTA and per flag, from (count, element size, CTAs).
inline void partition(Params* p, size_t count, size_t esize, int ctas) {
  const size_t vec = 16 / esize;
  size_t per = (count + ctas - 1) / ctas;
  p->cta_elems = (per + vec - 1) / vec * vec;
  p->sub_elems = std::max<size_t>(vec, kSubBytes / esize);
}

// The floor's kernel: `bytes` moved as 16-byte words when everything is aligned, else as bytes.
inline cudaError_t launchExchange(Params p, size_t bytes, int ctas, cudaStream_t stream) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.recv) | bytes) & 15u) == 0;
  p.exchange = 1;
  p.inner = 1;
  if (aligned) {
    p.count = bytes / 16;
    partition(&p, p.count, 16, ctas);
    deviceScanKernel<uint4, float, 1, true><<<ctas, kThreads, 0, stream>>>(p);
  } else {
    p.count = bytes;
    partition(&p, p.count, 1, ctas);
    deviceScanKernel<unsigned char, float, 1, true><<<ctas, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace device
}  // namespace detail
}  // namespace allscan
