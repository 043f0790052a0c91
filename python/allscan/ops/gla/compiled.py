"""torch.compile: :func:`allscan.ops.gla.zeco_gla`'s forward and backward bodies
(:mod:`allscan.ops.gla.body`) as two custom ops, ``allscan::zeco_gla`` and ``allscan::zeco_gla_backward``
(opaque to the tracer: no graph break, no collective while tracing; every rank runs them as the eager
function does, the checks and the shard's cut included). The options travel as keyword-only arguments.
Absent results travel as empty tensors (a schema has no optional outputs); which are absent depends on
shapes and the group's size only, an argument of the forward op (``group_size``), so that the fake kernel
knows it and a compiled graph's cache key holds it (docs/design.md, torch.compile).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from allscan._comm import resolve_group
from allscan.context import LOCAL, SequenceContext

from .._launch import absent, or_empty
from .._shards import ShardSegments, on_device, own_precision
from ..hooks import check_cut_world, op_hooks
from .body import GLARun, backward_body, forward_body, select_backend
from .chunk import state_dtype
from .checks import checked_segments

__all__ = ["zeco_gla_op", "zeco_gla_backward_op"]


def _op_segments(group_name: str, q, cu_seqlens, check_args=None, agreed: bool = False) -> ShardSegments:
    """The shard cut, after the forward op's arguments ``check_args`` (k, v, g, h0, method, needs_grad)
    are checked (what the eager layer does before its Function): a rank whose own arguments fail
    reaches its peers' first exchange, as in eager. The backward op passes none: the forward checked
    them. ``agreed``: ``cu_seqlens`` are a context's offsets (agreed when it was built), checked as the
    eager call with that context checks them: not compared again."""
    group = resolve_group(group_name) if group_name else None
    if check_args is None:
        return op_hooks.shard_cut(group, q.shape[1], q.shape[0], cu_seqlens, "zeco_gla")
    k, v, g, h0, method, needs_grad = check_args
    if agreed and cu_seqlens is not None:
        context = SequenceContext.from_agreed_offsets(LOCAL if group is None else group, cu_seqlens)
        return checked_segments(group, q, k, v, g, h0, None, method, needs_grad, context=context)
    return checked_segments(group, q, k, v, g, h0, cu_seqlens, method, needs_grad)


@torch.library.custom_op("allscan::zeco_gla", mutates_args=())
def zeco_gla_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                h0: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], *, group_name: str, group_size: int,
                scale: float, method: str, want_final: bool, needs_grad: bool,
                agreed: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                               List[torch.Tensor]]:
    """:func:`zeco_gla`'s forward under torch.compile (``group_name`` "" = one process, ``group_size`` its
    ranks, 1 for one process; ``needs_grad``:
    whether the traced call differentiates, compared across ranks; ``agreed``: ``cu_seqlens`` are a
    context's offsets): ``(o, final, S_in, gamma, saved)``, each absent one an empty tensor."""
    segs = _op_segments(group_name, q, cu_seqlens, (k, v, g, h0, method, needs_grad), agreed)
    check_cut_world(segs, group_size, "zeco_gla")
    run = GLARun(scale, segs, method, want_final, keep_offsets=False, share_zeros=False)
    with own_precision(q.device.type), on_device(q):
        o, final, S_in, gamma, saved = forward_body(select_backend(q), run, (q, k, v, g, h0))
    return (o.contiguous(), or_empty(final, q).contiguous(), or_empty(S_in, q), or_empty(gamma, q).contiguous(),
            [t.contiguous() for t in saved])  # contiguous whatever the inputs' strides, as the fake says


@zeco_gla_op.register_fake
def _zeco_gla_fake(q, k, v, g, h0, cu_seqlens, *, group_name, group_size, scale, method, want_final, needs_grad,
                   agreed=False):
    if q.dim() != 4 or v.dim() != 4 or (cu_seqlens is not None and cu_seqlens.dim() != 1):
        # arguments the op refuses when it runs, on every rank: shapes of no consequence, so that this
        # rank's trace does not fail alone and leave its peers waiting
        return (v.new_empty(v.shape), *(q.new_empty(0, dtype=torch.float32) for _ in range(3)), [])
    B, T, H, K = q.shape
    V = v.shape[-1]
    sp = group_size > 1
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sdt = state_dtype(q.dtype)
    final = q.new_empty(n, H, K, V, dtype=sdt) if want_final else None
    S_in = q.new_empty(B, H, K, V, dtype=sdt) if sp else None
    gamma = None
    if sp and (g is not None or cu_seqlens is not None):  # the body's fixed decay / the backend's shard_gamma
        gamma = q.new_empty(((B,) if g is None else tuple(g.shape[:1]) + tuple(g.shape[2:])), dtype=sdt)
    return (v.new_empty(B, T, H, V), or_empty(final, q), or_empty(S_in, q), or_empty(gamma, q),
            select_backend(q).saved_like(q, v))


@torch.library.custom_op("allscan::zeco_gla_backward", mutates_args=())
def zeco_gla_backward_op(do: torch.Tensor, dfinal: Optional[torch.Tensor], inputs: List[Optional[torch.Tensor]],
                         cu_seqlens: Optional[torch.Tensor], S_in: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], saved: List[torch.Tensor], *, group_name: str, scale: float,
                         method: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`zeco_gla`'s backward under torch.compile: ``(dq, dk, dv, dg, dh0)`` of the forward's
    ``inputs`` ``[q, k, v, g, h0]``, an absent one empty."""
    q = inputs[0]
    run = GLARun(scale, _op_segments(group_name, q, cu_seqlens), method, share_zeros=False)
    with own_precision(do.device.type), on_device(do):
        dq, dk, dv, dg, dh0 = backward_body(select_backend(q), run, do, dfinal, tuple(inputs), S_in, gamma, saved)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), or_empty(dg, q).contiguous(),
            or_empty(dh0, q).contiguous())


@zeco_gla_backward_op.register_fake
def _zeco_gla_backward_fake(do, dfinal, inputs, *_, **__):
    # the real op's gradients are contiguous whatever the inputs' strides
    q, k, v, g, h0 = inputs
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            or_empty(None if g is None else g.new_empty(g.shape), q),
            or_empty(None if h0 is None else h0.new_empty(h0.shape), q))


def _op_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, g, h0, cu_seqlens = inputs
    _, _, S_in, gamma, saved = output
    ctx.save_for_backward(q, k, v, g, h0, cu_seqlens, S_in, gamma, *saved)
    ctx.options = {name: keyword_only_inputs[name] for name in ("group_name", "scale", "method")}


def _op_backward(ctx, do, dfinal, _dS_in, _dgamma, _dsaved):
    q, k, v, g, h0, cu_seqlens, S_in, gamma, *saved = ctx.saved_tensors
    dq, dk, dv, dg, dh0 = zeco_gla_backward_op(do, absent(dfinal), [q, k, v, g, h0], cu_seqlens, absent(S_in),
                                               absent(gamma), saved, **ctx.options)
    return (dq, dk, dv, None if g is None else dg, None if h0 is None else dh0, None)


zeco_gla_op.register_autograd(_op_backward, setup_context=_op_setup_context)
