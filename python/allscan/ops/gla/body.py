"""The bodies of :func:`allscan.ops.gla.zeco_gla` (the algorithm: :mod:`allscan.ops.gla.zeco`'s
docstring): the forward and the backward on a staged local backend, one call's options in a
:class:`GLARun` record; eager calls run them through :class:`~allscan.ops.gla.zeco.ZecoGLAFunction`,
compiled ones through the custom ops (:mod:`allscan.ops.gla.compiled`).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from allscan._settings import settings
from allscan.context import ShardCut

from .._launch import refuse_double_backward, tell_peers_of_failure
from ..diagonal_scan import OP as SCAN_OP
from ..hooks import op_hooks
from .chunk import TorchGLA, state_dtype
from .fla import FlaGLA, fla_available

__all__ = ["METHODS", "SCAN_METHOD", "GLARun", "select_backend", "forward_body", "backward_body"]

SCAN_METHOD = {"zeco": "pipelined", "lasp1": "serial", "lasp2": "allgather"}
METHODS = tuple(SCAN_METHOD)  # the ``method=`` values of zeco_gla


_WARNED: list = []


# why zeco_gla's backward is differentiable once (refused in backward_body, eager and compiled)
_NOT_TWICE = ("its backward holds the state entering each shard as a constant (its dependence on the other ranks' "
             "inputs is not in the gradients) and runs kernels that autograd cannot differentiate")


def select_backend(q):
    """The local backend for ``q``: fla-core's kernels on CUDA when importable, the torch chunked
    implementation otherwise and for float64 (``ALLSCAN_GLA_BACKEND=fla|torch`` forces one)."""
    want = settings.gla_backend
    if q.dtype == torch.float64:  # fla's kernels compute and keep states in float32: float64 is the torch backend's
        if want == "fla":
            raise RuntimeError("ALLSCAN_GLA_BACKEND=fla: fla-core's kernels take no float64 inputs (unset it, or "
                               "pass float32/bfloat16/float16)")
        return TorchGLA
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
    """g of GLA ``[B,T,H,K]``, simple GLA ``[B,T,H]`` or None -> ``[B,T,H,K]`` for the local kernels; a decay per
    head stays a broadcast view (stride 0 over K), which the fla backend sums once per head."""
    B, T, H, K = q.shape
    if g is None:
        return q.new_zeros(B, T, H, K, dtype=torch.float32)
    if g.dim() == 3:
        return g.contiguous().unsqueeze(-1).expand(B, T, H, K)
    return g.contiguous()


def _scale_state(S, evec):
    return S if evec is None else S * evec


def _gamma_fixed(segs, g, B, like, share_zeros: bool):
    """The decay this rank passes to the All-Scan (a prefix shape of the state [B, H, K, V], in the
    state's dtype ``like.dtype``, on its device)."""
    device = like.device
    if g is None:
        shape = (B,)
    else:
        shape = tuple(g.shape[:1]) + tuple(g.shape[2:])  # [B, H, K] or [B, H]
    # Zero where a sequence starts in this shard (no state crosses it), and at the chain's ends, whose
    # decay no scan reads: the first rank's multiplies the zero entering the forward scan's head, the
    # last rank's the zero entering the reverse scan's head (both heads send their x as it is); it
    # saves the ends the shard's decay (a kernel launch and its host time)
    if segs.starts_inside or (g is not None and segs.rank in (0, segs.world - 1)):
        return _zeros(shape, like, share_zeros)
    if g is None:  # plain linear attention: decay 1 (a tensor when varlen, so every rank passes one)
        return torch.ones(shape, dtype=like.dtype, device=device) if segs.varlen else None
    return None  # computed by the backend from the shard's decays


_SHARED_ZEROS: Dict[tuple, torch.Tensor] = {}
_SHARED_ZEROS_BYTES = 32 << 20  # what the shared zeros may hold in all; a larger tensor is made per call


def _zeros(shape: tuple, like: torch.Tensor, shared: bool) -> torch.Tensor:
    """Zeros of ``shape`` in ``like``'s dtype and device that only a scan reads (a chain end's decay,
    the part of the incoming state's gradient a rank without one contributes). ``shared`` (eager
    calls): made once per shape, dtype and device, a launch and its host time per call saved, except
    while a CUDA graph is captured; the custom ops make their own (torch.compile's CUDA graphs warm up
    in a graph pool the tree may hand out again)."""
    device, dtype = like.device, like.dtype
    nbytes = like.element_size() * math.prod(shape)
    if not shared or nbytes > _SHARED_ZEROS_BYTES // 4 or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(shape, dtype=dtype, device=device)
    key = (shape, device, dtype)
    zeros = _SHARED_ZEROS.get(key)
    if zeros is None:
        if nbytes + sum(z.element_size() * z.numel() for z in _SHARED_ZEROS.values()) > _SHARED_ZEROS_BYTES:
            _SHARED_ZEROS.clear()  # bounded: a process that sees ever new shapes
        zeros = _SHARED_ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return zeros


def _segment_states(segs: ShardCut, h0, first) -> List[Optional[torch.Tensor]]:
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


@dataclass(frozen=True)
class GLARun:
    """What one call's bodies do besides its tensors: the scale, this rank's cut of the shard, the
    ``method``, whether the final state is returned, whether the saved tensors keep the chunk offsets
    (the custom ops save tensors only) and whether the chain ends' zeros are shared (eager calls)."""

    scale: float
    segs: ShardCut
    method: str
    want_final: bool = False
    keep_offsets: bool = True
    share_zeros: bool = True


def forward_body(be, run: GLARun, inputs):
    """The forward on the local backend ``be`` of ``inputs`` ``(q, k, v, g, h0)``: ``(o, final or None,
    S_in or None, gamma or None, saved)``, what the backward needs besides the inputs (``S_in``: the
    state entering the shard, None with one rank; ``gamma``: the decay the All-Scan used; ``saved``:
    the backend's tensors, with ``run.keep_offsets`` the chunk offsets too)."""
    q, k, v, g, h0 = inputs
    scale, segs, method, share_zeros = run.scale, run.segs, run.method, run.share_zeros
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = segs.world > 1
    smethod = SCAN_METHOD[run.method]
    gamma = None
    # everything before this rank's part of the scan: a failure (out of memory) tells the peers
    # waiting in it, which raise too
    try:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gf = _full_decay(g, q)
        h0s = _segment_states(segs, h0, None)  # a continued first segment starts from 0
        st = be.fwd_states(q, k, v, gf, scale, segs.bounds, h0s)
        if sp:
            x = st.finals[-1].to(state_dtype(q.dtype)).contiguous()
            gamma = _gamma_fixed(segs, g, B, x, share_zeros)
            if gamma is None and g is not None:
                gamma = be.shard_gamma(st, g)
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
        if run.want_final and segs.ends_here[0]:  # the first segment's final state is returned
            finals[0] = finals[0] + _scale_state(S_in, evec)

    final = None
    if run.want_final:
        if segs.varlen:
            final = q.new_zeros(segs.num_seqs, H, K, V, dtype=state_dtype(q.dtype))
            for j in range(segs.nseg):
                if segs.ends_here[j]:
                    final[segs.seq_ids[j]] = finals[j][0]
        else:
            final = finals[0]

    saved = be.saved(st, segs.bounds[1] if run.keep_offsets else None)
    return o, final, S_in, gamma, saved


def _final_grads(dfin, y) -> List[Optional[torch.Tensor]]:
    """The gradient of every local segment's final state (None: zero): the caller's ``dfin``, plus for
    the last segment ``y``, the gradient of the state leaving the shard from the next ranks (None:
    none)."""
    dhts = list(dfin)
    if y is not None:
        dhts[-1] = y if dhts[-1] is None else dhts[-1] + y
    return dhts


def backward_body(be, run: GLARun, do, dfinal, inputs, S_in, gamma, saved):
    """The backward on the local backend ``be`` from what :func:`forward_body` returned: ``(dq, dk, dv,
    dg or None, dh0 or None)``."""
    q, k, v, g, h0 = inputs
    scale, segs, method, share_zeros = run.scale, run.segs, run.method, run.share_zeros
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = segs.world > 1
    smethod = SCAN_METHOD[run.method]
    handle = y = x = None
    # everything before this rank's part of the reverse scan: a failure (out of memory) tells the
    # peers waiting in it, which raise too
    try:
        refuse_double_backward("zeco_gla", _NOT_TWICE)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        do = do.contiguous()
        gf = _full_decay(g, q)

        # final-state gradients per local segment
        dfin: List[Optional[torch.Tensor]] = []
        for j in range(segs.nseg):
            if dfinal is None or not segs.ends_here[j]:
                dfin.append(None)
            elif segs.varlen:
                dfin.append(dfinal[segs.seq_ids[j]:segs.seq_ids[j] + 1].to(state_dtype(q.dtype)))
            else:
                dfin.append(dfinal.to(state_dtype(q.dtype)))

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
                x = _zeros((B, H, K, V), q.new_empty(0, dtype=state_dtype(q.dtype)), share_zeros)
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
        dg = (dgf.to(state_dtype(dgf.dtype)).sum(-1) if g.dim() == 3 else dgf).to(g.dtype)
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
