// The watch over a communicator's collectives (allscanWatchCreate), as the cores use it: every C
// API call that issues NCCL work runs through `watched`, which refuses to issue on a communicator
// whose watch has failed and records the call's completion event for the watch thread. Internal,
// not installed; the implementation and the watch thread are in watch.cpp.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "allscan/common.h"

namespace allscan {
namespace detail {

// Before issuing NCCL work on `nccl`: nullptr when no watch exists for it; the failure's code
// (allscanTimeout, or what allscanWatchFail gave; message set) through `*result` when its watch has
// failed. Otherwise holds the watch's issue lock until
// watchEnd, so an abort does not free the communicator under a call being issued (unless that call
// is stuck inside NCCL past the timeout: watch.cpp says what happens then).
allscanWatch_t watchBegin(ncclComm_t nccl, allscanResult_t* result);
// After issuing: records the work's completion on `stream` (whether or not the call succeeded: it
// may have enqueued some work), counts the call when `issued` (allscanWatchCalls) and releases the
// lock.
void watchEnd(allscanWatch_t watch, cudaStream_t stream, bool issued);

// Runs `issue()` (returning allscanResult_t) under the watch of `nccl`, if any.
template <typename F> allscanResult_t watched(ncclComm_t nccl, cudaStream_t stream, F&& issue) {
  if (nccl == nullptr) return issue();
  allscanResult_t r = allscanSuccess;
  allscanWatch_t watch = watchBegin(nccl, &r);
  if (r != allscanSuccess) return r;
  r = issue();
  if (watch != nullptr) watchEnd(watch, stream, r == allscanSuccess);
  return r;
}

}  // namespace detail
}  // namespace allscan
