/*
 * allscan: what every collective of the library shares in its C API: the result codes, the
 * storage dtypes, the last-error getter and the export macro. Included by allscan/allscan.h and
 * allscan/a2a_chunked.h; depends on no collective.
 */
#ifndef ALLSCAN_COMMON_H_
#define ALLSCAN_COMMON_H_

#include <stddef.h>

#include <cuda_runtime.h>
#include <nccl.h>

#if defined(_WIN32)
#define ALLSCAN_API
#else
/* The library is built with hidden visibility; only the C API is exported. */
#define ALLSCAN_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  allscanSuccess = 0,
  allscanInvalidArgument = 1,
  allscanCudaError = 2,
  allscanNcclError = 3,
  allscanInternalError = 4,
  allscanTimeout = 5, /* a watched communicator timed out (allscanWatchCreate); it is no longer usable */
  allscanMismatch = 6, /* ranks passed different arguments to one collective (found on the GPU: the
                          signature check of allscanScanArgs_t); the communicator is out of step */
  allscanRemoteError = 7, /* another rank reported a failure of this communicator (allscanWatchFail), or
                             NCCL's ncclRemoteError: a peer exited or aborted its communicator */
} allscanResult_t;

typedef enum {
  allscanFloat32 = 0,
  allscanFloat16 = 1,
  allscanBfloat16 = 2,
  allscanFloat64 = 3,
} allscanDataType_t;

ALLSCAN_API const char* allscanGetErrorString(allscanResult_t result);
/* The message of the last error of any allscan call on this thread (names the argument at fault). */
ALLSCAN_API const char* allscanGetLastError(void);

/* Bytes per element of a dtype (0 for a value that is not an allscanDataType_t). */
static inline size_t allscanDataTypeSize(allscanDataType_t dtype) {
  switch (dtype) {
    case allscanFloat32: return 4;
    case allscanFloat16: return 2;
    case allscanBfloat16: return 2;
    case allscanFloat64: return 8;
  }
  return 0;
}
/* The NCCL dtype of an allscan dtype (ncclFloat32 for a value that is not an allscanDataType_t). */
static inline ncclDataType_t allscanNcclDataType(allscanDataType_t dtype) {
  switch (dtype) {
    case allscanFloat32: return ncclFloat32;
    case allscanFloat16: return ncclFloat16;
    case allscanBfloat16: return ncclBfloat16;
    case allscanFloat64: return ncclFloat64;
  }
  return ncclFloat32;
}

/*
 * Bounded failure: a watch over the collectives allscan issues on one NCCL communicator (every
 * allscan call on that communicator, from any collective, is watched once a watch exists for it).
 * Each call records a CUDA event on its stream; a thread polls them. When calls are pending and none
 * has completed for `timeout_s` seconds, or one has been stuck issuing its NCCL work that long (a
 * peer died or is stuck), the watch fails: with
 * `abort_on_timeout` it calls ncclCommAbort (the kernels in flight return, their results are
 * undefined, and the communicator is gone: do not destroy it); every later allscan call on the
 * communicator returns allscanTimeout (or the code allscanWatchFail gave) with the reason in
 * allscanGetLastError. Only a communicator
 * the caller owns should be aborted. Calls issued under CUDA graph capture are not watched.
 * A watch is found by its communicator's address, and NCCL may give an aborted communicator's
 * address to one created later: destroy the aborted one's watch (allscanWatchDestroy) before you
 * watch or use a communicator created after the abort, and never use the aborted one's address again
 * (allscanCommFail keeps its failure for the calls made with its allscanComm_t).
 */
typedef struct allscanWatch* allscanWatch_t;
ALLSCAN_API allscanResult_t allscanWatchCreate(ncclComm_t nccl, double timeout_s, int abort_on_timeout,
                                               allscanWatch_t* watch);
/* Stops the thread (an abort in progress finishes first) and forgets the communicator (neither
 * destroys nor aborts it); *aborted (may be NULL): whether the watch aborted it, so it must not be
 * destroyed. */
ALLSCAN_API allscanResult_t allscanWatchDestroy(allscanWatch_t watch, int* aborted);
/* allscanSuccess, or the failure's code (allscanTimeout, or what allscanWatchFail gave) once the
 * watch has failed (the reason in allscanGetLastError); *aborted (may be NULL) says whether the
 * communicator was aborted. */
ALLSCAN_API allscanResult_t allscanWatchStatus(allscanWatch_t watch, int* aborted);
/* Fails the watch now, as a timeout would (aborting the communicator when the watch may), with
 * `code` (allscanTimeout, allscanMismatch or allscanRemoteError) and `reason` for every later call;
 * nothing when it failed already. For the caller's fault propagation: another rank reported a
 * failure, or this rank found one the watch cannot see. */
ALLSCAN_API allscanResult_t allscanWatchFail(allscanWatch_t watch, allscanResult_t code, const char* reason);
/* The number of allscan calls issued on the watched communicator so far (each one that enqueued its
 * work, captured ones included): ranks that made the same calls agree on it. */
ALLSCAN_API allscanResult_t allscanWatchCalls(allscanWatch_t watch, unsigned long long* calls);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ALLSCAN_COMMON_H_ */
