// The chain head's own result, written beside its send (internal, not installed): shared by every
// scan flavour whose head sends on one value and keeps another (init, zeros, or x itself).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>

#include "comm.h"

namespace allscan {
namespace detail {

// y = src (or zeros when src is null), `bytes` bytes, written while the head's send runs. A second
// kernel on the head costs its launch and join beside a short send, so up to self_fill_max bytes
// (auto) y is written inside the send's own NCCL group call, as a send/recv to itself: one kernel,
// like the bare send. Larger states take a few CTAs on the side stream beside the send, whose
// bandwidth a self copy would share. Zeros come from the communicator's zeroed buffer
// (ensureZeros; without it, the side path); the side path runs in series after the send when
// asked or when its buffers are not 16-byte aligned.
// Measurements: bench/README.md, "Measurements behind design choices", "The head's own result".
class HeadResult {
 public:
  // Chooses the path (ALLSCAN_HEAD_FILL, the size, the zero buffer, the alignment). y null: the
  // head's result is what it sends, nothing to write.
  HeadResult(allscanComm* comm, void* y, const void* src, size_t bytes, cudaStream_t stream);

  // Before the send's group call: the side path forks its CTAs onto the side stream.
  allscanResult_t fork();
  // Inside the send's group call: the self path's send/recv to itself.
  ncclResult_t inGroup(ncclComm_t nc);
  // After the group call, also when it failed (a capture never holds an unjoined fork).
  allscanResult_t join();
  // After a successful send: the series path.
  allscanResult_t inSeries();

 private:
  allscanComm* comm_;
  void* y_;
  const void* src_;  // null: zeros
  size_t bytes_;
  cudaStream_t stream_;
  int mode_ = -1;  // a HeadFill but kFillAuto; -1: nothing to write
};

}  // namespace detail
}  // namespace allscan
