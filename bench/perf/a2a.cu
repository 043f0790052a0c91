// allscan_perf -o a2a: the chunked all-to-all rows (csrc/a2a_chunked, Ulysses' head all-to-all).
//   nccl-alltoall   the floor: every rank sends size/P bytes to every rank and receives as many, one
//                   NCCL group of ncclSend/ncclRecv pairs (what ncclAllToAll and nccl-tests' alltoall do)
//   a2a-scatter     allscanA2A scatter-heads of -C tensors [B, S_local, H, D] (q, k, v), the heads cut
//                   into each -k chunk count, one call per chunk
//   a2a-gather      allscanA2A gather-heads, its inverse
// The size is the bytes one rank holds of one call's tensors in the sequence-sharded layout,
// C * B * S_local * H * D * element size: S_local is the largest that fits in it.
#include <allscan/a2a_chunked.h>
#include <getopt.h>

#include <algorithm>
#include <cstring>

#include "harness.h"

namespace perf {
namespace {

struct A2AOptions {
  int heads = 32;
  int headDim = 128;
  int batch = 1;
  int tensors = 3;
  std::vector<int> chunks = {1};
  std::vector<allscanA2ADirection_t> directions = {allscanA2AScatterHeads, allscanA2AGatherHeads};
  SignatureRows signature;  // -S
} opts;

const char* directionName(int d) { return d == allscanA2AScatterHeads ? "scatter" : "gather"; }

void parse(int letter, const char* arg) {
  switch (letter) {
    case 'H': opts.heads = static_cast<int>(parseInt("-H (heads)", arg, 1, 1 << 16, "a head count >= 1")); break;
    case 'A': opts.headDim = static_cast<int>(parseInt("-A (head_dim)", arg, 1, 1 << 16, "a head dimension >= 1")); break;
    case 'B': opts.batch = static_cast<int>(parseInt("-B (batch)", arg, 1, 1 << 16, "a batch size >= 1")); break;
    case 'C':
      opts.tensors = static_cast<int>(parseInt("-C (tensors)", arg, 1, ALLSCAN_A2A_MAX_TENSORS,
                                               ("a tensor count 1.." + std::to_string(ALLSCAN_A2A_MAX_TENSORS)).c_str()));
      break;
    case 'k': {
      opts.chunks.clear();
      for (const auto& t : splitList(arg)) {
        const int k = static_cast<int>(parseInt("-k (chunks)", t.c_str(), 1, 1 << 16,
                                                "a comma-separated list of head chunk counts >= 1"));
        if (std::find(opts.chunks.begin(), opts.chunks.end(), k) == opts.chunks.end()) opts.chunks.push_back(k);
      }
      break;
    }
    case 'S': parseSignatureRows(&opts.signature, arg); break;
    case 'T': {
      opts.directions.clear();
      for (const auto& t : splitList(arg)) {
        std::vector<allscanA2ADirection_t> add;
        if (t == "scatter") add = {allscanA2AScatterHeads};
        else if (t == "gather") add = {allscanA2AGatherHeads};
        else if (t == "all") add = {allscanA2AScatterHeads, allscanA2AGatherHeads};
        else argError("-T (directions): expected a comma-separated list of scatter, gather (or all), got '" + t + "'");
        for (auto d : add)
          if (std::find(opts.directions.begin(), opts.directions.end(), d) == opts.directions.end())
            opts.directions.push_back(d);
      }
      break;
    }
  }
}

void validate(const Options&) {
  for (int k : opts.chunks)
    if (k > opts.heads)
      argError("-k (chunks): " + std::to_string(k) + " chunks of " + std::to_string(opts.heads) +
               " heads (-H) would leave a chunk without heads");
}

// ------------------------------------------------------------------------------------------------
// Exact values and the GPU-side checks. Rank p's sequence-sharded input holds xval(p, e) at element
// e of the call (the -C tensors back to back); every output is a permutation of inputs, compared
// exactly (the NaN pre-fill counts as wrong).
// ------------------------------------------------------------------------------------------------

// One tensor's piece of one chunk in the head-sharded layout [B, P*S_local, n, D]: heads
// [lo, lo + n) of the tensor at element offset `base` of every rank's sequence-sharded input.
struct HeadPiece {
  size_t base;  // element offset of the tensor in the call's input
  int B, Sl, P, n, lo, H, D;
};

// fill = 1: write the values scatter-heads produces (gather's input); 0: count the elements that differ.
template <typename T>
__global__ void headLayoutKernel(T* buf, HeadPiece hp, int fill, unsigned long long* wrong) {
  const size_t total = static_cast<size_t>(hp.B) * hp.P * hp.Sl * hp.n * hp.D;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t d = i % hp.D;
    const size_t row = i / hp.D;
    const size_t jj = row % hp.n;
    const size_t bs = row / hp.n;
    const size_t sg = bs % (static_cast<size_t>(hp.P) * hp.Sl);
    const size_t b = bs / (static_cast<size_t>(hp.P) * hp.Sl);
    const int p = static_cast<int>(sg / hp.Sl);
    const size_t s = sg % hp.Sl;
    const size_t e = hp.base + ((b * hp.Sl + s) * hp.H + hp.lo + jj) * hp.D + d;
    const float expect = xval(p, e);
    if (fill) buf[i] = fromFloat<T>(expect);
    else if (!(toDouble<T>(buf[i]) == static_cast<double>(expect))) ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

// out[q*per + i] == xval(srcOf(q), offset(q) + i): the sequence-sharded result of gather-heads
// (per = count, one source: this rank) or the all-to-all floor (per = count/P, source q, offset rank*per).
template <typename T>
__global__ void sourceCheckKernel(const T* out, size_t per, int nsrc, int rank, int alltoall, unsigned long long* wrong) {
  const size_t total = per * static_cast<size_t>(nsrc);
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int q = static_cast<int>(i / per);
    const size_t k = i - static_cast<size_t>(q) * per;
    const float expect = alltoall ? xval(q, static_cast<size_t>(rank) * per + k) : xval(rank, k);
    if (!(toDouble<T>(out[i]) == static_cast<double>(expect))) ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

// ------------------------------------------------------------------------------------------------
// One rank's rows
// ------------------------------------------------------------------------------------------------
enum Kind { KIND_FLOOR = 0, KIND_A2A = 1 };

// The calls of one (direction, chunk count) row at the current size.
struct Plan {
  allscanA2ADirection_t dir;
  int chunks;
  std::vector<std::vector<int>> lo, hi;  // per chunk: the head map over ranks
  std::vector<allscanA2AArgs_t> calls;   // per chunk
  std::vector<HeadPiece> pieces;         // per chunk and tensor: this rank's head-sharded output
  std::vector<size_t> pieceOffset;       // element offset of each piece in the head buffer
};

class A2ABench : public Bench {
 public:
  using Bench::Bench;

  size_t count(size_t size) override {
    requested_ = size;
    seqLocal_ = size / tokenBytes();
    return seqLocal_ * tokenBytes() / c.es;
  }

  void setup() override {
    const int P = c.nranks;
    ASCHECK(allscanCommCreate(c.nccl, &comm_));  // the signed rows' signature table and status
    // The most heads this rank holds over the chunks of any -k: sizes the head-sharded buffer.
    size_t maxHeads = 0;
    for (int k : opts.chunks) {
      size_t mine = 0;
      for (const auto& hm : chunkMaps(k)) mine += static_cast<size_t>(hm.second[c.rank] - hm.first[c.rank]);
      maxHeads = std::max(maxHeads, mine);
    }
    const size_t maxSl = c.o->maxBytes / tokenBytes();
    const size_t seqBytes = maxSl * tokenBytes();
    const size_t headBytes = static_cast<size_t>(opts.tensors) * opts.batch * P * maxSl * maxHeads * opts.headDim * c.es;
    CUDACHECK(cudaMalloc(&seqIn_, std::max<size_t>(seqBytes, 16)));
    CUDACHECK(cudaMalloc(&seqOut_, std::max<size_t>(seqBytes, 16)));
    CUDACHECK(cudaMalloc(&recv_, std::max<size_t>(seqBytes, 16)));
    CUDACHECK(cudaMalloc(&head_, std::max<size_t>(headBytes, 16)));
    launchFillX(c.o->dtype, seqIn_, seqBytes / c.es, c.rank, c.stream);
  }

  std::vector<std::string> header() override {
    std::string ks, ds;
    for (int k : opts.chunks) ks += (ks.empty() ? "" : ",") + std::to_string(k);
    for (auto d : opts.directions) ds += (ds.empty() ? "" : ",") + std::string(directionName(d));
    char buf[512];
    snprintf(buf, sizeof(buf), "#  dtype %s  tensors %d x [B %d, S_local, H %d, D %d]  directions %s  chunks %s",
             dtypeName(c.o->dtype), opts.tensors, opts.batch, opts.heads, opts.headDim, ds.c_str(), ks.c_str());
    return {buf};
  }

  std::vector<Row> rows(size_t count) override {
    const int P = c.nranks;
    plans_.clear();
    std::string skip;
    if (seqLocal_ == 0)
      skip = std::to_string(requested_) + " bytes is less than one token of the call (" + std::to_string(tokenBytes()) +
             " bytes: -C x -B x -H x -A elements)";
    const std::string tail = ",\"batch\":" + std::to_string(opts.batch) + ",\"seq_local\":" + std::to_string(seqLocal_) +
                             ",\"heads\":" + std::to_string(opts.heads) + ",\"head_dim\":" +
                             std::to_string(opts.headDim) + ",\"tensors\":" + std::to_string(opts.tensors);
    std::vector<Row> rows;
    Row fl;
    fl.kind = KIND_FLOOR;
    fl.name = "nccl-alltoall";
    fl.busFactor = static_cast<double>(P - 1) / P;
    fl.floorRank = 1;
    fl.skip = skip;
    fl.jsonFields = ",\"method\":null,\"K\":null,\"K_auto\":false";
    fl.jsonTail = tail;
    rows.push_back(fl);
    for (auto dir : opts.directions) {
      for (int k : opts.chunks) {
        for (bool unsig : {false, true}) {
          if (unsig ? !opts.signature.off : !opts.signature.on) continue;
          Row r;
          r.kind = KIND_A2A;
          r.method = dir;
          r.K = static_cast<int>(plans_.size());
          r.unsigned_ = unsig;
          r.name = std::string("a2a-") + directionName(dir) + (unsig ? "-nosig" : "");
          r.kLabel = std::to_string(k);
          r.busFactor = static_cast<double>(P - 1) / P;
          r.inSummary = !unsig || !opts.signature.on;
          r.skip = skip;
          r.jsonFields = ",\"method\":\"" + std::string(directionName(dir)) + "\",\"K\":" + std::to_string(k) +
                         ",\"K_auto\":false,\"signature\":" + (unsig ? "false" : "true");
          r.jsonTail = tail;
          plans_.push_back(makePlan(dir, k, unsig));
          rows.push_back(r);
        }
      }
    }
    (void)count;
    return rows;
  }

  // Workspace: the largest any call needs at this size; gather's input: what scatter produces.
  void prepare(const std::vector<Row>& rows, size_t count) override {
    (void)rows, (void)count;
    if (seqLocal_ == 0) return;
    size_t need = 0;
    for (const auto& plan : plans_) {
      for (const allscanA2AArgs_t& a : plan->calls) {
        size_t b = 0;
        ASCHECK(allscanA2AWorkspaceSize(c.nranks, c.rank, plan->dir, &a, &b));
        need = std::max(need, b);
      }
      if (plan->dir == allscanA2AGatherHeads) fillHead(*plan, /*fill=*/1, nullptr);
    }
    if (need > wsBytes_) {
      if (ws_) CUDACHECK(cudaFree(ws_));
      CUDACHECK(cudaMalloc(&ws_, need));
      wsBytes_ = need;
    }
  }

  void launch(const Row& r, size_t count) override {
    if (r.kind == KIND_FLOOR) {
      const int P = c.nranks;
      const size_t per = count / P;
      const ncclDataType_t nt = allscanNcclDataType(c.o->dtype);
      NCCLCHECK(ncclGroupStart());
      for (int q = 0; q < P; ++q) {
        NCCLCHECK(ncclSend(static_cast<const char*>(seqIn_) + q * per * c.es, per, nt, q, c.nccl, c.stream));
        NCCLCHECK(ncclRecv(static_cast<char*>(recv_) + q * per * c.es, per, nt, q, c.nccl, c.stream));
      }
      NCCLCHECK(ncclGroupEnd());
      return;
    }
    const Plan& plan = *plans_[r.K];
    for (const allscanA2AArgs_t& a : plan.calls) ASCHECK(allscanA2A(c.nccl, plan.dir, &a, ws_, wsBytes_, c.stream));
  }

  void check(const Row& r, size_t count, unsigned long long* wrong) override {
    const allscanDataType_t t = c.o->dtype;
    if (r.kind == KIND_FLOOR) {
      const size_t per = count / c.nranks;
      CUDACHECK(cudaMemsetAsync(recv_, 0xff, per * c.nranks * c.es, c.stream));
      launch(r, count);
      launchSourceCheck(t, recv_, per, c.nranks, /*alltoall=*/1, wrong);
      return;
    }
    const Plan& plan = *plans_[r.K];
    if (plan.dir == allscanA2AScatterHeads) {
      CUDACHECK(cudaMemsetAsync(head_, 0xff, headElems(plan) * c.es, c.stream));
      launch(r, count);
      fillHead(plan, /*fill=*/0, wrong);
    } else {
      CUDACHECK(cudaMemsetAsync(seqOut_, 0xff, count * c.es, c.stream));
      fillHead(plan, /*fill=*/1, nullptr);  // a scatter row's check may have left NaN behind
      launch(r, count);
      launchSourceCheck(t, seqOut_, count, 1, /*alltoall=*/0, wrong);
    }
  }

  void teardown() override {
    ASCHECK(allscanCommDestroy(comm_));
    if (ws_) CUDACHECK(cudaFree(ws_));
    CUDACHECK(cudaFree(seqIn_));
    CUDACHECK(cudaFree(seqOut_));
    CUDACHECK(cudaFree(recv_));
    CUDACHECK(cudaFree(head_));
  }

  std::string configJson() override {
    std::string ks, ds;
    for (int k : opts.chunks) ks += (ks.empty() ? "" : ",") + std::to_string(k);
    for (auto d : opts.directions) ds += std::string(ds.empty() ? "" : ",") + "\"" + directionName(d) + "\"";
    return ",\"heads\":" + std::to_string(opts.heads) + ",\"head_dim\":" + std::to_string(opts.headDim) +
           ",\"batch\":" + std::to_string(opts.batch) + ",\"tensors\":" + std::to_string(opts.tensors) +
           ",\"chunks\":[" + ks + "],\"directions\":[" + ds + "],\"signature\":\"" + opts.signature.label() + "\"";
  }

 private:
  // Bytes of one token of the call: -C tensors x B x H x D elements.
  size_t tokenBytes() const {
    return static_cast<size_t>(opts.tensors) * opts.batch * opts.heads * opts.headDim * c.es;
  }

  // Heads [0, H) cut into k chunks, each chunk's heads split over the ranks (allscanA2ASplitHeads,
  // as the Python layer splits them): per chunk, (lo[], hi[]).
  std::vector<std::pair<std::vector<int>, std::vector<int>>> chunkMaps(int k) const {
    const int P = c.nranks;
    std::vector<int> clo(k), chi(k);
    ASCHECK(allscanA2ASplitHeads(0, opts.heads, k, clo.data(), chi.data()));
    std::vector<std::pair<std::vector<int>, std::vector<int>>> maps;
    for (int j = 0; j < k; ++j) {
      std::vector<int> lo(P), hi(P);
      ASCHECK(allscanA2ASplitHeads(clo[j], chi[j], P, lo.data(), hi.data()));
      maps.emplace_back(lo, hi);
    }
    return maps;
  }

  std::unique_ptr<Plan> makePlan(allscanA2ADirection_t dir, int k, bool unsig) const {
    auto plan = std::make_unique<Plan>();
    plan->dir = dir;
    plan->chunks = k;
    for (auto& hm : chunkMaps(k)) {
      plan->lo.push_back(hm.first);
      plan->hi.push_back(hm.second);
    }
    const int P = c.nranks, Sl = static_cast<int>(seqLocal_);
    const size_t tensorElems = static_cast<size_t>(opts.batch) * Sl * opts.heads * opts.headDim;
    size_t off = 0;
    for (int j = 0; j < k; ++j) {
      allscanA2AArgs_t a;
      memset(&a, 0, sizeof(a));
      a.batch = opts.batch;
      a.seq_local = Sl;
      a.head_dim = opts.headDim;
      a.dtype = c.o->dtype;
      a.num_tensors = opts.tensors;
      a.check_comm = unsig ? nullptr : comm_;
      a.signature = unsig ? 0 : kPerfSignature;
      const int n = plan->hi[j][c.rank] - plan->lo[j][c.rank];
      for (int t = 0; t < opts.tensors; ++t) {
        char* seq = static_cast<char*>(dir == allscanA2AScatterHeads ? seqIn_ : seqOut_) + t * tensorElems * c.es;
        char* head = static_cast<char*>(head_) + off * c.es;
        allscanA2ATensor_t& x = a.tensors[t];
        x.input = dir == allscanA2AScatterHeads ? static_cast<const void*>(seq) : head;
        x.output = dir == allscanA2AScatterHeads ? static_cast<void*>(head) : seq;
        x.num_heads = opts.heads;
        x.head_lo = plan->lo[j].data();
        x.head_hi = plan->hi[j].data();
        plan->pieces.push_back(HeadPiece{t * tensorElems, opts.batch, Sl, P, n, plan->lo[j][c.rank], opts.heads,
                                         opts.headDim});
        plan->pieceOffset.push_back(off);
        off += static_cast<size_t>(opts.batch) * P * Sl * n * opts.headDim;
      }
      plan->calls.push_back(a);
    }
    return plan;
  }

  size_t headElems(const Plan& plan) const {
    size_t n = 0;
    for (const HeadPiece& hp : plan.pieces) n += static_cast<size_t>(hp.B) * hp.P * hp.Sl * hp.n * hp.D;
    return n;
  }

  // Writes (fill = 1) or checks (fill = 0) the head-sharded layout scatter-heads produces.
  void fillHead(const Plan& plan, int fill, unsigned long long* wrong) {
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      const HeadPiece& hp = plan.pieces[i];
      const size_t total = static_cast<size_t>(hp.B) * hp.P * hp.Sl * hp.n * hp.D;
      if (total == 0) continue;
      dispatchDtype(c.o->dtype, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        headLayoutKernel<T><<<gridFor(total), 256, 0, c.stream>>>(static_cast<T*>(head_) + plan.pieceOffset[i], hp,
                                                                  fill, wrong);
      });
      CUDACHECK(cudaGetLastError());
    }
  }

  void launchSourceCheck(allscanDataType_t t, const void* out, size_t per, int nsrc, int alltoall,
                         unsigned long long* wrong) {
    if (per == 0) return;
    dispatchDtype(t, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      sourceCheckKernel<T><<<gridFor(per * nsrc), 256, 0, c.stream>>>(static_cast<const T*>(out), per, nsrc, c.rank,
                                                                       alltoall, wrong);
    });
    CUDACHECK(cudaGetLastError());
  }

