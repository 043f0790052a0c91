// The matrix-transition All-Scan: y_{p+1} = M_p @ y_p + x_p over the ranks of a communicator, with
// the pipelined / serial / all-gather schedules on NCCL. Shares the communicator, the block-count
// rule and the head's zero buffer with the diagonal scan (comm.h). No libtorch.
#include <algorithm>
#include <string>

#include "allscan/allscan.h"
#include "comm.h"
#include "common/error.h"
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
  if (a->method != allscanPipelined) return 1;
  return effectiveBlocks(comm, a->num_blocks, stateCount(a) * dtypeSize(a->dtype));
}

bool mulOverflows(size_t a, size_t b, size_t* out) { return __builtin_mul_overflow(a, b, out); }

allscanResult_t checkArgs(const allscanComm* comm, const allscanMatrixScanArgs_t* a) {
  ALLSCAN_ARG_CHECK(comm != nullptr, "comm: null communicator");
  ALLSCAN_ARG_CHECK(a != nullptr, "args: null argument struct");
  ALLSCAN_ARG_CHECK(validDtype(a->dtype), "dtype: expected allscanFloat32, allscanFloat16, allscanBfloat16 or allscanFloat64, got " + std::to_string(static_cast<int>(a->dtype)));
  ALLSCAN_ARG_CHECK(validDtype(a->m_dtype) && (a->m_dtype == allscanFloat32 || a->m_dtype == a->dtype),
                    std::string("m_dtype: expected float32 or the state's dtype (") + dtypeName(a->dtype) + "), got " +
                        std::to_string(static_cast<int>(a->m_dtype)));
  ALLSCAN_ARG_CHECK(a->method == allscanPipelined || a->method == allscanSerial || a->method == allscanAllGather,
                    "method: expected allscanPipelined, allscanSerial or allscanAllGather, got " + std::to_string(static_cast<int>(a->method)));
  ALLSCAN_ARG_CHECK(a->num_blocks >= 0, "num_blocks: expected 0 (auto) or a positive block count, got " + std::to_string(a->num_blocks));
  ALLSCAN_ARG_CHECK(a->reverse == 0 || a->reverse == 1, "reverse: expected 0 or 1");
  ALLSCAN_ARG_CHECK(a->inclusive == 0 || a->inclusive == 1, "inclusive: expected 0 or 1");
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
  const int head = a->reverse ? P - 1 : 0;
  const bool has_next = a->reverse ? comm->rank > 0 : comm->rank < P - 1;
  if (comm->rank == head) return b.packed() || (a->init != nullptr && !a->inclusive) ? alignUp(bytes, kAlign) : 0;
  // See scanLink: R stages what is received, S what is sent on.
  const bool need_r = b.packed() || a->inclusive;
  const bool need_s = has_next && (b.packed() || !a->inclusive);
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
  if (a->inclusive && a->init != nullptr) {
    const Blocks w = wholeState(a);
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(
        combineArgs(a, w, 0, a->m, w.natural(a->init, 0), w.natural(a->x, 0), w.natural(a->y, 0)), stream));
  } else if (a->inclusive) {
    ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, a->x, bytes, cudaMemcpyDeviceToDevice, stream));
  } else if (a->init != nullptr) {
    ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, a->init, bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    ALLSCAN_CUDA_CHECK(cudaMemsetAsync(a->y, 0, bytes, stream));
  }
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
  if (n == 0) {
    if (cur == nullptr) {
      ALLSCAN_CUDA_CHECK(cudaMemsetAsync(a->y, 0, bytes, stream));
    } else {
      ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, cur, bytes, cudaMemcpyDeviceToDevice, stream));
    }
    return allscanSuccess;
  }
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

