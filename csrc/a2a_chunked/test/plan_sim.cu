// Host-only check of the chunked all-to-all's plan (no GPU needed): every rank's plan is built with
// host buffers, the pack/unpack segments and summations are executed on the host with the kernels'
// semantics, and the NCCL transfers are matched pairwise in issue order, as NCCL matches them. The
// results are compared with the contract of include/allscan/a2a_chunked.h.
//
//   nvcc -std=c++17 -I csrc -I csrc/common/include -I csrc/allscan/include -I csrc/a2a_chunked/include \
//        -I <nccl include> csrc/a2a_chunked/test/plan_sim.cu -o plan_sim && ./plan_sim
// (links nothing from NCCL or CUDA at run time beyond what the compiled TU references: the kernels
// are never launched.)
#include "../a2a_chunked.cu"
#include "common/error.cpp"
#include "common/watch.cpp"
#include "common/signature.cu"

// The scan core is not linked here; these simulated calls never set check_comm.
allscan::detail::SignatureTable* allscan::detail::signaturesOf(const allscanComm*) { return nullptr; }
ncclComm_t allscan::detail::ncclOf(const allscanComm*) { return nullptr; }
allscanResult_t allscan::detail::storedFailure(const allscanComm*) { return allscanSuccess; }

#include <cstdlib>
#include <map>
#include <random>

namespace {

struct Case {
  int P, B, Sl, D;
  allscanDataType_t dtype;
  allscanA2ADirection_t dir;
  std::vector<int> H;                                  // per tensor
  std::vector<std::vector<std::pair<int, int>>> maps;  // per tensor, per rank
  std::vector<int> acc;                                // per tensor
};

void hostCopy(const CopySeg& s, int B, int64_t row) {
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < s.S; ++i)
      for (int h = 0; h < s.n; ++h)
        std::memcpy(s.dst + b * s.dst_sb + i * s.dst_ss + h * row, s.src + b * s.src_sb + i * s.src_ss + h * row, row);
}

template <typename T>
void hostSum(const SumBatch& sb) {
  const int64_t row = static_cast<int64_t>(sb.D) * sizeof(T);
  for (int b = 0; b < sb.B; ++b)
    for (int s = 0; s < sb.S; ++s)
      for (int h = sb.h_begin; h < sb.h_end; ++h)
        for (int d = 0; d < sb.D; ++d) {
          T* out = reinterpret_cast<T*>(sb.out) + ((static_cast<int64_t>(b) * sb.S + s) * sb.H + h) * sb.D + d;
          double acc = 0;
          bool any = false;
          if (sb.accumulate) {
            acc = *out;
            any = true;
          }
          for (int r = 0; r < sb.num; ++r) {
            const SumPiece& p = sb.piece[r];
            if (h >= p.lo && h < p.hi) {
              acc += reinterpret_cast<const T*>(p.ptr + b * p.sb + s * p.ss + (h - p.lo) * row)[d];
              any = true;
            }
          }
          if (any) *out = static_cast<T>(acc);
        }
}

