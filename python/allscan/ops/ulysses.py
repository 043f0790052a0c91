"""Ulysses attention with head-chunked overlap (HCMS), forward and backward: the op behind
:class:`allscan.layers.UlyssesAttention`.

Ulysses sequence parallelism turns ``[B, S_local, H, D]`` (sequence-sharded, all heads) into
``[B, S, H_rank, D]`` (whole sequence, this rank's heads) with an all-to-all, runs attention, and
turns the output back with a second all-to-all. Here the heads are cut into ``C`` chunks and the
chunks are pipelined over two CUDA streams::

    comm stream:     S0 S1 .. G0 S2 .. G1 S3 ..          S = scatter-heads of q, k, v of a chunk
    compute stream:        A0    A1    A2 ...             A = attention of a chunk (SDPA)
                                                          G = gather-heads of the chunk's output

so that the all-to-alls of chunks c-1 and c+1 run while chunk c is attended. The backward pass is
pipelined the same way: scatter of the output gradient, per-chunk SDPA backward (through the graph the
forward kept, so nothing is recomputed), gather of dq, dk, dv.

Chunks are rank-major (:func:`allscan.ops.chunk_head_ranges`): every rank's own heads are cut into C
pieces, so C never changes which heads a rank attends. Heads need not divide the group size (the first
``H % P`` ranks get one more), and k/v may have fewer heads than q (grouped-query attention): each
rank receives the k/v heads its query heads use (replicated when there are fewer k/v heads than
ranks), and their gradients are summed back.

On CPU (or any non-NCCL group) the same code runs sequentially through the torch.distributed path.
"""
from __future__ import annotations

import operator
import zlib
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._contract import DTYPE_CODES, announce_invalid, check_across_ranks, dtype_code, peers_exchange, settings
from .. import _C, _comm
from .._comm import normalize_group
from ._launch import PlanCache
from .a2a import GATHER, SCATTER, _use_cpp, a2a_multi, chunk_head_ranges, kv_head_ranges, split_heads

__all__ = ["ulysses_attention", "choose_num_chunks", "pick_measured", "clear_auto_cache"]

_OP = "UlyssesAttention"


# ------------------------------------------------------------------------------------------------
# The plan of one call: head maps per chunk, local k/v index for grouped-query attention
# ------------------------------------------------------------------------------------------------

