// The error plumbing every collective of the core uses (internal, not installed): one thread-local
// last error, one way to record it, one set of argument / CUDA / NCCL check macros. Depends only
// on the public allscan/common.h, never on a collective.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "allscan/common.h"

namespace allscan {
namespace detail {

// Records `msg` as this thread's last error (allscanGetLastError) and returns `code`.
allscanResult_t setError(allscanResult_t code, const std::string& msg);

// The same with a printf-style message.
allscanResult_t setErrorf(allscanResult_t code, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// This thread's last error message.
const char* lastError();

// Waits for a non-blocking communicator's pending operation (ncclInProgress) to settle.
ncclResult_t ncclSettle(ncclComm_t comm, ncclResult_t r);

// The code of a failed NCCL call. ncclRemoteError (a peer exited, or aborted the communicator after
// a failure of its own, as allscan's watch and fault board do) is the communicator failing:
// allscanRemoteError, which Python raises as CommunicatorError, as for a failure the board spreads.
inline allscanResult_t ncclFailure(ncclResult_t r) {
  return r == ncclRemoteError ? allscanRemoteError : allscanNcclError;
}

}  // namespace detail
}  // namespace allscan

#define ALLSCAN_ARG_CHECK(cond, msg)                                                        \
  do {                                                                                      \
    if (!(cond)) return ::allscan::detail::setError(allscanInvalidArgument, (msg));        \
  } while (0)

#define ALLSCAN_CUDA_CHECK(expr)                                                            \
  do {                                                                                      \
    cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess)                                                                  \
      return ::allscan::detail::setError(                                                   \
          allscanCudaError, std::string(#expr ": ") + cudaGetErrorString(_e));              \
  } while (0)

#define ALLSCAN_NCCL_CHECK(comm, expr)                                                      \
  do {                                                                                      \
    ncclResult_t _r = ::allscan::detail::ncclSettle((comm), (expr));                        \
    if (_r != ncclSuccess)                                                                  \
      return ::allscan::detail::setError(                                                   \
          ::allscan::detail::ncclFailure(_r), std::string(#expr ": ") + ncclGetErrorString(_r)); \
  } while (0)

// Inside an ncclGroupStart/ncclGroupEnd pair: on failure, close the group before returning, so
// the thread's NCCL group depth (shared with torch's own NCCL calls) is not left open.
#define ALLSCAN_NCCL_CHECK_IN_GROUP(comm, expr)                                             \
  do {                                                                                      \
    ncclResult_t _r = (expr);                                                               \
    if (_r != ncclSuccess && _r != ncclInProgress) {                                        \
      ::allscan::detail::ncclSettle((comm), ncclGroupEnd());                                \
      return ::allscan::detail::setError(                                                   \
          ::allscan::detail::ncclFailure(_r), std::string(#expr ": ") + ncclGetErrorString(_r)); \
    }                                                                                       \
  } while (0)

#define ALLSCAN_CHECK(expr)                                                                 \
  do {                                                                                      \
    allscanResult_t _s = (expr);                                                            \
    if (_s != allscanSuccess) return _s;                                                    \
  } while (0)
