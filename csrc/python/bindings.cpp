// allscan._C: a thin layer over the C API. Integers in (device pointers, cudaStream_t, ncclComm_t,
// allscanComm_t), Python exceptions out. No libtorch: the Python side passes data_ptr()s.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "allscan/allscan.h"
#include "python/check.h"

namespace py = pybind11;

void bindA2A(py::module_& m);
void bindMatrix(py::module_& m);

namespace {

using allscan_py::check;
using allscan_py::ptr;

// NCCL is bound lazily (CMakeLists.txt): before the first NCCL call, allscan._nccl.load() puts a
// libnccl.so.2 in the global scope. A call without one would end the process in the dynamic linker;
// this raises instead.
bool ncclLoaded() { return dlsym(RTLD_DEFAULT, "ncclGetVersion") != nullptr; }

void requireNccl() {
  if (!ncclLoaded())
    throw std::runtime_error("allscan: the NCCL library is not loaded (allscan._nccl.load() loads it: the NCCL "
                             "torch loaded, else the nvidia-nccl wheel's)");
}

void checkNccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string("allscan: ") + what + ": " + ncclGetErrorString(r));
}

allscanScanArgs_t makeArgs(std::uintptr_t x, std::uintptr_t y, size_t count, int dtype, std::uintptr_t g,
                           size_t g_count, int g_dtype, std::uintptr_t init, bool reverse, bool inclusive,
                           int num_blocks, int method, unsigned long long signature = 0) {
  allscanScanArgs_t a{};
  a.signature = signature;
  allscan_py::setChainArgs(&a, x, y, dtype, init, reverse, inclusive, num_blocks, method);
  a.count = count;
  a.g = ptr<const void>(g);
  a.g_count = g_count;
  a.g_dtype = static_cast<allscanDataType_t>(g_dtype);
  return a;
}

void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("allscan: ") + what + ": " + cudaGetErrorString(e));
}

// Events for the Python async path (scan(async_op=True)): the side stream waits for the caller's
// stream and the handle waits for the side stream through these, a few microseconds less per call
// than torch.cuda's Python wrappers. Recycled per device; an event goes back to the pool as soon as
// the wait on it is enqueued (cudaStreamWaitEvent captures the record it waits for). Leaked at exit
// on purpose: destroying CUDA objects during interpreter shutdown can run after the driver is gone.
struct EventPool {
  std::mutex mu;
  std::unordered_map<int, std::vector<cudaEvent_t>> free;
};

EventPool& pool() {
  static EventPool* p = new EventPool;
  return *p;
}

int currentDevice() {
  int dev = 0;
  checkCuda(cudaGetDevice(&dev), "cudaGetDevice");
  return dev;
}

