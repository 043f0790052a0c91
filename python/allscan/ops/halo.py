"""The halo exchange of a sequence-parallel short convolution: each rank's last ``w`` tokens go to the next rank.

    halo = halo_exchange(x, w, group=None)   # x [B, T_local, ...] -> [B, w, ...]: rank p-1's last w tokens

Rank 0 (and a single process) receives zeros. Autograd: the gradient of the received halo goes back to
its sender and is added to the gradient of its last ``w`` tokens. Point-to-point (isend/irecv), so it runs
on gloo and NCCL alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._shards import sequence_parallel_group

__all__ = ["halo_exchange"]


def _shift(send: torch.Tensor, pg, to_next: bool) -> torch.Tensor:
    """Sends ``send`` one rank along (to rank+1 if ``to_next`` else rank-1); returns what arrives from the
    other side (zeros at the end of the chain)."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    dst, src = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)
    recv = torch.zeros_like(send)
    ops = []  # one batch: on NCCL, separate isend/irecv calls along a chain can wait on each other
    if 0 <= dst < world:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(pg, dst), pg))
    if 0 <= src < world:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, src), pg))
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return recv


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, pg):
        ctx.w, ctx.pg, ctx.T = w, pg, x.shape[1]
        if pg is None or dist.get_world_size(pg) == 1:
            return x.new_zeros((x.shape[0], w) + tuple(x.shape[2:]))
        return _shift(x[:, x.shape[1] - w:], pg, to_next=True)

    @staticmethod
    def backward(ctx, grad_halo):
        w, pg, T = ctx.w, ctx.pg, ctx.T
        grad_x = grad_halo.new_zeros((grad_halo.shape[0], T) + tuple(grad_halo.shape[2:]))
        if pg is not None and dist.get_world_size(pg) > 1:
            grad_x[:, T - w:] = _shift(grad_halo, pg, to_next=False)
        return grad_x, None, None


def halo_exchange(x: torch.Tensor, w: int, group=None) -> torch.Tensor:
    """Returns the previous rank's last ``w`` tokens of ``x [B, T_local, ...]`` (dim 1 is the sequence),
    zeros on rank 0. ``group``: the sequence-parallel group (rank order = sequence order); None: the
    default group (one process when torch.distributed is not initialised); ``allscan.ops.LOCAL``: this
    process alone. Every rank must pass the same ``w`` and shape; ``T_local >= w`` with several ranks."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("halo_exchange: x must be a tensor [B, T_local, ...] (dim 1 the sequence)")
    if not isinstance(w, int) or w < 0:
        raise ValueError(f"halo_exchange: w must be a non-negative int, got {w!r}")
    pg = sequence_parallel_group(group, "halo_exchange")
    if pg is not None and dist.get_world_size(pg) > 1 and x.shape[1] < w:
        raise ValueError(f"halo_exchange: x's local length T_local={x.shape[1]} is shorter than the halo w={w}")
    return _Halo.apply(x, w, pg)
