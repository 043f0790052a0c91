// allscan_perf -o matrix: the matrix-transition All-Scan rows (allscanMatrixScan).
//   p2p-chain         the floor: allscanNeighborExchange(chain=1), the bare send of the same bytes
//   matrix-pipelined  allscanMatrixScan, automatic block count and every fixed -K
//   matrix-serial     allscanMatrixScan, one block
//   matrix-allgather  allscanMatrixScan, all-gather of x and M and a local fold (fla's CP pattern)
// The state is [batch, n, n] (-V n, default 128: K = V = 128), batch = size / (n*n*element), the
// transition [batch, n, n] fp32.
#include <getopt.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "harness.h"

namespace perf {
namespace {

enum LinkMode { LINK_CALIBRATE = 0, LINK_NONE = 1, LINK_SET = 2 };

struct MatrixOptions {
  std::vector<int> fixedK;
  std::vector<allscanMethod_t> methods = {allscanPipelined, allscanSerial, allscanAllGather};
  int reverse = 0;
  int n = 128;  // K = V = n
  LinkMode link = LINK_CALIBRATE;
  double linkLatencyUs = 0, linkUsPerByte = 0;
} opts;

const char* methodName(allscanMethod_t m) {
  switch (m) {
    case allscanPipelined: return "pipelined";
    case allscanSerial: return "serial";
    case allscanAllGather: return "allgather";
  }
  return "?";
}

void parse(int letter, const char* arg) {
  switch (letter) {
    case 'V': opts.n = static_cast<int>(parseInt("-V (vdim)", arg, 1, 4096, "the state's K = V, 1..4096")); break;
    case 'r':
      opts.reverse = arg ? static_cast<int>(parseInt("-r (reverse)", arg, 0, 1, "0 or 1 (write -r, -r0 or -r1)")) : 1;
      break;
    case 'K': {
      opts.fixedK.clear();
      for (const auto& t : splitList(arg)) {
        if (t == "auto") continue;
        opts.fixedK.push_back(static_cast<int>(parseInt(
            "-K (blocks)", t.c_str(), 1, allscanMaxBlocks,
            ("'auto' or a block count 1.." + std::to_string(allscanMaxBlocks) + " (comma-separated list allowed)").c_str())));
      }
      break;
    }
    case 'm': {
      opts.methods.clear();
      for (const auto& t : splitList(arg)) {
        if (t == "pipelined") opts.methods.push_back(allscanPipelined);
        else if (t == "serial") opts.methods.push_back(allscanSerial);
        else if (t == "allgather") opts.methods.push_back(allscanAllGather);
        else if (t == "all") opts.methods = {allscanPipelined, allscanSerial, allscanAllGather};
        else argError("-m (methods): expected a comma-separated list of pipelined, serial, allgather (or all), got '" + t + "'");
      }
      std::vector<allscanMethod_t> uniq;
      for (auto m : opts.methods)
        if (std::find(uniq.begin(), uniq.end(), m) == uniq.end()) uniq.push_back(m);
      opts.methods = uniq;
      break;
    }
    case 'L': {
      std::string s(arg);
      if (s == "calibrate") {
        opts.link = LINK_CALIBRATE;
      } else if (s == "none") {
        opts.link = LINK_NONE;
      } else {
        auto parts = splitList(s);
        char* e1 = nullptr;
        char* e2 = nullptr;
        double a = parts.size() == 2 ? strtod(parts[0].c_str(), &e1) : -1;
        double b = parts.size() == 2 ? strtod(parts[1].c_str(), &e2) : -1;
        if (parts.size() != 2 || parts[0].empty() || parts[1].empty() || *e1 || *e2 || !(a > 0) || !(b > 0) ||
            !std::isfinite(a) || !std::isfinite(b))
          argError("-L (link_model): expected calibrate, none or <latency_us>,<us_per_byte> (two positive numbers), got '" + s + "'");
        opts.link = LINK_SET;
        opts.linkLatencyUs = a;
        opts.linkUsPerByte = b;
      }
      break;
    }
  }
}

void validate(const Options&) {
  if (opts.methods.empty()) argError("-m (methods): no method selected");
}

// ------------------------------------------------------------------------------------------------
// Exactly representable transitions and the GPU-side check
//
//   x_p[b, i, c] = xval(p, flat index)                       in {-3..3}
//   M_p[b] = s * signed permutation: M_p[b][i][pi(i)] = s * sgn(i), pi(i) = (i + b + 3p) mod n,
//            sgn(i) = (i + p) odd ? -1 : 1, s = {2, 1/2, 1, 0}[(p + b) mod 4]
// so M_p @ y has one product per row, and the zero scale cuts the chain every 4 ranks: every
// intermediate is a multiple of 1/2 below 32 in magnitude (as the diagonal rows' decays), exact in
// every dtype at any P and in any summation order. The check walks each element's row back through
// the permutations in double.
// ------------------------------------------------------------------------------------------------
__host__ __device__ inline float mscale(int rank, size_t b) {
  switch ((static_cast<size_t>(rank) + b) % 4u) {
    case 0: return 2.0f;
    case 1: return 0.5f;
    case 2: return 1.0f;
    default: return 0.0f;
  }
}
__host__ __device__ inline size_t mperm(int rank, size_t b, size_t i, size_t n) {
  return (i + b + 3u * static_cast<size_t>(rank)) % n;
}
__host__ __device__ inline float msign(int rank, size_t i) { return ((i + static_cast<size_t>(rank)) & 1u) ? -1.0f : 1.0f; }

__global__ void fillMKernel(float* m, size_t batch, size_t n, int rank) {
  const size_t total = batch * n * n;
  for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t b = e / (n * n), i = e / n % n, j = e % n;
    m[e] = j == mperm(rank, b, i, n) ? mscale(rank, b) * msign(rank, i) : 0.0f;
  }
}

struct CheckParams {
  int chain;  // 1: the floor (expects the predecessor's x), 0: the matrix scan (exclusive y)
  int rank, nranks, reverse;
  size_t count, n;
};

template <typename T>
__global__ void checkKernel(const T* out, CheckParams p, unsigned long long* wrong) {
  unsigned long long bad = 0;
  const size_t nn = p.n * p.n;
  for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < p.count;
       e += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int step = p.reverse ? 1 : -1;  // towards the chain's head
    double expect = 0.0;
    if (p.chain) {
      const int src = p.rank + step;
      if (src < 0 || src >= p.nranks) continue;  // the chain's head receives nothing
      expect = xval(src, e);
    } else {
      // y_r[b][i][c] = x_{r-1}[b][i][c] + s sgn(i) y_{r-1}[b][pi(i)][c], walked back to the head.
      const size_t b = e / nn, c = e % p.n;
      size_t row = e / p.n % p.n;
      double mult = 1.0;
      for (int q = p.rank + step; q >= 0 && q < p.nranks && mult != 0.0; q += step) {
        expect += mult * xval(q, b * nn + row * p.n + c);
        mult *= static_cast<double>(mscale(q, b)) * msign(q, row);
        row = mperm(q, b, row, p.n);
      }
    }
    if (!(toDouble<T>(out[e]) == expect)) ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

// ------------------------------------------------------------------------------------------------
// One rank's rows
// ------------------------------------------------------------------------------------------------
enum OpKind { OP_CHAIN, OP_MATRIX };

class MatrixBench : public Bench {
 public:
  using Bench::Bench;

  void setup() override {
    ASCHECK(allscanCommCreate(c.nccl, &comm_));
    if (opts.link == LINK_SET) ASCHECK(allscanSetLinkModel(comm_, opts.linkLatencyUs, opts.linkUsPerByte));
    if (opts.link == LINK_CALIBRATE && c.nranks > 1) ASCHECK(allscanCalibrate(comm_, c.stream));
    ASCHECK(allscanGetLinkModel(comm_, &lat_, &upb_, &isSet_));
    const size_t n = static_cast<size_t>(opts.n);
    const size_t maxCount = c.o->maxBytes / c.es;
    const size_t maxBatch = maxCount / (n * n);
    CUDACHECK(cudaMalloc(&x_, std::max<size_t>(maxCount, 1) * c.es));
    CUDACHECK(cudaMalloc(&y_, std::max<size_t>(maxCount, 1) * c.es));
    CUDACHECK(cudaMalloc(&recv_, std::max<size_t>(maxCount, 1) * c.es));
    CUDACHECK(cudaMalloc(&m_, std::max<size_t>(maxBatch * n * n, 1) * sizeof(float)));
    launchFillX(c.o->dtype, x_, maxCount, c.rank, c.stream);
    if (maxBatch > 0) {
      fillMKernel<<<gridFor(maxBatch * n * n), 256, 0, c.stream>>>(m_, maxBatch, n, c.rank);
      CUDACHECK(cudaGetLastError());
    }
  }

  std::vector<std::string> header() override {
    std::vector<std::string> lines;
    char buf[512];
    snprintf(buf, sizeof(buf),
             "#  dtype %s  reverse %d  state [batch, %d, %d], transition [batch, %d, %d] fp32 (exact: signed "
             "permutations x {2, 1/2, 1, 0})",
             dtypeName(c.o->dtype), opts.reverse, opts.n, opts.n, opts.n, opts.n);
    lines.push_back(buf);
    std::string ks = "auto";
    for (int k : opts.fixedK) ks += "," + std::to_string(k);
    std::string ms;
    for (auto m : opts.methods) ms += (ms.empty() ? "" : ",") + std::string(methodName(m));
    lines.push_back("#  methods " + ms + "  K " + ks);
    if (isSet_)
      snprintf(buf, sizeof(buf), "#  link model (%s): latency %.3f us, %.6g us/byte (%.1f GB/s)",
               opts.link == LINK_SET ? "-L" : "calibrated", lat_, upb_, 1e-3 / upb_);
    else
      snprintf(buf, sizeof(buf), "#  link model: none (the automatic K is 1)");
    lines.push_back(buf);
    return lines;
  }

  std::vector<Row> rows(size_t count) override {
    const size_t n = static_cast<size_t>(opts.n);
    batch_ = count / (n * n);
    const std::string shapeSkip = count % (n * n) != 0
                                      ? "size is not a whole number of [" + std::to_string(n) + ", " +
                                            std::to_string(n) + "] states"
                                      : "";
    std::vector<Row> rows;
    Row floor;
    floor.kind = OP_CHAIN;
    floor.name = "p2p-chain";
    floor.floorRank = 1;
    floor.jsonFields = ",\"method\":null,\"K\":null,\"K_auto\":false";
    rows.push_back(floor);
    for (auto m : opts.methods) {
      std::vector<int> Ks = {0};
      if (m == allscanPipelined) Ks.insert(Ks.end(), opts.fixedK.begin(), opts.fixedK.end());
      for (int K : Ks) {
        Row r;
        r.kind = OP_MATRIX;
        r.method = m;
        r.K = K;
        r.name = std::string("matrix-") + methodName(m);
        r.inSummary = m == allscanPipelined && K == 0;
        r.skip = shapeSkip;
        int blocks = 1;
        if (r.skip.empty()) {
          allscanMatrixScanArgs_t a = args(r);
          if (allscanMatrixCheckArgs(comm_, &a) != allscanSuccess) r.skip = allscanGetLastError();
          int want = K;
          if (m == allscanPipelined && K == 0) ASCHECK(allscanChooseNumBlocks(comm_, count * c.es, &want));
          if (m == allscanPipelined) ASCHECK(allscanMatrixBlocks(batch_, n, n, want, &blocks, nullptr));
        }
        if (m != allscanPipelined) r.kLabel = "1";
        else if (K == 0) r.kLabel = "auto:" + std::to_string(blocks);
        else r.kLabel = std::to_string(blocks);
        r.jsonFields = ",\"method\":\"" + std::string(methodName(m)) + "\",\"K\":" + std::to_string(blocks) +
                       ",\"K_auto\":" + (K == 0 ? "true" : "false");
        rows.push_back(r);
      }
    }
    const std::string tail = ",\"layout\":[" + std::to_string(batch_) + "," + std::to_string(n) + "," +
                             std::to_string(n) + "],\"transition\":\"float\"";
    for (Row& r : rows) r.jsonTail = tail;
    return rows;
  }

  void prepare(const std::vector<Row>& rows, size_t) override {
    size_t need = 0;
    for (const Row& r : rows) {
      if (r.kind != OP_MATRIX || !r.skip.empty()) continue;
      allscanMatrixScanArgs_t a = args(r);
      size_t b = 0;
      ASCHECK(allscanMatrixWorkspaceSize(comm_, &a, &b));
      need = std::max(need, b);
    }
    if (need > wsBytes_) {
      if (ws_) CUDACHECK(cudaFree(ws_));
      CUDACHECK(cudaMalloc(&ws_, need));
      wsBytes_ = need;
    }
  }

  void launch(const Row& r, size_t count) override {
    if (r.kind == OP_CHAIN) {
      ASCHECK(allscanNeighborExchange(comm_, x_, recv_, count * c.es, opts.reverse, 1, c.stream));
      return;
    }
    allscanMatrixScanArgs_t a = args(r);
    ASCHECK(allscanMatrixScan(comm_, &a, ws_, wsBytes_, c.stream));
  }

  void check(const Row& r, size_t count, unsigned long long* wrong) override {
    CheckParams p;
    p.chain = r.kind == OP_CHAIN ? 1 : 0;
    p.rank = c.rank;
    p.nranks = c.nranks;
    p.reverse = opts.reverse;
    p.count = count;
    p.n = static_cast<size_t>(opts.n);
    void* out = r.kind == OP_CHAIN ? recv_ : y_;
    CUDACHECK(cudaMemsetAsync(out, 0xff, count * c.es, c.stream));
    launch(r, count);
    if (c.nranks == 1 && r.kind == OP_CHAIN) return;  // one rank sends nothing
    dispatchDtype(c.o->dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      checkKernel<T><<<gridFor(count), 256, 0, c.stream>>>(static_cast<const T*>(out), p, wrong);
    });
    CUDACHECK(cudaGetLastError());
  }

  void teardown() override {
    if (ws_) CUDACHECK(cudaFree(ws_));
    CUDACHECK(cudaFree(x_));
    CUDACHECK(cudaFree(y_));
    CUDACHECK(cudaFree(recv_));
    CUDACHECK(cudaFree(m_));
    ASCHECK(allscanCommDestroy(comm_));
  }

  std::string configJson() override {
    std::string ks;
    for (int k : opts.fixedK) ks += (ks.empty() ? "" : ",") + std::to_string(k);
    std::string ms;
    for (auto m : opts.methods) ms += std::string(ms.empty() ? "" : ",") + "\"" + methodName(m) + "\"";
    return ",\"reverse\":" + std::to_string(opts.reverse) + ",\"vdim\":" + std::to_string(opts.n) +
           ",\"methods\":[" + ms + "],\"fixed_K\":[" + ks + "]";
  }

  std::string topJson() override {
    const char* source = opts.link == LINK_SET ? "-L" : (opts.link == LINK_CALIBRATE ? "calibrate" : "none");
    return std::string("\"link_model\":{\"set\":") + (isSet_ ? "true" : "false") + ",\"source\":\"" + source +
           "\",\"latency_us\":" + jsonNumber(lat_) + ",\"us_per_byte\":" + jsonNumber(upb_) + "},\n";
  }

 private:
  allscanMatrixScanArgs_t args(const Row& r) const {
    allscanMatrixScanArgs_t a;
    memset(&a, 0, sizeof(a));
    a.x = x_;
    a.y = y_;
    a.batch = batch_;
    a.k = static_cast<size_t>(opts.n);
    a.v = static_cast<size_t>(opts.n);
    a.dtype = c.o->dtype;
    a.m = m_;
    a.m_dtype = allscanFloat32;
    a.reverse = opts.reverse;
    a.num_blocks = r.method == allscanPipelined ? r.K : 0;
    a.method = static_cast<allscanMethod_t>(r.method);
    return a;
  }

  allscanComm_t comm_ = nullptr;
  double lat_ = 0, upb_ = 0;
  int isSet_ = 0;
  size_t batch_ = 0;
  void* x_ = nullptr;
  void* y_ = nullptr;
  void* recv_ = nullptr;
  float* m_ = nullptr;
  void* ws_ = nullptr;
  size_t wsBytes_ = 0;
};

}  // namespace

