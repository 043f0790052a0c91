// The in-band signature check (see signature.h).
#include "common/signature.h"

#include <cstdio>
#include <new>

#include "common/acc.cuh"
#include "common/error.h"

namespace allscan {
namespace detail {
namespace {

__global__ void storeSignature(unsigned long long* slot, unsigned long long value) { *slot = value; }

template <typename T>
__global__ void poisonKernel(T* __restrict__ y, size_t count, SigCheck check) {
  if (!check.mismatch()) return;
  using A = typename Acc<T>::type;
  const T nan = fromAcc<T>(quietNan(A(0)));
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) y[i] = nan;
}

}  // namespace

allscanResult_t createSignatures(SignatureTable** out) {
  auto* t = new (std::nothrow) SignatureTable();
  if (t == nullptr) return setError(allscanInternalError, "signature table: out of host memory");
  const size_t bytes = sizeof(unsigned long long) * (SignatureTable::kSendSlots + SignatureTable::kRecvSlots);
  cudaError_t e = cudaMalloc(&t->dev, bytes);
  if (e == cudaSuccess) e = cudaMemset(t->dev, 0, bytes);
  if (e == cudaSuccess) e = cudaHostAlloc(&t->record, sizeof(MismatchRecord), cudaHostAllocMapped);
  if (e != cudaSuccess) {
    freeSignatures(t);
    return setError(allscanCudaError, std::string("signature table: ") + cudaGetErrorString(e));
  }
  t->record->set = 0;
  t->sig_in.assign(SignatureTable::kSendSlots, 0);
  t->written.assign(SignatureTable::kSendSlots, 0);
  *out = t;
  return allscanSuccess;
}

void freeSignatures(SignatureTable* t) {
  if (t == nullptr) return;
  if (t->dev) cudaFree(t->dev);
  if (t->record) cudaFreeHost(t->record);
  cudaGetLastError();
  delete t;
}

allscanResult_t signatureSlots(SignatureTable* t, uint64_t signature, cudaStream_t stream, SigSlots* out) {
  *out = SigSlots{};
  if (t == nullptr || signature == 0) return allscanSuccess;
  int slot = 0;
  auto it = t->slot_of.find(signature);
  if (it != t->slot_of.end()) {
    slot = it->second;
  } else {
    slot = t->next_send;
    t->next_send = (t->next_send + 1) % SignatureTable::kSendSlots;
    if (t->sig_in[slot] != 0) t->slot_of.erase(t->sig_in[slot]);
    t->sig_in[slot] = signature;
    t->slot_of[signature] = slot;
    t->written[slot] = 0;
  }
  if (!t->written[slot]) {
    // Until an eager call wrote it: a write captured into a graph runs only when the graph does.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    ALLSCAN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    storeSignature<<<1, 1, 0, stream>>>(t->dev + slot, signature);
    ALLSCAN_CUDA_CHECK(cudaGetLastError());
    if (capture == cudaStreamCaptureStatusNone) t->written[slot] = 1;
  }
  const int recv = SignatureTable::kSendSlots + t->next_recv;
  t->next_recv = (t->next_recv + 1) % SignatureTable::kRecvSlots;
  out->send = t->dev + slot;
  out->check.recv = t->dev + recv;
  out->check.expect = signature;
  out->check.record = t->record;
  return allscanSuccess;
}

allscanResult_t mismatchStatus(const SignatureTable* t) {
  if (t == nullptr || t->record->set == 0) return allscanSuccess;
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "ranks passed different arguments to the same collective: this rank's call had signature "
                "%016llx, its predecessor in the chain sent %016llx (shapes, dtypes or options differ; that call's "
                "results here are NaN). The communicator is out of step: make a new process group",
                static_cast<unsigned long long>(t->record->expected), static_cast<unsigned long long>(t->record->got));
  return setError(allscanMismatch, buf);
}

cudaError_t launchPoison(void* y, size_t count, allscanDataType_t dtype, const SigCheck& check, cudaStream_t stream) {
  if (check.recv == nullptr || count == 0) return cudaSuccess;
  constexpr int kBlocks = 32, kThreads = 256;  // only does work on a mismatch
  switch (dtype) {
    case allscanFloat32: poisonKernel<float><<<kBlocks, kThreads, 0, stream>>>(static_cast<float*>(y), count, check); break;
    case allscanFloat16: poisonKernel<__half><<<kBlocks, kThreads, 0, stream>>>(static_cast<__half*>(y), count, check); break;
    case allscanBfloat16:
      poisonKernel<__nv_bfloat16><<<kBlocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(y), count, check);
      break;
    case allscanFloat64: poisonKernel<double><<<kBlocks, kThreads, 0, stream>>>(static_cast<double*>(y), count, check); break;
  }
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace allscan
