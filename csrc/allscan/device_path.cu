// The device-initiated All-Scan over NVLink, host side (device_path.h says what it is; the kernel
// and its window protocol: device_scan_kernel.cuh): the window, its peers' addresses, the checks
// that decide whether the path runs, and the launches.
#include "device_path.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <dlfcn.h>
#include <nccl.h>

#include <type_traits>

#include "comm.h"
#include "device_scan_kernel.cuh"
#include "common/error.h"
#include "common/signature.h"

// The device API is header-inline: its structs are compiled into this file, so the path runs only
// with the NCCL (major.minor) these headers come from (checked at run time).
#if defined(__has_include)
#if __has_include(<nccl_device.h>) && defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 22807
#include <nccl_device.h>
#define ALLSCAN_DEVICE_API 1
#endif
#endif
#ifndef ALLSCAN_DEVICE_API
#define ALLSCAN_DEVICE_API 0
#endif

namespace allscan {
namespace detail {

using namespace device;

#if ALLSCAN_DEVICE_API
// NCCL's device-API host functions, looked up in the loaded NCCL at run time (after the version
// check), so that a core built against 2.28+ still loads beside an older NCCL (then: the NCCL path).
struct DeviceApi {
  decltype(&ncclMemAlloc) memAlloc = nullptr;
  decltype(&ncclMemFree) memFree = nullptr;
  decltype(&ncclCommWindowRegister) windowRegister = nullptr;
  decltype(&ncclCommWindowDeregister) windowDeregister = nullptr;
  decltype(&ncclDevCommCreate) devCommCreate = nullptr;
  decltype(&ncclDevCommDestroy) devCommDestroy = nullptr;
  ncclTeam_t (*teamLsa)(ncclComm_t) = nullptr;  // (ncclTeamLsa is overloaded: host and device)
  bool complete() const {
    return memAlloc && memFree && windowRegister && windowDeregister && devCommCreate && devCommDestroy && teamLsa;
  }
};

const DeviceApi& deviceApi() {
  static const DeviceApi api = [] {
    DeviceApi a;
    auto get = [](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(RTLD_DEFAULT, name)); };
    get(a.memAlloc, "ncclMemAlloc");
    get(a.memFree, "ncclMemFree");
    get(a.windowRegister, "ncclCommWindowRegister");
    get(a.windowDeregister, "ncclCommWindowDeregister");
    get(a.devCommCreate, "ncclDevCommCreate");
    get(a.devCommDestroy, "ncclDevCommDestroy");
    get(a.teamLsa, "ncclTeamLsa");
    return a;
  }();
  return api;
}
#endif

struct DevicePath {
  bool tried = false;
  bool usable = false;
  std::string reason;
  size_t capacity = 0;  // incoming-state bytes per direction of the current window
  unsigned long long* scratch = nullptr;  // the setup's all-reduces
  size_t grow_failed = 0;  // the smallest state a larger window could not be made for (0: none)
  std::vector<char*> peers;  // every rank's window base, as this rank addresses it
  unsigned* err = nullptr;   // host-mapped
  unsigned* err_dev = nullptr;
  // The last eager call of each direction: a call on another stream waits for it (two calls of one
  // direction must not run at once: they share the window's regions and call numbers).
  cudaEvent_t last[2] = {nullptr, nullptr};
  cudaStream_t last_stream[2] = {nullptr, nullptr};
  unsigned long long timeout_ns = 600ull * 1000 * 1000 * 1000;
  struct Window {
    void* buf;
#if ALLSCAN_DEVICE_API
    ncclWindow_t win;
#endif
  };
  std::vector<Window> windows;  // the current one last; earlier ones stay mapped for captured graphs
#if ALLSCAN_DEVICE_API
  bool have_devcomm = false;
  ncclDevComm devcomm;
#endif
};

namespace {

bool unusable(DevicePath* d, const std::string& why) {
  d->usable = false;
  d->reason = why;
  return false;
}

#if ALLSCAN_DEVICE_API
__global__ void peerBasesKernel(ncclWindow_t win, int nranks, char** out) {
  for (int r = threadIdx.x; r < nranks; r += blockDim.x) out[r] = static_cast<char*>(ncclGetLsaPointer(win, 0, r));
}

// The all-reduce (min or max) of one value over the communicator (host-blocking); false when it
// could not run. The setup's steps are collective: every rank must take each one or none.
bool allReduce(allscanComm* comm, DevicePath* d, unsigned long long* v, ncclRedOp_t op, cudaStream_t stream) {
  if (d->scratch == nullptr && cudaMalloc(&d->scratch, sizeof(unsigned long long)) != cudaSuccess) {
    cudaGetLastError();
    d->scratch = nullptr;
    return false;  // (the others block in the all-reduce until the watch's timeout: 8 bytes failed)
  }
  const bool good =
      cudaMemcpyAsync(d->scratch, v, sizeof(*v), cudaMemcpyHostToDevice, stream) == cudaSuccess &&
      ncclSettle(comm->nccl, ncclAllReduce(d->scratch, d->scratch, 1, ncclUint64, op, comm->nccl, stream)) ==
          ncclSuccess &&
      cudaMemcpyAsync(v, d->scratch, sizeof(*v), cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
      cudaStreamSynchronize(stream) == cudaSuccess;
  if (!good) cudaGetLastError();
  return good;
}

// Whether every rank's `ok` holds.
bool agree(allscanComm* comm, DevicePath* d, bool ok, cudaStream_t stream) {
  unsigned long long v = ok ? 1 : 0;
  return allReduce(comm, d, &v, ncclMin, stream) && v == 1;
}

// A new window of `capacity` bytes per direction and its peers' bases (collective, host-blocking);
// false (reason set) on every rank when any rank failed.
bool newWindow(allscanComm* comm, DevicePath* d, size_t capacity, cudaStream_t stream) {
  // The same window on every rank: the largest capacity any rank asks for (ranks that pass
  // different sizes, e.g. unchecked, must not address each other's windows differently).
  unsigned long long want = alignUp(capacity, NCCL_WIN_REQUIRED_ALIGNMENT);  // regions stay aligned
  if (!allReduce(comm, d, &want, ncclMax, stream)) return unusable(d, "agreeing on the window's size failed");
  capacity = static_cast<size_t>(want);
  const size_t bytes = kHeaderBytes + 2 * capacity;
  void* buf = nullptr;
  const DeviceApi& api = deviceApi();
  ncclResult_t r = api.memAlloc(&buf, bytes);
  bool ok = r == ncclSuccess && cudaMemsetAsync(buf, 0, bytes, stream) == cudaSuccess &&
            cudaStreamSynchronize(stream) == cudaSuccess;
  if (!agree(comm, d, ok, stream)) {
    if (buf != nullptr) api.memFree(buf);
    return unusable(d, "a window of " + std::to_string(bytes) + " bytes could not be allocated on every rank");
  }
  ncclWindow_t win = nullptr;
  r = ncclSettle(comm->nccl, api.windowRegister(comm->nccl, buf, bytes, &win, NCCL_WIN_DEFAULT));
  if (!agree(comm, d, r == ncclSuccess && win != nullptr, stream)) {
    if (r == ncclSuccess) api.windowDeregister(comm->nccl, win);
    api.memFree(buf);
    return unusable(d, std::string("ncclCommWindowRegister failed on a rank (here: ") + ncclGetErrorString(r) + ")");
  }
  d->windows.push_back(DevicePath::Window{buf, win});  // released with the communicator, whatever follows
  if (!d->have_devcomm) {
    // A window NCCL could not make symmetric still registers, as a handle no kernel may read;
    // creating a device communicator then fails: the test before any kernel touches the window.
    ncclDevCommRequirements reqs;
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
    reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
    std::memset(&reqs, 0, sizeof(reqs));
#endif
    r = ncclSettle(comm->nccl, api.devCommCreate(comm->nccl, &reqs, &d->devcomm));
    d->have_devcomm = r == ncclSuccess;
    if (!agree(comm, d, d->have_devcomm && d->devcomm.lsaSize == comm->nranks, stream))
      return unusable(d, std::string("no symmetric memory on every rank (here: ncclDevCommCreate ") +
                             ncclGetErrorString(r) + ", LSA team " +
                             std::to_string(d->have_devcomm ? d->devcomm.lsaSize : 0) + " of " +
                             std::to_string(comm->nranks) + " ranks)");
  }
  char** bases = nullptr;
  std::vector<char*> host(comm->nranks);
  ok = cudaMalloc(&bases, sizeof(char*) * comm->nranks) == cudaSuccess;
  if (ok) {
    peerBasesKernel<<<1, 32, 0, stream>>>(win, comm->nranks, bases);
    ok = cudaGetLastError() == cudaSuccess &&
         cudaMemcpyAsync(host.data(), bases, sizeof(char*) * comm->nranks, cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
         cudaStreamSynchronize(stream) == cudaSuccess;
  }
  if (bases != nullptr) cudaFree(bases);
  if (!ok) cudaGetLastError();
  if (!agree(comm, d, ok, stream)) return unusable(d, "reading the window's peer addresses failed on a rank");
  d->peers = host;
  d->capacity = capacity;
  return true;
}

// Why this rank cannot run the path ("" when it can try).
std::string staticReason(const allscanComm* comm) {
  if (comm->device_path_off) return "ALLSCAN_DEVICE_PATH=off";
  const char* p2p = std::getenv("NCCL_P2P_DISABLE");
  if (p2p != nullptr && std::string(p2p) == "1") return "NCCL_P2P_DISABLE=1";
  int loaded = 0;
  if (ncclGetVersion(&loaded) != ncclSuccess) return "ncclGetVersion failed";
  const int built = NCCL_VERSION_CODE;
  if (loaded / 100 != built / 100 || loaded < 22807)
    return "the loaded NCCL (" + std::to_string(loaded) + ") is not the one the device kernels were compiled against (" +
           std::to_string(built) + "; the device API's structs differ between versions)";
  if (!deviceApi().complete()) return "the loaded NCCL lacks the device API's host functions";
  ncclTeam_t lsa = deviceApi().teamLsa(comm->nccl);
  if (lsa.nRanks != comm->nranks)
    return "not every rank is load/store accessible (LSA team of " + std::to_string(lsa.nRanks) + " of " +
           std::to_string(comm->nranks) + " ranks: no NVLink/P2P between them)";
  return "";
}

bool setup(allscanComm* comm, DevicePath* d, size_t bytes, cudaStream_t stream) {
  d->tried = true;
  std::string why = staticReason(comm);
  d->timeout_ns = static_cast<unsigned long long>(comm->device_timeout_s * 1e9);
  if (why.empty() && (cudaHostAlloc(&d->err, sizeof(unsigned), cudaHostAllocMapped) != cudaSuccess ||
                      cudaHostGetDevicePointer(reinterpret_cast<void**>(&d->err_dev), d->err, 0) != cudaSuccess)) {
    cudaGetLastError();
    d->err = nullptr;
    why = "cudaHostAlloc of the failure word failed";
  }
  if (d->err != nullptr) *d->err = 0;
  if (!agree(comm, d, why.empty(), stream)) return unusable(d, why.empty() ? "another rank cannot use it" : why);
  if (!newWindow(comm, d, std::max(bytes, kMinCapacity), stream)) return false;
  d->usable = true;
  d->reason.clear();
  return true;
}
#endif  // ALLSCAN_DEVICE_API

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return cs != cudaStreamCaptureStatusNone;
}


}  // namespace

bool devicePathReady(allscanComm* comm, size_t bytes, cudaStream_t stream) {
#if !ALLSCAN_DEVICE_API
  (void)bytes;
  (void)stream;
  if (comm->device == nullptr) comm->device = new DevicePath();
  if (!comm->device->tried) {
    comm->device->tried = true;
    comm->device->reason = "allscan was built against an NCCL without the device API (< 2.28.7)";
  }
  return false;
#else
  if (comm->nccl == nullptr || comm->nranks < 2) return false;
  if (comm->device == nullptr) comm->device = new DevicePath();
  DevicePath* d = comm->device;
  if (!d->tried) {
    if (capturing(stream)) {
      d->reason = "the device path is prepared by an eager call, not under capture";
      return false;
    }
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    setup(comm, d, bytes, stream);
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  if (!d->usable) return false;
  if (bytes <= d->capacity) return true;
  if (capturing(stream)) return false;  // a larger window is made by an eager call only
  if (d->grow_failed != 0 && bytes >= d->grow_failed) return false;  // not tried again (a collective)
  // Every rank needs the larger window at the same call (the arguments agree): collective. A
  // failure leaves the smaller window in use (larger states take the NCCL path).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  const size_t keep = d->capacity;
  const bool grown = newWindow(comm, d, std::max(bytes, 2 * d->capacity), stream);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (!grown) {  // the old window still serves states up to its capacity; larger ones: the NCCL path
    d->usable = true;
    d->capacity = keep;
    d->grow_failed = bytes;  // the same on every rank: the failure was agreed
    d->reason.clear();
  }
  return grown;
#endif
}

const char* devicePathReason(const allscanComm* comm) {
  return comm != nullptr && comm->device != nullptr ? comm->device->reason.c_str() : "";
}

allscanResult_t devicePathStatus(const allscanComm* comm) {
  if (comm == nullptr || comm->device == nullptr || comm->device->err == nullptr) return allscanSuccess;
  const unsigned e = *reinterpret_cast<volatile unsigned*>(comm->device->err);
  if (e & kErrMismatch)
    return setError(allscanMismatch, "allscanScan (device path): a rank received a call made with other arguments "
                                     "than its own (its results were NaN); the communicator is no longer usable");
  if (e & kErrTimeout)
    return setError(allscanTimeout, "allscanScan (device path): a neighbour did not publish within "
                                    "ALLSCAN_DEVICE_TIMEOUT_S; the communicator is no longer usable");
  return allscanSuccess;
}

namespace {
Params baseParams(allscanComm* comm, int reverse, int recv_in, int send_out) {
  DevicePath* d = comm->device;
  Params p{};
  const int succ = reverse ? comm->rank - 1 : comm->rank + 1;
  const int pred = reverse ? comm->rank + 1 : comm->rank - 1;
  p.recv_in = recv_in;
  p.send_out = send_out;
  p.local = d->peers[comm->rank];
  p.succ = send_out ? d->peers[(succ + comm->nranks) % comm->nranks] : nullptr;
  p.pred = d->peers[(pred + comm->nranks) % comm->nranks];
  p.dir_header = static_cast<size_t>(reverse) * kDirHeader;
  p.dir_data = kHeaderBytes + static_cast<size_t>(reverse) * d->capacity;
  p.timeout_ns = d->timeout_ns;
  p.err = d->err_dev;
  return p;
}

}  // namespace

namespace {
// Eager calls only: under capture the graph's own order holds (and an event recorded outside a
// capture cannot be waited on inside it).
allscanResult_t orderAfterLast(DevicePath* d, int dir, cudaStream_t stream) {
  if (capturing(stream) || d->last[dir] == nullptr || d->last_stream[dir] == stream) return allscanSuccess;
  if (cudaStreamWaitEvent(stream, d->last[dir], 0) != cudaSuccess)
    return setError(allscanCudaError, "allscanScan (device path): ordering after the previous call failed");
  return allscanSuccess;
}

cudaError_t recordLast(DevicePath* d, int dir, cudaStream_t stream) {
  if (capturing(stream)) return cudaSuccess;
  if (d->last[dir] == nullptr) {
    const cudaError_t e = cudaEventCreateWithFlags(&d->last[dir], cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
  }
  d->last_stream[dir] = stream;
  return cudaEventRecord(d->last[dir], stream);
}
}  // namespace

allscanResult_t devicePathScan(allscanComm* comm, const allscanScanArgs_t* a, cudaStream_t stream) {
  ALLSCAN_CHECK(devicePathStatus(comm));
  const ChainPos pos = chainPos(comm, a->reverse);
  const size_t esize = dtypeSize(a->dtype);
  const int ctas = ctasFor(a->count * esize, a->num_blocks);
  Params p = baseParams(comm, a->reverse, !pos.head, pos.has_next);
  p.x = a->x;
  p.y = a->y;
  p.g = a->g;
  p.init = pos.head ? a->init : nullptr;
  p.count = a->count;
  p.inner = a->g != nullptr ? a->count / a->g_count : 1;
  p.inclusive = a->inclusive;
  p.sig = a->signature;
  partition(&p, a->count, esize, ctas);
  ALLSCAN_CHECK(orderAfterLast(comm->device, a->reverse, stream));
  cudaError_t e = launch(p, a->dtype, a->g_dtype, ctas, stream);
  if (e == cudaSuccess) e = recordLast(comm->device, a->reverse, stream);
  if (e != cudaSuccess) return setError(allscanCudaError, std::string("allscanScan (device path): ") + cudaGetErrorString(e));
  return allscanSuccess;
}

allscanResult_t devicePathExchange(allscanComm* comm, const void* sendbuf, void* recvbuf, size_t bytes, int reverse,
                                   int chain, int num_ctas, cudaStream_t stream) {
  ALLSCAN_CHECK(devicePathStatus(comm));
  const int P = comm->nranks, r = comm->rank;
  const bool send = !chain || (reverse ? r > 0 : r < P - 1);
  const bool recv = !chain || (reverse ? r < P - 1 : r > 0);
  Params p = baseParams(comm, reverse, recv, send);
  p.x = sendbuf;
  p.recv = recvbuf;
  ALLSCAN_CHECK(orderAfterLast(comm->device, reverse, stream));
  cudaError_t e = launchExchange(p, bytes, ctasFor(bytes, num_ctas), stream);
  if (e == cudaSuccess) e = recordLast(comm->device, reverse, stream);
  if (e != cudaSuccess) return setError(allscanCudaError, std::string("device path exchange: ") + cudaGetErrorString(e));
  return allscanSuccess;
}

void devicePathDestroy(allscanComm* comm) {
  DevicePath* d = comm->device;
  if (d == nullptr) return;
  // No eager call of this rank still uses the windows (not the whole device: torch's own work may
  // be stuck on a dead peer).
  for (cudaEvent_t ev : d->last)
    if (ev != nullptr) cudaEventSynchronize(ev);
#if ALLSCAN_DEVICE_API
  // comm->nccl is null when the NCCL communicator is gone (allscanCommForgetNccl): its windows
  // went with it; only the memory is left to free.
  const DeviceApi& api = deviceApi();
  if (comm->nccl != nullptr && d->have_devcomm) ncclSettle(comm->nccl, api.devCommDestroy(comm->nccl, &d->devcomm));
  for (auto& w : d->windows) {
    if (comm->nccl != nullptr) ncclSettle(comm->nccl, api.windowDeregister(comm->nccl, w.win));
    api.memFree(w.buf);
  }
#endif
  for (cudaEvent_t ev : d->last)
    if (ev != nullptr) cudaEventDestroy(ev);
  if (d->scratch != nullptr) cudaFree(d->scratch);
  if (d->err != nullptr) cudaFreeHost(d->err);
  cudaGetLastError();
  delete d;
  comm->device = nullptr;
}

}  // namespace detail
}  // namespace allscan
