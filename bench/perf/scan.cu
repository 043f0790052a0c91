// allscan_perf -o scan (the default): the All-Scan rows.
//   p2p-chain       the floor: allscanNeighborExchange(chain=1), exactly the transfers one scan makes
//   p2p-ring        the same with the ring closed (every rank sends and receives)
//   nccl-allgather  ncclAllGather of the states (the LASP-2 communication)
//   nccl-allreduce  ncclAllReduce of one state
//   scan-pipelined  allscanScan, automatic block count and every fixed -K
//   scan-serial     allscanScan, LASP-1 pattern
//   scan-allgather  allscanScan, LASP-2 pattern
//   dev-chain       the device path's floor: allscanDeviceNeighborExchange(chain=1) (-x device, or -m device)
//   scan-device     allscanScan, device-initiated over NVLink (-m device); K shows dev:<CTAs> or nccl
#include <getopt.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "chain.h"
#include "harness.h"

namespace perf {
namespace {

enum Ref { REF_CHAIN = 0, REF_RING = 1, REF_ALLGATHER = 2, REF_ALLREDUCE = 3, REF_DEVICE = 4, REF_COUNT = 5 };
const char* kRefNames[REF_COUNT] = {"chain", "ring", "allgather", "allreduce", "device"};

enum Decay { DECAY_NONE = 0, DECAY_HEAD = 1, DECAY_KEY = 2, DECAY_FULL = 3 };
const char* kDecayNames[4] = {"none", "head", "key", "full"};

struct ScanOptions {
  ChainOptions chain;  // -K, -m, -r, -L
  bool refs[REF_COUNT] = {true, true, true, true, false};
  Decay decay = DECAY_KEY;
  int dv = 128;  // trailing dims of the [H, Dk, Dv] view are gcd(count, dv), gcd(count/Dv, dv)
} opts;

void parse(int letter, const char* arg) {
  if (parseChainOption(&opts.chain, letter, arg)) return;
  switch (letter) {
    case 'V': opts.dv = static_cast<int>(parseInt("-V (vdim)", arg, 1, 1 << 20, "a dimension >= 1")); break;
    case 'D': {
      std::string s(arg);
      bool ok = false;
      for (int k = 0; k < 4; ++k)
        if (s == kDecayNames[k]) opts.decay = static_cast<Decay>(k), ok = true;
      if (!ok) argError("-D (decay): expected none, head, key or full, got '" + s + "'");
      break;
    }
    case 'x': {
      for (bool& b : opts.refs) b = false;
      for (const auto& t : splitList(arg)) {
        bool ok = false;
        if (t == "all") {
          for (int k = 0; k < REF_DEVICE; ++k) opts.refs[k] = true;
          ok = true;
        } else if (t == "none") {
          ok = true;
        }
        for (int k = 0; k < REF_COUNT; ++k)
          if (t == kRefNames[k]) opts.refs[k] = true, ok = true;
        if (!ok) argError("-x (refs): expected a comma-separated list of chain, ring, allgather, allreduce, device (or all: the first four, none), got '" + t + "'");
      }
      break;
    }
  }
}

void validate(const Options&) {
  validateChainOptions(opts.chain);
  for (auto m : opts.chain.methods)
    if (m == allscanDevice) opts.refs[REF_DEVICE] = true;  // the device path's floor beside it
}

// The [H, Dk, Dv] view of a state of `count` elements and the decay's element count for a form.
struct Layout {
  size_t H, Dk, Dv, gCount;
};

Layout layoutFor(size_t count, Decay d, int dv) {
  Layout L;
  L.Dv = std::gcd(count, static_cast<size_t>(dv));
  L.Dk = std::gcd(count / L.Dv, static_cast<size_t>(dv));
  L.H = count / (L.Dv * L.Dk);
  switch (d) {
    case DECAY_NONE: L.gCount = 0; break;
    case DECAY_HEAD: L.gCount = L.H; break;
    case DECAY_KEY: L.gCount = L.H * L.Dk; break;
    case DECAY_FULL: L.gCount = count; break;
  }
  return L;
}

// ------------------------------------------------------------------------------------------------
// Exactly representable inputs and the GPU-side check
//
//   x_p[e] = ((5e + 3p) mod 7) - 3                  in {-3..3} (xval); consecutive ranks cycle
//                                                   through all residues, so a plain prefix sum
//                                                   stays in [-9, 9]
//   g_p[j] = {2, 1/2, 1, 0}[(p + j) mod 4]          powers of two and a zero that cuts the chain
//                                                   every 4 ranks, so |y| <= 3*(1+2+2) = 15
// Every intermediate is a multiple of 1/2 below 32 in magnitude: exact in fp64, fp32, fp16 and bf16,
// at any P, whatever order a method combines in. The expected y is recomputed per element on the GPU.
// ------------------------------------------------------------------------------------------------
__host__ __device__ inline float gval(int rank, size_t j) {
  switch ((static_cast<size_t>(rank) + j) % 4u) {
    case 0: return 2.0f;
    case 1: return 0.5f;
    case 2: return 1.0f;
    default: return 0.0f;
  }
}

__global__ void fillGKernel(float* g, size_t count, int rank) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<size_t>(gridDim.x) * blockDim.x)
    g[j] = gval(rank, j);
}