class _Chunk:
    __slots__ = ("q_map", "kv_map", "q_lo", "q_hi", "kv_lo", "kv_hi", "kv_index", "new_map", "done_map", "_idx")

    def __init__(self, q_map, kv_map, me, q_per_kv):
        self.q_map = q_map
        self.kv_map = kv_map
        self.q_lo, self.q_hi = q_map[me]
        self.kv_lo, self.kv_hi = kv_map[me]
        self.kv_index = None
        if q_per_kv > 1 and self.q_hi > self.q_lo:
            # local query head i uses local k/v head (q_lo + i) // g - kv_lo
            self.kv_index = [(h // q_per_kv) - self.kv_lo for h in range(self.q_lo, self.q_hi)]
        # k/v heads this chunk brings to each rank (first use) and whose gradients it sends back
        # (last use); with grouped-query attention consecutive chunks of a rank may share a k/v head,
        # which then moves once each way. Filled in by _ChunkPlan.
        self.new_map = kv_map
        self.done_map = kv_map
        self._idx = {}

    def index(self, device, offset=0):
        """kv_index (+ offset) as a tensor on device, cached (no host-to-device copy per call)."""
        key = (str(device), offset)
        t = self._idx.get(key)
        if t is None:
            t = torch.tensor([j + offset for j in self.kv_index], dtype=torch.long, device=device)
            self._idx[key] = t
        return t

    @property
    def nq(self):
        return self.q_hi - self.q_lo

    @property
    def nkv(self):
        return self.kv_hi - self.kv_lo


def _first_last_maps(chunks, world):
    """new_map[c][r]: the k/v heads of rank r first used by chunk c; done_map: last used."""
    for r in range(world):
        first: Dict[int, int] = {}
        last: Dict[int, int] = {}
        for c, ch in enumerate(chunks):
            lo, hi = ch.kv_map[r]
            for h in range(lo, hi):
                first.setdefault(h, c)
                last[h] = c
        for c, ch in enumerate(chunks):
            for attr, table in (("new_map", first), ("done_map", last)):
                heads = [h for h, cc in table.items() if cc == c]
                rng = (min(heads), max(heads) + 1) if heads else (ch.kv_map[r][0], ch.kv_map[r][0])
                assert not heads or rng[1] - rng[0] == len(heads)
                m = list(getattr(ch, attr))
                m[r] = rng
                setattr(ch, attr, m)


class _ChunkPlan:
    def __init__(self, group, world, me, B, Sl, Hq, Hkv, D, num_chunks, weights, causal, scale, bounds=None):
        self.group, self.world, self.me = group, world, me
        self.B, self.Sl, self.Hq, self.Hkv, self.D = B, Sl, Hq, Hkv, D
        self.q_per_kv = Hq // Hkv
        self.causal, self.scale = causal, scale
        self.bounds = bounds  # packed sequences' global bounds (a tuple of ints), or None: one sequence
        # what the all-to-alls' in-band signature carries besides their shapes (a2a_multi)
        self.call_signature = zlib.crc32(repr((bool(causal), scale, bounds, num_chunks, weights)).encode()) or 1
        q_maps = chunk_head_ranges(Hq, world, num_chunks, weights)
        chunks = []
        for qm in q_maps:
            if all(hi <= lo for lo, hi in qm):
                continue  # no rank has a head in this chunk
            chunks.append(_Chunk(qm, kv_head_ranges(qm, self.q_per_kv), me, self.q_per_kv))
        self.chunks = chunks
        # this rank's k/v heads over all chunks
        self.kv_lo, self.kv_hi = kv_head_ranges(split_heads(0, Hq, world), self.q_per_kv)[me]
        # Grouped-query attention: a k/v head is moved once to each rank that needs it, and its
        # gradient is accumulated on that rank in fp32 over the chunks that use it, then summed over
        # the ranks that hold it (gather-heads with accumulation: ranks may finish it in different chunks).
        self.kv_accumulate = self.q_per_kv > 1
        if self.kv_accumulate:
            _first_last_maps(chunks, world)


def _kv_for_chunk(ch: "_Chunk", pieces):
    """The chunk's k/v heads [kv_lo, kv_hi) from the pieces received so far [(lo, hi, k, v)]."""
    parts_k, parts_v = [], []
    for lo, hi, k, v in pieces:
        a, b = max(lo, ch.kv_lo), min(hi, ch.kv_hi)
        if a < b:
            if a == lo and b == hi and ch.kv_lo == lo and ch.kv_hi == hi:
                return k, v
            parts_k.append(k[:, :, a - lo:b - lo])
            parts_v.append(v[:, :, a - lo:b - lo])
    return torch.cat(parts_k, 2), torch.cat(parts_v, 2)


def _expand_kv(ch: _Chunk, k: torch.Tensor, v: torch.Tensor):
    """Grouped-query attention: the chunk's k/v heads repeated for each local query head."""
    if ch.kv_index is None:
        return k, v
    idx = ch.index(k.device)
    return k.index_select(2, idx), v.index_select(2, idx)


def _sdpa(plan: _ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on [B, S, n, D] tensors (k, v already expanded) -> [B, S, n, D] contiguous; with packed
    sequences, one SDPA per sequence (no token attends across a sequence's bounds)."""
    if plan.bounds is None:
        return _sdpa_one(plan, q, k, v).contiguous()
    pairs = [(a, b) for a, b in zip(plan.bounds[:-1], plan.bounds[1:]) if b > a]
    return torch.cat([_sdpa_one(plan, q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in pairs], 1)


def _sdpa_one(plan: _ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=plan.causal, scale=plan.scale)
    return o.transpose(1, 2)


def _attend(plan: _ChunkPlan, ch: _Chunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    k, v = _expand_kv(ch, k, v)
    return _sdpa(plan, q, k, v)


def _streams_for(device: torch.device):
    """The communication stream of a device (one per device, created on first use)."""
    st = _COMM_STREAMS.get(device.index)
    if st is None:
        st = torch.cuda.Stream(device=device, priority=-1)
        _COMM_STREAMS[device.index] = st
    return st


_COMM_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _use_streams(x: torch.Tensor) -> bool:
    return x.is_cuda and settings.ulysses_streams


# ------------------------------------------------------------------------------------------------
# The pipeline driver: S(c) on the comm stream, A(c) on the current stream, G(c) on the comm stream
# ------------------------------------------------------------------------------------------------

class _CudaSync:
    """The two streams of the pipeline and how to make an event (tests pass a fake with the same
    surface: ``main``, ``comm`` with ``wait_stream``/``wait_event``, ``event()`` with ``record(stream)``)."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.comm = _streams_for(device)

    @staticmethod
    def event():
        return torch.cuda.Event()


def _run_pipeline(n: int, scatter, attend, gather, cuda_device: Optional[torch.device], sync=None, failed=None):
    """scatter(c, stream) issues chunk c's input all-to-all, attend(c) its computation on the current
    (main) stream (returns what gather needs), gather(c, result, stream) its output all-to-all.

    Cross-stream dependencies, each made here by the driver itself (never by a callee):
      1. main -> comm before the first scatter: the inputs and every buffer allocated so far on main
         (scatter outputs, gather outputs, zeroed accumulators) are ready and no longer in use there;
      2. scatter(c) on comm -> attend(c) on main: an event recorded on comm right after scatter(c)
         is enqueued, waited on by main before attend(c) (events are in stream order, so this also
         covers the earlier chunks' k/v that grouped-query attention reuses);
      3. attend(c) on main -> gather(c) on comm: an event recorded on main after attend(c), waited on
         by comm before gather(c);
      4. comm -> main at the end: every gather has landed before main reads the outputs or frees or
         reuses any buffer the comm stream touched. The attend results read by comm are kept alive
         until then (they were allocated on main; the caching allocator could otherwise hand their
         memory to main-stream work while comm still reads it).
    Without a CUDA device (or with ``ALLSCAN_ULYSSES_STREAMS=0``) it runs the same steps sequentially
    on the current stream.

    If a step of chunk c raises (out of memory, say), ``failed(c, error, step)`` runs before the error
    propagates (``step``: "scatter", "attend" or "gather"): the peers are waiting in this rank's next
    all-to-all. (4) is made whatever raised, so no buffer the comm stream may still write is handed to
    other work."""
    if n == 0:
        return
    at, step = 0, "scatter"  # the chunk and step running: the ones ``failed`` names
    if sync is None and cuda_device is None:
        try:
            for at in range(n):
                step = "scatter"
                scatter(at, None)
                step = "attend"
                res = attend(at)
                step = "gather"
                gather(at, res, None)
        except Exception as e:
            if failed is not None:
                failed(at, e, step)
            raise
        return
    if sync is None:
        sync = _CudaSync(cuda_device)
    main, comm = sync.main, sync.comm
    comm.wait_stream(main)                      # (1)
    in_ev = [None] * n
    keep = []

    def issue(c):
        scatter(c, comm)
        ev = sync.event()
        ev.record(comm)
        in_ev[c] = ev

    try:
        issue(0)
        for c in range(n):
            if c + 1 < n:
                at = c + 1
                issue(c + 1)
            at, step = c, "attend"
            main.wait_event(in_ev[c])           # (2)
            res = attend(c)
            ev = sync.event()
            ev.record(main)
            keep.append(res)
            comm.wait_event(ev)                 # (3)
            step = "gather"
            gather(c, res, comm)
            step = "scatter"
    except Exception as e:
        if failed is not None:
            failed(at, e, step)
        raise
    finally:
        main.wait_stream(comm)                  # (4)
        del keep


def _chunks_checked(group, x: torch.Tensor) -> bool:
    """Whether each head chunk's all-to-all is checked across ranks (``a2a_multi(check=True)``): with
    torch's all-to-all where every rank exchanges its signature on every call anyway (gloo; any group
    with ``ALLSCAN_CHECK=always``), so that a rank whose own work failed between two all-to-alls can
    tell its peers in the next one's check (:func:`_report_failure`). The core's all-to-all carries its
    signature in band instead, and its failures go to the fault board."""
    return not _use_cpp(group, x) and peers_exchange(group, x.device)


def _report_failure(plan: "_ChunkPlan", like: torch.Tensor, phase: str):
    """``failed(c, error, step)`` for a rank whose ``phase`` (forward or backward) raised in ``step``
    of head chunk c (c None: before its first all-to-all), where its peers wait in its next all-to-all.
    With the core's all-to-all (NCCL) it reports the call it skips on the fault board: the peers'
    communicators fail within seconds, unless every rank skipped that same call (then the group carries
    on). With torch's all-to-all and every chunk checked (:func:`_chunks_checked`: gloo) a failure of
    the rank's own work (its buffers, a chunk's attention) joins the next all-to-all's check marked
    invalid, so the peers raise there at once. A failure inside an all-to-all is not announced again:
    its check failed on every rank, or the all-to-all announced it itself (its arguments, or its
    buffers, which torch's all-to-all allocates before its check), or its exchange failed on the peers
    too. Elsewhere (torch's all-to-all on NCCL without ``ALLSCAN_CHECK=always``; ``never``) the peers
    wait until their timeout.
    Nothing is reported alone, for a failed communicator (the board spreads that already; NCCL's
    remote error, a ``CommunicatorError`` too, means a peer aborted, which the board spreads, or
    exited, which every rank's watch finds) or under CUDA graph capture (nothing runs before the
    replay)."""
    checked = _chunks_checked(plan.group, like)

    def failed(c: Optional[int], error: BaseException, step: Optional[str] = None) -> None:
        if plan.world == 1 or isinstance(error, _C.CommunicatorError):
            return
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        where = "before its first all-to-all" if c is None else f"at head chunk {c}"
        reason = f"{_OP}: its {phase} failed {where}: {type(error).__name__}: {error}"
        if _use_cpp(plan.group, like):
            _comm.report_local_error(plan.group, like.device, reason)
        elif checked and step in (None, "attend"):
            announce_invalid(plan.group, like.device, _OP, reason)
    return failed


DOUBLE_BACKWARD_REFUSED = (
    f"{_OP}: double backward (a backward with create_graph=True, e.g. for a gradient penalty) is not supported: "
    "its backward (all-to-alls around each head chunk's attention backward) is not differentiable. Take the "
    "gradients without create_graph=True, or use one-process attention where second-order gradients are needed")


def _graph_kept() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``): the per-chunk graphs are
    then kept for the next backward. True where torch cannot tell (keeping is always correct)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _ChunkPlan):
        out, graphs = _forward(plan, q, k, v, keep_graph=True)
        ctx.plan = plan
        ctx.graphs = graphs
        return out

    @staticmethod
    def backward(ctx, dout):
        # The per-chunk graphs are freed as the backward consumes them unless the graph is retained (a
        # second backward then runs through them again); a backward without retain_graph frees them, so a
        # next one raises torch's "backward through the graph a second time" error first.
        plan, graphs = ctx.plan, ctx.graphs
        retain = _graph_kept()
        dq, dk, dv = _backward(plan, graphs, dout, ctx.needs_input_grad, retain)
        if not retain:
            ctx.graphs = None
        return dq, dk, dv, None


def _forward_buffers(plan: _ChunkPlan, q, k, v):
    """The output and, per chunk, the head-sharded q, k, v it receives (its new k/v heads only),
    allocated up front on the current stream."""
    B, S, D, me = plan.B, plan.Sl * plan.world, plan.D, plan.me
    out = q.new_empty(B, plan.Sl, plan.Hq, D)
    ins = []
    for ch in plan.chunks:
        lo, hi = ch.new_map[me]
        ins.append((q.new_empty(B, S, ch.nq, D), k.new_empty(B, S, hi - lo, D), v.new_empty(B, S, hi - lo, D)))
    return out, ins


def _forward(plan: _ChunkPlan, q, k, v, keep_graph: bool, streams: Optional[bool] = None):
    """streams: None = two streams on CUDA unless ALLSCAN_ULYSSES_STREAMS=0; False = one stream.
    With ALLSCAN_CHECK=always a two-stream forward is repeated on one stream (same chunks, same
    kernels) and must match it bitwise, else RuntimeError (a pipeline synchronisation bug)."""
    B, Sl, D, P = plan.B, plan.Sl, plan.D, plan.world
    S = Sl * P
    group = plan.group
    chunks = plan.chunks
    use = _use_streams(q) if streams is None else (bool(streams) and q.is_cuda)
    cuda = q.device if use else None
    failed = _report_failure(plan, q, "forward")
    check = _chunks_checked(group, q)
    me = plan.me
    try:
        out, ins = _forward_buffers(plan, q, k, v)
    except Exception as e:
        failed(None, e)
        raise
    pieces = [(ch.new_map[me][0], ch.new_map[me][1], ins[c][1], ins[c][2]) for c, ch in enumerate(chunks)]
    graphs: List[Optional[tuple]] = [None] * len(chunks)

    def scatter(c, stream):
        ch = chunks[c]
        a2a_multi(SCATTER, [q, k, v], [ch.q_map, ch.new_map, ch.new_map], [plan.Hq, plan.Hkv, plan.Hkv],
                  group, outs=list(ins[c]), stream=stream, check=check, call_signature=plan.call_signature,
                  names=["q", "k", "v"])

    def attend(c):
        ch = chunks[c]
        qc = ins[c][0]
        if ch.nq == 0:
            return qc.new_empty(B, S, 0, D)
        kc, vc = _kv_for_chunk(ch, pieces[:c + 1])
        if keep_graph:
            # The graph starts at the expanded k/v: their gradients are reduced in fp32 in _backward
            # rather than by autograd's index_select backward, which adds in the storage dtype.
            kc, vc = _expand_kv(ch, kc, vc)
            qc, kc, vc = (t.detach().requires_grad_(True) for t in (qc, kc, vc))
            with torch.enable_grad():
                oc = _sdpa(plan, qc, kc, vc)
            graphs[c] = (oc, qc, kc, vc)
            return oc.detach()
        return _attend(plan, ch, qc, kc, vc)

    def gather(c, oc, stream):
        ch = chunks[c]
        a2a_multi(GATHER, [oc], [ch.q_map], [plan.Hq], group, outs=[out], stream=stream, check=check,
                  call_signature=plan.call_signature, names=["attention output"])

    _run_pipeline(len(chunks), scatter, attend, gather, cuda, failed=failed)
    del ins
    if cuda is not None and settings.check == "always":
        with torch.no_grad():
            ref, _ = _forward(plan, q, k, v, keep_graph=False, streams=False)
        if not torch.equal(out, ref):
            diff = (out.float() - ref.float()).abs()
            bad = (diff > 0).reshape(B, Sl, plan.Hq, D).any(3).any(1).any(0).nonzero().flatten().tolist()
            raise RuntimeError(
                f"UlyssesAttention (ALLSCAN_CHECK=always): the two-stream forward differs from the one-stream "
                f"forward with the same {len(chunks)} chunks (max abs diff {diff.max().item():.3g}, heads {bad}): "
                f"a synchronisation bug in the pipeline")
    return out, graphs


def _backward_buffers(plan: _ChunkPlan, dout):
    """``(dout contiguous, dq, dk, dv, douts, acc_k, acc_v)``: the gradients this rank gathers, the
    head-sharded output gradient per chunk, and with ``plan.kv_accumulate`` the k/v gradients of the
    whole sequence summed in fp32 (fp64) before they travel (else None, None)."""
    B, Sl, D = plan.B, plan.Sl, plan.D
    S = Sl * plan.world
    dout = dout.contiguous()
    dq = dout.new_empty(B, Sl, plan.Hq, D)
    douts = [dout.new_empty(B, S, ch.nq, D) for ch in plan.chunks]
    if not plan.kv_accumulate:
        return dout, dq, dout.new_empty(B, Sl, plan.Hkv, D), dout.new_empty(B, Sl, plan.Hkv, D), douts, None, None
    # k/v gradients travel and are summed in fp32 (fp64) and rounded once at the end
    acc_dtype = torch.float64 if dout.dtype == torch.float64 else torch.float32
    dk, dv = (torch.zeros(B, Sl, plan.Hkv, D, dtype=acc_dtype, device=dout.device) for _ in range(2))
    n_kv = plan.kv_hi - plan.kv_lo
    acc_k, acc_v = (torch.zeros(B, S, n_kv, D, dtype=acc_dtype, device=dout.device) for _ in range(2))
    return dout, dq, dk, dv, douts, acc_k, acc_v


def _backward(plan: _ChunkPlan, graphs, dout, needs, retain: bool = False):
    """dq, dk, dv (None where ``needs`` says none is wanted) from the per-chunk graphs the forward kept;
    ``retain``: keep those graphs for another backward (``retain_graph=True``), else free each once used.
    Refused (every rank runs the same graph, so every rank raises, before any all-to-all) under
    ``create_graph=True``: the gradients it returns are not differentiable."""
    B, Sl, D, P = plan.B, plan.Sl, plan.D, plan.world
    S = Sl * P
    group = plan.group
    chunks = plan.chunks
    cuda = dout.device if _use_streams(dout) else None
    failed = _report_failure(plan, dout, "backward")
    check = _chunks_checked(group, dout)
    me = plan.me
    try:
        if torch.is_grad_enabled():  # the engine runs a backward in grad mode only for create_graph=True
            raise RuntimeError(DOUBLE_BACKWARD_REFUSED)
        dout, dq, dk, dv, douts, acc_k, acc_v = _backward_buffers(plan, dout)
    except Exception as e:
        failed(None, e)
        raise

    def scatter(c, stream):
        ch = chunks[c]
        a2a_multi(SCATTER, [dout], [ch.q_map], [plan.Hq], group, outs=[douts[c]], stream=stream,
                  check=check, call_signature=plan.call_signature, names=["output gradient"])

    def attend(c):
        ch = chunks[c]
        g = graphs[c]
        if g is None:  # no query head of this chunk on this rank (so no k/v head either)
            if plan.kv_accumulate:  # the k/v gradients travel in the accumulators' dtype
                return dout.new_empty(B, S, 0, D), acc_k[:, :, :0], acc_v[:, :, :0]
            return tuple(dout.new_empty(B, S, 0, D) for _ in range(3))
        oc, qc, kc, vc = g
        gq, gk, gv = torch.autograd.grad(oc, (qc, kc, vc), douts[c], retain_graph=retain)
        if not retain:
            graphs[c] = None
        if not plan.kv_accumulate:
            return gq.contiguous(), gk.contiguous(), gv.contiguous()
        idx = ch.index(gk.device, ch.kv_lo - plan.kv_lo)
        acc_k.index_add_(2, idx, gk.to(acc_k.dtype))
        acc_v.index_add_(2, idx, gv.to(acc_v.dtype))
        lo, hi = ch.done_map[me]
        a, b = lo - plan.kv_lo, hi - plan.kv_lo
        return gq.contiguous(), acc_k[:, :, a:b].contiguous(), acc_v[:, :, a:b].contiguous()

    def gather(c, res, stream):
        ch = chunks[c]
        acc = plan.kv_accumulate
        if not acc:
            a2a_multi(GATHER, list(res), [ch.q_map, ch.kv_map, ch.kv_map], [plan.Hq, plan.Hkv, plan.Hkv],
                      group, outs=[dq, dk, dv], stream=stream, check=check, call_signature=plan.call_signature,
                      names=["dq", "dk", "dv"])
        else:
            a2a_multi(GATHER, [res[0]], [ch.q_map], [plan.Hq], group, outs=[dq], stream=stream, check=check,
                      call_signature=plan.call_signature, names=["dq"])
            a2a_multi(GATHER, list(res[1:]), [ch.done_map, ch.done_map], [plan.Hkv, plan.Hkv], group,
                      outs=[dk, dv], accumulate=[True, True], stream=stream, check=check,
                      call_signature=plan.call_signature, names=["dk", "dv"])

    _run_pipeline(len(chunks), scatter, attend, gather, cuda, failed=failed)
    if plan.kv_accumulate:
        dk, dv = dk.to(dout.dtype), dv.to(dout.dtype)
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None)


# ------------------------------------------------------------------------------------------------
# Choosing the number of chunks
# ------------------------------------------------------------------------------------------------

_AUTO_CACHE = PlanCache()  # key -> (chosen chunk count, timings); bounded LRU
_PLANS = PlanCache()  # key -> _ChunkPlan; bounded LRU


def clear_auto_cache() -> None:
    _AUTO_CACHE.clear()
    _PLANS.clear()


def _time_cuda(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps runs (one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def model_time(C: int, n: int, att: Tuple[float, float], comm: Tuple[float, float]) -> float:
    """Pipeline time (ms) of C equal chunks of a rank's n heads. att = (fixed, per head) of one
    chunk's attention, comm = (fixed, per head) of one chunk's scatter + gather. The first scatter
    and the last gather are exposed; in between each step takes the longer of the attention of a
    chunk and the all-to-alls that run beside it."""
    m = n / C
    a = att[0] + m * att[1]
    x = comm[0] + m * comm[1]
    return x + C * a + (C - 1) * max(0.0, x - a)


def choose_num_chunks(n_heads: int, att: Tuple[float, float], comm: Tuple[float, float],
                      max_chunks: Optional[int] = None, min_gain: float = 0.02) -> int:
    """The C that minimises :func:`model_time`; 1 unless it saves at least ``min_gain`` of C = 1."""
    cmax = max(1, min(n_heads, max_chunks or n_heads))
    t1 = model_time(1, n_heads, att, comm)
    best, best_t = 1, t1
    for C in range(2, cmax + 1):
        t = model_time(C, n_heads, att, comm)
        if t < best_t:
            best, best_t = C, t
    if best_t > t1 * (1.0 - min_gain):
        return 1
    return best


def _measure(plan_args, q, k, v, train: bool = False, min_gain_measured: float = 0.01) -> Tuple[int, dict]:
    """Measure (collectively) attention and all-to-all costs at 1 head and all heads per rank, agree
    on the maxima across ranks, choose C from the model, then time the layer at that C against C = 1
    (forward+backward when ``train``) and keep the faster."""
    group, world, me, B, Sl, Hq, Hkv, D, causal, scale, max_chunks, bounds = plan_args
    n_min = min(hi - lo for lo, hi in split_heads(0, Hq, world))
    full = _ChunkPlan(group, world, me, B, Sl, Hq, Hkv, D, 1, None, causal, scale, bounds)
    one = full
    if n_min > 1:
        one = _ChunkPlan(group, world, me, B, Sl, Hq, Hkv, D, max(1, n_min), None, causal, scale, bounds)
    S = Sl * world

    def att_time(pl):
        ch = pl.chunks[0]
        qc = q.new_empty(B, S, ch.nq, D).normal_()
        kc = q.new_empty(B, S, ch.nkv, D).normal_()
        vc = q.new_empty(B, S, ch.nkv, D).normal_()
        return ch.nq, _time_cuda(lambda: _attend(pl, ch, qc, kc, vc), 2)

    def comm_time(pl):
        ch = pl.chunks[0]
        outs = [q.new_empty(B, S, ch.nq, D), k.new_empty(B, S, ch.nkv, D), v.new_empty(B, S, ch.nkv, D)]
        o = q.new_empty(B, Sl, Hq, D)

        def run():
            a2a_multi(SCATTER, [q, k, v], [ch.q_map, ch.kv_map, ch.kv_map], [Hq, Hkv, Hkv], group,
                           outs=outs, check=False)
            a2a_multi(GATHER, [outs[0]], [ch.q_map], [Hq], group, outs=[o], check=False)

        return _time_cuda(run, 3)

    n_full, t_att_full = att_time(full)
    n_one, t_att_one = att_time(one)
    dist.barrier(group=group)
    t_comm_full = comm_time(full)
    t_comm_one = comm_time(one)
    # Every rank must choose the same C: the maxima over ranks (head counts included) feed the model.
    vals = torch.tensor([t_att_full, t_att_one, t_comm_full, t_comm_one, n_full, n_one], dtype=torch.float64,
                        device=q.device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    t_att_full, t_att_one, t_comm_full, t_comm_one, n_full, n_one = vals.tolist()
    n_full, n_one = max(int(n_full), 1), int(n_one)
    if n_full > n_one:
        att_slope = max(0.0, (t_att_full - t_att_one) / (n_full - n_one))
        comm_slope = max(0.0, (t_comm_full - t_comm_one) / (n_full - n_one))
    else:
        att_slope, comm_slope = t_att_full / n_full, t_comm_full / n_full
    att = (max(0.0, t_att_full - att_slope * n_full), att_slope)
    comm = (max(0.0, t_comm_full - comm_slope * n_full), comm_slope)
    C_model = C = choose_num_chunks(n_full, att, comm, max_chunks)
    measured = None
    if C > 1:
        # The model can promise overlap the hardware does not deliver (on NVLink the all-to-alls and
        # the attention share the SMs and the memory): time the real pipeline at C and at 1, side by
        # side, and keep C only if it is measurably faster.
        measured = _time_candidates(plan_args, q, k, v, [1, C], train)
        C = pick_measured(measured, min_gain=min_gain_measured)
    info = {
        "t_attention_ms": t_att_full,
        "t_all_to_all_ms": t_comm_full,
        "rho": t_comm_full / (t_comm_full + t_att_full) if t_comm_full + t_att_full > 0 else 0.0,
        "attention_model_ms": att,
        "all_to_all_model_ms": comm,
        "num_chunks": C,
        "model_num_chunks": C_model,
        "predicted_ms": {c: model_time(c, n_full, att, comm) for c in range(1, max(1, n_full) + 1)},
        "measured_ms": measured,
        "measured_pass": "forward+backward" if train else "forward",
    }
    return C, info


def pick_measured(measured: Dict[int, float], min_gain: float = 0.01) -> int:
    """The fastest C of ``measured`` ({C: ms}, C = 1 included), 1 unless it beats C = 1 by at least
    ``min_gain`` (timing noise must not pick a chunking that is no faster)."""
    if 1 not in measured:
        raise ValueError("pick_measured: the measurements must include C = 1")
    best = min(measured, key=lambda c: (measured[c], c))
    if best != 1 and measured[best] > measured[1] * (1.0 - min_gain):
        return 1
    return best


def _time_candidates(plan_args, q, k, v, candidates, train: bool, reps: int = 5) -> Dict[int, float]:
    """Median ms of the whole layer (forward, or forward+backward when ``train``) at each C, the
    candidates interleaved so that drift (clocks, other work) hits them alike; the maxima over ranks
    (collective: every rank runs the same candidates in the same order)."""
    group, world, me, B, Sl, Hq, Hkv, D, causal, scale, _, bounds = plan_args
    plans = {c: _ChunkPlan(group, world, me, B, Sl, Hq, Hkv, D, c, None, causal, scale, bounds) for c in candidates}
    if train:
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        dout = torch.randn_like(q)

        def run(pl):
            with torch.enable_grad():
                out = _UlyssesFn.apply(qg, kg, vg, pl)
                torch.autograd.grad(out, (qg, kg, vg), dout)
    else:
        def run(pl):
            _forward(pl, q, k, v, keep_graph=False)

    for c in candidates:  # warm-up (first use of a plan's shapes)
        run(plans[c])
    dist.barrier(group=group)
    times: Dict[int, List[float]] = {c: [] for c in candidates}
    for r in range(reps):
        for c in (candidates if r % 2 == 0 else candidates[::-1]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(plans[c])
            b.record()
            b.synchronize()
            times[c].append(a.elapsed_time(b))
    med = torch.tensor([sorted(times[c])[reps // 2] for c in candidates], dtype=torch.float64, device=q.device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return {c: float(t) for c, t in zip(candidates, med.tolist())}


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, world):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"UlyssesAttention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"UlyssesAttention: {name} must be 4-D [B, S_local, H, D], got shape {tuple(t.shape)}")
        dtype_code(t.dtype, f"UlyssesAttention: {name}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"UlyssesAttention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"UlyssesAttention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"UlyssesAttention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Sl, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != Sl or k.shape[3] != D:
        raise ValueError(
            f"UlyssesAttention: k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, local sequence and head_dim"
        )
    Hkv = k.shape[2]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"UlyssesAttention: the query heads ({Hq}) must be a multiple of the k/v heads ({Hkv}) (grouped-query attention)"
        )
    if Hq < world:
        raise ValueError(
            f"UlyssesAttention: needs at least one query head per rank: {Hq} query heads for a group of {world} ranks"
        )
    return B, Sl, Hq, Hkv, D


def signature(q, k, causal: bool, scale: Optional[float], num_chunks: int, needs_grad: bool,
              bounds: Optional[Tuple[int, ...]] = None):
    """The fields every rank's call must agree on (``num_chunks`` 0: "auto"), for ``check_across_ranks``."""
    B, Sl, Hq, D = q.shape
    return [("batch B", B), ("local sequence length S_local", Sl), ("query heads", Hq), ("k/v heads", k.shape[2]),
            ("head_dim D", D), ("dtype", DTYPE_CODES[q.dtype]), ("causal", int(bool(causal))),
            ("scale (x1e9)", int(round((scale or 0.0) * 1e9))), ("num_chunks (0 auto)", int(num_chunks)),
            ("needs grad", int(needs_grad)),
            ("packed sequences (0: cu_seqlens None)", 0 if bounds is None else len(bounds) - 1),
            ("cu_seqlens checksum", 0 if bounds is None else zlib.crc32(repr(tuple(bounds)).encode()))]


def refuse_packed_while_tracing(op: str) -> None:
    """Packed sequences while torch.compile traces: the bounds are read on the host and would specialise
    the graph, so such a call is left to eager (a graph break; ``fullgraph=True`` raises this)."""
    raise NotImplementedError(f"{op}: packed sequences (cu_seqlens) under torch.compile are not traced (the bounds "
                              "are read on the host); without fullgraph=True the call runs eagerly")


def packed_bounds(cu_seqlens, B: int, S: int, op: str = _OP) -> Optional[Tuple[int, ...]]:
    """``cu_seqlens`` (a 1-D integer tensor or sequence, the packed sequences' offsets in the whole
    sequence of ``S`` tokens, the same on every rank) as a tuple of ints, checked (a tensor on a GPU is
    read once: a device synchronisation); None stays None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        bounds = tuple(int(b) for b in cu_seqlens.tolist())
    else:
        try:
            if any(isinstance(b, bool) for b in cu_seqlens):
                raise TypeError
            bounds = tuple(operator.index(b) for b in cu_seqlens)  # ints, NumPy's included
        except TypeError:
            raise ValueError(f"{op}: cu_seqlens must hold integers, got {cu_seqlens!r}") from None
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch size must be 1 (the sequences packed in one row), got {B}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != S or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to the whole sequence's length {S} (the local length "
                         f"times the group size), got {list(bounds)}")
    return bounds


def ulysses_attention(q, k, v, group=None, *, causal: bool = False, scale: Optional[float] = None,
                      num_chunks: Union[int, str] = "auto", chunk_weights: Optional[Sequence[float]] = None,
                      max_chunks: Optional[int] = None, cu_seqlens=None, return_info: bool = False):
    """Functional form of :class:`UlyssesAttention` (see there). Traced by torch.compile it is plain
    Ulysses with one head chunk (:mod:`allscan.ops.ulysses_traced`), without packed sequences."""
    group = normalize_group(group)
    if torch.compiler.is_compiling():
        if cu_seqlens is not None:
            refuse_packed_while_tracing(_OP)
        from .ulysses_traced import traced_attention

        chunks = 0 if num_chunks == "auto" else num_chunks
        if not (chunks == 0 or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1)):
            chunks = -1  # refused by the op, on every rank, when it runs
        out = traced_attention(q, k, v, group, causal, scale, chunks)
        return (out, {"num_chunks": 1, "auto": None}) if return_info else out
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    try:
        B, Sl, Hq, Hkv, D = _check_inputs(q, k, v, world)
        if isinstance(num_chunks, str):
            if num_chunks != "auto":
                raise ValueError(f"UlyssesAttention: num_chunks must be a positive int or 'auto', got {num_chunks!r}")
        elif isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or not 1 <= num_chunks <= Hq:
            raise ValueError(f"UlyssesAttention: num_chunks must be 'auto' or an int in [1, {q.shape[2]}] (query heads), got {num_chunks!r}")
        if chunk_weights is not None and (num_chunks == "auto" or len(chunk_weights) != num_chunks
                                          or any(w <= 0 for w in chunk_weights)):
            raise ValueError("UlyssesAttention: chunk_weights needs an int num_chunks and one positive weight per chunk")
        bounds = packed_bounds(cu_seqlens, B, Sl * world)
    except (ValueError, TypeError) as e:
        # The other ranks may be in the signature exchange: join it, so they raise too. Packed calls
        # exchange on every call (their bounds change from batch to batch and are read on the host anyway).
        announce_invalid(group, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), _OP, str(e),
                         every_call=cu_seqlens is not None)
        raise
    # A mismatch raises on every rank instead of hanging in an all-to-all.
    check_across_ranks(group, q.device, _OP, signature(q, k, causal, scale, 0 if num_chunks == "auto" else num_chunks,
                                                       torch.is_grad_enabled() and any(t.requires_grad
                                                                                       for t in (q, k, v)), bounds),
                       every_call=bounds is not None)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    info = None
    if num_chunks == "auto":
        if q.is_cuda and world > 1 and _use_streams(q):
            train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            # measured once per shape: packed sequences (whose bounds change from batch to batch) are timed
            # as one sequence
            key = (group.group_name, B, Sl, Hq, Hkv, D, q.dtype, bool(causal), scale, max_chunks, train)
            hit = _AUTO_CACHE.get(key)
            if hit is None:
                with torch.no_grad():
                    hit = _measure((group, world, me, B, Sl, Hq, Hkv, D, causal, scale, max_chunks, None), q, k, v,
                                   train=train)
                _AUTO_CACHE[key] = hit
            num_chunks, info = hit
        else:
            num_chunks = 1  # no second stream: nothing to overlap
    pkey = (group.group_name, world, me, B, Sl, Hq, Hkv, D, int(num_chunks),
            tuple(chunk_weights) if chunk_weights is not None else None, bool(causal), scale, bounds)
    plan = _PLANS.get(pkey)
    if plan is None:
        plan = _ChunkPlan(group, world, me, B, Sl, Hq, Hkv, D, int(num_chunks), chunk_weights, causal, scale, bounds)
        _PLANS[pkey] = plan
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _UlyssesFn.apply(q, k, v, plan)
    else:
        out, _ = _forward(plan, q, k, v, keep_graph=False)
    if return_info:
        return out, {"num_chunks": int(num_chunks), "auto": info}
    return out
