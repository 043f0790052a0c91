"""The fault board: one rank's failure of a group's NCCL communicator reaches the other ranks in
about a second, instead of each waiting for its own timeout.

A watched NCCL communicator (``_comm``) is registered here under a key every rank shares. A rank
posts a numbered report under that key in torch.distributed's store, of one of two kinds:

- *fatal*: its watch timed out (a peer died or is stuck), its core found a mismatched signature on
  the GPU (``allscanCommStatus``: a peer called with other arguments), or it gave up on a skipped
  call (below). Every other rank fails its communicator at its next round (``allscanWatchFail``:
  abort, every later call raises ``allscan.CommunicatorError`` with the reporter's reason).
- *skip*: its own arguments failed a local check after the communicator existed, so it made no call
  where its peers (which checked that signature before and do not exchange again) may have made
  one. If every rank of the group reports the same skip within :data:`SKIP_GRACE_S` (they all made
  the same mistake) nobody issued anything and the group carries on. Otherwise the skipping rank
  gives up on the communicator and posts a fatal report: a peer's call may be waiting for it, or may
  have completed into NCCL's buffers and would feed stale data to the next call.

One daemon thread, every :data:`POLL_S` seconds, posts queued reports, reports local failures and
reads the peers' reports; store round trips happen only there, never on a collective's path (a
dead store stalls the board, not the caller).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

__all__ = ["POLL_S", "SKIP_GRACE_S", "Target", "FaultBoard", "board"]

POLL_S = 0.25  # how often the thread looks at the store and at the communicators
SKIP_GRACE_S = 2.0  # every rank reports the same skip within this, or the skipping ranks give up
FATAL, SKIP = "fatal", "skip"


@dataclass
class Target:
    """What the board needs of one communicator: its rank, its size, its local failure (None, or (code, reason)),
    and how to fail it with a code and a reason."""

    rank: int
    size: int
    local_failure: Callable[[], Optional[Tuple[int, str]]]  # (code, reason) or None
    fail: Callable[[int, str], None]  # (code, reason): abort, later calls raise


@dataclass
class _Entry:
    target: Target
    seen: int = 0                  # reports read
    failed: bool = False
    skips: int = 0                 # skips this rank reported (every rank agrees on the count while the group lives)
    my_skip: Optional[Tuple[int, float, str]] = None  # (round, when, reason) of an unresolved own skip
    skippers: Dict[int, Set[int]] = field(default_factory=dict)  # round -> ranks that reported it
    outbox: List[Tuple[str, int, str]] = field(default_factory=list)  # (kind, round, reason) to post


_GONE = object()


class FaultBoard:
    """Reports and reads failures of registered communicators through a torch.distributed store."""

    def __init__(self, poll_s: float = POLL_S, skip_grace_s: float = SKIP_GRACE_S):
        self.poll_s = poll_s
        self.skip_grace_s = skip_grace_s
        self._lock = threading.Lock()  # the entries and their outboxes
        self._use = threading.Lock()   # held while a target is called: unregister waits for it
        self._entries: Dict[str, _Entry] = {}
        self._store = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- registration ---------------------------------------------------------------------------
    def register(self, key: str, target: Target, store, seen: Optional[int] = None) -> None:
        """Watch ``target`` under ``key`` (equal on every rank of its group). ``seen``: reports to
        skip (those of an earlier communicator under the same key); None reads the count now."""
        if seen is None:
            seen = int(store.add(key + "/n", 0))
        with self._lock:
            self._store = store
            self._entries[key] = _Entry(target, seen=seen)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="allscan-fault-board", daemon=True)
                self._thread.start()

    def unregister(self, key: str) -> None:
        """Forget ``key``; returns once no board round is using its target."""
        with self._use, self._lock:
            self._entries.pop(key, None)

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._thread = None

    # -- reports --------------------------------------------------------------------------------
    def report_skip(self, key: str, reason: str) -> None:
        """This rank raised on its own arguments instead of making a call on ``key``'s communicator
        (queued; the board's thread posts it within a round)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.failed:
                return
            e.skips += 1
            e.my_skip = (e.skips, time.monotonic(), reason)
            e.outbox.append((SKIP, e.skips, reason))

    def wait_skip(self, key: str, timeout: float) -> None:
        """Block until this rank's last skip on ``key`` is resolved (every rank skipped it) or its
        communicator failed; after ``timeout`` (the board stalled: a dead store) fail it here. So a
        rank that skipped a call never makes its next one on a communicator a peer may have fed."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                e = self._entries.get(key)
                if e is None or e.failed or e.my_skip is None:
                    return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        self._call(key, e, lambda: e.target.fail(
            _remote_code(), f"{e.my_skip[2]} (this rank raised instead of making the call and could not tell "
            "whether its peers did: the fault board did not answer)"))
        e.failed = True

    def tick(self) -> None:
        """One round over every registered communicator."""
        with self._lock:
            entries = list(self._entries.items())
            store = self._store
        for key, e in entries:
            if e.failed:
                continue
            try:
                self._tick_one(store, key, e)
            except Exception:  # noqa: BLE001 - the store went away (shutdown): nothing to propagate
                continue

    def _call(self, key: str, e: _Entry, fn):
        with self._use:
            with self._lock:
                if self._entries.get(key) is not e:
                    return _GONE
            return fn()

    def _post(self, store, key: str, e: _Entry, kind: str, round_: int, reason: str) -> None:
        n = int(store.add(key + "/n", 1))
        store.set(f"{key}/{n}", f"{e.target.rank}\n{kind}\n{round_}\n{reason}")

    def _fail(self, store, key: str, e: _Entry, code: int, reason: str, post: Optional[str]) -> None:
        """Fail this rank's communicator (and post ``post`` as a fatal report when given)."""
        if post is not None:
            self._post(store, key, e, FATAL, 0, post)
        self._call(key, e, lambda: e.target.fail(code, reason))
        e.failed = True

    def _tick_one(self, store, key: str, e: _Entry) -> None:
        with self._lock:
            outbox, e.outbox = e.outbox, []
        for kind, round_, reason in outbox:
            self._post(store, key, e, kind, round_, reason)
        local = self._call(key, e, e.target.local_failure)
        if local is _GONE:
            return
        if local is not None:
            code, reason = local
            self._fail(store, key, e, code, reason, post=reason)
            return
        n = int(store.add(key + "/n", 0))
        while e.seen < n:
            e.seen += 1
            rank, kind, round_, reason = store.get(f"{key}/{e.seen}").decode().split("\n", 3)
            if kind == FATAL and int(rank) != e.target.rank:
                self._fail(store, key, e, _remote_code(), f"rank {rank} reported: {reason}", post=None)
                return
            if kind == SKIP:
                e.skippers.setdefault(int(round_), set()).add(int(rank))
        if e.my_skip is None:
            return
        round_, since, reason = e.my_skip
        ranks = e.skippers.get(round_, set())
        if len(ranks) == e.target.size:
            e.my_skip = None  # every rank skipped the same call: nobody issued it, the group is in step
            e.skippers.pop(round_, None)
        elif time.monotonic() - since >= self.skip_grace_s:
            missing = sorted(set(range(e.target.size)) - ranks)
            why = (f"{reason} (this rank raised instead of making the call; rank(s) {missing} did not within "
                   f"{self.skip_grace_s:.0f} s, so their calls may wait for it or hold stale data)")
            self._fail(store, key, e, _remote_code(), why, post=why)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.tick()


def _remote_code() -> int:
    from . import _C

    return _C.REMOTE_ERROR


_board: Optional[FaultBoard] = None
_board_lock = threading.Lock()


def board() -> FaultBoard:
    """The process's board (its thread starts with the first registration)."""
    global _board
    with _board_lock:
        if _board is None:
            _board = FaultBoard()
        return _board
