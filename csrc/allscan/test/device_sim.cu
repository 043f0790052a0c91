// The device-initiated All-Scan's kernel on P simulated ranks of ONE GPU: each rank a cudaMalloc'd
// window and a stream, every rank's kernel in flight at once (they wait on each other's flags as
// they do across GPUs), results compared bitwise with the host's chain of the same fp32 (fp64)
// multiply-then-add. Covers what two GPUs cannot: P = 3, 4 (inner ranks that receive and send),
// and, like two GPUs would, every dtype, direction, exclusive/inclusive, init, decay shape, CTA
// count, sub-block tails, many calls on the same window (flags, acks and call counters reused),
// the floor (chain and ring), and CUDA graphs replayed (their call counters advance on the GPU).
//
//   nvcc -std=c++17 -arch=sm_90 -Icsrc -Icsrc/common/include -Icsrc/allscan/include device_sim.cu
//   ./device_sim            -> "device_sim: N cases, 0 failed", exit 0
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "allscan/device_scan_kernel.cuh"

using namespace allscan::detail::device;

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

namespace {

int g_cases = 0, g_failed = 0;

void fail(const std::string& what) {
  ++g_failed;
  if (g_failed <= 20) std::printf("FAIL %s\n", what.c_str());
}

// Host copies of the device arithmetic: combine in fp32 (fp64), round to the storage type.
float toF(float v) { return v; }
float toF(__half v) { return __half2float(v); }
float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
double toF(double v) { return v; }
template <typename T> T fromF(float v) { return static_cast<T>(v); }
template <> __half fromF<__half>(float v) { return __float2half_rn(v); }
template <> __nv_bfloat16 fromF<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T> struct HostAcc { using type = float; };
template <> struct HostAcc<double> { using type = double; };

struct World {
  int P;
  size_t capacity;
  std::vector<char*> win;
  std::vector<cudaStream_t> streams;
  unsigned* err = nullptr;  // host-mapped
  unsigned* err_dev = nullptr;

