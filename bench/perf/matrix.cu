// allscan_perf -o matrix: the matrix-transition All-Scan rows (allscanMatrixScan).
//   p2p-chain         the floor: allscanNeighborExchange(chain=1), the bare send of the same bytes
//   matrix-pipelined  allscanMatrixScan, automatic block count and every fixed -K
//   matrix-serial     allscanMatrixScan, one block
//   matrix-allgather  allscanMatrixScan, all-gather of x and M and a local fold (fla's CP pattern)
// The state is [batch, n, n] (-V n, default 128: K = V = 128), batch = size / (n*n*element), the
// transition [batch, n, n] fp32.
#include <getopt.h>

#include <algorithm>
#include <cstring>

#include "chain.h"
#include "harness.h"

namespace perf {
namespace {

struct MatrixOptions {
  ChainOptions chain;  // -K, -m, -r, -L
  int n = 128;         // K = V = n
} opts;

void parse(int letter, const char* arg) {
  if (parseChainOption(&opts.chain, letter, arg)) return;
  if (letter == 'V') opts.n = static_cast<int>(parseInt("-V (vdim)", arg, 1, 4096, "the state's K = V, 1..4096"));
}

void validate(const Options&) {
  validateChainOptions(opts.chain);
  for (auto m : opts.chain.methods)
    if (m == allscanDevice) argError("-m (methods): device serves the diagonal scan (-o scan) only");
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

class MatrixBench : public ChainBench {
 public:
  explicit MatrixBench(RankCtx& ctx) : ChainBench(ctx, opts.chain) {}

  void setup() override {
    setupChain();
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
             dtypeName(c.o->dtype), opts.chain.reverse, opts.n, opts.n, opts.n, opts.n);
    lines.push_back(buf);
    for (const std::string& l : chainHeaderLines()) lines.push_back(l);
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
    for (Row& r : methodRows(opts.chain, "matrix", OP_MATRIX)) {
      const auto m = static_cast<allscanMethod_t>(r.method);
      r.skip = shapeSkip;
      int blocks = 1;
      if (r.skip.empty()) {
        allscanMatrixScanArgs_t a = args(r);
        if (allscanMatrixCheckArgs(comm_, &a) != allscanSuccess) r.skip = allscanGetLastError();
        int want = r.K;
        if (m == allscanPipelined && r.K == 0) ASCHECK(allscanChooseNumBlocks(comm_, count * c.es, &want));
        if (m == allscanPipelined) ASCHECK(allscanMatrixBlocks(batch_, n, n, want, &blocks, nullptr));
      }
      labelScanRow(&r, m, r.K, blocks);
      rows.push_back(r);
    }
    const std::string tail = ",\"layout\":[" + std::to_string(batch_) + "," + std::to_string(n) + "," +
                             std::to_string(n) + "],\"transition\":\"float\"";
    for (Row& r : rows) r.jsonTail = tail;
    return rows;
  }

  void prepare(const std::vector<Row>& rows, size_t) override {
    ws_.reserve(rows, OP_MATRIX, [&](const Row& r) {
      allscanMatrixScanArgs_t a = args(r);
      size_t b = 0;
      ASCHECK(allscanMatrixWorkspaceSize(comm_, &a, &b));
      return b;
    });
  }

  void launch(const Row& r, size_t count) override {
    if (r.kind == OP_CHAIN) {
      ASCHECK(allscanNeighborExchange(comm_, x_, recv_, count * c.es, opts.chain.reverse, 1, c.stream));
      return;
    }
    allscanMatrixScanArgs_t a = args(r);
    ASCHECK(allscanMatrixScan(comm_, &a, ws_.ptr, ws_.bytes, c.stream));
  }

  void check(const Row& r, size_t count, unsigned long long* wrong) override {
    CheckParams p;
    p.chain = r.kind == OP_CHAIN ? 1 : 0;
    p.rank = c.rank;
    p.nranks = c.nranks;
    p.reverse = opts.chain.reverse;
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
    CUDACHECK(cudaFree(m_));
    teardownChain();
  }

  std::string configJson() override {
    return ",\"reverse\":" + std::to_string(opts.chain.reverse) + ",\"vdim\":" + std::to_string(opts.n) +
           chainConfigJson(opts.chain);
  }

 private:
  allscanMatrixScanArgs_t args(const Row& r) const {
    allscanMatrixScanArgs_t a;
    memset(&a, 0, sizeof(a));
    a.batch = batch_;
    a.k = static_cast<size_t>(opts.n);
    a.v = static_cast<size_t>(opts.n);
    a.dtype = c.o->dtype;
    a.m = m_;
    a.m_dtype = allscanFloat32;
    setRowArgs(&a, r);
    return a;
  }

  size_t batch_ = 0;
  float* m_ = nullptr;
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
    {kBlocksOption,
     kMethodsOption,
     kReverseOption,
     kSignatureOption,
     {'V', "vdim", required_argument, "<n>", "the state's K = V (state [batch, n, n]; default 128)"},
     kLinkModelOption},
    parse,
    validate,
    [](RankCtx& c) -> std::unique_ptr<Bench> { return std::make_unique<MatrixBench>(c); }};

}  // namespace perf