int runCase(const Case& c, int idx) {
  const int P = c.P, T = static_cast<int>(c.H.size());
  const int64_t es = dtypeSize(c.dtype);
  const int64_t S = static_cast<int64_t>(c.Sl) * P;
  std::mt19937 rng(idx);
  // Element values: float / double, small integers so that sums are exact.
  auto val = [&](int64_t) { return static_cast<double>(static_cast<int>(rng() % 17) - 8); };
  auto store = [&](char* p, int64_t i, double x) {
    if (es == 4) reinterpret_cast<float*>(p)[i] = static_cast<float>(x);
    else if (es == 8) reinterpret_cast<double*>(p)[i] = x;
    else reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(static_cast<int>(x) & 0xffff);
  };
  auto load = [&](const char* p, int64_t i) -> double {
    if (es == 4) return reinterpret_cast<const float*>(p)[i];
    if (es == 8) return reinterpret_cast<const double*>(p)[i];
    return static_cast<double>(static_cast<int16_t>(reinterpret_cast<const uint16_t*>(p)[i]));
  };
  std::vector<std::vector<int>> lo(T, std::vector<int>(P)), hi(T, std::vector<int>(P));
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < P; ++r) {
      lo[t][r] = c.maps[t][r].first;
      hi[t][r] = c.maps[t][r].second;
    }
  // Buffers: in[r][t], out[r][t], ws[r]; initial outputs hold values (to check accumulate / untouched heads).
  std::vector<std::vector<std::vector<char>>> in(P, std::vector<std::vector<char>>(T)), out = in, out0;
  std::vector<std::vector<char>> ws(P);
  std::vector<allscanA2AArgs_t> args(P);
  std::vector<Plan> plans(P);
  for (int r = 0; r < P; ++r) {
    allscanA2AArgs_t& a = args[r];
    std::memset(&a, 0, sizeof(a));
    a.batch = c.B;
    a.seq_local = c.Sl;
    a.head_dim = c.D;
    a.dtype = c.dtype;
    a.num_tensors = T;
    for (int t = 0; t < T; ++t) {
      const int64_t n = hi[t][r] - lo[t][r];
      const int64_t seq_elems = static_cast<int64_t>(c.B) * c.Sl * c.H[t] * c.D;
      const int64_t head_elems = static_cast<int64_t>(c.B) * S * n * c.D;
      const int64_t ni = c.dir == allscanA2AScatterHeads ? seq_elems : head_elems;
      const int64_t no = c.dir == allscanA2AScatterHeads ? head_elems : seq_elems;
      in[r][t].resize(ni * es + 16);
      out[r][t].resize(no * es + 16);
      for (int64_t i = 0; i < ni; ++i) store(in[r][t].data(), i, val(i));
      for (int64_t i = 0; i < no; ++i) store(out[r][t].data(), i, val(i));
      a.tensors[t].input = in[r][t].data();
      a.tensors[t].output = out[r][t].data();
      a.tensors[t].num_heads = c.H[t];
      a.tensors[t].head_lo = lo[t].data();
      a.tensors[t].head_hi = hi[t].data();
      a.tensors[t].accumulate = c.acc.empty() ? 0 : c.acc[t];
    }
    if (checkArgs(P, r, c.dir, &a, true) != allscanSuccess) {
      std::printf("case %d: checkArgs failed: %s\n", idx, allscanGetLastError());
      return 1;
    }
    Plan sz;
    buildPlan(P, r, c.dir, &a, nullptr, &sz);
    ws[r].resize(sz.workspace_bytes + kAlign);
    char* base = ws[r].data();
    base += (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
    buildPlan(P, r, c.dir, &a, base, &plans[r]);
    if (plans[r].workspace_bytes != sz.workspace_bytes) {
      std::printf("case %d: workspace size differs between size query and run\n", idx);
      return 1;
    }
  }
  out0 = out;
  for (int r = 0; r < P; ++r) {
    for (const CopySeg& s : plans[r].pack) hostCopy(s, c.B, plans[r].row_bytes);
  }
  // NCCL matching: the k-th send from a to b meets the k-th receive on b from a.
  std::map<std::pair<int, int>, std::vector<const Transfer*>> sends, recvs;
  for (int r = 0; r < P; ++r)
    for (const Transfer& t : plans[r].xfers) {
      if (t.send_bytes) sends[{r, t.peer}].push_back(&t);
      if (t.recv_bytes) recvs[{t.peer, r}].push_back(&t);
    }
  for (auto& [key, sv] : sends) {
    auto& rv = recvs[key];
    if (rv.size() != sv.size()) {
      std::printf("case %d: %zu sends %d->%d but %zu receives\n", idx, sv.size(), key.first, key.second, rv.size());
      return 1;
    }
    for (size_t i = 0; i < sv.size(); ++i) {
      if (sv[i]->send_bytes != rv[i]->recv_bytes) {
        std::printf("case %d: send %d->%d #%zu has %zu bytes, receive %zu\n", idx, key.first, key.second, i,
                    sv[i]->send_bytes, rv[i]->recv_bytes);
        return 1;
      }
      std::memcpy(rv[i]->recv, sv[i]->send, sv[i]->send_bytes);
    }
  }
  for (auto& [key, rv] : recvs)
    if (sends[key].size() != rv.size()) {
      std::printf("case %d: receive without send %d->%d\n", idx, key.first, key.second);
      return 1;
    }
  for (int r = 0; r < P; ++r) {
    for (const CopySeg& s : plans[r].unpack) hostCopy(s, c.B, plans[r].row_bytes);
    for (const SumBatch& s : plans[r].sums) {
      if (es == 4) hostSum<float>(s);
      else if (es == 8) hostSum<double>(s);
      else { std::printf("case %d: sums need float32/float64 in the simulator\n", idx); return 1; }
    }
  }
  // Expected values from the contract.
  int bad = 0;
  for (int r = 0; r < P; ++r)
    for (int t = 0; t < T; ++t) {
      const int H = c.H[t];
      const int n = hi[t][r] - lo[t][r];
      if (c.dir == allscanA2AScatterHeads) {
        for (int b = 0; b < c.B; ++b)
          for (int64_t s = 0; s < S; ++s)
            for (int j = 0; j < n; ++j)
              for (int d = 0; d < c.D; ++d) {
                const int p = static_cast<int>(s / c.Sl), sl = static_cast<int>(s % c.Sl);
                const double want = load(in[p][t].data(), ((static_cast<int64_t>(b) * c.Sl + sl) * H + lo[t][r] + j) * c.D + d);
                const double got = load(out[r][t].data(), ((static_cast<int64_t>(b) * S + s) * n + j) * c.D + d);
                if (want != got && bad++ < 5)
                  std::printf("case %d: scatter rank %d tensor %d (b %d s %lld j %d d %d): got %g want %g\n", idx, r, t, b,
                              (long long)s, j, d, got, want);
              }
      } else {
        for (int b = 0; b < c.B; ++b)
          for (int s = 0; s < c.Sl; ++s)
            for (int h = 0; h < H; ++h)
              for (int d = 0; d < c.D; ++d) {
                const int64_t oi = ((static_cast<int64_t>(b) * c.Sl + s) * H + h) * c.D + d;
                double want = 0;
                bool any = false;
                if (!c.acc.empty() && c.acc[t]) {
                  want = load(out0[r][t].data(), oi);
                  any = true;
                }
                for (int q = 0; q < P; ++q)
                  if (h >= lo[t][q] && h < hi[t][q]) {
                    const int nq = hi[t][q] - lo[t][q];
                    want += load(in[q][t].data(), ((static_cast<int64_t>(b) * S + static_cast<int64_t>(r) * c.Sl + s) * nq + h - lo[t][q]) * c.D + d);
                    any = true;
                  }
                if (!any) want = load(out0[r][t].data(), oi);
                const double got = load(out[r][t].data(), oi);
                if (want != got && bad++ < 5)
                  std::printf("case %d: gather rank %d tensor %d (b %d s %d h %d d %d): got %g want %g\n", idx, r, t, b,
                              s, h, d, got, want);
              }
      }
    }
  return bad ? 1 : 0;
}