extern const Collective kMatrixCollective;  // registered in collectives.cpp
const Collective kMatrixCollective = {
    "matrix",
    "Matrix-transition All-Scan benchmark",
    "the matrix All-Scan (allscanMatrixScan, y_{p+1} = M_p @ y_p + x_p; every method, the all-gather\n"
    "one being fla's context-parallel pattern) against the floor (neighbour send/recv of the same\n"
    "bytes); the size is one state's bytes, [batch, n, n] with -V n",
    "matrix-pipelined, auto K",
    {{'K', "blocks", required_argument, "<list>",
      "pipelined block counts: 'auto' or comma-separated integers 1..64;\n"
      "                              the automatic K is always timed (default auto)"},
     {'m', "methods", required_argument, "<list>", "scan methods: pipelined,serial,allgather or all (default all)"},
     {'r', "reverse", optional_argument, "0|1", "reverse scan (rank p+1 -> p); -r alone means 1 (default 0)"},
     {'V', "vdim", required_argument, "<n>", "the state's K = V (state [batch, n, n]; default 128)"},
     {'L', "link_model", required_argument, "<m>",
      "calibrate | none | <latency_us>,<us_per_byte>: the link model\n"
      "                              that chooses the automatic K (default calibrate)"}},
    parse,
    validate,
    [](RankCtx& c) -> std::unique_ptr<Bench> { return std::make_unique<MatrixBench>(c); }};

}  // namespace perf
