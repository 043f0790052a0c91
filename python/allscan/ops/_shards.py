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

import contextlib
import threading
import weakref
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from allscan._comm import normalize_group
from allscan._agreement import peers_exchange, still_checked
from allscan._settings import settings

from allscan.context import LOCAL, ShardCut, checked_offsets, mesh_dimension_group, resolve_sp_group

from ._launch import plan_cache

__all__ = ["LOCAL", "sequence_parallel_group", "ShardSegments", "world_and_rank", "inputs_need_grad", "checked_cut",
           "own_precision"]


def sequence_parallel_group(group, op: str):
    """``group`` as a ``zeco_*`` op takes it -> the process group to scan over, or None for one process:
    :func:`allscan.context.resolve_sp_group`'s rule (None is the default group, or one process where
    torch.distributed is not initialised; :data:`LOCAL` one process), without its cache, which
    torch.compile traces through here and cannot guard (a dict keyed by process groups)."""
    if group is LOCAL:
        return None
    initialised = dist.is_available() and dist.is_initialized()
    if group is None:
        return normalize_group(None) if initialised else None
    if not initialised:
        raise RuntimeError(f"{op}: group given but torch.distributed is not initialised")
    return normalize_group(mesh_dimension_group(group, op))


def inputs_need_grad(*inputs) -> bool:
    """Whether a layer call differentiates (grad mode on, some tensor input requires grad): compared
    across ranks, since a rank that runs no backward would leave its peers in the reverse scan."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


_PLACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def world_and_rank(group):
    """(world size, rank) of this process in ``group``: fixed for the group's life, so asked of
    torch.distributed once (every layer call needs it: host time per call, issue 14). Not for code
    torch.compile traces: a cache filled while tracing is a guard that fails on the next call."""
    place = _PLACES.get(group)
    if place is None:
        place = _PLACES[group] = (dist.get_world_size(group), dist.get_rank(group))
    return place


class ShardSegments(ShardCut):
    """:class:`allscan.context.ShardCut` from an op's own arguments: ``group`` (a process group, or None
    for one process) and ``cu_seqlens`` (global offsets, checked and read to the host here)."""

    def __init__(self, group, T: int, B: int, cu_seqlens, op: str):
        sp = resolve_sp_group(LOCAL if group is None else group, op)
        super().__init__(sp, T, B, None if cu_seqlens is None else checked_offsets(cu_seqlens, T, B, sp.size, op))

    @property
    def nseg(self):
        return len(self.bounds) - 1


def own_precision(device_type: str):
    """The context a layer computes in: autocast off (its precision choices are its own), and
    nothing at all when autocast is off already (entering and leaving one costs host time per call)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """The context a layer launches its kernels in: ``t``'s CUDA device made current (Triton kernels,
    fla's and allscan's, launch on the current device), and nothing at all when it is current
    already (entering one costs host time per call)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Checked calls. A layer's checks read its tensors' types, shapes, dtypes and devices and its
# options' values, never a tensor's values (except cu_seqlens', which such calls never skip). So a
# call with the same of all these on the same group as one that passed its checks passes them too,
# and skips them where the cross-rank check is itself made once per signature, for as long as that
# signature stays checked (every rank evicts it at the same call, and checks again). The cuts are
# kept in a bounded LRU, forgotten with the collectives' plans (allscan.destroy_communicators).
# ------------------------------------------------------------------------------------------------
_checked_cuts = plan_cache()
_checked_cuts_lock = threading.Lock()  # layers may run on several threads (one group each)


def _argument_key(tensors, options) -> Optional[tuple]:
    """What a layer's checks read: each of ``tensors`` (None allowed) by shape, dtype and device, each
    of ``options`` by type and value; None when an argument is of another kind (a tensor or a list as
    an option, say), which the checks then see every call."""
    key = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key.append((t.shape, t.dtype, t.device))
        elif t is None:
            key.append(None)
        else:
            return None
    for a in options:
        if a is not None and type(a) not in (bool, int, float, str):
            return None
        key.append((type(a), a))
    return tuple(key)


def checked_cut(op: str, group, device: Optional[torch.device], tensors, options,
                check: Callable[[], Tuple["ShardSegments", Optional[tuple]]]) -> "ShardSegments":
    """The shard's cut of an ``op`` call on ``group`` (None: one process). ``check()`` makes every
    check of the call, the local ones then across ranks, and returns ``(cut, signature key)`` (the key
    :func:`~allscan._agreement.check_across_ranks` returned). A call whose ``tensors`` and ``options``
    (everything the checks read; pass ``tensors=None`` with packed sequences: the cut reads
    ``cu_seqlens``' values) match an earlier call's on the same group, in the same check mode, reuses
    that cut while its signature is still checked. Every call checks with ``ALLSCAN_CHECK=always``
    and wherever the peers exchange their signatures every call (off NCCL)."""
    key = None if tensors is None or device is None else _argument_key(tensors, options)
    if key is not None:
        key = (op, id(group), settings.check) + key
        with _checked_cuts_lock:
            hit = _checked_cuts.get(key)
        # the entry holds its group (so its id is not reused) and the signature's key
        if hit is not None and hit[0] is group and (hit[2] is None or still_checked(group, hit[2])):
            return hit[1]
    cut, signature = check()
    if key is not None and _skippable(group, device):
        with _checked_cuts_lock:
            _checked_cuts[key] = (group, cut, signature)
    return cut


def _skippable(group, device) -> bool:
    """Whether a repeated call may skip its checks: not with ``ALLSCAN_CHECK=always``, nor where the
    peers exchange their signatures every call."""
    if settings.check == "always":
        return False
    return group is None or world_and_rank(group)[0] == 1 or not peers_exchange(group, device)