cudaEvent_t acquireEvent(int dev) {
  {
    std::lock_guard<std::mutex> lk(pool().mu);
    auto& v = pool().free[dev];
    if (!v.empty()) {
      cudaEvent_t e = v.back();
      v.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  checkCuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}

void releaseEvent(int dev, cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(pool().mu);
  pool().free[dev].push_back(e);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "allscan C++/CUDA core (thin bindings over the C API)";

  m.attr("FLOAT32") = static_cast<int>(allscanFloat32);
  m.attr("FLOAT16") = static_cast<int>(allscanFloat16);
  m.attr("BFLOAT16") = static_cast<int>(allscanBfloat16);
  m.attr("FLOAT64") = static_cast<int>(allscanFloat64);
  m.attr("PIPELINED") = static_cast<int>(allscanPipelined);
  m.attr("SERIAL") = static_cast<int>(allscanSerial);
  m.attr("ALLGATHER") = static_cast<int>(allscanAllGather);
  m.attr("DEVICE") = static_cast<int>(allscanDevice);
  m.attr("MAX_BLOCKS") = static_cast<int>(allscanMaxBlocks);
  m.attr("MIN_BLOCK_BYTES") = static_cast<int>(allscanMinBlockBytes);

  m.def("version", &allscanGetVersion);
  // The NCCL headers this module was compiled against; the library loaded at run time may differ.
  m.attr("NCCL_VERSION_COMPILED") = static_cast<int>(NCCL_VERSION_CODE);
  m.def("nccl_loaded", &ncclLoaded);
  m.def("nccl_version", []() {
    requireNccl();
    int v = 0;
    checkNccl(ncclGetVersion(&v), "ncclGetVersion");
    return v;
  });

  // Owned NCCL communicators (when torch's cannot be borrowed).
  m.def("nccl_get_unique_id", []() {
    requireNccl();
    ncclUniqueId id;
    checkNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return py::bytes(id.internal, sizeof(id.internal));
  });
  m.def("nccl_comm_init_rank", [](int nranks, py::bytes id_bytes, int rank) {
    requireNccl();
    std::string s = id_bytes;
    if (s.size() != sizeof(ncclUniqueId)) throw py::value_error("allscan: id: expected " + std::to_string(sizeof(ncclUniqueId)) + " bytes");
    ncclUniqueId id;
    std::copy(s.begin(), s.end(), id.internal);
    ncclComm_t c = nullptr;
    {
      py::gil_scoped_release nogil;
      checkNccl(ncclCommInitRank(&c, nranks, id, rank), "ncclCommInitRank");
    }
    return reinterpret_cast<std::uintptr_t>(c);
  });
  m.def("nccl_comm_destroy", [](std::uintptr_t c) { checkNccl(ncclCommDestroy(ptr<ncclComm>(c)), "ncclCommDestroy"); });

  auto comm_error = pybind11::register_exception<allscan_py::CommunicatorError>(m, "CommunicatorError", PyExc_RuntimeError);
  pybind11::register_exception<allscan_py::CommunicatorTimeout>(m, "CommunicatorTimeout", comm_error);
  m.def("watch_create", [](std::uintptr_t nccl, double timeout_s, bool abort_on_timeout) {
    allscanWatch_t w = nullptr;
    check(allscanWatchCreate(ptr<ncclComm>(nccl), timeout_s, abort_on_timeout ? 1 : 0, &w));
    return reinterpret_cast<std::uintptr_t>(w);
  });
  m.def("watch_destroy", [](std::uintptr_t w) {
    int aborted = 0;
    allscanResult_t r;
    {
      py::gil_scoped_release release;  // waits for the watch thread (at most an abort in progress)
      r = allscanWatchDestroy(ptr<allscanWatch>(w), &aborted);
    }
    check(r);
    return aborted != 0;
  }, "stop watching; returns whether the watch aborted the communicator (then it must not be destroyed)");
  m.attr("TIMEOUT") = static_cast<int>(allscanTimeout);
  m.attr("MISMATCH") = static_cast<int>(allscanMismatch);
  m.attr("REMOTE_ERROR") = static_cast<int>(allscanRemoteError);
  m.def("watch_status", [](std::uintptr_t w) { check(allscanWatchStatus(ptr<allscanWatch>(w), nullptr)); },
        "raise the watch's failure (CommunicatorTimeout / CommunicatorError), if any");
  m.def("watch_fail", [](std::uintptr_t w, int code, const std::string& reason) {
    py::gil_scoped_release release;  // an abort may wait for a call being issued
    check(allscanWatchFail(ptr<allscanWatch>(w), static_cast<allscanResult_t>(code), reason.c_str()));
  });
  m.def("watch_calls", [](std::uintptr_t w) {
    unsigned long long n = 0;
    check(allscanWatchCalls(ptr<allscanWatch>(w), &n));
    return n;
  });
  m.def("comm_create", [](std::uintptr_t nccl) {
    if (nccl) requireNccl();  // a null one is an argument error the core reports without NCCL
    allscanComm_t c = nullptr;
    check(allscanCommCreate(ptr<ncclComm>(nccl), &c));
    return reinterpret_cast<std::uintptr_t>(c);
  });
  m.def("comm_create_detached", [](int rank, int nranks) {
    allscanComm_t c = nullptr;
    check(allscanCommCreateDetached(rank, nranks, &c));
    return reinterpret_cast<std::uintptr_t>(c);
  });
  m.def("comm_destroy", [](std::uintptr_t c) { check(allscanCommDestroy(ptr<allscanComm>(c))); });
  m.def("comm_forget_nccl", [](std::uintptr_t c) { check(allscanCommForgetNccl(ptr<allscanComm>(c))); });
  m.def("comm_fail", [](std::uintptr_t c, int code, const std::string& reason) {
    check(allscanCommFail(ptr<allscanComm>(c), static_cast<allscanResult_t>(code), reason.c_str()));
  });
  m.def("comm_rank", [](std::uintptr_t c) { int r; check(allscanCommRank(ptr<allscanComm>(c), &r)); return r; });
  m.def("comm_size", [](std::uintptr_t c) { int n; check(allscanCommSize(ptr<allscanComm>(c), &n)); return n; });
  m.def("comm_status", [](std::uintptr_t c) { check(allscanCommStatus(ptr<allscanComm>(c))); },
        "raise the failure given to comm_fail, or CommunicatorError once a call on this rank received another rank's "
        "mismatched signature");

  m.def("device_path", [](std::uintptr_t c) {
    int state = 0;
    const char* reason = nullptr;
    check(allscanDevicePath(ptr<allscanComm>(c), &state, &reason));
    return py::make_tuple(state, std::string(reason != nullptr ? reason : ""));
  }, "allscanDevicePath: (1 device-initiated / 0 not tried / -1 the NCCL path, why)");
  m.def("set_link_model", [](std::uintptr_t c, double a, double b) { check(allscanSetLinkModel(ptr<allscanComm>(c), a, b)); });
  m.def("get_link_model", [](std::uintptr_t c) {
    double a = 0, b = 0;
    int set = 0;
    check(allscanGetLinkModel(ptr<allscanComm>(c), &a, &b, &set));
    return py::make_tuple(a, b, set != 0);
  });
  m.def("calibrate", [](std::uintptr_t c, std::uintptr_t stream) {
    py::gil_scoped_release nogil;
    check(allscanCalibrate(ptr<allscanComm>(c), ptr<CUstream_st>(stream)));
  });
  m.def("choose_num_blocks", [](std::uintptr_t c, size_t bytes) {
    int k = 0;
    check(allscanChooseNumBlocks(ptr<allscanComm>(c), bytes, &k));
    return k;
  });
  m.def("choose_num_blocks_model", &allscanChooseNumBlocksModel, py::arg("nranks"), py::arg("bytes"),
        py::arg("latency_us"), py::arg("us_per_byte"));

  m.def("workspace_size",
        [](std::uintptr_t c, size_t count, int dtype, std::uintptr_t g, size_t g_count, int g_dtype, std::uintptr_t init,
           bool reverse, bool inclusive, int num_blocks, int method) {
          // x/y are not dereferenced: any distinct non-null placeholders do.
          allscanScanArgs_t a = makeArgs(16, 32, count, dtype, g, g_count, g_dtype, init, reverse, inclusive, num_blocks, method);
          size_t bytes = 0;
          check(allscanWorkspaceSize(ptr<allscanComm>(c), &a, &bytes));
          return bytes;
        });
  m.def("scan",
        [](std::uintptr_t c, std::uintptr_t x, std::uintptr_t y, size_t count, int dtype, std::uintptr_t g, size_t g_count,
           int g_dtype, std::uintptr_t init, bool reverse, bool inclusive, int num_blocks, int method,
           std::uintptr_t ws, size_t ws_bytes, std::uintptr_t stream, unsigned long long signature) {
          allscanScanArgs_t a =
              makeArgs(x, y, count, dtype, g, g_count, g_dtype, init, reverse, inclusive, num_blocks, method, signature);
          check(allscanScan(ptr<allscanComm>(c), &a, ptr<void>(ws), ws_bytes, ptr<CUstream_st>(stream)));
        });
  m.def("neighbor_exchange",
        [](std::uintptr_t c, std::uintptr_t send, std::uintptr_t recv, size_t bytes, bool reverse, bool chain,
           std::uintptr_t stream) {
          check(allscanNeighborExchange(ptr<allscanComm>(c), ptr<const void>(send), ptr<void>(recv), bytes, reverse ? 1 : 0,
                                        chain ? 1 : 0, ptr<CUstream_st>(stream)));
        });

  // Stream ordering for the async path (current device; streams as integers).
  m.def("stream_wait", [](std::uintptr_t waiter, std::uintptr_t src) {
    const int dev = currentDevice();
    cudaEvent_t e = acquireEvent(dev);
    cudaError_t r = cudaEventRecord(e, ptr<CUstream_st>(src));
    if (r == cudaSuccess) r = cudaStreamWaitEvent(ptr<CUstream_st>(waiter), e, 0);
    releaseEvent(dev, e);
    checkCuda(r, "stream_wait");
  });
  m.def("event_record", [](std::uintptr_t stream) {
    const int dev = currentDevice();
    cudaEvent_t e = acquireEvent(dev);
    cudaError_t r = cudaEventRecord(e, ptr<CUstream_st>(stream));
    if (r != cudaSuccess) {
      releaseEvent(dev, e);
      checkCuda(r, "event_record");
    }
    return py::make_tuple(dev, reinterpret_cast<std::uintptr_t>(e));
  });
  m.def("event_wait", [](std::uintptr_t stream, std::uintptr_t e) {
    checkCuda(cudaStreamWaitEvent(ptr<CUstream_st>(stream), ptr<CUevent_st>(e), 0), "event_wait");
  });
  m.def("event_query", [](std::uintptr_t e) {
    cudaError_t r = cudaEventQuery(ptr<CUevent_st>(e));
    if (r == cudaErrorNotReady) return false;
    checkCuda(r, "event_query");
    return true;
  });
  m.def("event_release", [](int dev, std::uintptr_t e) { releaseEvent(dev, ptr<CUevent_st>(e)); });

  bindA2A(m);
  bindMatrix(m);
}
