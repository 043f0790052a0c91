// The matrix-transition All-Scan: y_{p+1} = M_p @ y_p + x_p over the ranks of a communicator, with
// the pipelined / serial / all-gather schedules on NCCL. Shares the communicator, the argument
// checks, the block-count rule and the chain positions with the diagonal scan (comm.h), and the
// chain head's own result beside its send (head_result.h). No libtorch.
#include <algorithm>
#include <string>

#include "allscan/allscan.h"
#include "comm.h"
#include "common/error.h"
#include "common/watch.h"
#include "head_result.h"
#include "pipeline.h"
#include "matrix_combine.h"

using namespace allscan::detail;
using allscan::matrix::CombineArgs;
using allscan::matrix::View;

namespace {

// ------------------------------------------------------------------------------------------------
// Blocks
// ------------------------------------------------------------------------------------------------
// Every output column needs the whole M_p and the whole column of y_p, so the columns of different
// batch entries and different v-column ranges are independent. Blocks of whole batch entries are
// contiguous in memory and go to NCCL as they are; only when more blocks are wanted than there are
// batch entries are the v columns of each entry split, and then a block ([k, vc], strided in the
// natural layout) is staged packed in the workspace ("block layout": entry b keeps its k*v elements
// at b*k*v, as its column blocks one after another).
struct Blocks {
  size_t batch = 0, k = 0, v = 0, es = 0;
  size_t n = 0;    // blocks
  size_t bb = 1;   // batch entries per block (1 when v is split)
  size_t vcw = 0;  // columns per column block (v: whole entries)
  size_t nvs = 1;  // column blocks per batch entry
  bool packed() const { return nvs > 1; }
  size_t b0(size_t i) const { return packed() ? i / nvs : i * bb; }
  size_t nb(size_t i) const { return packed() ? 1 : std::min(bb, batch - b0(i)); }
  size_t c0(size_t i) const { return packed() ? (i % nvs) * vcw : 0; }
  size_t vc(size_t i) const { return std::min(vcw, v - c0(i)); }
  size_t off(size_t i) const { return b0(i) * k * v + k * c0(i); }  // in the block layout
  size_t elems(size_t i) const { return nb(i) * k * vc(i); }
  // Block i of a buffer in the natural [batch, k, v] layout.
  View natural(const void* p, size_t i) const {
    View w;
    w.p = static_cast<char*>(const_cast<void*>(p)) + (b0(i) * k * v + c0(i)) * es;
    w.bstride = k * v;
    w.rstride = v;
    return w;
  }
  // Block i of a buffer in the block layout (the natural one when blocks are whole entries).
  View block(const void* p, size_t i) const {
    View w;
    w.p = static_cast<char*>(const_cast<void*>(p)) + off(i) * es;
    w.bstride = k * vc(i);
    w.rstride = vc(i);
    return w;
  }
};

Blocks makeBlocks(size_t batch, size_t k, size_t v, size_t es, int requested) {
  Blocks b;
  b.batch = batch;
  b.k = k;
  b.v = v;
  b.es = es;
  const size_t want = static_cast<size_t>(std::max(requested, 1));
  if (batch == 0 || v == 0) return b;
  if (want <= batch) {
    b.bb = (batch + want - 1) / want;
    b.n = (batch + b.bb - 1) / b.bb;
    b.vcw = v;
    b.nvs = 1;
  } else {
    const size_t splits = std::min((want + batch - 1) / batch, v);
    b.vcw = (v + splits - 1) / splits;
    b.nvs = (v + b.vcw - 1) / b.vcw;
    b.bb = 1;
    b.n = batch * b.nvs;
  }
  return b;
}

size_t stateCount(const allscanMatrixScanArgs_t* a) { return a->batch * a->k * a->v; }

int matrixBlockCount(const allscanComm* comm, const allscanMatrixScanArgs_t* a) {
  return methodBlocks(comm, a->method, a->num_blocks, stateCount(a) * dtypeSize(a->dtype));
}

bool mulOverflows(size_t a, size_t b, size_t* out) { return __builtin_mul_overflow(a, b, out); }

allscanResult_t checkArgs(const allscanComm* comm, const allscanMatrixScanArgs_t* a) {
  ALLSCAN_CHECK(checkTarget(comm, a));
  ALLSCAN_ARG_CHECK(validDtype(a->m_dtype) && (a->m_dtype == allscanFloat32 || a->m_dtype == a->dtype),
                    std::string("m_dtype: expected float32 or the state's dtype (") + dtypeName(a->dtype) + "), got " +
                        std::to_string(static_cast<int>(a->m_dtype)));
  ALLSCAN_CHECK(checkSchedule(a));
  ALLSCAN_ARG_CHECK(a->method != allscanDevice,
                    "method: allscanDevice serves the diagonal scan (allscanScan) only; expected allscanPipelined, "
                    "allscanSerial or allscanAllGather");
  ALLSCAN_ARG_CHECK(a->transpose_m == 0 || a->transpose_m == 1, "transpose_m: expected 0 or 1");
  size_t bk = 0, n = 0, mk = 0, mn = 0, bytes = 0;
  ALLSCAN_ARG_CHECK(!mulOverflows(a->batch, a->k, &bk) && !mulOverflows(bk, a->v, &n) &&
                        !mulOverflows(n, dtypeSize(a->dtype), &bytes) && !mulOverflows(bk, a->k, &mk) &&
                        !mulOverflows(mk, dtypeSize(a->m_dtype), &mn),
                    "batch/k/v: the state or transition size overflows size_t");
  if (n > 0) {
    ALLSCAN_ARG_CHECK(a->x != nullptr, "x: null pointer for a state of " + std::to_string(n) + " elements");
    ALLSCAN_ARG_CHECK(a->y != nullptr, "y: null pointer for a state of " + std::to_string(n) + " elements");
    ALLSCAN_ARG_CHECK(a->m != nullptr, "m: null transition for a state of " + std::to_string(n) + " elements");
    ALLSCAN_ARG_CHECK(a->x != a->y, "y: must not alias x");
    ALLSCAN_ARG_CHECK(a->init != a->y, "y: must not alias init");
    ALLSCAN_ARG_CHECK(a->m != a->y, "y: must not alias m");
  }
  return allscanSuccess;
}

size_t workspaceBytes(const allscanComm* comm, const allscanMatrixScanArgs_t* a) {
  const int P = comm->nranks;
  const size_t count = stateCount(a);
  if (P == 1 || count == 0) return 0;
  const size_t bytes = count * dtypeSize(a->dtype);
  if (a->method == allscanAllGather) {
    size_t ws = alignUp(static_cast<size_t>(P) * bytes, kAlign);                                         // X
    ws += alignUp(static_cast<size_t>(P) * a->batch * a->k * a->k * dtypeSize(a->m_dtype), kAlign);  // Ms
    if (a->init != nullptr) ws += alignUp(bytes, kAlign);                                                // init
    return ws + alignUp(bytes, kAlign);                                                                 // fold temp
  }
  const Blocks b = makeBlocks(a->batch, a->k, a->v, dtypeSize(a->dtype), matrixBlockCount(comm, a));
  const ChainPos pos = chainPos(comm, a->reverse);
  if (pos.head) return b.packed() || (a->init != nullptr && !a->inclusive) ? alignUp(bytes, kAlign) : 0;
  // See scanLink: R stages what is received, S what is sent on.
  const bool need_r = b.packed() || a->inclusive;
  const bool need_s = pos.has_next && (b.packed() || !a->inclusive);
  return (need_r ? alignUp(bytes, kAlign) : 0) + (need_s ? alignUp(bytes, kAlign) : 0);
}

// out = M @ y + x over block i, M the block's transitions.
CombineArgs combineArgs(const allscanMatrixScanArgs_t* a, const Blocks& b, size_t i, const void* m, View y, View x,
                        View out) {
  CombineArgs c;
  c.m = static_cast<const char*>(m) + b.b0(i) * a->k * a->k * dtypeSize(a->m_dtype);
  c.m_dtype = a->m_dtype;
  c.transpose = a->transpose_m != 0;
  c.y = y;
  c.x = x;
  c.out = out;
  c.nb = b.nb(i);
  c.k = a->k;
  c.vc = b.vc(i);
  c.dtype = a->dtype;
  return c;
}

// The whole state as one block (P = 1, the all-gather fold).
Blocks wholeState(const allscanMatrixScanArgs_t* a) {
  return makeBlocks(a->batch, a->k, a->v, dtypeSize(a->dtype), 1);
}

allscanResult_t scanOneRank(const allscanMatrixScanArgs_t* a, cudaStream_t stream) {
  const size_t bytes = stateCount(a) * dtypeSize(a->dtype);
  if (!a->inclusive) return copyOrZero(a->y, a->init, bytes, stream);
  if (a->init == nullptr) return copyOrZero(a->y, a->x, bytes, stream);
  const Blocks w = wholeState(a);
  ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(
      combineArgs(a, w, 0, a->m, w.natural(a->init, 0), w.natural(a->x, 0), w.natural(a->y, 0)), stream));
  return allscanSuccess;
}

