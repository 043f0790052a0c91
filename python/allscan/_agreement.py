"""The one cross-rank agreement protocol every collective runs before it communicates, so that ranks
passing different shapes raise instead of hanging.

- :func:`check_across_ranks`: the ranks' argument signatures compared (an all-gather of one fixed-width
  row per rank), once per signature and group where ``ALLSCAN_CHECK`` allows (:func:`still_checked`);
- :func:`signature_hash`: the 8-byte signature the core's chains send ahead of their first block;
- :func:`announce_invalid`: a rank whose own arguments failed a local check joins its peers' exchange
  (or reports on the fault board where they make none), so that they raise too;
- :func:`peers_exchange`, :func:`clear_checked_signatures`.
"""
from __future__ import annotations

import functools
import hashlib
import threading
import weakref
import zlib
from collections import OrderedDict
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _comm
from ._dtypes import DTYPE_NAMES
from ._settings import settings

__all__ = ["MAX_CHECKED_SIGNATURES", "check_across_ranks", "still_checked", "signature_hash", "announce_invalid",
           "peers_exchange", "clear_checked_signatures"]

# One row per rank: [magic, op code, number of fields, values..., zero padding]. The width is fixed,
# so the all-gather itself can never mismatch, whatever the ranks pass.
_WIDTH = 32
_HEADER = 3
_VALID = 0x5CA4
_INVALID = 0xBAD
MAX_CHECKED_SIGNATURES = 1024  # LRU: an evicted signature is checked again on its next use

_checked: "OrderedDict[tuple, weakref.ReferenceType]" = OrderedDict()
_checked_lock = threading.Lock()


def _op_code(op: str) -> int:
    return zlib.crc32(op.encode())


def _on_nccl(group, device: torch.device) -> bool:
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower()


def peers_exchange(group, device: torch.device) -> bool:
    """Whether every rank exchanges its signature on every call (so a rank that failed locally must
    join): with ``ALLSCAN_CHECK=always``, and in ``first`` mode off NCCL (there the exchange costs no
    host synchronisation the op does not already make)."""
    mode = settings.check
    return mode == "always" or (mode in ("first", "trust") and not _on_nccl(group, device))


def _gather_rows(group, device: torch.device, row: Sequence[int]):
    P = dist.get_world_size(group)
    local = torch.tensor(list(row), dtype=torch.int64, device=device if _on_nccl(group, device) else "cpu")
    rows = [torch.empty_like(local) for _ in range(P)]
    dist.all_gather(rows, local, group=group)
    return [r.tolist() for r in rows]


def _show(name: str, value: int) -> str:
    return DTYPE_NAMES.get(value, "none") if name.endswith("dtype") else str(value)


def check_across_ranks(group, device: torch.device, op: str, fields: Sequence[Tuple[str, int]], *,
                       every_call: bool = False) -> Optional[tuple]:
    """Raise ``ValueError`` on every rank if the ranks of ``group`` pass different ``fields``
    ((name, int) pairs, at most 28) to ``op``, naming each field that differs and every rank's value.

    Obeys ``settings.check`` (``first`` and ``trust``: on NCCL once per signature and group, cached
    in an LRU of :data:`MAX_CHECKED_SIGNATURES`, elsewhere every call; ``always``: every call;
    ``never``: no check). ``every_call``: exchange on every call in ``first`` and ``trust`` too, for
    calls whose signatures change from call to call (their fields read on the host anyway), so that
    neither a mismatch between signatures each checked before nor a rank's local failure (it joins
    with :func:`announce_invalid` ``every_call``) can pass unseen. The fields include whether this
    rank sends the in-band signature (``first``/``always`` do, ``trust`` does not): ranks that
    disagree on it would mismatch in NCCL.
    Under CUDA graph capture it exchanges nothing: a signature checked before capture passes, a new
    one raises ``RuntimeError``. Collective whenever it exchanges. Returns the signature's key where
    it is checked once (NCCL, ``first``/``trust``), for :func:`still_checked`; else None."""
    mode = settings.check
    if mode == "never" or dist.get_world_size(group) == 1:
        return None
    fields = list(fields) + [("in-band signature (ALLSCAN_CHECK first/always: 1, trust: 0)", int(mode != "trust"))]
    values = tuple(int(v) for _, v in fields)
    if len(values) > _WIDTH - _HEADER:
        raise ValueError(f"check_across_ranks: {op} passes {len(values)} fields, at most {_WIDTH - _HEADER}")
    key = (group.group_name, id(group), op, values)
    with _checked_lock:
        ref = _checked.get(key)
        seen = ref is not None and ref() is group
        if seen:
            _checked.move_to_end(key)
    once = mode in ("first", "trust") and _on_nccl(group, device) and not every_call
    if seen and once:
        return key
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if seen:
            return key if once else None  # checked before capture; the exchange would synchronise, which capture forbids
        raise RuntimeError(
            f"allscan.{op}: these arguments were never checked across ranks, and the check cannot run while "
            f"a CUDA graph is being captured; call it once with them before capturing")
    row = [_VALID, _op_code(op), len(values), *values]
    rows = _gather_rows(group, device, row + [0] * (_WIDTH - len(row)))
    _raise_on_difference(op, fields, rows, dist.get_rank(group))
    with _checked_lock:
        _checked[key] = weakref.ref(group)
        _checked.move_to_end(key)
        while len(_checked) > MAX_CHECKED_SIGNATURES:
            _checked.popitem(last=False)
    return key if once else None


