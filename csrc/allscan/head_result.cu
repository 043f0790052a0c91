// The chain head's own result beside its send (see head_result.h).
#include "head_result.h"

#include <algorithm>

namespace allscan {
namespace detail {

namespace {

constexpr int kThreads = 256;

// Writes `n16` 16-byte words of zeros, or a copy of `src`, with a small fixed number of CTAs: the
// head's own result, written beside the send without taking the memory bandwidth the transfer needs.
__global__ void __launch_bounds__(kThreads) fillKernel(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n16) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n16; i += stride)
    dst[i] = src != nullptr ? src[i] : make_uint4(0, 0, 0, 0);
}

}  // namespace

HeadResult::HeadResult(allscanComm* comm, void* y, const void* src, size_t bytes, cudaStream_t stream)
    : comm_(comm), y_(y), src_(src), bytes_(bytes), stream_(stream) {
  if (y == nullptr) return;
  int mode = comm->head_fill;
  if (mode == kFillAuto) mode = bytes_ <= comm->self_fill_max ? kFillSelf : kFillSide;
  if (mode == kFillSelf && src_ == nullptr && !ensureZeros(comm, bytes_, stream)) mode = kFillSide;
  if (mode == kFillSide && (comm->fill_ctas == 0 || bytes_ % 16 != 0 || !aligned16(y_) ||
                            (src_ != nullptr && !aligned16(src_))))
    mode = kFillSeries;
  mode_ = mode;
}

allscanResult_t HeadResult::fork() {
  if (mode_ != kFillSide) return allscanSuccess;
  ALLSCAN_CUDA_CHECK(cudaEventRecord(comm_->fork, stream_));
  ALLSCAN_CUDA_CHECK(cudaStreamWaitEvent(comm_->side, comm_->fork, 0));
  const size_t n16 = bytes_ / 16;
  const int ctas = static_cast<int>(std::min<size_t>(comm_->fill_ctas, (n16 + kThreads - 1) / kThreads));
  fillKernel<<<std::max(ctas, 1), kThreads, 0, comm_->side>>>(static_cast<uint4*>(y_), static_cast<const uint4*>(src_),
                                                             n16);
  ALLSCAN_CUDA_CHECK(cudaGetLastError());
  ALLSCAN_CUDA_CHECK(cudaEventRecord(comm_->join, comm_->side));
  return allscanSuccess;
}

ncclResult_t HeadResult::inGroup(ncclComm_t nc) {
  if (mode_ != kFillSelf) return ncclSuccess;
  const void* src = src_ != nullptr ? src_ : comm_->zeros;
  ncclResult_t nr = ncclSend(src, bytes_, ncclUint8, comm_->rank, nc, stream_);
  if (nr == ncclSuccess) nr = ncclRecv(y_, bytes_, ncclUint8, comm_->rank, nc, stream_);
  return nr;
}

allscanResult_t HeadResult::join() {
  if (mode_ == kFillSide) ALLSCAN_CUDA_CHECK(cudaStreamWaitEvent(stream_, comm_->join, 0));
  return allscanSuccess;
}

allscanResult_t HeadResult::inSeries() {
  return mode_ == kFillSeries ? copyOrZero(y_, src_, bytes_, stream_) : allscanSuccess;
}

}  // namespace detail
}  // namespace allscan