  allscanComm_t comm_ = nullptr;
  size_t requested_ = 0;
  size_t seqLocal_ = 0;
  std::vector<std::unique_ptr<Plan>> plans_;
  void* seqIn_ = nullptr;   // [C][B, S_local, H, D]: xval(rank, e)
  void* seqOut_ = nullptr;  // gather-heads' output
  void* recv_ = nullptr;    // the floor's receive buffer
  void* head_ = nullptr;    // scatter-heads' output, gather-heads' input: per chunk, per tensor [B, P*S_local, n, D]
  void* ws_ = nullptr;
  size_t wsBytes_ = 0;
};

}  // namespace

extern const Collective kA2ACollective;  // registered in collectives.cpp
const Collective kA2ACollective = {
    "a2a",
    "chunked all-to-all benchmark",
    "the chunked all-to-all of Ulysses attention (allscanA2A scatter-heads and gather-heads\n"
    "of -C tensors [B, S_local, H, D]) against the floor, an all-to-all of the same bytes as one NCCL\n"
    "group of send/recv pairs; the size is one rank's bytes of a call's tensors (C*B*S_local*H*D)",
    "a2a-scatter and a2a-gather rows",
    {{'H', "heads", required_argument, "<n>", "heads H of every tensor (default 32)"},
     {'A', "head_dim", required_argument, "<n>", "head dimension D (default 128)"},
     {'B', "batch", required_argument, "<n>", "batch B (default 1)"},
     {'C', "tensors", required_argument, "<n>", "tensors per call, 1..4 (default 3: q, k, v)"},
     {'k', "chunks", required_argument, "<list>",
      "head chunk counts, comma-separated: the heads cut into k chunks,\n"
      "                              one call each, back to back (default 1)"},
     {'T', "directions", required_argument, "<list>", "scatter,gather or all (default all)"},
     kSignatureOption},
    parse,
    validate,
    [](RankCtx& c) -> std::unique_ptr<Bench> { return std::make_unique<A2ABench>(c); }};

}  // namespace perf