enum CheckMode { CHK_SCAN = 0, CHK_RECV_CHAIN = 1, CHK_RECV_RING = 2, CHK_ALLGATHER = 3, CHK_ALLREDUCE = 4 };

struct CheckParams {
  int mode;
  int rank, nranks, reverse;
  size_t count;  // elements of one state
  size_t inner;  // state elements per decay element (0: no decay)
};

// Counts the elements of `out` that differ from the expected value (exact comparison; NaN, the
// pre-fill, counts as wrong).
template <typename T>
__global__ void checkKernel(const T* out, CheckParams p, unsigned long long* wrong) {
  const size_t total = p.mode == CHK_ALLGATHER ? p.count * static_cast<size_t>(p.nranks) : p.count;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    double expect = 0.0;
    switch (p.mode) {
      case CHK_SCAN: {
        // Sequential recurrence from the head of the chain, rounded to T at every rank boundary.
        const size_t j = p.inner ? i / p.inner : 0;
        double y = 0.0;
        if (!p.reverse) {
          for (int q = 0; q < p.rank; ++q) {
            const double g = p.inner ? gval(q, j) : 1.0;
            y = toDouble<T>(fromFloat<T>(static_cast<float>(__dadd_rn(__dmul_rn(g, y), xval(q, i)))));
          }
        } else {
          for (int q = p.nranks - 1; q > p.rank; --q) {
            const double g = p.inner ? gval(q, j) : 1.0;
            y = toDouble<T>(fromFloat<T>(static_cast<float>(__dadd_rn(__dmul_rn(g, y), xval(q, i)))));
          }
        }
        expect = y;
        break;
      }
      case CHK_RECV_CHAIN:
      case CHK_RECV_RING: {
        int src = p.reverse ? p.rank + 1 : p.rank - 1;
        if (src < 0 || src >= p.nranks) {
          if (p.mode == CHK_RECV_CHAIN) continue;  // the chain's head receives nothing
          src = (src + p.nranks) % p.nranks;
        }
        expect = xval(src, i);
        break;
      }
      case CHK_ALLGATHER: {
        const int q = static_cast<int>(i / p.count);
        expect = xval(q, i - static_cast<size_t>(q) * p.count);
        break;
      }
      case CHK_ALLREDUCE: {
        for (int q = 0; q < p.nranks; ++q) expect += xval(q, i);
        break;
      }
    }
    if (!(toDouble<T>(out[i]) == expect)) ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

void launchCheck(allscanDataType_t t, const void* out, const CheckParams& p, unsigned long long* wrong, cudaStream_t s) {
  const size_t total = p.mode == CHK_ALLGATHER ? p.count * static_cast<size_t>(p.nranks) : p.count;
  dispatchDtype(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    checkKernel<T><<<gridFor(total), 256, 0, s>>>(static_cast<const T*>(out), p, wrong);
  });
  CUDACHECK(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------
// One rank's rows
// ------------------------------------------------------------------------------------------------
enum OpKind { OP_CHAIN, OP_RING, OP_ALLGATHER, OP_ALLREDUCE, OP_SCAN, OP_DEVICE_CHAIN };

class ScanBench : public ChainBench {
 public:
  explicit ScanBench(RankCtx& ctx) : ChainBench(ctx, opts.chain) {}

  void setup() override {
    const ScanOptions& so = opts;
    setupChain();
    // Buffers at the largest size, allocated once (outside any timed loop).
    const size_t maxCount = c.o->maxBytes / c.es;
    const size_t maxBytes = maxCount * c.es;
    CUDACHECK(cudaMalloc(&x_, maxBytes));
    CUDACHECK(cudaMalloc(&y_, maxBytes));
    if (so.refs[REF_CHAIN] || so.refs[REF_RING] || so.refs[REF_DEVICE]) CUDACHECK(cudaMalloc(&recv_, maxBytes));
    if (so.refs[REF_ALLGATHER]) CUDACHECK(cudaMalloc(&ag_, maxBytes * c.nranks));
    if (so.refs[REF_ALLREDUCE]) CUDACHECK(cudaMalloc(&ar_, maxBytes));
    if (so.decay != DECAY_NONE) {
      CUDACHECK(cudaMalloc(&g_, maxCount * sizeof(float)));
      fillGKernel<<<gridFor(maxCount), 256, 0, c.stream>>>(g_, maxCount, c.rank);
      CUDACHECK(cudaGetLastError());
    }
    launchFillX(c.o->dtype, x_, maxCount, c.rank, c.stream);
    if (so.refs[REF_DEVICE] && c.nranks > 1) {
      // Prepares the device path's window at the largest size, outside any timed loop (collective).
      if (allscanDeviceNeighborExchange(comm_, x_, recv_, maxBytes, so.chain.reverse, 1, 0, c.stream) != allscanSuccess)
        deviceSkip_ = allscanGetLastError();
      CUDACHECK(cudaStreamSynchronize(c.stream));
    }
    int state = 0;
    const char* why = nullptr;
    ASCHECK(allscanDevicePath(comm_, &state, &why));
    deviceLabel_ = state == 1 ? "dev" : "nccl";
  }

  std::vector<std::string> header() override {
    const ScanOptions& so = opts;
    std::vector<std::string> lines;
    char buf[512];
    snprintf(buf, sizeof(buf),
             "#  dtype %s  reverse %d  decay %s (fp32; state viewed as [H, Dk, Dv], Dv = gcd(count,%d), Dk = gcd(count/Dv,%d))",
             dtypeName(c.o->dtype), so.chain.reverse, kDecayNames[so.decay], so.dv, so.dv);
    lines.push_back(buf);
    for (const std::string& l : chainHeaderLines()) lines.push_back(l);
    return lines;
  }

  std::vector<Row> rows(size_t count) override {
    const ScanOptions& so = opts;
    const int P = c.nranks;
    layout_ = layoutFor(count, so.decay, so.dv);
    std::vector<Row> rows;
    auto ref = [&](OpKind k, const char* name, double factor, int floorRank) {
      Row r;
      r.kind = k;
      r.name = name;
      r.busFactor = factor;
      r.floorRank = floorRank;
      r.jsonFields = ",\"method\":null,\"K\":null,\"K_auto\":false";
      rows.push_back(r);
    };
    if (so.refs[REF_CHAIN]) ref(OP_CHAIN, "p2p-chain", 1.0, 1);
    if (so.refs[REF_RING]) ref(OP_RING, "p2p-ring", 1.0, 2);
    if (so.refs[REF_ALLGATHER]) ref(OP_ALLGATHER, "nccl-allgather", static_cast<double>(P - 1), 0);
    if (so.refs[REF_ALLREDUCE]) ref(OP_ALLREDUCE, "nccl-allreduce", 2.0 * (P - 1) / P, 0);
    if (so.refs[REF_DEVICE]) {
      ref(OP_DEVICE_CHAIN, "dev-chain", 1.0, 0);
      rows.back().skip = deviceSkip_;
    }
    for (Row& r : methodRows(so.chain, "scan", OP_SCAN)) {
      const auto m = static_cast<allscanMethod_t>(r.method);
      allscanScanArgs_t a = scanArgs(r, count);
      if (allscanCheckArgs(comm_, &a) != allscanSuccess) r.skip = allscanGetLastError();
      int Keff = 1;
      if (m == allscanPipelined) {
        if (r.K == 0) ASCHECK(allscanChooseNumBlocks(comm_, count * c.es, &Keff));
        else Keff = r.K;
      }
      labelScanRow(&r, m, r.K, Keff);
      if (m == allscanDevice) r.kLabel = deviceLabel_ + ":" + (r.K == 0 ? "auto" : std::to_string(r.K));
      rows.push_back(r);
    }
    const Layout& L = layout_;
    const std::string tail = ",\"layout\":[" + std::to_string(L.H) + "," + std::to_string(L.Dk) + "," +
                             std::to_string(L.Dv) + "],\"g_count\":" +
                             std::to_string(so.decay == DECAY_NONE ? 0 : L.gCount);
    for (Row& r : rows) r.jsonTail = tail;
    return rows;
  }

  // Workspace: the largest any scan row needs at this size, allocated before timing.
  void prepare(const std::vector<Row>& rows, size_t count) override {
    ws_.reserve(rows, OP_SCAN, [&](const Row& r) {
      allscanScanArgs_t a = scanArgs(r, count);
      size_t b = 0;
      ASCHECK(allscanWorkspaceSize(comm_, &a, &b));
      return b;
    });
  }

  void launch(const Row& r, size_t count) override {
    const size_t bytes = count * c.es;
    const int reverse = opts.chain.reverse;
    const ncclDataType_t nt = allscanNcclDataType(c.o->dtype);
    switch (r.kind) {
      case OP_CHAIN: ASCHECK(allscanNeighborExchange(comm_, x_, recv_, bytes, reverse, 1, c.stream)); break;
      case OP_RING: ASCHECK(allscanNeighborExchange(comm_, x_, recv_, bytes, reverse, 0, c.stream)); break;
      case OP_DEVICE_CHAIN: ASCHECK(allscanDeviceNeighborExchange(comm_, x_, recv_, bytes, reverse, 1, 0, c.stream)); break;
      case OP_ALLGATHER: NCCLCHECK(ncclAllGather(x_, ag_, count, nt, c.nccl, c.stream)); break;
      case OP_ALLREDUCE: NCCLCHECK(ncclAllReduce(x_, ar_, count, nt, ncclSum, c.nccl, c.stream)); break;
      case OP_SCAN: {
        allscanScanArgs_t a = scanArgs(r, count);
        ASCHECK(allscanScan(comm_, &a, ws_.ptr, ws_.bytes, c.stream));
        break;
      }
    }
  }

  void check(const Row& r, size_t count, unsigned long long* wrong) override {
    const int P = c.nranks;
    const size_t bytes = count * c.es;
    CheckParams p;
    p.rank = c.rank;
    p.nranks = P;
    p.reverse = opts.chain.reverse;
    p.count = count;
    p.inner = (r.kind == OP_SCAN && opts.decay != DECAY_NONE) ? count / layout_.gCount : 0;
    void* outp = nullptr;
    size_t outBytes = bytes;
    switch (r.kind) {
      case OP_CHAIN: p.mode = CHK_RECV_CHAIN; outp = recv_; break;
      case OP_RING: p.mode = CHK_RECV_RING; outp = recv_; break;
      case OP_DEVICE_CHAIN: p.mode = CHK_RECV_CHAIN; outp = recv_; break;
      case OP_ALLGATHER: p.mode = CHK_ALLGATHER; outp = ag_; outBytes = bytes * P; break;
      case OP_ALLREDUCE: p.mode = CHK_ALLREDUCE; outp = ar_; break;
      case OP_SCAN: p.mode = CHK_SCAN; outp = y_; break;
    }
    CUDACHECK(cudaMemsetAsync(outp, 0xff, outBytes, c.stream));
    launch(r, count);
    // One rank: nothing is sent; the ring "receives" its own state trivially. Nothing to check.
    if (!(P == 1 && (r.kind == OP_CHAIN || r.kind == OP_RING || r.kind == OP_DEVICE_CHAIN))) launchCheck(c.o->dtype, outp, p, wrong, c.stream);
  }

  void teardown() override {
    if (ag_) CUDACHECK(cudaFree(ag_));
    if (ar_) CUDACHECK(cudaFree(ar_));
    if (g_) CUDACHECK(cudaFree(g_));
    teardownChain();
  }

  std::string configJson() override {
    return ",\"reverse\":" + std::to_string(opts.chain.reverse) + ",\"decay\":\"" + kDecayNames[opts.decay] +
           "\",\"vdim\":" + std::to_string(opts.dv) + chainConfigJson(opts.chain);
  }

 private:
  allscanScanArgs_t scanArgs(const Row& r, size_t count) const {
    allscanScanArgs_t a;
    memset(&a, 0, sizeof(a));
    a.count = count;
    a.dtype = c.o->dtype;
    if (opts.decay != DECAY_NONE) {
      a.g = g_;
      a.g_count = layout_.gCount;
      a.g_dtype = allscanFloat32;
    }
    a.init = nullptr;
    a.inclusive = 0;
    setRowArgs(&a, r);
    return a;
  }

  Layout layout_{};
  std::string deviceSkip_;           // why dev-chain cannot run ("" when it can)
  std::string deviceLabel_ = "nccl";  // the K column of scan-device: dev (device path) or nccl (fallback)
  void* ag_ = nullptr;
  void* ar_ = nullptr;
  float* g_ = nullptr;
};

}  // namespace

extern const Collective kScanCollective;  // registered in collectives.cpp
const Collective kScanCollective = {
    "scan",
    "All-Scan benchmark",
    "the All-Scan (allscanScan, every method) against the floor (neighbour send/recv of the same\n"
    "bytes), the closed ring, ncclAllGather and ncclAllReduce; the size is one state's bytes",
    "scan-pipelined, auto K",
    {kBlocksOption,
     kMethodsOption,
     {'x', "refs", required_argument, "<list>",
      "reference rows: chain,ring,allgather,allreduce,device, all or none\n"
      "                              (default all: the first four; 'chain' is the floor of the\n"
      "                              vs_floor column; device: the device path's copy, on with -m device)"},
     kReverseOption,
     kSignatureOption,
     {'D', "decay", required_argument, "<form>",
      "none|head|key|full: the decay's shape in the [H, Dk, Dv]\n"
      "                              view of the state (default key, i.e. g is [H, Dk], fp32)"},
     {'V', "vdim", required_argument, "<n>",
      "Dv and Dk of that view are gcd(count, n), gcd(count/Dv, n)\n"
      "                              (default 128)"},
     kLinkModelOption},
    parse,
    validate,
    [](RankCtx& c) -> std::unique_ptr<Bench> { return std::make_unique<ScanBench>(c); }};

}  // namespace perf