def still_checked(group, key: tuple) -> bool:
    """Whether the signature whose key :func:`check_across_ranks` returned is still among the checked
    ones, kept recent as a repeated check would keep it: a caller that skips repeated checks must
    check again once it is evicted, when every rank's repeated check exchanges again."""
    with _checked_lock:
        ref = _checked.get(key)
        if ref is None or ref() is not group:
            return False
        _checked.move_to_end(key)
        return True


def signature_hash(op: str, fields: Sequence[Tuple[str, int]]) -> int:
    """The 64-bit value the core's chain schedules send ahead of their first block so that a
    receiver can tell a call made with other arguments (``allscanScanArgs_t.signature``): a hash of
    ``op`` and ``fields`` (equal on every rank exactly when the fields are); 0 (no in-band check)
    with ``ALLSCAN_CHECK=trust`` or ``never``."""
    if settings.check in ("never", "trust"):
        return 0
    return _hash_fields(op, tuple((name, int(v)) for name, v in fields))


@functools.lru_cache(maxsize=MAX_CHECKED_SIGNATURES)
def _hash_fields(op: str, fields: Tuple[Tuple[str, int], ...]) -> int:
    text = op + ":" + ",".join(f"{name}={v}" for name, v in fields)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def _raise_on_difference(op: str, fields, rows, me: int) -> None:
    bad = [q for q, row in enumerate(rows) if row[0] == _INVALID]
    if bad:
        raise ValueError(f"allscan.{op}: rank(s) {bad} rejected their own arguments or failed before this call "
                         f"(see the error raised there); this is rank {me}")
    others = [q for q, row in enumerate(rows) if row[1] != rows[me][1]]
    if others:
        raise ValueError(f"allscan.{op}: rank(s) {others} are in a different collective at the same time "
                         f"(this is rank {me}, in {op})")
    if all(row == rows[0] for row in rows):
        return
    parts = []
    counts = {row[2] for row in rows}
    if len(counts) > 1:
        parts.append("the number of fields (" + ", ".join(f"rank {q}: {row[2]}" for q, row in enumerate(rows)) + ")")
    for i, (name, _) in enumerate(fields):
        column = [row[_HEADER + i] for row in rows]
        if any(v != column[0] for v in column):
            per_rank = ", ".join(f"rank {q}: {_show(name, v)}" for q, v in enumerate(column))
            parts.append(f"{name} ({per_rank})")
    raise ValueError(
        f"allscan.{op}: ranks passed different arguments (a collective would hang): ranks disagree on "
        + "; ".join(parts) + f". Every rank must pass the same shapes, dtypes and options (this is rank {me})")


def announce_invalid(group, device: torch.device, op: str, reason: str = "", *, every_call: bool = False) -> None:
    """A rank whose own arguments failed a local check joins the exchange its peers make in the
    current mode (see :func:`peers_exchange`; ``every_call``: the peers' :func:`check_across_ranks`
    exchanges on every call, in every mode but ``never``), with a marker that makes them raise instead
    of waiting for it. Where the peers do not exchange (NCCL in ``first`` mode: they may be waiting in a
    call this rank will not make) it reports ``reason`` on the fault board (``allscan._faults``)
    instead. Nothing under capture, or alone."""
    if dist.get_world_size(group) == 1:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # nothing runs before the graph is replayed
    if not (peers_exchange(group, device) or (every_call and settings.check != "never")):
        _comm.report_local_error(group, device, f"allscan.{op}: {reason or 'its own arguments failed a check'}")
        return
    _gather_rows(group, device, [_INVALID, _op_code(op)] + [0] * (_WIDTH - 2))


def clear_checked_signatures() -> None:
    """Forget every checked signature (``allscan.destroy_communicators`` calls it)."""
    with _checked_lock:
        _checked.clear()
