// allscanWatch: bounded failure of a communicator's collectives (see allscan/common.h).
//
// Each watched call records a CUDA event into one of kSlots slots, round robin, stamped with the
// time it was issued; a thread queries the busy slots every poll interval. A slot reused while
// still busy keeps its older stamp, so a hang is never reported later than the timeout plus the
// poll interval. On timeout the watch fails once: the reason is kept for every later call and,
// with abort_on_timeout, the communicator is aborted under the issue lock (waited for up to
// kAbortWait: a call stuck inside NCCL is released by the abort itself, as NCCL intends).
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
  std::mutex mu;           // the slots, `stop`, `reason`
  struct Slot {
    cudaEvent_t event = nullptr;
    Clock::time_point issued;
    bool busy = false;
  };
  std::vector<Slot> slots;
  size_t next = 0;
  std::atomic<bool> failed{false};
  std::atomic<bool> aborted{false};
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

std::chrono::milliseconds pollInterval(double timeout_s) {
  // A tenth of the timeout, between 10 ms and 200 ms.
  const double ms = std::clamp(timeout_s * 100.0, 10.0, 200.0);
  return std::chrono::milliseconds(static_cast<long>(ms));
}

void fail(allscanWatch* w, double waited_s) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "an allscan collective on this NCCL communicator did not complete within %.1f s (waited %.1f s): a "
                "peer died or is stuck%s; the communicator cannot be used again: make a new process group",
                w->timeout_s, waited_s, w->abort_on_timeout ? "; the communicator was aborted" : "");
  {
    std::lock_guard<std::mutex> lk(w->mu);
    w->reason = buf;
  }
  w->failed.store(true);
  if (!w->abort_on_timeout) return;
  const bool locked = w->issue.try_lock_for(kAbortWait);
  ncclCommAbort(w->nccl);
  w->aborted.store(true);
  if (locked) w->issue.unlock();
}

void watchLoop(allscanWatch* w) {
  cudaSetDevice(w->device);
  const auto poll = pollInterval(w->timeout_s);
  std::unique_lock<std::mutex> lk(w->mu);
  while (!w->stop) {
    w->cv.wait_for(lk, poll, [w] { return w->stop; });
    if (w->stop) break;
    const auto now = Clock::now();
    double worst = 0;
    for (auto& s : w->slots) {
      if (!s.busy) continue;
      const cudaError_t q = cudaEventQuery(s.event);
      if (q == cudaErrorNotReady) {
        worst = std::max(worst, std::chrono::duration<double>(now - s.issued).count());
      } else {
        s.busy = false;  // done (or a CUDA error, which the stream's next user sees)
        if (q != cudaSuccess) cudaGetLastError();
      }
    }
    if (worst > w->timeout_s) {
      lk.unlock();
      fail(w, worst);
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
    if (!w->failed.load()) return w;
    w->issue.unlock();
  }
  std::lock_guard<std::mutex> lk(w->mu);
  *result = setError(allscanTimeout, w->reason);
  return nullptr;
}

void watchEnd(allscanWatch_t w, cudaStream_t stream, bool issued) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (issued && cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone) {
    std::lock_guard<std::mutex> lk(w->mu);
    auto& s = w->slots[w->next];
    w->next = (w->next + 1) % w->slots.size();
    if (s.event != nullptr || cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming) == cudaSuccess) {
      if (cudaEventRecord(s.event, stream) == cudaSuccess) {
        if (!s.busy) s.issued = Clock::now();
        s.busy = true;
      }
    }
  }
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
  int device = 0;
  ALLSCAN_NCCL_CHECK(nccl, ncclCommCuDevice(nccl, &device));
  auto* w = new allscanWatch();
  w->nccl = nccl;
  w->device = device;
  w->timeout_s = timeout_s;
  w->abort_on_timeout = abort_on_timeout != 0;
  w->slots.resize(allscan::detail::kSlots);
  {
    std::unique_lock<std::shared_mutex> reg(allscan::detail::g_registry_mu);
    for (allscanWatch* other : allscan::detail::g_registry)
      if (other->nccl == nccl) {
        delete w;
        return setError(allscanInvalidArgument, "nccl: this communicator already has a watch");
      }
    allscan::detail::g_registry.push_back(w);
  }
  w->thread = std::thread(allscan::detail::watchLoop, w);
  *watch = w;
  return allscanSuccess;
}

extern "C" ALLSCAN_API allscanResult_t allscanWatchDestroy(allscanWatch_t w) {
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
  if (w->thread.joinable()) w->thread.join();
  {
    std::lock_guard<std::timed_mutex> issuing(w->issue);  // a call still being issued finishes first
  }
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
  return setError(allscanTimeout, w->reason);
}
