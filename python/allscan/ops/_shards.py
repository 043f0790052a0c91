"""How a sequence-parallel layer's group and shard are resolved: what every ``zeco_*`` op shares.

- :data:`LOCAL` and :func:`sequence_parallel_group`: ``group=None`` is the default process group (one
  process when torch.distributed is not initialised); ``LOCAL`` is one process even inside one.
- :class:`ShardSegments`: this rank's contiguous shard of the global sequence, cut at the packed
  sequences' boundaries (``cu_seqlens``, global offsets, the same on every rank).
"""
from __future__ import annotations

import bisect
import weakref

import torch
import torch.distributed as dist

from allscan._comm import normalize_group

__all__ = ["LOCAL", "sequence_parallel_group", "ShardSegments", "world_and_rank", "inputs_need_grad"]


class _Local:
    def __repr__(self):
        return "allscan.ops.LOCAL"


LOCAL = _Local()
"""``group=LOCAL``: no sequence parallelism, even inside an initialised process group: this process
holds the whole sequence (what ``group=None`` meant for ``zeco_gla`` before it became the default group)."""


def sequence_parallel_group(group, op: str):
    """``group`` as a ``zeco_*`` op takes it -> the process group to scan over, or None for one process."""
    if group is LOCAL:
        return None
    initialised = dist.is_available() and dist.is_initialized()
    if group is None:  # the default group, as in torch.distributed; one process when there is none
        return normalize_group(None) if initialised else None
    if not initialised:
        raise RuntimeError(f"{op}: group given but torch.distributed is not initialised")
    return normalize_group(group)


def inputs_need_grad(*inputs) -> bool:
    """Whether a layer call differentiates (grad mode on, some tensor input requires grad): compared
    across ranks, since a rank that runs no backward would leave its peers in the reverse scan."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


_PLACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def world_and_rank(group):
    """(world size, rank) of this process in ``group``: fixed for the group's life, so asked of
    torch.distributed once (every layer call needs it: host time per call, issue 14)."""
    place = _PLACES.get(group)
    if place is None:
        place = _PLACES[group] = (dist.get_world_size(group), dist.get_rank(group))
    return place


class ShardSegments:
    """This rank's shard of the global sequence, cut into local segments at the sequence boundaries
    (``cu_seqlens``) that fall inside it: the segment bounds, which global sequence each belongs to,
    which ones end here, whether the first continues a sequence from the previous rank."""

    def __init__(self, group, T: int, B: int, cu_seqlens, op: str):
        if group is None:
            self.world, self.rank = 1, 0
        else:
            self.world, self.rank = world_and_rank(group)
        self.group = group
        self.T = T
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.bounds = [0, T]
            self.seq_ids = [None]
            self.ends_here = [True]
            self.continued = self.rank > 0
            self.starts_inside = False
            self.num_seqs = B
            return
        if B != 1:
            raise ValueError(f"{op}: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens must be a 1-D tensor [N+1] of cumulative sequence lengths "
                             "over the GLOBAL packed sequence")
        if cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"{op}: cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        total = self.world * T
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"{op}: cu_seqlens must start at 0 and end at world_size * T_local = "
                             f"{self.world} * {T} = {total} (the global packed length), got {cu[0]} .. {cu[-1]}")
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{op}: cu_seqlens must be strictly increasing (empty sequences are not supported)")
        off = self.rank * T
        cuset = set(cu)
        cut = sorted(set([0, T] + [c - off for c in cu if off < c < off + T]))
        self.bounds = cut
        self.seq_ids = [bisect.bisect_right(cu, off + s) - 1 for s in cut[:-1]]
        self.ends_here = [(off + e) in cuset for e in cut[1:]]
        self.continued = off not in cuset
        self.starts_inside = (not self.continued) or len(cut) > 2
        self.num_seqs = len(cu) - 1

    @property
    def nseg(self):
        return len(self.bounds) - 1
