"""Gated linear attention with ZeCO sequence parallelism (All-Scan): :func:`zeco_gla`.

A long sequence is cut into contiguous shards, one per rank of ``group`` (rank order = sequence
order). :func:`zeco_gla` returns on each rank exactly what single-GPU ``chunk_gla`` (fla) returns on
the whole sequence, restricted to the rank's shard.

The algorithm (rank p, shard of T tokens, log decays g, G_t = sum_{s<=t} g_s inside the shard)::

    local:      (o_loc, S_loc) = chunk_gla(q, k, v, g, initial_state=0)     # zero incoming state
    All-Scan:   S_in_p = scan(S_loc, gamma=exp(G_T))                       # y_{p+1} = exp(G_T,p) y_p + S_loc_p
    correction: o = o_loc + scale * (q * exp(G)) @ S_in                    # no recomputation
                S_out = S_loc + exp(G_T) * S_in

The scan runs asynchronously while the local intra-chunk attention and output are computed.

Backward, with Z_p the gradient of the state leaving rank p (from the next rank and, on the rank that
returns it, from the caller's ``final_state``): the gradient of the state entering rank p is
``dS_in_p = X_p + exp(G_T) * Z_p`` with ``X_p = scale * sum_t (q_t * exp(G_t)) do_t^T``, and
``Z_{p-1} = dS_in_p``, i.e. ``Z`` is the REVERSE All-Scan of ``X_p + exp(G_T) * dfinal_p`` with the
same decays. ``X_p`` needs only q, g and do, so the reverse scan starts early (after the chunk states
are recomputed: that kernel slows beside a concurrent one) and runs while the local backward prepares
everything else that does not need ``Z``; then the local backward of
``chunk_gla(q, k, v, g, initial_state=S_in)`` with final-state gradient ``Z`` gives exactly dq, dk, dv,
dg (including the decay of the incoming state) and the initial state's gradient. The last rank knows
its ``Z`` (the caller's ``dfinal``) without the scan: on fla's kernels it runs the local state backward
first, and the initial state's gradient that backward computes is its ``dS_in`` (no pass for ``X``).

Variable-length packing (``cu_seqlens`` over the GLOBAL packed sequence, B = 1, equal shard lengths):
the shard is cut into local segments at the sequence boundaries that fall inside it
(:class:`ShardSegments`). Only the first segment can continue a sequence from the previous rank (the
incoming state applies to its tokens only); the state passed on is the last segment's. A rank whose
shard contains a sequence start passes decay 0 to the scan, so no state crosses a sequence start.

Methods (same code, different scan): ``"zeco"`` (pipelined All-Scan, overlapped), ``"lasp1"`` (serial
point-to-point chain, waited for before the local output: LASP-1), ``"lasp2"`` (all-gather of every
state: LASP-2, overlapped).

Collectives (what keeps P ranks from deadlocking): with ``world > 1`` every rank, in every branch
(first, last or inner rank, varlen or not, any method), issues exactly one ``allscan.scan`` in forward
and one reverse ``allscan.scan`` in backward, with the same signature (state ``[B, H, K, V]`` fp32;
gamma of the same shape and dtype on every rank, or None on every rank), and nothing else. Every rank
launches its scans in the same order, and the local work before a launch that may synchronise the
device (Triton compiling or autotuning, ``.item()``; in the backward the chunk states' recomputation,
a middle rank's X, the last rank's state backward) waits only for work already issued, whose scans
every peer launches without waiting for this rank: so every rank reaches each launch. If the last
rank's state backward raises before its launch, it launches from X instead and raises after. Every
async handle is waited on before the function returns. A rank that raises after launching its scan
leaves its peers able to finish that scan; a mismatch of arguments across ranks raises on every rank
in the scan's signature check instead of hanging.

The local work runs on one of two staged backends (:class:`~allscan.ops.gla.fla.FlaGLA` on CUDA with
fla-core, :class:`~allscan.ops.gla.chunk.TorchGLA` otherwise; ``ALLSCAN_GLA_BACKEND`` forces one).

Entry points of the same two bodies (:func:`_forward`, :func:`_backward`): eager calls go through
:class:`ZecoGLAFunction`; under torch.compile the layer is the custom ops ``allscan::zeco_gla`` and
``allscan::zeco_gla_backward`` (the tracer sees neither the collectives nor fla's kernels). The scans
are issued, and the eager bodies run, through the op's documented hooks (:mod:`allscan.ops.hooks`:
``gla_scan``, ``gla_body``), which benchmarks replace to time them from outside.
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from allscan._agreement import check_across_ranks
from allscan._dtypes import DTYPE_CODES
from allscan._settings import settings

from allscan._comm import resolve_group

from .._launch import absent, or_empty, tell_peers_of_failure, traced_refusal, validated_group
from ..diagonal_scan import OP as SCAN_OP
from ..hooks import op_hooks
from .._shards import (LOCAL, ShardSegments, checked_cut, inputs_need_grad, on_device, own_precision,
                       sequence_parallel_group, world_and_rank)
from ..batch_context import context_conflict, context_fields, context_group
from .chunk import TorchGLA
from .fla import FlaGLA, fla_available

__all__ = ["zeco_gla", "LOCAL", "METHODS"]

_SCAN_METHOD = {"zeco": "pipelined", "lasp1": "serial", "lasp2": "allgather"}
METHODS = tuple(_SCAN_METHOD)  # the ``method=`` values of zeco_gla


_WARNED: list = []


def select_backend(q):
    """The local backend for ``q``: fla-core's kernels on CUDA when importable, the torch chunked
    implementation otherwise (``ALLSCAN_GLA_BACKEND=fla|torch`` forces one)."""
    want = settings.gla_backend
    if want == "torch":
        return TorchGLA
    if q.is_cuda and (want == "fla" or fla_available()):
        return FlaGLA
    if want == "fla":
        raise RuntimeError("ALLSCAN_GLA_BACKEND=fla needs CUDA tensors and fla-core (pip install allscan[gla])")
    if q.is_cuda and not _WARNED:
        _WARNED.append(True)
        warnings.warn("allscan.ops.gla: fla-core (flash-linear-attention) is not importable; using the torch "
                      "chunked GLA on CUDA (correct, but slow and memory-hungry: pip install allscan[gla])")
    return TorchGLA


def _full_decay(g, q):
    """g of GLA ``[B,T,H,K]``, simple GLA ``[B,T,H]`` or None -> ``[B,T,H,K]`` for the local kernels."""
    B, T, H, K = q.shape
    if g is None:
        return q.new_zeros(B, T, H, K, dtype=torch.float32)
    if g.dim() == 3:
        return g.unsqueeze(-1).expand(B, T, H, K).contiguous()
    return g.contiguous()


def _scale_state(S, evec):
    return S if evec is None else S * evec


def _gamma_fixed(segs, g, B, device, share_zeros: bool):
    """The decay this rank passes to the All-Scan (a prefix shape of the state [B, H, K, V])."""
    if g is None:
        shape = (B,)
    else:
        shape = tuple(g.shape[:1]) + tuple(g.shape[2:])  # [B, H, K] or [B, H]
    # Zero where a sequence starts in this shard (no state crosses it), and at the chain's ends, whose
    # decay no scan reads: the first rank's multiplies the zero entering the forward scan's head, the
    # last rank's the zero entering the reverse scan's head (both heads send their x as it is); it
    # saves the ends the shard's decay (a kernel launch and its host time)
    if segs.starts_inside or (g is not None and segs.rank in (0, segs.world - 1)):
        return _zeros(shape, device, share_zeros)
    if g is None:  # plain linear attention: decay 1 (a tensor when varlen, so every rank passes one)
        return torch.ones(shape, dtype=torch.float32, device=device) if segs.varlen else None
    return None  # computed by the backend from the shard's decays


_SHARED_ZEROS: Dict[tuple, torch.Tensor] = {}
_SHARED_ZEROS_BYTES = 32 << 20  # what the shared zeros may hold in all; a larger tensor is made per call


def _zeros(shape: tuple, device: torch.device, shared: bool) -> torch.Tensor:
    """fp32 zeros of ``shape`` that only a scan reads (a chain end's decay, the part of the incoming
    state's gradient a rank without one contributes). ``shared`` (eager calls): made once per shape and
    device, a launch and its host time per call saved, except while a CUDA graph is captured; the
    custom ops make their own (torch.compile's CUDA graphs warm up in a graph pool the tree may hand
    out again)."""
    nbytes = 4 * math.prod(shape)
    if not shared or nbytes > _SHARED_ZEROS_BYTES // 4 or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    key = (shape, device)
    zeros = _SHARED_ZEROS.get(key)
    if zeros is None:
        if nbytes + sum(4 * z.numel() for z in _SHARED_ZEROS.values()) > _SHARED_ZEROS_BYTES:
            _SHARED_ZEROS.clear()  # bounded: a process that sees ever new shapes
        zeros = _SHARED_ZEROS[key] = torch.zeros(shape, dtype=torch.float32, device=device)
    return zeros


def _segment_states(segs: ShardSegments, h0, first) -> List[Optional[torch.Tensor]]:
    """The initial state of every local segment (None = zeros): ``first`` for a first segment that
    continues a sequence from the previous rank, else the caller's ``initial_state`` (its row)."""
    h0s: List[Optional[torch.Tensor]] = []
    for j in range(segs.nseg):
        if j == 0 and segs.continued:
            h0s.append(first)
        elif h0 is None:
            h0s.append(None)
        elif segs.varlen:
            h0s.append(h0[segs.seq_ids[j]:segs.seq_ids[j] + 1])
        else:
            h0s.append(h0)
    return h0s


def _forward(be, q, k, v, g, h0, scale, segs: ShardSegments, method: str, want_final: bool, keep_offsets=True,
             share_zeros=True):
    """The forward on the local backend ``be``: ``(o, final or None, S_in or None, gamma or None,
    saved)``, what the backward needs besides the inputs (``S_in``: the state entering the shard,
    None with one rank; ``gamma``: the decay the All-Scan used; ``saved``: the backend's tensors, with
    ``keep_offsets`` the chunk offsets too)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = segs.world > 1
    smethod = _SCAN_METHOD[method]
    gamma = None
    # everything before this rank's part of the scan: a failure (out of memory) tells the peers
    # waiting in it, which raise too
    try:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gf = _full_decay(g, q)
        h0s = _segment_states(segs, h0, None)  # a continued first segment starts from 0
        st = be.fwd_states(q, k, v, gf, scale, segs.bounds, h0s)
        if sp:
            gamma = _gamma_fixed(segs, g, B, q.device, share_zeros)
            if gamma is None and g is not None:
                gamma = be.shard_gamma(st, g)
            x = st.finals[-1].float().contiguous()
    except Exception as e:
        if sp:
            tell_peers_of_failure(segs.group, SCAN_OP, "its forward before the scan", e)
        raise
    handle = None
    S_in = None
    if sp:
        if method == "lasp1":
            S_in = op_hooks.gla_scan(x, gamma, segs.group, method=smethod)
        else:
            handle = op_hooks.gla_scan(x, gamma, segs.group, method=smethod, async_op=True)
    finals = list(st.finals)
    fused = None
    if segs.continued and getattr(be, "fused_output_ok", lambda: False)():
        # The intra-chunk part runs while the state is in flight; then one output kernel with
        # the incoming state folded in (no second pass over q, the decays and o).
        be.fwd_intra(st, q, k, scale)
        if handle is not None:
            S_in = handle.wait()
        fused = be.fwd_output_with_state(st, q, v, S_in, scale, segs.bounds[1])
        if fused is not None:
            o, evec = fused
        else:
            o = be.fwd_output(st, q, k, v, gf, scale, segs.bounds)
    else:
        o = be.fwd_output(st, q, k, v, gf, scale, segs.bounds)
        if handle is not None:
            S_in = handle.wait()
    if segs.continued:  # the incoming state's contribution to the first segment, no recomputation
        if fused is None:
            evec = be.correct(st, q, g, o, S_in, scale, segs.bounds[1])
        if want_final and segs.ends_here[0]:  # the first segment's final state is returned
            finals[0] = finals[0] + _scale_state(S_in, evec)

    final = None
    if want_final:
        if segs.varlen:
            final = q.new_zeros(segs.num_seqs, H, K, V, dtype=torch.float32)
            for j in range(segs.nseg):
                if segs.ends_here[j]:
                    final[segs.seq_ids[j]] = finals[j][0]
        else:
            final = finals[0]

    saved = be.saved(st, segs.bounds[1] if keep_offsets else None)
    return o, final, S_in, gamma, saved


def _final_grads(dfin, y) -> List[Optional[torch.Tensor]]:
    """The gradient of every local segment's final state (None: zero): the caller's ``dfin``, plus for
    the last segment ``y``, the gradient of the state leaving the shard from the next ranks (None:
    none)."""
    dhts = list(dfin)
    if y is not None:
        dhts[-1] = y if dhts[-1] is None else dhts[-1] + y
    return dhts


def _backward(be, do, dfinal, q, k, v, g, h0, S_in, gamma, saved, scale, segs: ShardSegments, method: str,
              share_zeros=True):
    """The backward on the local backend ``be`` from what :func:`_forward` returned: ``(dq, dk, dv,
    dg or None, dh0 or None)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = segs.world > 1
    smethod = _SCAN_METHOD[method]
    handle = y = x = None
    # everything before this rank's part of the reverse scan: a failure (out of memory) tells the
    # peers waiting in it, which raise too
    try:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        do = do.contiguous()
        gf = _full_decay(g, q)

        # final-state gradients per local segment
        dfin: List[Optional[torch.Tensor]] = []
        for j in range(segs.nseg):
            if dfinal is None or not segs.ends_here[j]:
                dfin.append(None)
            elif segs.varlen:
                dfin.append(dfinal[segs.seq_ids[j]:segs.seq_ids[j] + 1].float())
            else:
                dfin.append(dfinal.float())

        h0s = _segment_states(segs, h0, S_in)  # as the local forward saw them, with the true S_in
        # The chunk states are recomputed before the reverse scan is issued: that kernel runs few,
        # long, sequential CTAs, and beside the scan's kernels (the side stream, most of all inside a
        # CUDA graph) it ran up to 1.7x slower; the scan overlaps the intra-chunk backward instead. (The
        # delta layers' backward has no such step before the scan's result is needed, and issues its
        # scan beside the recomputation: ops/delta/fla.py.)
        prep = be.bwd_begin(q, k, v, gf, segs.bounds, h0s)

        # The last rank's final-state gradients are the caller's alone (nothing comes from its right),
        # so where the state backward is a step of its own (fla's kernel, not the torch backend's one
        # vjp of everything) it runs first and the gradient of the incoming state is the one it
        # computes anyway (with fla's rounding of the decayed queries to the input dtype, as fla's own
        # backward on one GPU): no separate pass over q, g and do for X.
        last = sp and segs.continued and segs.rank == segs.world - 1 and be.state_backward_first
        if last:
            try:
                prep = be.bwd_dh(prep, q, k, v, gf, scale, segs.bounds, h0s, do, _final_grads(dfin, y))
                x = prep.dh0s[0].reshape(B, H, K, V)
            except Exception:  # noqa: BLE001 - issue the scan from X, so the peers are not left waiting in
                last = False   # it; the state backward runs again after it (and raises there if it fails again)
        if sp and x is None:  # the part of dS_in this rank contributes (needs only q, g, do): start the scan on it
            if segs.continued:
                x, evec = be.xgrad(prep, saved, q, g, do, scale, segs.bounds[1])
                if dfin[0] is not None:
                    x = x + _scale_state(dfin[0], evec)
            else:  # nothing of this rank's output depends on the incoming state
                x = _zeros((B, H, K, V), q.device, share_zeros)
        if sp:
            x = x.contiguous()
    except Exception as e:
        if sp:
            tell_peers_of_failure(segs.group, SCAN_OP, "its backward before the reverse scan", e)
        raise
    if sp:
        if method == "lasp1":
            y = op_hooks.gla_scan(x, gamma, segs.group, reverse=True, method=smethod)
        else:
            handle = op_hooks.gla_scan(x, gamma, segs.group, reverse=True, method=smethod, async_op=True)

    prep = be.bwd_prepare(prep, saved, q, k, v, gf, scale, segs.bounds, h0s, do)
    if not last:
        if handle is not None:
            y, handle = handle.wait(), None
        prep = be.bwd_dh(prep, q, k, v, gf, scale, segs.bounds, h0s, do, _final_grads(dfin, y))
    dq, dk, dv, dgf, dh0s = be.bwd_finish(prep, q, k, v, gf, scale, segs.bounds, h0s, do)
    if handle is not None:
        handle.wait()  # the last rank's scan result is zero (nothing comes from its right)

    dg = None
    if g is not None:
        dg = (dgf.float().sum(-1) if g.dim() == 3 else dgf).to(g.dtype)
    dh0 = None
    if h0 is not None:
        dh0 = torch.zeros_like(h0)
        for j in range(segs.nseg):
            if (j == 0 and segs.continued) or dh0s[j] is None:
                continue
            if segs.varlen:
                dh0[segs.seq_ids[j]] += dh0s[j][0].to(h0.dtype)
            else:
                dh0 += dh0s[j].to(h0.dtype)
    return dq, dk, dv, dg, dh0


class ZecoGLAFunction(torch.autograd.Function):
    """The autograd function of :func:`zeco_gla` in eager mode (arguments already checked).
    Differentiable once: the backward holds the incoming state as a constant (its own dependence on
    the other ranks' inputs is not in the gradients), so differentiating the gradients again raises
    rather than returning second-order gradients without those terms."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, segs: ShardSegments, method: str, want_final: bool):
        be = select_backend(q)
        with own_precision(q.device.type), on_device(q):
            o, final, S_in, gamma, saved = op_hooks.gla_body("forward body", _forward, be, q, k, v, g, h0, scale,
                                                             segs, method, want_final)
        ctx.save_for_backward(q, k, v, g, h0, S_in, *saved)
        ctx.be, ctx.scale, ctx.segs, ctx.method, ctx.gamma = be, scale, segs, method, gamma
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, g, h0, S_in, *saved = ctx.saved_tensors
        with own_precision(do.device.type), on_device(do):
            grads = op_hooks.gla_body("backward body", _backward, ctx.be, do, dfinal, q, k, v, g, h0, S_in,
                                      ctx.gamma, saved, ctx.scale, ctx.segs, ctx.method)
        return grads + (None, None, None, None)


# ------------------------------------------------------------------------------------------------
# torch.compile: the same forward and backward as two custom ops (opaque to the tracer: no graph
# break, no collective while tracing; every rank runs them as the eager function does). Absent
# results travel as empty tensors (a schema has no optional outputs); which are absent depends on
# shapes and the group only, so the fake kernels know.
# ------------------------------------------------------------------------------------------------
def _op_segments(group_name: str, q, cu_seqlens, check_args=None) -> ShardSegments:
    """The shard cut, after the forward op's arguments ``check_args`` (k, v, g, h0, method, needs_grad)
    are checked (what the eager layer does before its Function): a rank whose own arguments fail
    reaches its peers' first exchange, as in eager. The backward op passes none: the forward checked
    them."""
    group = resolve_group(group_name) if group_name else None
    if check_args is None:
        return ShardSegments(group, q.shape[1], q.shape[0], cu_seqlens, "zeco_gla")
    k, v, g, h0, method, needs_grad = check_args
    return checked_segments(group, q, k, v, g, h0, cu_seqlens, method, needs_grad)


def _op_world(group_name: str) -> int:
    return world_and_rank(resolve_group(group_name))[0] if group_name else 1


@torch.library.custom_op("allscan::zeco_gla", mutates_args=())
def zeco_gla_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                h0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], group_name: str, scale: float,
                method: str, want_final: bool, needs_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, List[torch.Tensor]]:
    """:func:`zeco_gla`'s forward under torch.compile (``group_name`` "" = one process; ``needs_grad``:
    whether the traced call differentiates, compared across ranks): ``(o, final, S_in, gamma,
    saved)``, each absent one an empty tensor."""
    segs = _op_segments(group_name, q, cu_seqlens, (k, v, g, h0, method, needs_grad))
    with own_precision(q.device.type), on_device(q):
        o, final, S_in, gamma, saved = _forward(select_backend(q), q, k, v, g, h0, scale, segs, method, want_final,
                                                keep_offsets=False, share_zeros=False)
    return (o.contiguous(), or_empty(final, q).contiguous(), or_empty(S_in, q), or_empty(gamma, q).contiguous(),
            [t.contiguous() for t in saved])  # contiguous whatever the inputs' strides, as the fake says


@zeco_gla_op.register_fake
def _zeco_gla_fake(q, k, v, g, h0, cu_seqlens, group_name, scale, method, want_final, needs_grad):
    if q.dim() != 4 or v.dim() != 4 or (cu_seqlens is not None and cu_seqlens.dim() != 1):
        # arguments the op refuses when it runs, on every rank: shapes of no consequence, so that this
        # rank's trace does not fail alone and leave its peers waiting
        return (v.new_empty(v.shape), *(q.new_empty(0, dtype=torch.float32) for _ in range(3)), [])
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = _op_world(group_name) > 1
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty(n, H, K, V, dtype=torch.float32) if want_final else None
    S_in = q.new_empty(B, H, K, V, dtype=torch.float32) if sp else None
    gamma = None
    if sp and (g is not None or cu_seqlens is not None):  # _gamma_fixed / the backend's shard_gamma
        gamma = q.new_empty(((B,) if g is None else tuple(g.shape[:1]) + tuple(g.shape[2:])), dtype=torch.float32)
    return (v.new_empty(B, T, H, V), or_empty(final, q), or_empty(S_in, q), or_empty(gamma, q),
            select_backend(q).saved_like(q, v))


@torch.library.custom_op("allscan::zeco_gla_backward", mutates_args=())
def zeco_gla_backward_op(do: torch.Tensor, dfinal: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, g: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                         cu_seqlens: Optional[torch.Tensor], S_in: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], saved: List[torch.Tensor], group_name: str, scale: float,
                         method: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`zeco_gla`'s backward under torch.compile: ``(dq, dk, dv, dg, dh0)``, an absent one empty."""
    segs = _op_segments(group_name, q, cu_seqlens)
    with own_precision(do.device.type), on_device(do):
        dq, dk, dv, dg, dh0 = _backward(select_backend(q), do, dfinal, q, k, v, g, h0, S_in, gamma, saved, scale,
                                        segs, method, share_zeros=False)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), or_empty(dg, q).contiguous(),
            or_empty(dh0, q).contiguous())