std::vector<std::pair<int, int>> split(int h0, int h1, int P) {
  std::vector<int> lo(P), hi(P);
  allscanA2ASplitHeads(h0, h1, P, lo.data(), hi.data());
  std::vector<std::pair<int, int>> m;
  for (int r = 0; r < P; ++r) m.emplace_back(lo[r], hi[r]);
  return m;
}

std::vector<std::pair<int, int>> kv(const std::vector<std::pair<int, int>>& q, int g) {
  const int P = static_cast<int>(q.size());
  std::vector<int> ql(P), qh(P), lo(P), hi(P);
  for (int r = 0; r < P; ++r) {
    ql[r] = q[r].first;
    qh[r] = q[r].second;
  }
  allscanA2AKvHeads(P, ql.data(), qh.data(), g, lo.data(), hi.data());
  std::vector<std::pair<int, int>> m;
  for (int r = 0; r < P; ++r) m.emplace_back(lo[r], hi[r]);
  return m;
}

}  // namespace

int main() {
  std::vector<Case> cases;
  const allscanA2ADirection_t dirs[2] = {allscanA2AScatterHeads, allscanA2AGatherHeads};
  for (allscanA2ADirection_t dir : dirs)
    for (int P : {1, 2, 3, 4})
      for (int B : {1, 2})
        for (allscanDataType_t dt : {allscanFloat32, allscanBfloat16, allscanFloat64}) {
          // q, k, v of a chunk: plain, uneven, GQA replicated (8 q heads, 2 kv)
          for (int H : {2 * P, 5, 7}) {
            auto m = split(0, H, P);
            cases.push_back(Case{P, B, 3, 4, dt, dir, {H, H, H}, {m, m, m}, {}});
          }
          // a chunk of heads [2, 5) of 8, and a GQA chunk with its kv map
          auto qm = split(2, 5, P);
          cases.push_back(Case{P, B, 2, 8, dt, dir, {8}, {qm}, {}});
          auto q8 = split(0, 8, P);
          auto k8 = kv(q8, 4);
          const bool sums = dir == allscanA2AGatherHeads && dt != allscanBfloat16;
          if (dir == allscanA2AScatterHeads || sums) {
            cases.push_back(Case{P, B, 3, 4, dt, dir, {8, 2, 2}, {q8, k8, k8}, {}});
            auto q6 = split(0, 6, P);
            cases.push_back(Case{P, B, 2, 2, dt, dir, {6, 3, 3}, {q6, kv(q6, 2), kv(q6, 2)}, {}});
          }
          if (sums) {
            cases.push_back(Case{P, B, 3, 4, dt, dir, {8, 2, 2}, {q8, k8, k8}, {0, 1, 1}});  // accumulate
            cases.push_back(Case{P, B, 3, 4, dt, dir, {8}, {q8}, {1}});
          }
          // one rank holds every head (whole-tensor pieces: sent / received in place)
          std::vector<std::pair<int, int>> one(P, {0, 0});
          one[P - 1] = {0, 3};
          cases.push_back(Case{P, B, 2, 4, dt, dir, {3}, {one}, {}});
        }
  // D * es not a multiple of 16 (narrower vectors)
  cases.push_back(Case{2, 2, 3, 3, allscanBfloat16, allscanA2AScatterHeads, {5}, {split(0, 5, 2)}, {}});
  cases.push_back(Case{2, 2, 3, 3, allscanBfloat16, allscanA2AGatherHeads, {5}, {split(0, 5, 2)}, {}});
  int failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) failed += runCase(cases[i], static_cast<int>(i));
  // Argument errors name the argument.
  {
    int lo[2] = {0, 2}, hi[2] = {2, 5};
    allscanA2AArgs_t a;
    std::memset(&a, 0, sizeof(a));
    a.batch = 1; a.seq_local = 2; a.head_dim = 4; a.dtype = allscanFloat32; a.num_tensors = 1;
    a.tensors[0] = allscanA2ATensor_t{nullptr, nullptr, 4, lo, hi, 0};
    if (allscanA2ACheckArgs(2, 0, allscanA2AScatterHeads, &a) != allscanInvalidArgument ||
        std::strstr(allscanA2AGetLastError(), "head range of rank 1") == nullptr) {
      std::printf("expected a head-range error, got: %s\n", allscanA2AGetLastError());
      ++failed;
    }
    hi[1] = 4;
    a.tensors[0].accumulate = 1;
    if (allscanA2ACheckArgs(2, 0, allscanA2AScatterHeads, &a) != allscanInvalidArgument ||
        std::strstr(allscanA2AGetLastError(), "accumulate") == nullptr) {
      std::printf("expected an accumulate error, got: %s\n", allscanA2AGetLastError());
      ++failed;
    }
  }
  std::printf("plan_sim: %zu cases, %d failed\n", cases.size(), failed);
  return failed ? 1 : 0;
}
