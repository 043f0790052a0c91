"""Every check of a :func:`allscan.ops.gla.zeco_gla` call, eager or compiled: the local ones, the
signature compared across ranks, and this rank's cut of the packed sequences (the batch context's when
one is given) (:func:`checked_segments`).
"""
from __future__ import annotations

from typing import Optional

import torch

from allscan._agreement import check_across_ranks
from allscan._dtypes import DTYPE_CODES
from allscan.context import SequenceContext

from .._launch import validated_group
from .._shards import ShardSegments, checked_cut
from ..batch_context import context_fields
from ..hooks import op_hooks
from .body import METHODS, SCAN_METHOD
from .chunk import state_dtype

__all__ = ["checked_segments", "check_arguments"]


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
    # the cut changes from batch to batch: compared every call (a context agreed on it once per batch; a rank
    # whose context conflicts tells its peers as their context path expects)
    packed = cu_seqlens is not None and not isinstance(context, SequenceContext)
    context = context if conflict is None else None  # the context the checks read

    def check():
        segs = []

        def validate():
            if conflict is not None:
                raise conflict
            check_arguments(q, k, v, g, h0, cu_seqlens, method, _packed_count(context))
            if context is None:
                segs.append(op_hooks.shard_cut(group, q.shape[1], q.shape[0], cu_seqlens, "zeco_gla"))
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

    if conflict is not None:
        check()  # raises it (told to the peers) on every call: never a cached pass of an earlier call's shapes
    device = q.device if isinstance(q, torch.Tensor) else None
    if context is None:
        return checked_cut("zeco_gla", group, device, None if packed else (q, k, v, g, h0), (method, needs_grad),
                           check)
    # the context's cut is its own (made once per shape); what the checks read of the context is keyed
    options = (method, needs_grad, context.local_len, _packed_count(context))
    checked_cut("zeco_gla", group, device, (q, k, v, g, h0), options, check)
    return context.cut(q.shape[1], q.shape[0], "zeco_gla")


def _packed_count(context) -> Optional[int]:
    """The number of packed sequences of a context (None: none given, or whole sequences)."""
    return len(context.cu_seqlens) - 1 if context is not None and context.packed else None


def check_arguments(q, k, v, g, initial_state, cu_seqlens, method, packed_count=None):
    """zeco_gla's local argument checks (the packed sequences' cut is checked by ShardSegments;
    ``packed_count``: the number of sequences a context packs)."""
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"zeco_gla: cu_seqlens must be a 1-D integer tensor [N+1] or None, got "
                        f"{type(cu_seqlens).__name__}")
    if method not in SCAN_METHOD:
        raise ValueError(f"zeco_gla: method must be one of {sorted(SCAN_METHOD)}, got {method!r}")
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
        if initial_state.dtype != state_dtype(q.dtype):
            want = str(state_dtype(q.dtype)).replace("torch.", "")
            raise ValueError(f"zeco_gla: initial_state must be {want} for {q.dtype} inputs (float32; float64 for "
                             f"float64 inputs), got {initial_state.dtype}")