@zeco_gla_backward_op.register_fake
def _zeco_gla_backward_fake(do, dfinal, q, k, v, g, h0, cu_seqlens, S_in, gamma, saved, group_name, scale, method):
    # the real op's gradients are contiguous whatever the inputs' strides
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            or_empty(None if g is None else g.new_empty(g.shape), q),
            or_empty(None if h0 is None else h0.new_empty(h0.shape), q))


def _op_setup_context(ctx, inputs, output):
    q, k, v, g, h0, cu_seqlens, group_name, scale, method, _, _ = inputs
    _, _, S_in, gamma, saved = output
    ctx.save_for_backward(q, k, v, g, h0, cu_seqlens, S_in, gamma, *saved)
    ctx.options = (group_name, scale, method)


def _op_backward(ctx, do, dfinal, _dS_in, _dgamma, _dsaved):
    q, k, v, g, h0, cu_seqlens, S_in, gamma, *saved = ctx.saved_tensors
    group_name, scale, method = ctx.options
    dq, dk, dv, dg, dh0 = zeco_gla_backward_op(do, absent(dfinal), q, k, v, g, h0, cu_seqlens, absent(S_in),
                                               absent(gamma), saved, group_name, scale, method)
    return (dq, dk, dv, None if g is None else dg, None if h0 is None else dh0, None, None, None, None, None, None)


