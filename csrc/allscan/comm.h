// The All-Scan communicator and what every scan flavour of the core shares (internal, not
// installed): dtype helpers, the argument checks every flavour makes, the pipeline's block
// partition, chain positions, the chain head's zeroed buffer and the communicator's environment
// settings. The head's own result and the NCCL steps of the pipeline: head_result.h, pipeline.h.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allscan/allscan.h"
#include "common/error.h"
#include "common/signature.h"

namespace allscan {
namespace detail {
struct DevicePath;  // device_path.h
}  // namespace detail
}  // namespace allscan

struct allscanComm {
  ncclComm_t nccl = nullptr;  // borrowed, never destroyed here (null for a detached communicator)
  // allscanCommFail: what every later NCCL call returns (set by the thread that makes the calls, or
  // while none is being made: like the rest of the communicator, not for concurrent use)
  allscanResult_t failure_code = allscanSuccess;
  std::string failure;
  int rank = 0;
  int nranks = 1;
  // The link model (allscanSetLinkModel / allscanCalibrate): one message of n bytes between
  // neighbours costs latency_us + n * us_per_byte.
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
  int head_fill = 0;  // allscan::detail::HeadFill (ALLSCAN_HEAD_FILL)
  size_t self_fill_max = size_t(8) << 20;  // auto: self copy up to this many bytes (ALLSCAN_SELF_FILL_MAX_BYTES)
  void* zeros = nullptr;  // zeroed buffer: an exclusive head's zeros (see ensureZeros)
  size_t zeros_bytes = 0;
  size_t zeros_failed = 0;  // smallest size whose allocation failed (0: none); not retried
  // Buffers replaced by a larger one: graphs captured earlier may still read them, so they live
  // until the communicator goes.
  std::vector<void*> retired;
  // The in-band signature check (signature.h); null for a detached or one-rank communicator.
  allscan::detail::SignatureTable* signatures = nullptr;
  // The device-initiated path (allscanDevice): its windows, made by the first call that uses it;
  // ALLSCAN_DEVICE_PATH=off (always the NCCL path) and ALLSCAN_DEVICE_TIMEOUT_S (its spins' bound).
  allscan::detail::DevicePath* device = nullptr;
  bool device_path_off = false;
  double device_timeout_s = 600.0;  // as torch's default NCCL timeout: a slow peer is not a dead one
};