// fla's context-parallel pattern: all-gather every rank's x and M (and broadcast the head's init),
// then fold the chain up to this rank locally, one combine per predecessor, rounding to the storage
// dtype at every boundary as the pipeline does.
allscanResult_t scanAllGather(const allscanComm* comm, const allscanMatrixScanArgs_t* a, void* workspace,
                              cudaStream_t stream) {
  const int P = comm->nranks, r = comm->rank;
  const size_t count = stateCount(a), es = dtypeSize(a->dtype), bytes = count * es;
  const size_t mcount = a->batch * a->k * a->k, mes = dtypeSize(a->m_dtype);
  const int head = a->reverse ? P - 1 : 0;
  const int step = a->reverse ? -1 : 1;
  ncclComm_t nc = comm->nccl;
  char* ws = static_cast<char*>(workspace);
  char* X = ws;
  size_t off = alignUp(static_cast<size_t>(P) * bytes, kAlign);
  char* Ms = ws + off;
  off += alignUp(static_cast<size_t>(P) * mcount * mes, kAlign);
  char* I = nullptr;
  if (a->init != nullptr) {
    I = ws + off;
    off += alignUp(bytes, kAlign);
  }
  void* T = ws + off;
  ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
  ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(a->x, X, count, ncclType(a->dtype), nc, stream));
  ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclAllGather(a->m, Ms, mcount, ncclType(a->m_dtype), nc, stream));
  if (I != nullptr) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclBroadcast(a->init, I, count, ncclType(a->dtype), head, nc, stream));
  ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());

  // The ranks folded, in chain order: head .. r-1 (exclusive) or head .. r (inclusive); without
  // init the head's x is the starting value itself.
  const int last = a->inclusive ? r + step : r;
  const void* cur = I;
  int q = head;
  if (cur == nullptr && q != last) {
    cur = X + static_cast<size_t>(q) * bytes;
    q += step;
  }
  const int n = (last - q) * step;
  if (n == 0) return copyOrZero(a->y, cur, bytes, stream);
  // Ping-pong between T and y, so that the last combine writes y (a combine cannot work in place:
  // every output row reads the whole column).
  const Blocks w = wholeState(a);
  for (int i = 0; i < n; ++i, q += step) {
    void* dst = (n - 1 - i) % 2 == 0 ? a->y : T;
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(
        combineArgs(a, w, 0, Ms + static_cast<size_t>(q) * mcount * mes, w.natural(cur, 0),
                    w.natural(X + static_cast<size_t>(q) * bytes, 0), w.natural(dst, 0)),
        stream));
    cur = dst;
  }
  return allscanSuccess;
}