zeco_gla_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _signature(q, v, g, h0, segs: ShardSegments, method, needs_grad, context=None):
    B, T, H, K = q.shape
    given = context is not None  # the context's cut was agreed when it was built: not compared again
    return [
        ("dtype", DTYPE_CODES.get(q.dtype, -1)),
        ("B", B),
        ("H", H),
        ("K", K),
        ("V", v.shape[3]),
        ("g (0 none, 1 [B, T, H], 2 [B, T, H, K])", 0 if g is None else g.dim() - 2),
        ("number of packed sequences", segs.num_seqs if segs.varlen and not given else 0),
        ("packed sequence boundaries (hash; none: 0)", 0 if given else segs.digest),
        *context_fields(context),
        ("method", METHODS.index(method)),
        ("initial_state given", int(h0 is not None)),
        # a rank whose inputs need no gradient runs no backward: its peers would wait in the reverse scan
        ("inputs need gradients", int(needs_grad)),
    ]


def checked_segments(group, q, k, v, g, h0, cu_seqlens, method, needs_grad, *, context=None,
                     conflict=None) -> ShardSegments:
    """Every check of a call on ``group`` (a process group, None: one process): the local ones (a rank
    whose arguments fail tells its peers, whose exchange then fails too; ``conflict``: what
    :func:`~allscan.ops.batch_context.context_conflict` found), then the call's signature across
    ranks; the shard's cut (a repeated call's: :func:`~allscan.ops._shards.checked_cut`). With the
    batch's ``context`` the cut is the context's (agreed once per batch: not exchanged per call)."""
    packed = cu_seqlens is not None and context is None  # the cut changes from batch to batch: compared every call

    def check():
        segs = []

        def validate():
            if conflict is not None:
                raise conflict
            _check_arguments(q, k, v, g, h0, cu_seqlens, method, _packed_count(context))
            if context is None:
                segs.append(ShardSegments(group, q.shape[1], q.shape[0], cu_seqlens, "zeco_gla"))
            else:
                segs.append(context.cut(q.shape[1], q.shape[0], "zeco_gla"))

        if group is None:
            validate()
            return segs[0], None
        validated_group(group, q, "zeco_gla", validate, every_call=packed)
        signature = None
        if segs[0].world > 1:
            signature = check_across_ranks(group, q.device, "zeco_gla",
                                           _signature(q, v, g, h0, segs[0], method, needs_grad, context),
                                           every_call=packed)
        return segs[0], signature

    device = q.device if isinstance(q, torch.Tensor) else None
    if context is None:
        return checked_cut("zeco_gla", group, device, None if packed else (q, k, v, g, h0), (method, needs_grad),
                           check)
    # the context's cut is its own (made once per shape); what the checks read of the context is keyed
    options = (method, needs_grad, conflict is None, context.local_len, _packed_count(context))
    checked_cut("zeco_gla", group, device, (q, k, v, g, h0), options, check)
    return context.cut(q.shape[1], q.shape[0], "zeco_gla")


