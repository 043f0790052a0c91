"""How a sequence-parallel layer's group and shard are resolved: what every ``zeco_*`` op shares.

- :data:`LOCAL` and :func:`sequence_parallel_group`: ``group=None`` is the default process group (one
  process when torch.distributed is not initialised); ``LOCAL`` is one process even inside one.
- :class:`ShardSegments`: this rank's contiguous shard of the global sequence, cut at the packed
  sequences' boundaries (``cu_seqlens``, global offsets, the same on every rank).
- :func:`checked_cut`: a call repeated with arguments its checks cannot tell apart reuses the cut of
  the call that passed them (the host's time per call, issue 14).
- :func:`own_precision`: the layers' arithmetic is theirs whatever the caller's autocast.
"""
from __future__ import annotations

import bisect
import contextlib
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from allscan._comm import normalize_group
from allscan._contract import peers_exchange, settings

from ._launch import plan_cache

__all__ = ["LOCAL", "sequence_parallel_group", "ShardSegments", "world_and_rank", "inputs_need_grad", "checked_cut",
           "own_precision"]


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


def own_precision(device_type: str):
    """The context a layer computes in: autocast off (its precision choices are its own), and
    nothing at all when autocast is off already (entering and leaving one costs host time per call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Checked calls. A layer's checks read its arguments' types, shapes, dtypes and devices and its
# options, never a tensor's values (except cu_seqlens', which such calls never skip). So a call
# with the same of all these on the same group as one that passed its checks passes them too, and
# skips them where the cross-rank check itself is made once per signature. The cuts are kept in a
# bounded LRU, forgotten with the collectives' plans (allscan.destroy_communicators).
# ------------------------------------------------------------------------------------------------
_checked_cuts = plan_cache()


def _argument_key(args) -> Optional[tuple]:
    """What a layer's checks read of ``args``: a tensor's shape, dtype and device, any other argument
    itself (None, bool, int, float, str); None for an argument of another type (the checks name it)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.dtype, a.device))
        elif a is None or type(a) in (bool, int, float, str):
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def checked_cut(op: str, group, device: torch.device, args, check: Callable[[], "ShardSegments"]):
    """``check()``: every check of an ``op`` call on ``group`` (None: one process), the local ones then
    across ranks, returning the shard's cut; or the cut of an earlier call on the same group whose
    ``args`` (everything the checks read, the packed sequences' ``cu_seqlens`` excluded: pass None
    for ``args`` with packed sequences) had the same key, while the check mode is the one it passed in.
    The checks are made every call with ``ALLSCAN_CHECK=always``, and wherever the cross-rank check
    exchanges every call (off NCCL): there every call still exchanges, as the peers expect."""
    key = None if args is None else _argument_key(args)
    if key is not None:
        key = (op, id(group), settings.check) + key
        hit = _checked_cuts.get(key)
        if hit is not None and hit[0] is group:  # the entry holds its group: its id is not reused
            return hit[1]
    cut = check()
    if key is not None and _skippable(group, device):
        _checked_cuts[key] = (group, cut)
    return cut


def _skippable(group, device) -> bool:
    """Whether a repeated call may skip its checks: not with ``ALLSCAN_CHECK=always``, nor where the
    peers exchange their signatures every call."""
    if settings.check == "always":
        return False
    return group is None or world_and_rank(group)[0] == 1 or not peers_exchange(group, device)
