"""A plain torch.distributed All-Scan used by the GLA layer only while ``allscan.scan`` is missing.

Same contract as ``allscan.scan`` (exclusive by default, forward or reverse, decays broadcast over
the trailing dimensions they lack), computed by all-gathering every rank's state and decay and
combining them in rank order in fp32 (fp64 for fp64 inputs). It exists so that the layer can be
developed and tested before (or without) the library's own scan; ``allscan.layers.gla`` prefers
``allscan.scan`` whenever it exists.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _Done:
    def __init__(self, t):
        self._t = t

    def wait(self):
        return self._t


def _expand(gamma, like):
    if gamma is None:
        return torch.ones_like(like)
    gamma = gamma.to(like.dtype)
    if tuple(gamma.shape) != tuple(like.shape[: gamma.dim()]):
        raise ValueError(
            f"scan: gamma must have a prefix shape of the state {tuple(like.shape)}, got {tuple(gamma.shape)}")
    return gamma.reshape(*gamma.shape, *([1] * (like.dim() - gamma.dim()))).expand_as(like).contiguous()


def scan(tensor, gamma=None, group=None, *, reverse=False, inclusive=False, init=None,
         num_blocks=None, method="pipelined", async_op=False):
    acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    x = tensor.detach().to(acc).contiguous()
    g = _expand(gamma.detach() if gamma is not None else None, x)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    xs = [torch.empty_like(x) for _ in range(world)]
    gs = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(gs, g, group=group)
    y = torch.zeros_like(x) if init is None else init.detach().to(acc).clone()
    out = None
    order = range(world - 1, -1, -1) if reverse else range(world)
    for p in order:
        nxt = gs[p] * y + xs[p]
        if p == rank:
            out = nxt if inclusive else y
        y = nxt
    out = out.to(tensor.dtype)
    return _Done(out) if async_op else out
