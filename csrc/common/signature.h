// The in-band signature check (allscanScanArgs_t.signature, allscanA2AArgs_t.signature; internal).
//
// A rank that reuses a signature its peers checked before, but with other arguments, is invisible
// to a check made once per signature on the host. So every pipelined or serial call with a
// non-zero signature sends it to its successor ahead of the first block, in the same NCCL group
// (8 bytes more on a connection that is used anyway), and the receiver's combine kernels compare
// it with their own: on a difference they write NaN over everything they produce (the result and
// what they send on, so the poison travels down the chain) and set a record in host-mapped memory
// that the next call on the communicator (and allscanCommStatus) reports as allscanMismatch. An
// exclusive result received straight into y is written by no combine: one small kernel poisons it.
//
// The chunked all-to-all does the same with every peer it exchanges with: a header to each before
// its data, one kernel after the call that compares them all and poisons every output.
//
// A disagreement that changes the bytes of a transfer hangs in NCCL before any kernel can compare:
// the watch's timeout bounds it (allscanWatchCreate).
//
// The value sent lives in a per-communicator device table, one slot per distinct signature, written
// by a one-thread kernel on the call's stream until an eager call has written it (a write captured
// into a graph runs only when the graph does, so it does not count). kSendSlots slots, reused round
// robin beyond that: a graph captured before its signature's slot was reused then sends the new
// signature and its peers see a mismatch (NaN and an error, loud): after 16384 distinct signatures on
// one communicator, capture graphs again. Received values land in a ring
// of kRecvSlots slots, not cleared between calls: after an abort the watch did not make (a borrowed
// communicator), a receive that never completed may read an old value.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "allscan/common.h"

struct allscanComm;

namespace allscan {
namespace detail {

// Host-mapped: written by a kernel that found a mismatch, read by the host.
struct MismatchRecord {
  volatile int set;
  int pad;
  volatile unsigned long long expected;  // this rank's signature
  volatile unsigned long long got;       // what its predecessor sent
};

// What a receiving kernel needs; recv == nullptr: no check.
struct SigCheck {
  const unsigned long long* recv = nullptr;
  unsigned long long expect = 0;
  MismatchRecord* record = nullptr;  // device view of the host-mapped record

#ifdef __CUDACC__
  // True when the predecessor sent another signature; the first thread of the grid records it.
  __device__ __forceinline__ bool mismatch() const {
    if (recv == nullptr) return false;
    const unsigned long long got = *recv;
    if (got == expect) return false;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
      record->expected = expect;
      record->got = got;
      __threadfence_system();
      record->set = 1;
    }
    return true;
  }
#endif
};

// One call's slots: `send` (8 bytes holding this rank's signature) and the check of what arrives.
struct SigSlots {
  const void* send = nullptr;
  SigCheck check;
  bool on() const { return send != nullptr; }
};

struct SignatureTable {
  static constexpr int kSendSlots = 16384;
  static constexpr int kRecvSlots = 64;
  unsigned long long* dev = nullptr;  // [kSendSlots | kRecvSlots]
  MismatchRecord* record = nullptr;   // host-mapped (the same address on the device: UVA)
  std::unordered_map<uint64_t, int> slot_of;
  std::vector<uint64_t> sig_in;  // the signature each send slot is assigned to (0: none)
  std::vector<char> written;     // whether an eager call wrote it (a captured write may never run)
  int next_send = 0;
  int next_recv = 0;
};

// The table of an allscan communicator (null for one rank or a detached one), the NCCL
// communicator it wraps, and the failure given to allscanCommFail (allscanSuccess if none, or for
// null); allscan.cu.
SignatureTable* signaturesOf(const allscanComm* comm);
ncclComm_t ncclOf(const allscanComm* comm);
allscanResult_t storedFailure(const allscanComm* comm);

// Allocates the table (at communicator creation, outside any capture); freed by freeSignatures.
allscanResult_t createSignatures(SignatureTable** out);
void freeSignatures(SignatureTable* t);

// The slots of one call: nothing (on() false) for signature 0, or a table-less communicator.
allscanResult_t signatureSlots(SignatureTable* t, uint64_t signature, cudaStream_t stream, SigSlots* out);

// allscanMismatch with the recorded values once a kernel found a mismatch (sticky), else success.
allscanResult_t mismatchStatus(const SignatureTable* t);

// NaN over y[0, count) when `check` finds a mismatch (the exclusive tail, which combines nothing).
cudaError_t launchPoison(void* y, size_t count, allscanDataType_t dtype, const SigCheck& check, cudaStream_t stream);

#ifdef __CUDACC__
// A quiet NaN of an accumulation type (what a mismatched call writes, rounded to the storage type).
__device__ __forceinline__ float quietNan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double quietNan(double) { return __longlong_as_double(0x7ff8000000000000ULL); }
#endif

}  // namespace detail
}  // namespace allscan