// The head sends M @ init + x (x itself without init) on in the block layout, and keeps init (or
// zeros) for itself: headSend.
allscanResult_t scanHead(allscanComm* comm, const allscanMatrixScanArgs_t* a, const Blocks& b, const SigSlots& sig,
                         void* workspace, cudaStream_t stream) {
  const void* s = a->x;
  if (a->init != nullptr) {
    void* S = a->inclusive && !b.packed() ? a->y : workspace;
    for (size_t i = 0; i < b.n; ++i) {
      CombineArgs c = combineArgs(a, b, i, a->m, b.natural(a->init, i), b.natural(a->x, i), b.block(S, i));
      if (a->inclusive && b.packed()) c.out2 = b.natural(a->y, i);
      ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(c, stream));
    }
    s = S;
  } else if (b.packed()) {
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchPack(b.es, a->x, workspace, b.batch, b.k, b.v, b.vcw, false, stream));
    s = workspace;
  }
  // The head's own result: init or zeros (exclusive), x itself (inclusive without init); with an
  // init, the inclusive result was written by the combine above.
  HeadResult own(comm, a->inclusive && a->init != nullptr ? nullptr : a->y, a->inclusive ? a->x : a->init,
                 stateCount(a) * b.es, stream);
  const ncclDataType_t nt = ncclType(a->dtype);
  return headSend(
      comm, a->reverse, b.n, own, sig,
      [&](size_t i, ncclComm_t nc, int next) {
        return ncclSend(static_cast<const char*>(s) + b.off(i) * b.es, b.elems(i), nt, next, nc, stream);
      },
      stream);
}

