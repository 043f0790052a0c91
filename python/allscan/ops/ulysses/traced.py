"""Ulysses attention as torch.compile traces it: one all-to-all custom op in, SDPA, one out.

Inside a compiled graph the head chunks of :mod:`allscan.ops.ulysses` could not overlap (the
compiler runs the graph on one stream), so the traced form is plain Ulysses with one chunk::

    q_s, k_s, v_s = ulysses_scatter(q, k, v)   allscan::ulysses_scatter: the call's checks across ranks
                                               (what eager checks), then scatter-heads of all three in
                                               one collective; its backward gathers their gradients
                                               (k/v heads held by several ranks, with grouped-query
                                               attention, summed)
    o_s = SDPA(q_s, k_s, v_s)                  k/v heads repeated for the local query heads
    o = gather_heads(o_s)                      allscan::gather_heads (backward: scatter-heads)

The compiler differentiates SDPA and the head repetition itself. ``num_chunks`` is checked across
ranks as in eager but does not change the traced graph.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import _comm
from ..._contract import announce_invalid, check_across_ranks
from ..a2a import GATHER, SCATTER, a2a_multi, kv_head_ranges, split_heads
from .checks import OP, check_inputs, signature


def _maps(world: int, Hq, Hkv):
    """The head maps of q and of k, v (head counts made concrete: the maps are plans, not shapes)."""
    Hq, Hkv = int(Hq), int(Hkv)
    q_map = split_heads(0, Hq, world)
    return q_map, kv_head_ranges(q_map, Hq // Hkv)


def _checked(q, k, v, group, causal: bool, scale: Optional[float], num_chunks: int, needs_grad: bool):
    """eager's checks of one call, the ones across ranks included (``num_chunks`` 0 = "auto")."""
    try:
        _, _, Hq, Hkv, _ = check_inputs(q, k, v, dist.get_world_size(group))
        if not 0 <= num_chunks <= Hq:
            raise ValueError(f"UlyssesAttention: num_chunks must be 'auto' or an int in [1, {Hq}] (query heads)")
    except (ValueError, TypeError) as e:
        announce_invalid(group, q.device, OP, str(e))
        raise
    check_across_ranks(group, q.device, OP, signature(q, k, causal, scale, num_chunks, needs_grad))
    return Hq, Hkv


def _refused(q, k, v, world: int) -> bool:
    """Shapes the op's checks refuse that would also break the trace around it."""
    return (q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] < world or k.shape[2] < 1
            or q.shape[2] % k.shape[2] != 0)


@torch.library.custom_op("allscan::ulysses_scatter", mutates_args=())
def ulysses_scatter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, group_size: int,
                    group_rank: int, causal: bool, scale: Optional[float], num_chunks: int,
                    needs_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checks of a Ulysses call, then scatter-heads of q (this rank's query heads) and k, v (the
    k/v heads they use) over ``group_name`` (``group_size`` ranks, this one ``group_rank``: the shapes
    depend on them): ``[B, S, n, D]`` each."""
    group = _comm.resolve_group(group_name)
    Hq, Hkv = _checked(q, k, v, group, causal, scale, num_chunks, needs_grad)
    q_map, kv_map = _maps(dist.get_world_size(group), Hq, Hkv)
    qs, ks, vs = a2a_multi(SCATTER, [q, k, v], [q_map, kv_map, kv_map], [Hq, Hkv, Hkv], group, check=False,
                           names=["q", "k", "v"])
    return qs, ks, vs


@ulysses_scatter.register_fake
def _ulysses_scatter_fake(q, k, v, group_name, group_size, group_rank, causal, scale, num_chunks, needs_grad):
    world, me = group_size, group_rank
    if _refused(q, k, v, world):
        # arguments the op refuses when it runs, on every rank: shapes of no consequence, so that this
        # rank's trace does not fail alone and leave its peers waiting
        return q.new_empty(0), k.new_empty(0), v.new_empty(0)
    B, Sl, Hq, D = q.shape
    q_map, kv_map = _maps(world, Hq, k.shape[2])

    def scattered(t, m):
        return t.new_empty(B, Sl * world, m[me][1] - m[me][0], t.shape[3])

    return scattered(q, q_map), scattered(k, kv_map), scattered(v, kv_map)


@torch.library.custom_op("allscan::ulysses_scatter_backward", mutates_args=())
def ulysses_scatter_backward(dqs: torch.Tensor, dks: torch.Tensor, dvs: torch.Tensor, group_name: str,
                             group_size: int, Hq: int, Hkv: int) -> List[torch.Tensor]:
    """Gather-heads of the three gradients in one collective (a k/v head's gradients summed over the
    ranks that held it)."""
    group = _comm.resolve_group(group_name)
    q_map, kv_map = _maps(dist.get_world_size(group), Hq, Hkv)
    return a2a_multi(GATHER, [dqs.contiguous(), dks.contiguous(), dvs.contiguous()], [q_map, kv_map, kv_map],
                     [Hq, Hkv, Hkv], group, check=False, names=["dq", "dk", "dv"])


@ulysses_scatter_backward.register_fake
def _ulysses_scatter_backward_fake(dqs, dks, dvs, group_name, group_size, Hq, Hkv):
    return [t.new_empty(t.shape[0], t.shape[1] // group_size, H, t.shape[3]) for t, H in ((dqs, Hq), (dks, Hkv),
                                                                                      (dvs, Hkv))]


def _setup(ctx, inputs, output):
    q, k, _, group_name, group_size = inputs[:5]
    ctx.group_name, ctx.group_size, ctx.Hq, ctx.Hkv = group_name, group_size, int(q.shape[2]), int(k.shape[2])


def _backward(ctx, dqs, dks, dvs):
    dq, dk, dv = ulysses_scatter_backward(dqs, dks, dvs, ctx.group_name, ctx.group_size, ctx.Hq, ctx.Hkv)
    return dq, dk, dv, None, None, None, None, None, None, None


ulysses_scatter.register_autograd(_backward, setup_context=_setup)


def traced_attention(q, k, v, group, causal: bool, scale: Optional[float], num_chunks: int) -> torch.Tensor:
    """:func:`allscan.ops.ulysses.ulysses_attention` as traced (module docstring); ``num_chunks`` 0 = "auto"."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    qs, ks, vs = ulysses_scatter(q, k, v, group.group_name, world, me, bool(causal), scale, int(num_chunks),
                                 needs_grad)
    if _refused(q, k, v, world):  # the op raises when it runs, on every rank; the result only keeps it in the graph
        return q + (qs.sum() + ks.sum() + vs.sum()) * 0
    Hq, Hkv = int(q.shape[2]), int(k.shape[2])
    q_map, kv_map = _maps(world, Hq, Hkv)
    (q_lo, q_hi), kv_lo = q_map[me], kv_map[me][0]
    if Hq != Hkv:  # local query head h uses local k/v head (q_lo + h) // (Hq / Hkv) - kv_lo
        idx = torch.tensor([h // (Hq // Hkv) - kv_lo for h in range(q_lo, q_hi)], device=q.device)
        ks, vs = ks.index_select(2, idx), vs.index_select(2, idx)
    o = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), is_causal=causal,
                                       scale=scale)
    lo, hi = zip(*q_map)
    return torch.ops.allscan.gather_heads(o.transpose(1, 2).contiguous(), group.group_name, me, Hq, list(lo),
                                          list(hi))
