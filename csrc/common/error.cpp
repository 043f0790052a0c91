#include "common/error.h"

#include <cstdarg>
#include <cstdio>
#include <thread>

namespace allscan {
namespace detail {

static thread_local std::string t_last_error;

allscanResult_t setError(allscanResult_t code, const std::string& msg) {
  t_last_error = msg;
  return code;
}

allscanResult_t setErrorf(allscanResult_t code, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  t_last_error = buf;
  return code;
}

const char* lastError() { return t_last_error.c_str(); }

ncclResult_t ncclSettle(ncclComm_t comm, ncclResult_t r) {
  // Communicators created non-blocking (torch may create them so) return ncclInProgress from
  // enqueue calls; the operation is then completed by polling the communicator's async state.
  if (r != ncclInProgress || comm == nullptr) return r;
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) {
    ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) return q;
    if (state == ncclInProgress) std::this_thread::yield();
  }
  return state;
}

}  // namespace detail
}  // namespace allscan

extern "C" ALLSCAN_API const char* allscanGetLastError(void) { return allscan::detail::lastError(); }

extern "C" ALLSCAN_API const char* allscanGetErrorString(allscanResult_t r) {
  switch (r) {
    case allscanSuccess: return "success";
    case allscanInvalidArgument: return "invalid argument";
    case allscanCudaError: return "CUDA error";
    case allscanNcclError: return "NCCL error";
    case allscanInternalError: return "internal error";
    case allscanTimeout: return "communicator timed out";
    case allscanMismatch: return "ranks passed different arguments";
    case allscanRemoteError: return "another rank reported a failure";
  }
  return "unknown allscan result";
}
