// What every scan flavour shares: the block count, the communicator's environment settings and
// the chain head's zeroed buffer (see comm.h).
#include "comm.h"

#include <cerrno>
#include <cstdlib>
#include <new>
#include <string>

#include "common/error.h"

namespace allscan {
namespace detail {

const char* dtypeName(allscanDataType_t t) {
  switch (t) {
    case allscanFloat32: return "float32";
    case allscanFloat16: return "float16";
    case allscanBfloat16: return "bfloat16";
    case allscanFloat64: return "float64";
  }
  return "?";
}

int effectiveBlocks(const allscanComm* comm, int numBlocks, size_t bytes) {
  int K = numBlocks;
  if (K == 0) allscanChooseNumBlocks(const_cast<allscanComm*>(comm), bytes, &K);
  return std::min(K, static_cast<int>(allscanMaxBlocks));  // more blocks only add message latencies
}

allscanResult_t copyOrZero(void* y, const void* src, size_t bytes, cudaStream_t stream) {
  if (src != nullptr) {
    ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(y, src, bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    ALLSCAN_CUDA_CHECK(cudaMemsetAsync(y, 0, bytes, stream));
  }
  return allscanSuccess;
}

allscanResult_t checkWorkspace(size_t need, const void* workspace, size_t workspace_bytes, const char* size_query) {
  ALLSCAN_ARG_CHECK(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                    "workspace: " + std::to_string(need) + " bytes needed (" + size_query + "), got " +
                        std::to_string(workspace_bytes));
  return allscanSuccess;
}

allscanResult_t newComm(int rank, int nranks, allscanComm** out) {
  allscanComm settings;
  ALLSCAN_CHECK(readEnv(&settings));
  auto* c = new (std::nothrow) allscanComm(settings);
  if (c == nullptr) return setError(allscanInternalError, "out of host memory");
  c->rank = rank;
  c->nranks = nranks;
  *out = c;
  return allscanSuccess;
}

namespace {

// A decimal byte or CTA count; false for anything else (signs, spaces, overflow).
bool parseSize(const char* v, size_t* out) {
  if (v == nullptr) return false;
  for (const char* p = v; *p; ++p)
    if (*p < '0' || *p > '9') return false;
  errno = 0;
  const unsigned long long n = std::strtoull(v, nullptr, 10);
  if (errno == ERANGE) return false;
  *out = static_cast<size_t>(n);
  return true;
}

// An empty value is the same as an unset one.
const char* getEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

allscanResult_t readEnv(allscanComm* c) {
  if (const char* v = getEnv("ALLSCAN_FILL_CTAS")) {
    size_t n = 0;
    ALLSCAN_ARG_CHECK(parseSize(v, &n) && n <= 1024,
                      std::string("ALLSCAN_FILL_CTAS: expected the side fill's CTA count, 0 (then it runs in series "
                                  "after the send) to 1024, got '") + v + "'");
    c->fill_ctas = static_cast<int>(n);
  }
  if (const char* v = getEnv("ALLSCAN_HEAD_FILL")) {
    const std::string m(v);
    if (m == "auto") c->head_fill = kFillAuto;
    else if (m == "self") c->head_fill = kFillSelf;
    else if (m == "side") c->head_fill = kFillSide;
    else if (m == "series") c->head_fill = kFillSeries;
    else return setError(allscanInvalidArgument, "ALLSCAN_HEAD_FILL: expected auto, self, side or series, got '" + m + "'");
  }
  if (const char* v = getEnv("ALLSCAN_SELF_FILL_MAX_BYTES")) {
    ALLSCAN_ARG_CHECK(parseSize(v, &c->self_fill_max) && c->self_fill_max <= kMaxSelfFill,
                      std::string("ALLSCAN_SELF_FILL_MAX_BYTES: expected a byte count up to ") +
                          std::to_string(kMaxSelfFill) + ", got '" + v + "'");
  }
  if (const char* v = getEnv("ALLSCAN_DEVICE_PATH")) {
    const std::string m(v);
    ALLSCAN_ARG_CHECK(m == "auto" || m == "off", "ALLSCAN_DEVICE_PATH: expected auto or off, got '" + m + "'");
    c->device_path_off = m == "off";
  }
  if (const char* v = getEnv("ALLSCAN_DEVICE_TIMEOUT_S")) {
    char* end = nullptr;
    errno = 0;
    const double s = std::strtod(v, &end);
    ALLSCAN_ARG_CHECK(errno == 0 && end != v && *end == '\0' && s > 0.0 && s <= 1e6,
                      std::string("ALLSCAN_DEVICE_TIMEOUT_S: expected seconds, more than 0 and at most 1e6, got '") + v + "'");
    c->device_timeout_s = s;
  }
  return allscanSuccess;
}

// The buffer is max(bytes, min(self_fill_max, 8 MiB)) when first needed (auto never needs more
// than self_fill_max, 8 MiB by default), a larger one only for a larger state (a raised
// ALLSCAN_SELF_FILL_MAX_BYTES, or a forced self copy); a replaced buffer is kept until the
// communicator goes (graphs captured before may read it). The call that allocates pays one
// cudaMalloc and one synchronisation of `stream`, outside capture only (relaxed capture mode, so
// another thread's capture is not disturbed). A failed size is not retried, nor any larger one.
bool ensureZeros(allscanComm* comm, size_t bytes, cudaStream_t stream) {
  if (comm->zeros_bytes >= bytes) return true;
  if (comm->zeros_failed != 0 && bytes >= comm->zeros_failed) return false;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return false;
  }
  const size_t want = alignUp(std::max(bytes, std::min(comm->self_fill_max, kDefaultSelfFill)), kAlign);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  void* p = nullptr;
  bool ok = cudaMalloc(&p, want) == cudaSuccess;
  // Zeroed and finished before any stream reads it.
  ok = ok && cudaMemsetAsync(p, 0, want, stream) == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (!ok) {
    cudaGetLastError();
    if (p != nullptr) cudaFree(p);
    cudaGetLastError();
    comm->zeros_failed = comm->zeros_failed == 0 ? bytes : std::min(comm->zeros_failed, bytes);
    return false;
  }
  if (comm->zeros != nullptr) comm->retired.push_back(comm->zeros);
  comm->zeros = p;
  comm->zeros_bytes = want;
  return true;
}

}  // namespace detail
}  // namespace allscan