// Inner and tail ranks: receive block i while sending block i-1 on, combine block i. R receives
// y_p in the block layout (straight into y when that is the natural layout and y is the result);
// S holds M @ y_p + x to send on (straight into y when it is the inclusive result). With packed
// blocks the combine also writes the natural-layout result (the received y, or the inclusive one).
allscanResult_t scanLink(const allscanComm* comm, const allscanMatrixScanArgs_t* a, const Blocks& b,
                         const SigSlots& sig, void* workspace, cudaStream_t stream) {
  const bool has_next = chainPos(comm, a->reverse).has_next;
  const size_t bytes = stateCount(a) * b.es;
  const bool need_r = b.packed() || a->inclusive;
  char* ws = static_cast<char*>(workspace);
  void* R = need_r ? ws : a->y;
  void* S = nullptr;
  if (has_next) S = a->inclusive && !b.packed() ? a->y : ws + (need_r ? alignUp(bytes, kAlign) : 0);
  const bool combine = has_next || a->inclusive;
  auto at = [&](void* base, size_t i) { return static_cast<char*>(base) + b.off(i) * b.es; };
  auto combineBlock = [&](size_t i) -> allscanResult_t {
    if (!combine) return allscanSuccess;
    CombineArgs c = combineArgs(a, b, i, a->m, b.block(R, i), b.natural(a->x, i),
                                has_next ? b.block(S, i) : b.natural(a->y, i));
    if (has_next && a->inclusive && b.packed()) c.out2 = b.natural(a->y, i);
    if (!a->inclusive && b.packed()) c.ycopy = b.natural(a->y, i);
    c.check = sig.check;
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(c, stream));
    return allscanSuccess;
  };
  ALLSCAN_CHECK(relayBlocks(
      comm, a->reverse, b.n, ncclType(a->dtype), sig,
      [&](size_t i) { return BlockRef{at(S, i), b.elems(i)}; },  // sent on
      [&](size_t i) { return BlockRef{at(R, i), b.elems(i)}; },  // received
      combineBlock, stream));
  if (!combine && b.packed()) {
    // The exclusive tail received the packed blocks: one unpack into the result.
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchPack(b.es, R, a->y, b.batch, b.k, b.v, b.vcw, true, stream));
  }
  // An exclusive result received straight into y (no combine writes it; with packed blocks the
  // combine's copy into y is poisoned already) is checked on its own.
  if (!a->inclusive && (!combine || !b.packed()))
    ALLSCAN_CUDA_CHECK(launchPoison(a->y, stateCount(a), a->dtype, sig.check, stream));
  return allscanSuccess;
}


// The NCCL work of allscanMatrixScan, run under the communicator's watch (common/watch.h).
allscanResult_t scanIssue(allscanComm* comm, const allscanMatrixScanArgs_t* a, void* workspace, cudaStream_t stream) {
  if (a->method == allscanAllGather) return scanAllGather(comm, a, workspace, stream);
  const Blocks b = makeBlocks(a->batch, a->k, a->v, dtypeSize(a->dtype), matrixBlockCount(comm, a));
  SigSlots sig;
  ALLSCAN_CHECK(signatureSlots(comm->signatures, a->signature, stream, &sig));
  if (chainPos(comm, a->reverse).head) return scanHead(comm, a, b, sig, workspace, stream);
  return scanLink(comm, a, b, sig, workspace, stream);
}
}  // namespace

extern "C" {

allscanResult_t allscanMatrixBlocks(size_t batch, size_t k, size_t v, int num_blocks, int* blocks,
                                    size_t* cols_per_block) {
  ALLSCAN_ARG_CHECK(num_blocks >= 1, "num_blocks: expected a positive block count, got " + std::to_string(num_blocks));
  ALLSCAN_ARG_CHECK(blocks != nullptr, "blocks: null output pointer");
  const Blocks b = makeBlocks(batch, k, v, 1, num_blocks);
  *blocks = static_cast<int>(b.n);
  if (cols_per_block != nullptr) *cols_per_block = b.vcw;
  return allscanSuccess;
}

allscanResult_t allscanMatrixCheckArgs(allscanComm_t comm, const allscanMatrixScanArgs_t* args) {
  return checkArgs(comm, args);
}

allscanResult_t allscanMatrixWorkspaceSize(allscanComm_t comm, const allscanMatrixScanArgs_t* args, size_t* bytes) {
  ALLSCAN_CHECK(checkArgs(comm, args));
  ALLSCAN_ARG_CHECK(bytes != nullptr, "bytes: null output pointer");
  *bytes = workspaceBytes(comm, args);
  return allscanSuccess;
}

allscanResult_t allscanMatrixScan(allscanComm_t comm, const allscanMatrixScanArgs_t* a, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  ALLSCAN_CHECK(checkArgs(comm, a));
  if (stateCount(a) == 0) return allscanSuccess;
  const size_t need = workspaceBytes(comm, a);
  ALLSCAN_CHECK(checkWorkspace(need, workspace, workspace_bytes, "allscanMatrixWorkspaceSize"));
  if (comm->nranks == 1) return scanOneRank(a, stream);
  ALLSCAN_CHECK(checkAttached(comm));
  // The watch's failure first: after an abort, a receive that never completed looks like a mismatch.
  return watched(comm->nccl, stream, [&] {
    ALLSCAN_CHECK(mismatchStatus(comm->signatures));
    return scanIssue(comm, a, workspace, stream);
  });
}

}  // extern "C"