def _packed_count(context) -> Optional[int]:
    """The number of packed sequences of a context (None: none given, or whole sequences)."""
    return len(context.cu_seqlens) - 1 if context is not None and context.packed else None


def _check_arguments(q, k, v, g, initial_state, cu_seqlens, method, packed_count=None):
    """zeco_gla's local argument checks (the packed sequences' cut is checked by ShardSegments;
    ``packed_count``: the number of sequences a context packs)."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"zeco_gla: cu_seqlens must be a 1-D integer tensor [N+1] or None, got "
                        f"{type(cu_seqlens).__name__}")
    if method not in _SCAN_METHOD:
        raise ValueError(f"zeco_gla: method must be one of {sorted(_SCAN_METHOD)}, got {method!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"zeco_gla: {name} must be a 4-D tensor [B, T_local, H, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"zeco_gla: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"zeco_gla: v must be [B, T_local, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if T == 0:
        raise ValueError("zeco_gla: every rank needs at least one token (T_local = 0)")
    V = v.shape[-1]
    if g is not None and tuple(g.shape) not in ((B, T, H, K), (B, T, H)):
        raise ValueError(f"zeco_gla: g must be [B, T, H, K] = {(B, T, H, K)} (GLA), [B, T, H] = {(B, T, H)} "
                         f"(simple GLA) or None, got {tuple(g.shape)}")
    if g is not None and not g.is_floating_point():
        raise ValueError(f"zeco_gla: g must be a floating-point tensor, got {g.dtype}")
    if initial_state is not None:
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        n = n if packed_count is None else packed_count
        per_sequence = cu_seqlens is not None or packed_count is not None
        if tuple(initial_state.shape) != (n, H, K, V):
            raise ValueError(f"zeco_gla: initial_state must be [{'N' if per_sequence else 'B'}, H, K, V] = "
                             f"{(n, H, K, V)}, got {tuple(initial_state.shape)}")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"zeco_gla: initial_state must be float32, got {initial_state.dtype}")


def zeco_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None, group=None, *,
             scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, method: str = "zeco",
             context=None):
    """Sequence-parallel gated linear attention (fla's ``chunk_gla`` conventions).

    Args:
        q, k: ``[B, T_local, H, K]``; v: ``[B, T_local, H, V]``: this rank's contiguous shard.
        g: natural-log decays (<= 0): ``[B, T_local, H, K]`` (GLA), ``[B, T_local, H]`` (simple GLA, one
            decay per head) or None (plain linear attention).
        group: the sequence-parallel process group (rank order = sequence order). None: the default
            group, as everywhere in torch.distributed (one process, holding the whole sequence, when
            torch.distributed is not initialised). :data:`LOCAL`: no sequence parallelism even in an
            initialised group (this process holds the whole sequence).
        scale: default ``K ** -0.5``.
        initial_state: fp32 ``[B, H, K, V]``, the state before the global first token (used by group
            rank 0 only; its gradient is returned there, zeros elsewhere). With ``cu_seqlens``:
            ``[N, H, K, V]``, one per global sequence, used by the rank where that sequence starts (the
            gradient of row i is returned there only: sum over ranks for the full gradient).
        output_final_state: return the final state. Without ``cu_seqlens``: ``[B, H, K, V]``, the state
            after this rank's last token (on the last rank: after the global last token). With
            ``cu_seqlens``: ``[N, H, K, V]`` with the rows of the sequences that END on this rank
            filled, zeros elsewhere.
        cu_seqlens: ``[N+1]`` cumulative lengths over the GLOBAL packed sequence (B = 1, every rank
            holds T_local tokens, ``cu_seqlens[-1] == world_size * T_local``); boundaries may fall
            anywhere, inside a rank or on a rank boundary. Same tensor on every rank.
        method: ``"zeco"`` (pipelined All-Scan overlapped with the local work), ``"lasp1"`` (serial
            chain, waited for: the LASP-1 baseline), ``"lasp2"`` (all-gather: the LASP-2 baseline).
        context: the batch's :class:`allscan.SequenceContext`, instead of ``group`` and ``cu_seqlens``:
            its group and its cut (agreed across ranks once, when it was built; not compared again
            here). Given with ``cu_seqlens`` or with another ``group``: ``ValueError``.

    Returns:
        ``(o [B, T_local, H, V] in v's dtype, final_state or None)``.
    """
    needs_grad = inputs_need_grad(q, k, v, g, initial_state)
    if torch.compiler.is_compiling():
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        conflict = context_conflict(context, group, cu_seqlens, "zeco_gla")
        spg = context_group(context if conflict is None else None, group, "zeco_gla")
        if conflict is not None:  # refused when the graph runs, on every rank
            return traced_refusal(spg, v, "zeco_gla", conflict), None
        if context is not None:  # the context is not traceable: the op takes its offsets and group name
            cu_seqlens = context.offsets(q.device)
        # the arguments are checked and the shard cut inside the op, when it runs (a failed check
        # traced here could not tell the peers: the trace runs no collective)
        o, final = zeco_gla_op(q, k, v, g, initial_state, cu_seqlens, "" if spg is None else spg.group_name, scale,
                               method, bool(output_final_state), needs_grad)[:2]
        return o, (final if output_final_state else None)
    conflict = context_conflict(context, group, cu_seqlens, "zeco_gla")
    spg = context_group(context if conflict is None else None, group, "zeco_gla")
    segs = checked_segments(spg, q, k, v, g, initial_state, cu_seqlens, method, needs_grad,
                            context=None if conflict is not None else context, conflict=conflict)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final = ZecoGLAFunction.apply(q, k, v, g, initial_state, scale, segs, method, bool(output_final_state))
    return o, (final if output_final_state else None)
