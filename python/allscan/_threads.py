"""One host thread at a time in a group's collectives.

The ranks of a group pair their collectives by issue order. Two host threads of one rank issuing
collectives on one group at the same time interleave them in an order the other ranks do not share,
and the pairs mix (the issue-13 probe: 246 of 500 results wrong, no error). :class:`one_thread`
marks a group busy for the duration of a call; a second thread entering a collective on that group
meanwhile raises ``RuntimeError`` at once. The same thread may nest (a layer calling ``scan``).
Detection is per rank: it catches the overlap where it happens, it does not make two threads safe.
"""
from __future__ import annotations

import threading
from typing import Dict, List

from . import _comm

_busy: Dict[int, List] = {}  # id(group) -> [thread ident, depth, op]; one entry per group in a call
_get_ident = threading.get_ident


def enter(group, op: str) -> list:
    """Mark ``group`` (a ProcessGroup, already normalised) busy in ``op`` on this thread; returns the
    entry for :func:`leave`. Raises ``RuntimeError`` when another thread is in a collective on it.

    No lock: ``dict.setdefault`` is atomic under the GIL, so of two threads entering at once exactly
    one owns the entry and the other sees it."""
    me = _get_ident()
    entry = _busy.setdefault(id(group), [me, 0, op])
    if entry[0] != me:
        raise RuntimeError(
            f"allscan.{op}: group {group.group_name!r} is in allscan.{entry[2]} on another host thread of "
            "this process; the collectives of one group must be issued from one thread at a time (the "
            "ranks pair calls by issue order, so two threads would mix their data)")
    entry[1] += 1
    return entry


def leave(group, entry: list) -> None:
    """The end of :func:`enter`'s call (the group is free once its outermost call leaves)."""
    entry[1] -= 1
    if entry[1] == 0:
        _busy.pop(id(group), None)


class one_thread:
    """``with one_thread(group, op):`` around a collective's issue on ``group`` (None: the default);
    :func:`enter` and :func:`leave` where a context manager costs too much (``scan``'s fast path)."""

    __slots__ = ("entry", "group")

    def __init__(self, group, op: str):
        self.group = _comm.normalize_group(group)  # normalised, for the caller
        self.entry = enter(self.group, op)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        leave(self.group, self.entry)
        return False
