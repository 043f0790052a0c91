// The device-initiated All-Scan (allscanDevice; internal, not installed): one kernel per rank that
// reads the incoming state from its own NCCL window, combines it with its x and decay, and stores
// the result straight into the next rank's window over NVLink (NCCL's device API: a symmetric
// window per communicator, LSA peer pointers), publishing each sub-block with a flag the next rank
// spins on. No proxy thread, no host round trip, capturable. The NCCL send/recv path serves every
// call this path cannot (see devicePathReason): allscanDevice falls back to allscanPipelined.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "allscan/allscan.h"

struct allscanComm;

namespace allscan {
namespace detail {

struct DevicePath;

// Prepares the path for states of `bytes` bytes (collective on the communicator the first time and
// whenever a larger window is needed; host-blocking; never under stream capture, where a window too
// small means the NCCL path). Returns false (reason in devicePathReason) when the path cannot run
// here: NCCL built without the device API, a loaded NCCL whose device structs differ from the
// headers compiled against, ALLSCAN_DEVICE_PATH=off, ranks not all in one LSA team (no NVLink/P2P
// between them, NCCL_P2P_DISABLE=1), or a window NCCL could not make symmetric.
bool devicePathReady(allscanComm* comm, size_t bytes, cudaStream_t stream);

// Why the path is not used on this communicator ("" when it is, or was not tried yet).
const char* devicePathReason(const allscanComm* comm);

// allscanSuccess, or the failure a device-path kernel found (allscanTimeout: a neighbour never
// published within ALLSCAN_DEVICE_TIMEOUT_S; allscanMismatch: it sent another signature); sticky.
allscanResult_t devicePathStatus(const allscanComm* comm);

// The scan of `a` (diagonal decays) on the prepared path, enqueued on `stream`. num_blocks is the
// CTA count (0: chosen from the size).
allscanResult_t devicePathScan(allscanComm* comm, const allscanScanArgs_t* a, cudaStream_t stream);

// The path's floor: every rank stores `bytes` of `sendbuf` into its successor's window (its
// predecessor's with `reverse`; the chain's ends cut with `chain`) and copies what it received
// into `recvbuf`, with the scan's flags and CTAs: the transfers of one scan without its combine.
allscanResult_t devicePathExchange(allscanComm* comm, const void* sendbuf, void* recvbuf, size_t bytes, int reverse,
                                   int chain, int num_ctas, cudaStream_t stream);

// Releases the windows (after synchronising the device); the communicator is going.
void devicePathDestroy(allscanComm* comm);

}  // namespace detail
}  // namespace allscan
