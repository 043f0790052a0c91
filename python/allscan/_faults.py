"""The fault board: one rank's failure of a group's NCCL communicator reaches the other ranks in
about a second, instead of each waiting for its own timeout.

A watched NCCL communicator (``_comm``) is registered here under a key every rank shares. A rank
posts a numbered report under that key in torch.distributed's store, of one of two kinds:

- *fatal*: its watch timed out (a peer died or is stuck), its core found a mismatched signature on
  the GPU (``allscanCommStatus``: a peer called with other arguments), or it gave up on a skipped
  call (below). Every other rank fails its communicator at its next round (``allscanWatchFail``:
  abort, every later call raises ``allscan.CommunicatorError`` with the reporter's reason).
- *skip*: its own arguments failed a local check after the communicator existed, or its own work
  between collectives raised (out of memory in a layer), so it made no call where its peers (which
  checked that signature before and do not exchange again) may have made one; the report names the
  call by the number of calls issued before it (``allscanWatchCalls``).
  If every rank reports a skip of the same call within :data:`SKIP_GRACE_S` (they all made the same
  mistake) nobody issued it and the group carries on. Otherwise the skipping rank gives up on the
  communicator and posts a fatal report: a peer's call may be waiting for it, or may have completed
  into NCCL's buffers and would feed stale data to the next call. Until then the skipping rank holds
  (``wait_skip``): its next call must not meet a peer's call from before.

One daemon thread, every :data:`POLL_S` seconds, posts queued reports, reports local failures and
reads the peers' reports; store round trips happen only there, never on a collective's path (a dead
store stalls the board, not the caller; only an argument error waits for it, at most the grace).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from . import _C

__all__ = ["POLL_S", "SKIP_GRACE_S", "Target", "FaultBoard", "board"]

POLL_S = 0.25  # how often the thread looks at the store and at the communicators
SKIP_GRACE_S = 3.0  # every rank reports the same skipped call within this, or the skipping ranks give up
FATAL, SKIP = "fatal", "skip"
_GAP_S = 2.0  # a report numbered but not written for this long is passed over


@dataclass
class Target:
    """What the board needs of one communicator: its rank and size, the number of calls issued on it
    (ranks that made the same calls agree on it: a skip names the call it skipped by it), its local
    failure (None, or (code, reason)), and how to fail it with a code and a reason."""

    rank: int
    size: int
    calls: Callable[[], int]
    local_failure: Callable[[], Optional[Tuple[int, str]]]
    fail: Callable[[int, str], None]  # (code, reason): abort, later calls raise


@dataclass
class _Entry:
    target: Target
    use: threading.Lock = field(default_factory=threading.Lock)  # held while the target is called
    seen: int = 0                  # reports read (or skipped: numbered but never written)
    gap_since: Optional[float] = None  # when reading first stopped at a number not written yet
    failed: bool = False
    my_skip: Optional[Tuple[int, float, str]] = None  # (call index, when, reason) of an unresolved own skip
    skippers: Dict[int, Set[int]] = field(default_factory=dict)  # call index -> ranks that skipped it
    outbox: List[Tuple[str, int, str]] = field(default_factory=list)  # (kind, call index, reason) to post


_GONE = object()


class FaultBoard:
    """Reports and reads failures of registered communicators through a torch.distributed store."""

    def __init__(self, poll_s: float = POLL_S, skip_grace_s: float = SKIP_GRACE_S):
        self.poll_s = poll_s
        self.skip_grace_s = skip_grace_s
        self._lock = threading.Lock()  # the entries, their outboxes and skip state
        self._entries: Dict[str, _Entry] = {}
        self._store = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # -- registration ---------------------------------------------------------------------------
    def register(self, key: str, target: Target, store) -> None:
        """Watch ``target`` under ``key`` (equal on every rank of its group, new for each
        communicator: reports under it are read from the first)."""
        with self._lock:
            self._store = store
            self._entries[key] = _Entry(target)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="allscan-fault-board", daemon=True)
                self._thread.start()

    def unregister(self, key: str) -> None:
        """Forget ``key``; returns once no board round is calling its target."""
        with self._lock:
            e = self._entries.pop(key, None)
        if e is not None:
            with e.use:
                pass

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread (a later registration starts it again); waits at most ``timeout`` for a
        round in progress (a dead store may hold it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=timeout)
        self._thread = None

    # -- reports --------------------------------------------------------------------------------
    def report_skip(self, key: str, reason: str) -> None:
        """This rank raised on its own arguments instead of making its next call on ``key``'s
        communicator (queued; the board's thread posts it within a round)."""
        with self._lock:
            e = self._entries.get(key)
        if e is None or e.failed:
            return
        index = self._call(key, e, e.target.calls)
        if index is _GONE:
            return
        with self._lock:
            e.my_skip = (int(index), time.monotonic(), reason)
            e.outbox.append((SKIP, int(index), reason))

    def wait_skip(self, key: str, timeout: float) -> None:
        """Block until this rank's last skip on ``key`` is resolved (every rank skipped the same
        call) or its communicator failed; after ``timeout`` (the board is stalled) fail it here and
        queue the fatal report. So a rank that skipped a call never makes its next one on a
        communicator a peer may have fed."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                e = self._entries.get(key)
                if e is None or e.failed or e.my_skip is None:
                    return
                reason = e.my_skip[2]
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        why = f"{reason} (this rank raised instead of making the call and could not learn whether its peers did)"
        self._fail(key, e, _remote_code(), why, post=why)

    def tick(self) -> None:
        """One round over every registered communicator."""
        with self._lock:
            entries = list(self._entries.items())
            store = self._store
        for key, e in entries:
            try:
                self._tick_one(store, key, e)
            except Exception:  # noqa: BLE001 - the store went away (shutdown): try again next round
                continue

    # -- internals ------------------------------------------------------------------------------
    def _call(self, key: str, e: _Entry, fn):
        with e.use:
            with self._lock:
                if self._entries.get(key) is not e:
                    return _GONE
            return fn()

    def _fail(self, key: str, e: _Entry, code: int, reason: str, post: Optional[str]) -> None:
        """Fail this rank's communicator; queue ``post`` as a fatal report when given."""
        with self._lock:
            if e.failed:
                return
            e.failed = True
            if post is not None:
                e.outbox.append((FATAL, 0, post))
        self._call(key, e, lambda: e.target.fail(code, reason))

    def _flush(self, store, key: str, e: _Entry) -> None:
        """Post the queued reports (what fails to post stays queued for the next round)."""
        with self._lock:
            outbox, e.outbox = e.outbox, []
        for i, (kind, index, reason) in enumerate(outbox):
            try:
                n = int(store.add(key + "/n", 1))
                store.set(f"{key}/{n}", f"{e.target.rank}\n{kind}\n{index}\n{reason}")
            except Exception:  # noqa: BLE001
                with self._lock:
                    e.outbox[:0] = outbox[i:]
                raise

    def _tick_one(self, store, key: str, e: _Entry) -> None:
        self._flush(store, key, e)
        if not e.failed:
            self._read_and_judge(store, key, e)
        self._flush(store, key, e)  # a failure found this round goes out now

    def _read_and_judge(self, store, key: str, e: _Entry) -> None:
        local = self._call(key, e, e.target.local_failure)
        if local is _GONE:
            return
        if local is not None:
            code, reason = local
            self._fail(key, e, code, reason, post=reason)
            return
        n = int(store.add(key + "/n", 0))
        now = time.monotonic()
        while e.seen < n:
            name = f"{key}/{e.seen + 1}"
            if not store.check([name]):
                # Numbered, not written yet: next round. A poster that died (or failed) between
                # numbering and writing leaves a gap for good: passed over after _GAP_S.
                e.gap_since = e.gap_since or now
                if now - e.gap_since < _GAP_S:
                    break
                e.seen += 1
                e.gap_since = None
                continue
            e.gap_since = None
            rank, kind, index, reason = store.get(name).decode().split("\n", 3)
            e.seen += 1
            if int(rank) == e.target.rank:
                continue
            if kind == FATAL:
                self._fail(key, e, _remote_code(), f"rank {rank} reported: {reason}", post=None)
                return
            with self._lock:
                e.skippers.setdefault(int(index), set()).add(int(rank))
        with self._lock:
            if e.my_skip is None:
                return
            index, since, reason = e.my_skip
            ranks = e.skippers.get(index, set()) | {e.target.rank}
            if len(ranks) == e.target.size:
                e.my_skip = None  # every rank skipped the same call: nobody issued it, the group is in step
                e.skippers.pop(index, None)
                return
            if time.monotonic() - since < self.skip_grace_s:
                return
        missing = sorted(set(range(e.target.size)) - ranks)
        why = (f"{reason} (this rank raised instead of making call {index} on the communicator; rank(s) "
               f"{missing} did not within {self.skip_grace_s:.0f} s, so their calls may wait for it or hold "
               "stale data)")
        self._fail(key, e, _remote_code(), why, post=why)

    def _run(self) -> None:
        # A thread that outlived a stop() (a round held by a dead store) leaves once it sees it was
        # replaced, so two threads never work the same entries.
        me = threading.current_thread()
        while not self._stop.wait(self.poll_s) and self._thread is me:
            self.tick()


def _remote_code() -> int:
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
