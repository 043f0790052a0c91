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
from typing import Dict, List, Tuple

from . import _comm

_lock = threading.Lock()
_busy: Dict[Tuple[str, int], List] = {}  # group key -> [thread ident, depth, op]


class one_thread:
    """``with one_thread(group, op):`` around a collective's issue on ``group`` (None: the default)."""

    __slots__ = ("key", "me")

    def __init__(self, group, op: str):
        group = _comm.normalize_group(group)
        self.key = (group.group_name, id(group))
        self.me = threading.get_ident()
        with _lock:
            entry = _busy.get(self.key)
            if entry is None:
                _busy[self.key] = [self.me, 1, op]
                return
            if entry[0] != self.me:
                raise RuntimeError(
                    f"allscan.{op}: group {group.group_name!r} is in allscan.{entry[2]} on another host thread of "
                    "this process; the collectives of one group must be issued from one thread at a time (the "
                    "ranks pair calls by issue order, so two threads would mix their data)")
            entry[1] += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        with _lock:
            entry = _busy[self.key]
            entry[1] -= 1
            if entry[1] == 0:
                del _busy[self.key]
        return False
