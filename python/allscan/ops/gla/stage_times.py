"""Benchmark hook: the host time of each stage of :func:`allscan.ops.gla.zeco_gla`.

``with host_stage_times() as t:`` accumulates, in ``t``, the host seconds that the zeco_gla calls made
inside the block spend in each stage. It times the op from outside, through the op's documented hooks
(:data:`allscan.ops.hooks.op_hooks`: ``gla_scan`` and ``gla_body``), which it replaces while a block is
open; outside a block the op runs its plain functions and pays nothing for this module.
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Dict, Iterator, List

from ..hooks import op_hooks

STAGES = ("fwd_states", "shard_gamma", "fwd_intra", "fwd_output_with_state", "fwd_output", "correct",
          "bwd_begin", "xgrad", "bwd_prepare", "bwd_dh", "bwd_finish")
_STAGE_TIMERS: List[Dict[str, float]] = []  # the dicts of the open host_stage_times() blocks
_PLAIN: list = []  # the hooks the outermost open block replaced


def _add_time(acc, label, t0):
    acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def host_stage_times() -> Iterator[Dict[str, float]]:
    """Benchmark hook: host seconds spent in each stage of the ``zeco_gla`` calls (forward and
    backward) made inside the block, accumulated in the dict it yields (the innermost block's, when
    blocks nest). Keys: the backend stages (:data:`STAGES`), ``"scan issue"`` (launching the
    All-Scans), ``"scan wait"`` (waiting for them), ``"forward body"`` and ``"backward body"`` (the
    whole of each, stages included). Nothing is synchronised: on CUDA these are the times to issue
    the work."""
    acc: Dict[str, float] = {}
    if not _STAGE_TIMERS:  # the outermost block puts the timed hooks in place
        _PLAIN[:] = [op_hooks.gla_scan, op_hooks.gla_body]
        op_hooks.gla_scan = functools.partial(_timed_scan, op_hooks.gla_scan)
        op_hooks.gla_body = _timed_body
    _STAGE_TIMERS.append(acc)
    try:
        yield acc
    finally:
        _STAGE_TIMERS.remove(acc)
        if not _STAGE_TIMERS:
            op_hooks.gla_scan, op_hooks.gla_body = _PLAIN
            _PLAIN.clear()


class _TimedStages:
    """A backend whose stages add their host time to ``acc``."""

    def __init__(self, backend, acc):
        self._backend, self._acc = backend, acc

    def __getattr__(self, name):
        fn = getattr(self._backend, name)
        if name not in STAGES:
            return fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _add_time(self._acc, name, t0)
        return timed


class _TimedHandle:
    def __init__(self, handle, acc):
        self._handle, self._acc = handle, acc

    def wait(self):
        t0 = time.perf_counter()
        try:
            return self._handle.wait()
        finally:
            _add_time(self._acc, "scan wait", t0)


def _timed_scan(scan, x, gamma, group, **kwargs):
    """``scan(x, gamma, group, **kwargs)``, its issue (and an async handle's wait) timed in the
    innermost block."""
    acc = _STAGE_TIMERS[-1]
    t0 = time.perf_counter()
    out = scan(x, gamma, group, **kwargs)
    _add_time(acc, "scan issue", t0)
    return _TimedHandle(out, acc) if kwargs.get("async_op") else out


def _timed_body(label, body, be, *args):
    """``body(be, *args)`` (a forward or backward), its whole time and each of ``be``'s stages timed in
    the innermost block."""
    acc = _STAGE_TIMERS[-1]
    t0 = time.perf_counter()
    try:
        return body(_TimedStages(be, acc), *args)
    finally:
        _add_time(acc, label, t0)