  World(int p, size_t cap) : P(p), capacity(cap), win(p), streams(p) {
    for (int r = 0; r < P; ++r) {
      CK(cudaMalloc(&win[r], kHeaderBytes + 2 * capacity));
      CK(cudaMemset(win[r], 0, kHeaderBytes + 2 * capacity));
      CK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    CK(cudaHostAlloc(&err, sizeof(unsigned), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev), err, 0));
    *err = 0;
    CK(cudaDeviceSynchronize());
  }
  ~World() {
    for (int r = 0; r < P; ++r) {
      cudaFree(win[r]);
      cudaStreamDestroy(streams[r]);
    }
    cudaFreeHost(err);
  }
  // What device_path.cu's baseParams gives rank r.
  Params params(int r, int reverse, bool chain) const {
    const int succ = reverse ? r - 1 : r + 1, pred = reverse ? r + 1 : r - 1;
    Params p{};
    const bool head = reverse ? r == P - 1 : r == 0;
    const bool tail = reverse ? r == 0 : r == P - 1;
    p.recv_in = chain ? !head : 1;
    p.send_out = chain ? !tail : 1;
    p.local = win[r];
    p.succ = p.send_out ? win[(succ + P) % P] : nullptr;
    p.pred = win[(pred + P) % P];
    p.dir_header = static_cast<size_t>(reverse) * kDirHeader;
    p.dir_data = kHeaderBytes + static_cast<size_t>(reverse) * capacity;
    p.timeout_ns = 2ull * 1000 * 1000 * 1000;
    p.err = err_dev;
    return p;
  }
};

template <typename T> void fillRandom(std::vector<T>& v, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  for (auto& e : v) e = fromF<T>(d(rng));
}

// One scan case: `calls` consecutive calls (inputs change per call), or graph replays.
template <typename T>
void scanCase(World& w, size_t count, size_t g_count, int reverse, int inclusive, bool init, int ctas, int calls,
              bool graph, allscanDataType_t dtype) {
  using A = typename HostAcc<T>::type;
  const int P = w.P;
  ++g_cases;
  char name[256];
  std::snprintf(name, sizeof(name), "P=%d dtype=%d count=%zu g=%zu rev=%d incl=%d init=%d ctas=%d graph=%d", P,
                static_cast<int>(dtype), count, g_count, reverse, inclusive, init, ctas, graph);
  std::mt19937 rng(static_cast<unsigned>(count * 31 + g_count * 7 + reverse * 3 + inclusive + P * 1000));
  std::vector<T*> x(P), y(P);
  std::vector<float*> g(P, nullptr);
  T* init_d = nullptr;
  std::vector<std::vector<T>> hx(P, std::vector<T>(count));
  std::vector<std::vector<float>> hg(P, std::vector<float>(g_count));
  std::vector<T> hinit(count);
  for (int r = 0; r < P; ++r) {
    CK(cudaMalloc(&x[r], count * sizeof(T)));
    CK(cudaMalloc(&y[r], count * sizeof(T)));
    if (g_count) {
      std::uniform_real_distribution<float> d(0.5f, 1.f);
      for (auto& e : hg[r]) e = d(rng);
      CK(cudaMalloc(&g[r], g_count * sizeof(float)));
      CK(cudaMemcpy(g[r], hg[r].data(), g_count * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  if (init) {
    fillRandom(hinit, rng);
    CK(cudaMalloc(&init_d, count * sizeof(T)));
    CK(cudaMemcpy(init_d, hinit.data(), count * sizeof(T), cudaMemcpyHostToDevice));
  }
  const int n_ctas = ctasFor(count * sizeof(T), ctas);
  std::vector<Params> ps(P);
  for (int r = 0; r < P; ++r) {
    Params p = w.params(r, reverse, true);
    p.x = x[r];
    p.y = y[r];
    p.g = g[r];
    p.init = (reverse ? r == P - 1 : r == 0) ? init_d : nullptr;
    p.count = count;
    p.inner = g_count ? count / g_count : 1;
    p.inclusive = inclusive;
    p.sig = 0x1234;
    partition(&p, count, sizeof(T), n_ctas);
    ps[r] = p;
  }
  std::vector<cudaGraphExec_t> execs(P, nullptr);
  if (graph) {
    for (int r = 0; r < P; ++r) {
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(w.streams[r], cudaStreamCaptureModeThreadLocal));
      CK(launch(ps[r], dtype, allscanFloat32, n_ctas, w.streams[r]));
      CK(cudaStreamEndCapture(w.streams[r], &gr));
      CK(cudaGraphInstantiate(&execs[r], gr, 0));
      CK(cudaGraphDestroy(gr));
    }
  }
  for (int call = 0; call < calls; ++call) {
    for (int r = 0; r < P; ++r) {
      fillRandom(hx[r], rng);
      CK(cudaMemcpy(x[r], hx[r].data(), count * sizeof(T), cudaMemcpyHostToDevice));
      CK(cudaMemset(y[r], 0xff, count * sizeof(T)));
    }
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < P; ++r) {
      if (graph) CK(cudaGraphLaunch(execs[r], w.streams[r]));
      else CK(launch(ps[r], dtype, allscanFloat32, n_ctas, w.streams[r]));
    }
    CK(cudaDeviceSynchronize());
    if (*w.err != 0) {
      fail(std::string(name) + ": error word " + std::to_string(*w.err));
      *w.err = 0;
      break;
    }
    // The host chain.
    std::vector<T> z(count);
    for (size_t i = 0; i < count; ++i) z[i] = init ? hinit[i] : fromF<T>(0.f);
    bool bad = false;
    for (int s = 0; s < P && !bad; ++s) {
      const int r = reverse ? P - 1 - s : s;
      std::vector<T> got(count);
      CK(cudaMemcpy(got.data(), y[r], count * sizeof(T), cudaMemcpyDeviceToHost));
      std::vector<T> next(count);
      for (size_t i = 0; i < count; ++i) {
        const A gi = g_count ? static_cast<A>(hg[r][i / (count / g_count)]) : A(1);
        const A wv = static_cast<A>(gi * static_cast<A>(toF(z[i]))) + static_cast<A>(toF(hx[r][i]));
        next[i] = fromF<T>(static_cast<float>(wv));
        if constexpr (sizeof(T) == 8) next[i] = static_cast<T>(wv);
        const T want = inclusive ? next[i] : z[i];
        if (std::memcmp(&want, &got[i], sizeof(T)) != 0) {
          fail(std::string(name) + " call " + std::to_string(call) + " rank " + std::to_string(r) + " element " +
               std::to_string(i) + ": got " + std::to_string(toF(got[i])) + ", want " + std::to_string(toF(want)));
          bad = true;
          break;
        }
      }
      z = next;
    }
    if (bad) break;
  }
  for (auto e : execs)
    if (e) cudaGraphExecDestroy(e);
  for (int r = 0; r < P; ++r) {
    cudaFree(x[r]);
    cudaFree(y[r]);
    if (g[r]) cudaFree(g[r]);
  }
  if (init_d) cudaFree(init_d);
}

// The floor: every rank (chain: but the tail) sends its bytes; every rank (chain: but the head)
// receives its predecessor's.
void exchangeCase(World& w, size_t bytes, int reverse, bool chain, int calls) {
  const int P = w.P;
  ++g_cases;
  char name[160];
  std::snprintf(name, sizeof(name), "exchange P=%d bytes=%zu rev=%d chain=%d", P, bytes, reverse, chain);
  std::vector<unsigned char*> s(P), rcv(P);
  std::vector<std::vector<unsigned char>> hs(P, std::vector<unsigned char>(bytes));
  for (int r = 0; r < P; ++r) {
    CK(cudaMalloc(&s[r], bytes));
    CK(cudaMalloc(&rcv[r], bytes));
  }
  std::mt19937 rng(static_cast<unsigned>(bytes + P));
  for (int call = 0; call < calls; ++call) {
    for (int r = 0; r < P; ++r) {
      for (auto& b : hs[r]) b = static_cast<unsigned char>(rng());
      CK(cudaMemcpy(s[r], hs[r].data(), bytes, cudaMemcpyHostToDevice));
      CK(cudaMemset(rcv[r], 0, bytes));
    }
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < P; ++r) {
      Params p = w.params(r, reverse, chain);
      p.x = s[r];
      p.recv = rcv[r];
      CK(launchExchange(p, bytes, ctasFor(bytes, 16), w.streams[r]));  // every rank's CTAs resident at once
    }
    CK(cudaDeviceSynchronize());
    if (*w.err != 0) {
      fail(std::string(name) + ": error word " + std::to_string(*w.err));
      *w.err = 0;
      break;
    }
    for (int r = 0; r < P; ++r) {
      const int pred = reverse ? r + 1 : r - 1;
      if (chain && (pred < 0 || pred >= P)) continue;
      std::vector<unsigned char> got(bytes);
      CK(cudaMemcpy(got.data(), rcv[r], bytes, cudaMemcpyDeviceToHost));
      if (got != hs[(pred + P) % P]) {
        fail(std::string(name) + " call " + std::to_string(call) + " rank " + std::to_string(r));
        break;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    cudaFree(s[r]);
    cudaFree(rcv[r]);
  }
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("device_sim: no GPU\n");
    return 3;
  }
  const size_t cap = size_t(8) << 20;
  for (int P : {2, 3, 4}) {
    World w(P, cap);
    std::printf("P=%d ...\n", P);
    // fp32 over sizes, decay shapes, directions, inclusive, init, CTA counts (<= 32: four ranks of
    // CTAs must be resident on one GPU at once)
    for (size_t count : {size_t(1), size_t(7), size_t(4224), size_t(65536 + 3), size_t(3 << 18)})
      for (size_t gc : {size_t(0), size_t(1), count})
        for (int rev : {0, 1})
          for (int incl : {0, 1})
            for (bool init : {false, true})
              scanCase<float>(w, count, gc, rev, incl, init, count > 4224 ? 0 : 1, 2, false, allscanFloat32);
    for (int ctas : {1, 3, 32}) scanCase<float>(w, 3 << 18, 3, 0, 0, true, ctas, 2, false, allscanFloat32);
    for (int rev : {0, 1}) {
      scanCase<__nv_bfloat16>(w, 65536 + 5, 16, rev, 1, true, 0, 2, false, allscanBfloat16);
      scanCase<__half>(w, 4224, 33, rev, 0, true, 2, 2, false, allscanFloat16);
      scanCase<double>(w, 4224, 0, rev, 1, false, 0, 2, false, allscanFloat64);
    }
    scanCase<float>(w, 1 << 16, 4, 0, 0, false, 0, 50, false, allscanFloat32);  // many calls on one window
    scanCase<float>(w, 1 << 16, 4, 1, 1, true, 0, 5, true, allscanFloat32);    // graph replays
    scanCase<float>(w, 1 << 16, 4, 0, 0, false, 0, 3, false, allscanFloat32);  // eager after the graph
    for (size_t bytes : {size_t(16), size_t(4096), size_t(1000003), size_t(4 << 20)})
      for (int rev : {0, 1})
        for (bool chain : {true, false}) exchangeCase(w, bytes, rev, chain, 2);
  }
  std::printf("device_sim: %d cases, %d failed\n", g_cases, g_failed);
  return g_failed == 0 ? 0 : 1;
}
