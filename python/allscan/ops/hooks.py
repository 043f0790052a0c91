"""Documented hooks: the points where the sequence-parallel linear-attention ops call out, so that a
benchmark or a test can time, observe or stand in for a part of them from outside the op.

Each hook is an attribute of :data:`op_hooks` holding the function the op calls; unused, it is the
plain function, so the op pays one attribute lookup and nothing else. Whoever replaces one puts it
back when done (``with replaced(op_hooks, name=fn):``); the hooks are process-wide.

- ``gla_scan(x, gamma, group, **kwargs)``: how :func:`allscan.ops.gla.zeco_gla` issues its
  All-Scans (forward and reverse, synchronous or ``async_op=True``): :func:`allscan.scan`'s arguments
  and results. Default: :func:`allscan.scan`.
- ``gla_body(label, body, backend, *args)``: how ``zeco_gla`` runs its eager forward and backward
  (``label`` ``"forward body"`` or ``"backward body"``): returns ``body(backend, *args)``; ``backend``
  is the local kernels' staged backend, whose stages (:data:`allscan.ops.gla.STAGES`) a timer may
  wrap. Default: :func:`run_body`.
- ``delta_scan(x, **kwargs)``: how :func:`allscan.ops.delta.zeco_gated_delta_rule` and
  :func:`~allscan.ops.delta.zeco_kda` issue their matrix All-Scans (``allscan.scan(x,
  transition=..., ...)``). Default: :func:`allscan.scan`.
- ``shard_cut(group, T, B, cu_seqlens, op)``: how ``zeco_gla`` and the delta rules cut this rank's shard
  when no :class:`allscan.SequenceContext` is given (a :class:`allscan.context.ShardCut`); a benchmark
  stands one rank in for another here. Default: :class:`allscan.ops._shards.ShardSegments`.
- :func:`cut_world`: the ranks a shard's cut spans, through ``shard_cut``: what the compiled ops take as
  their ``group_size`` (their results' shapes depend on it; :func:`check_cut_world` holds the cut they make
  to it).
- :func:`forget_plans`: forget the plans and checked cuts made so far, so that a replaced hook serves
  the next call even where a repeated call would reuse an earlier call's cut.

:func:`allscan.ops.gla.host_stage_times` (the benchmarks' host timer) is built on the first two.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ._launch import forget_plans
from ._shards import ShardSegments
from .scan import scan

__all__ = ["OpHooks", "op_hooks", "run_body", "replaced", "forget_plans", "cut_world", "check_cut_world"]


def run_body(label: str, body, backend, *args):
    """The default ``gla_body``: ``body(backend, *args)``."""
    return body(backend, *args)


class OpHooks:
    """The hooks (see the module docstring); one instance, :data:`op_hooks`."""

    __slots__ = ("gla_scan", "gla_body", "delta_scan", "shard_cut")

    def __init__(self):
        self.gla_scan = scan
        self.gla_body = run_body
        self.delta_scan = scan
        self.shard_cut = ShardSegments


op_hooks = OpHooks()


@contextlib.contextmanager
def replaced(hooks: OpHooks, **fns) -> Iterator[OpHooks]:
    """``with replaced(op_hooks, gla_scan=fn):`` the named hooks replaced inside the block, put back
    after it (also when it raises)."""
    saved = {name: getattr(hooks, name) for name in fns}
    try:
        for name, fn in fns.items():
            setattr(hooks, name, fn)
        yield hooks
    finally:
        for name, fn in saved.items():
            setattr(hooks, name, fn)


def cut_world(group, q, op: str) -> int:
    """How many ranks the cut of ``q``'s shard (``[B, T_local, ...]``) spans on ``group`` (None: one
    process), through the ``shard_cut`` hook, asked without the packed offsets (a trace has no values)."""
    if q.dim() < 2:  # refused by the op's checks when it runs; no shard to cut here
        return 1
    return op_hooks.shard_cut(group, q.shape[1], q.shape[0], None, op).world


def check_cut_world(cut, group_size: int, op: str) -> None:
    """A compiled op's cut spans the ``group_size`` ranks its results' shapes were traced for (a replaced
    ``shard_cut`` hook could cut packed rows otherwise): a clear error instead of mismatched shapes."""
    if cut.world != group_size:
        raise RuntimeError(f"allscan::{op}: traced for {group_size} rank(s), but this call's shard cut spans "
                           f"{cut.world} (a shard_cut hook that cuts packed rows differently from plain ones?)")
