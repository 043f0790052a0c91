// allscanWatch: bounded failure of a communicator's collectives (see allscan/common.h).
//
// Each watched call records a CUDA event into one of kSlots slots, round robin (events made on the
// communicator's device when the watch is). A thread queries the busy slots every poll interval.
// The watch fails when work is pending and nothing has completed for the timeout: no slot seen
// complete since the later of the last completion and the moment the watch went from idle to busy.
// Progress, not the age of the oldest call, so a GPU that runs steadily behind the host (every slot
// reused while busy) is never taken for a hung one. A call stuck while being issued (inside NCCL on
// the host, e.g. connecting to a dead peer) records nothing, so its start is stamped too.
//
// On failure the reason is kept for every later call and, with abort_on_timeout, the communicator
// is aborted under the issue lock, waited for at most kAbortWait: a call stuck inside NCCL is then
// released by the abort itself, as NCCL's abort intends; that call's own error path may still
// touch the freed communicator (the one case the lock cannot cover).
//
// The thread's CUDA calls use the relaxed stream-capture mode, so its event queries never
// invalidate a graph that another thread is capturing in global mode.
#include "common/watch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"

using Clock = std::chrono::steady_clock;

struct allscanWatch {
  ncclComm_t nccl = nullptr;
  int device = 0;
  double timeout_s = 0;
  bool abort_on_timeout = false;
  std::timed_mutex issue;  // held while a call issues work, and by the abort
  std::mutex mu;           // everything below but the atomics
  struct Slot {
    cudaEvent_t event = nullptr;
    bool busy = false;
  };
  std::vector<Slot> slots;
  size_t next = 0;
  Clock::time_point progress;  // last completion seen, or when the watch last went busy from idle
  std::atomic<int64_t> issuing_since{0};  // ns since the clock's epoch while a call issues, else 0
  std::atomic<bool> failed{false};
  std::atomic<bool> aborted{false};
  std::atomic<unsigned long long> calls{0};  // calls issued successfully (captured ones included)
  allscanResult_t code = allscanTimeout;  // what later calls return once failed
  std::string reason;
  bool stop = false;
  std::condition_variable cv;
  std::thread thread;
};

namespace allscan {
namespace detail {
namespace {

constexpr size_t kSlots = 64;
constexpr auto kAbortWait = std::chrono::seconds(2);

std::shared_mutex g_registry_mu;
std::vector<allscanWatch*> g_registry;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::chrono::milliseconds pollInterval(double timeout_s) {
  // A tenth of the timeout, between 10 ms and 200 ms.
  const double ms = std::clamp(timeout_s * 100.0, 10.0, 200.0);
  return std::chrono::milliseconds(static_cast<long>(ms));
}

// Fails the watch once (a later failure keeps the first reason) and aborts the communicator when
// the watch may; false when it had failed already.
bool failWith(allscanWatch* w, allscanResult_t code, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(w->mu);
    if (w->failed.load()) return false;
    w->code = code;
    w->reason = reason + (w->abort_on_timeout ? "; the communicator was aborted" : "") +
                ": it cannot be used again, make a new process group";
    w->failed.store(true);
  }
  if (!w->abort_on_timeout) return true;
  const bool locked = w->issue.try_lock_for(kAbortWait);
  ncclCommAbort(w->nccl);
  w->aborted.store(true);
  if (locked) w->issue.unlock();
  return true;
}

void fail(allscanWatch* w, const char* what, double waited_s) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%s on this NCCL communicator for %.1f s (timeout %.1f s): a peer died or is stuck, or the ranks "
                "called a collective with arguments whose transfers differ in size",
                what, waited_s, w->timeout_s);
  failWith(w, allscanTimeout, buf);
}

void watchLoop(allscanWatch* w) {
  cudaSetDevice(w->device);
  cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&relaxed);
  const auto poll = pollInterval(w->timeout_s);
  std::unique_lock<std::mutex> lk(w->mu);
  while (!w->stop) {
    w->cv.wait_for(lk, poll, [w] { return w->stop; });
    if (w->stop) break;
    const auto now = Clock::now();
    bool pending = false;
    for (auto& s : w->slots) {
      if (!s.busy) continue;
      const cudaError_t q = cudaEventQuery(s.event);
      if (q == cudaErrorNotReady) {
        pending = true;
      } else {
        s.busy = false;  // done (or a CUDA error, which the stream's next user sees)
        w->progress = now;
        if (q != cudaSuccess) cudaGetLastError();
      }
    }
    const double stalled = std::chrono::duration<double>(now - w->progress).count();
    const int64_t since = w->issuing_since.load();
    const double issuing = since ? (nowNs() - since) * 1e-9 : 0.0;
    if ((pending && stalled > w->timeout_s) || issuing > w->timeout_s) {
      lk.unlock();
      if (issuing > w->timeout_s)
        fail(w, "an allscan call has been stuck issuing its NCCL work", issuing);
      else
        fail(w, "allscan collectives have been pending without progress", stalled);
      return;
    }
  }
}

}  // namespace

allscanWatch_t watchBegin(ncclComm_t nccl, allscanResult_t* result) {
  std::shared_lock<std::shared_mutex> reg(g_registry_mu);
  auto it = std::find_if(g_registry.begin(), g_registry.end(), [nccl](allscanWatch* w) { return w->nccl == nccl; });
  if (it == g_registry.end()) return nullptr;
  allscanWatch* w = *it;
  if (!w->failed.load()) {
    w->issue.lock();
    if (!w->failed.load()) {
      w->issuing_since.store(nowNs());
      return w;
    }
    w->issue.unlock();
  }
  std::lock_guard<std::mutex> lk(w->mu);
  *result = setError(w->code, w->reason);
  return nullptr;
}