namespace allscan {
namespace detail {

// How the chain head writes its own result (init, zeros, or x itself for an inclusive scan).
enum HeadFill { kFillAuto = 0, kFillSelf = 1, kFillSide = 2, kFillSeries = 3 };
constexpr size_t kDefaultSelfFill = size_t(8) << 20;  // auto: the self copy up to 8 MiB
constexpr size_t kMaxSelfFill = size_t(1) << 30;      // ALLSCAN_SELF_FILL_MAX_BYTES at most 1 GiB

// ------------------------------------------------------------------------------------------------
// Dtypes
// ------------------------------------------------------------------------------------------------
inline size_t dtypeSize(allscanDataType_t t) { return allscanDataTypeSize(t); }
inline bool validDtype(int t) { return t >= allscanFloat32 && t <= allscanFloat64; }
inline ncclDataType_t ncclType(allscanDataType_t t) { return allscanNcclDataType(t); }
const char* dtypeName(allscanDataType_t t);

// ------------------------------------------------------------------------------------------------
// Arguments every scan flavour has (allscanScanArgs_t, allscanMatrixScanArgs_t), checked in this
// order: checkTarget, the flavour's own operand dtypes, checkSchedule, the flavour's own fields.
// ------------------------------------------------------------------------------------------------
template <typename Args> allscanResult_t checkTarget(const allscanComm* comm, const Args* a) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(a != nullptr, "args: null argument struct");
  ALLSCAN_ARG_CHECK(validDtype(a->dtype), "dtype: expected allscanFloat32, allscanFloat16, allscanBfloat16 or allscanFloat64, got " + std::to_string(static_cast<int>(a->dtype)));
  return allscanSuccess;
}

template <typename Args> allscanResult_t checkSchedule(const Args* a) {
  ALLSCAN_ARG_CHECK(a->method == allscanPipelined || a->method == allscanSerial || a->method == allscanAllGather ||
                        a->method == allscanDevice,
                    "method: expected allscanPipelined, allscanSerial, allscanAllGather or allscanDevice, got " +
                        std::to_string(static_cast<int>(a->method)));
  ALLSCAN_ARG_CHECK(a->num_blocks >= 0, "num_blocks: expected 0 (auto) or a positive block count, got " + std::to_string(a->num_blocks));
  ALLSCAN_ARG_CHECK(a->reverse == 0 || a->reverse == 1, "reverse: expected 0 or 1");
  ALLSCAN_ARG_CHECK(a->inclusive == 0 || a->inclusive == 1, "inclusive: expected 0 or 1");
  return allscanSuccess;
}

// At the start of a scan of a non-empty state: the workspace holds the `need` bytes its size query
// (`size_query`, named in the error) asked for.
allscanResult_t checkWorkspace(size_t need, const void* workspace, size_t workspace_bytes, const char* size_query);

// A failed communicator (allscanCommFail) returns its failure from every call that needs NCCL.
inline allscanResult_t checkNotFailed(const allscanComm* comm) {
  if (comm->failure_code != allscanSuccess) return allscan::detail::setError(comm->failure_code, comm->failure);
  return allscanSuccess;
}

// Before the first NCCL call: a failed communicator returns its failure; a detached one (no NCCL)
// only scans a chain of one.
inline allscanResult_t checkAttached(const allscanComm* comm) {
  ALLSCAN_CHECK(checkNotFailed(comm));
  ALLSCAN_ARG_CHECK(comm->nccl != nullptr, "comm: a detached communicator has no NCCL communicator");
  return allscanSuccess;
}

// ------------------------------------------------------------------------------------------------
// Blocks and workspace layout
// ------------------------------------------------------------------------------------------------
constexpr size_t kAlign = 256;  // workspace sub-buffers start at this alignment
inline size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Elements per pipeline block: ceil(count/K) rounded up to 16 bytes' worth of elements, so every
// block but the last starts 16-byte aligned. The number of blocks is then ceil(count / blockElems)
// (<= K). Every rank computes the same partition from (count, K, dtype).
inline size_t blockElems(size_t count, int K, size_t esize) {
  const size_t vec = 16 / esize;
  size_t b = (count + static_cast<size_t>(K) - 1) / static_cast<size_t>(K);
  b = alignUp(std::max<size_t>(b, 1), vec);
  return b;
}

// The pipeline's block count for a state of `bytes` bytes: `numBlocks`, or (0) the link model's
// choice (allscanChooseNumBlocks), at most allscanMaxBlocks.
int effectiveBlocks(const allscanComm* comm, int numBlocks, size_t bytes);

// The blocks a scan of `bytes` bytes is sent in: effectiveBlocks for the pipelined method, one for
// the serial and all-gather methods.
inline int methodBlocks(const allscanComm* comm, allscanMethod_t method, int numBlocks, size_t bytes) {
  // allscanDevice's fallback is the pipelined method
  return method == allscanPipelined || method == allscanDevice ? effectiveBlocks(comm, numBlocks, bytes) : 1;
}

// This rank's place in the chain of a forward (rank p-1 -> p) or reverse (p+1 -> p) scan.
struct ChainPos {
  bool head;     // the chain starts here (rank 0 forward, P-1 reverse)
  bool has_next;  // it sends on (not the tail)
  int prev;      // the rank it receives from (out of range at the head)
  int next;      // the rank it sends to (out of range at the tail)
};
inline ChainPos chainPos(const allscanComm* comm, int reverse) {
  const int P = comm->nranks, r = comm->rank;
  return ChainPos{r == (reverse ? P - 1 : 0), reverse ? r > 0 : r < P - 1, reverse ? r + 1 : r - 1,
                  reverse ? r - 1 : r + 1};
}

// y = src, or zeros when src is null, in series on `stream` (the chain head's own result when no
// faster path applies, and a chain of one).
allscanResult_t copyOrZero(void* y, const void* src, size_t bytes, cudaStream_t stream);

// ------------------------------------------------------------------------------------------------
// Communicator state
// ------------------------------------------------------------------------------------------------

// A new communicator of `nranks` with this rank, no NCCL yet, and the environment's settings
// (readEnv); allscanInvalidArgument naming the variable when one does not parse.
allscanResult_t newComm(int rank, int nranks, allscanComm** out);

// Reads ALLSCAN_FILL_CTAS, ALLSCAN_HEAD_FILL, ALLSCAN_SELF_FILL_MAX_BYTES, ALLSCAN_DEVICE_PATH and
// ALLSCAN_DEVICE_TIMEOUT_S into `c` (when the
// communicator is made); a value that does not parse is allscanInvalidArgument naming the
// variable, never silently the default.
allscanResult_t readEnv(allscanComm* c);

// Makes comm->zeros hold at least `bytes` zero bytes. Returns false under stream capture or when
// the allocation fails; the caller then takes a path that needs no zeros.
bool ensureZeros(allscanComm* comm, size_t bytes, cudaStream_t stream);

}  // namespace detail
}  // namespace allscan