// The chain starts here: y = init (or 0); the value sent on is M @ init + x (or x itself), in the
// block layout, all blocks in one group call (in order on one connection: the successor starts on
// block 0 while the rest is in flight). The head's own result, when it is not what is sent, is
// written in the same group call as a send/recv to itself up to self_fill_max bytes (one kernel, as
// the bare send: see allscanScan and bench/README.md), else after the send.
allscanResult_t scanHead(allscanComm* comm, const allscanMatrixScanArgs_t* a, const Blocks& b, void* workspace,
                         cudaStream_t stream) {
  const int r = comm->rank;
  const int next = a->reverse ? r - 1 : r + 1;
  ncclComm_t nc = comm->nccl;
  const ncclDataType_t nt = ncclType(a->dtype);
  const size_t bytes = stateCount(a) * b.es;
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
  const bool need_fill = !a->inclusive || a->init == nullptr;
  const void* fill_src = a->inclusive ? a->x : a->init;  // null: zeros
  bool self_fill = false;
  if (need_fill) {
    const bool self = comm->head_fill == kFillSelf || (comm->head_fill == kFillAuto && bytes <= comm->self_fill_max);
    self_fill = self && (fill_src != nullptr || ensureZeros(comm, bytes, stream));
  }
  ncclResult_t nr = ncclGroupStart();
  for (size_t i = 0; i < b.n && nr == ncclSuccess; ++i)
    nr = ncclSend(static_cast<const char*>(s) + b.off(i) * b.es, b.elems(i), nt, next, nc, stream);
  if (self_fill) {
    const void* src = fill_src != nullptr ? fill_src : comm->zeros;
    if (nr == ncclSuccess) nr = ncclSend(src, bytes, ncclUint8, r, nc, stream);
    if (nr == ncclSuccess) nr = ncclRecv(a->y, bytes, ncclUint8, r, nc, stream);
  }
  const ncclResult_t ne = ncclSettle(nc, ncclGroupEnd());
  if (nr == ncclSuccess) nr = ne;
  if (nr != ncclSuccess) return setError(allscanNcclError, std::string("ncclSend (chain head): ") + ncclGetErrorString(nr));
  if (need_fill && !self_fill) {
    if (fill_src != nullptr) {
      ALLSCAN_CUDA_CHECK(cudaMemcpyAsync(a->y, fill_src, bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
      ALLSCAN_CUDA_CHECK(cudaMemsetAsync(a->y, 0, bytes, stream));
    }
  }
  return allscanSuccess;
}

// Inner and tail ranks: receive block i while sending block i-1 on, combine block i. R receives
// y_p in the block layout (straight into y when that is the natural layout and y is the result);
// S holds M @ y_p + x to send on (straight into y when it is the inclusive result). With packed
// blocks the combine also writes the natural-layout result (the received y, or the inclusive one).
allscanResult_t scanLink(const allscanComm* comm, const allscanMatrixScanArgs_t* a, const Blocks& b, void* workspace,
                         cudaStream_t stream) {
  const int P = comm->nranks, r = comm->rank;
  const bool has_next = a->reverse ? r > 0 : r < P - 1;
  const int prev = a->reverse ? r + 1 : r - 1;
  const int next = a->reverse ? r - 1 : r + 1;
  ncclComm_t nc = comm->nccl;
  const ncclDataType_t nt = ncclType(a->dtype);
  const size_t bytes = stateCount(a) * b.es;
  const bool need_r = b.packed() || a->inclusive;
  char* ws = static_cast<char*>(workspace);
  void* R = need_r ? ws : a->y;
  void* S = nullptr;
  if (has_next) S = a->inclusive && !b.packed() ? a->y : ws + (need_r ? alignUp(bytes, kAlign) : 0);
  const bool combine = has_next || a->inclusive;
  auto at = [&](void* base, size_t i) { return static_cast<char*>(base) + b.off(i) * b.es; };
  for (size_t i = 0; i < b.n; ++i) {
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    if (has_next && i > 0) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(at(S, i - 1), b.elems(i - 1), nt, next, nc, stream));
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclRecv(at(R, i), b.elems(i), nt, prev, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
    if (!combine) continue;
    CombineArgs c = combineArgs(a, b, i, a->m, b.block(R, i), b.natural(a->x, i),
                                has_next ? b.block(S, i) : b.natural(a->y, i));
    if (has_next && a->inclusive && b.packed()) c.out2 = b.natural(a->y, i);
    if (!a->inclusive && b.packed()) c.ycopy = b.natural(a->y, i);
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchCombine(c, stream));
  }
  if (has_next) {
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(at(S, b.n - 1), b.elems(b.n - 1), nt, next, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
  } else if (!combine && b.packed()) {
    // The exclusive tail received the packed blocks: one unpack into the result.
    ALLSCAN_CUDA_CHECK(allscan::matrix::launchPack(b.es, R, a->y, b.batch, b.k, b.v, b.vcw, true, stream));
  }
  return allscanSuccess;
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
  ALLSCAN_ARG_CHECK(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                    "workspace: " + std::to_string(need) + " bytes needed (allscanMatrixWorkspaceSize), got " +
                        std::to_string(workspace_bytes));
  if (comm->nranks == 1) return scanOneRank(a, stream);
  ALLSCAN_ARG_CHECK(comm->nccl != nullptr, "comm: a detached communicator has no NCCL communicator");
  if (a->method == allscanAllGather) return scanAllGather(comm, a, workspace, stream);
  const Blocks b = makeBlocks(a->batch, a->k, a->v, dtypeSize(a->dtype), matrixBlockCount(comm, a));
  const int head = a->reverse ? comm->nranks - 1 : 0;
  if (comm->rank == head) return scanHead(comm, a, b, workspace, stream);
  return scanLink(comm, a, b, workspace, stream);
}

}  // extern "C"