void watchEnd(allscanWatch_t w, cudaStream_t stream, bool issued) {
  if (issued) w->calls.fetch_add(1);
  // Recorded whether or not the call succeeded: a call that failed half way may have enqueued work.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
  } else if (capture == cudaStreamCaptureStatusNone) {
    std::lock_guard<std::mutex> lk(w->mu);
    const bool idle = std::none_of(w->slots.begin(), w->slots.end(), [](const allscanWatch::Slot& s) { return s.busy; });
    auto& s = w->slots[w->next];
    w->next = (w->next + 1) % w->slots.size();
    if (cudaEventRecord(s.event, stream) == cudaSuccess) {
      if (idle) w->progress = Clock::now();
      s.busy = true;
    } else {
      cudaGetLastError();  // e.g. a stream of another device: this call is not watched
    }
  }
  w->issuing_since.store(0);
  w->issue.unlock();
}

}  // namespace detail
}  // namespace allscan

using allscan::detail::setError;

extern "C" ALLSCAN_API allscanResult_t allscanWatchCreate(ncclComm_t nccl, double timeout_s, int abort_on_timeout,
                                                          allscanWatch_t* watch) {
  ALLSCAN_ARG_CHECK(nccl != nullptr, "nccl: null communicator");
  ALLSCAN_ARG_CHECK(watch != nullptr, "watch: null output pointer");
  ALLSCAN_ARG_CHECK(timeout_s > 0 && timeout_s < 1e9, "timeout_s: expected a positive number of seconds, got " +
                                                          std::to_string(timeout_s));
  int device = 0, current = 0;
  ALLSCAN_NCCL_CHECK(nccl, ncclCommCuDevice(nccl, &device));
  auto* w = new allscanWatch();
  w->nccl = nccl;
  w->device = device;
  w->timeout_s = timeout_s;
  w->abort_on_timeout = abort_on_timeout != 0;
  w->slots.resize(allscan::detail::kSlots);
  w->progress = Clock::now();
  cudaError_t e = cudaGetDevice(&current);
  if (e == cudaSuccess) e = cudaSetDevice(device);
  for (auto& s : w->slots)
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming);
  cudaSetDevice(current);
  if (e != cudaSuccess) {
    for (auto& s : w->slots)
      if (s.event != nullptr) cudaEventDestroy(s.event);
    delete w;
    return setError(allscanCudaError, std::string("allscanWatchCreate: events: ") + cudaGetErrorString(e));
  }
  {
    std::unique_lock<std::shared_mutex> reg(allscan::detail::g_registry_mu);
    for (allscanWatch* other : allscan::detail::g_registry)
      if (other->nccl == nccl) {
        for (auto& s : w->slots) cudaEventDestroy(s.event);
        delete w;
        return setError(allscanInvalidArgument, "nccl: this communicator already has a watch");
      }
    allscan::detail::g_registry.push_back(w);
  }
  w->thread = std::thread(allscan::detail::watchLoop, w);
  *watch = w;
  return allscanSuccess;
}

extern "C" ALLSCAN_API allscanResult_t allscanWatchDestroy(allscanWatch_t w, int* aborted) {
  if (aborted != nullptr) *aborted = 0;
  if (w == nullptr) return allscanSuccess;
  {
    std::unique_lock<std::shared_mutex> reg(allscan::detail::g_registry_mu);
    auto& r = allscan::detail::g_registry;
    r.erase(std::remove(r.begin(), r.end(), w), r.end());
  }
  {
    std::lock_guard<std::mutex> lk(w->mu);
    w->stop = true;
  }
  w->cv.notify_all();
  if (w->thread.joinable()) w->thread.join();  // an abort in progress finishes first
  {
    std::lock_guard<std::timed_mutex> issuing(w->issue);  // a call still being issued finishes first
  }
  if (aborted != nullptr) *aborted = w->aborted.load() ? 1 : 0;
  for (auto& s : w->slots)
    if (s.event != nullptr) cudaEventDestroy(s.event);
  delete w;
  return allscanSuccess;
}

extern "C" ALLSCAN_API allscanResult_t allscanWatchStatus(allscanWatch_t w, int* aborted) {
  ALLSCAN_ARG_CHECK(w != nullptr, "watch: null watch");
  if (aborted != nullptr) *aborted = w->aborted.load() ? 1 : 0;
  if (!w->failed.load()) return allscanSuccess;
  std::lock_guard<std::mutex> lk(w->mu);
  return setError(w->code, w->reason);
}

extern "C" ALLSCAN_API allscanResult_t allscanWatchFail(allscanWatch_t w, allscanResult_t code, const char* reason) {
  ALLSCAN_ARG_CHECK(w != nullptr, "watch: null watch");
  ALLSCAN_ARG_CHECK(code == allscanTimeout || code == allscanMismatch || code == allscanRemoteError,
                    "code: expected allscanTimeout, allscanMismatch or allscanRemoteError, got " +
                        std::to_string(static_cast<int>(code)));
  // The abort's CUDA calls must not invalidate a graph another thread is capturing (as in the watch
  // thread): relaxed capture mode for this thread while it runs.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  allscan::detail::failWith(w, code, reason != nullptr ? reason : "failed by the caller");
  cudaThreadExchangeStreamCaptureMode(&mode);
  return allscanSuccess;
}

extern "C" ALLSCAN_API allscanResult_t allscanWatchCalls(allscanWatch_t w, unsigned long long* calls) {
  ALLSCAN_ARG_CHECK(w != nullptr && calls != nullptr, "watch/calls: null pointer");
  *calls = w->calls.load();
  return allscanSuccess;
}
