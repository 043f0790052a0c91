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
- ``cut_world(group, packed)``: how many ranks the cut of a call on ``group`` (None: one process) will span,
  ``packed`` whether it has packed offsets: what ``zeco_gla`` and the delta rules pass their custom ops under
  torch.compile as ``group_size`` (the results' shapes depend on it; it is evaluated while tracing, so it reads
  no tensor). Whoever replaces ``shard_cut`` with a cut of another size replaces this too. Default: the group's
  size. :func:`check_cut_world` holds the cut the op makes to it.
- :func:`forget_plans`: forget the plans and checked cuts made so far, so that a replaced hook serves
  the next call even where a repeated call would reuse an earlier call's cut.

:func:`allscan.ops.gla.host_stage_times` (the benchmarks' host timer) is built on the first two.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from ._launch import forget_plans
from ._shards import ShardSegments
from .scan import scan

__all__ = ["OpHooks", "op_hooks", "run_body", "replaced", "forget_plans", "group_world", "check_cut_world"]


def run_body(label: str, body, backend, *args):
    """The default ``gla_body``: ``body(backend, *args)``."""
    return body(backend, *args)


def group_world(group, packed: bool) -> int:
    """The default ``cut_world``: ``group``'s size (1 for None, one process), packed or not. Asked of
    torch.distributed, not of a cache: a cache filled while tracing is a guard that fails on the next call."""
    return 1 if group is None else dist.get_world_size(group)


class OpHooks:
    """The hooks (see the module docstring); one instance, :data:`op_hooks`."""

    __slots__ = ("gla_scan", "gla_body", "delta_scan", "shard_cut", "cut_world")

    def __init__(self):
        self.gla_scan = scan
        self.gla_body = run_body
        self.delta_scan = scan
        self.shard_cut = ShardSegments
        self.cut_world = group_world


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



def check_cut_world(cut, group_size: int, op: str) -> None:
    """A compiled op's cut spans the ``group_size`` ranks its results' shapes were traced for (a replaced
    ``shard_cut`` hook whose ``cut_world`` says otherwise): a clear error instead of mismatched shapes."""
    if cut.world != group_size:
        raise RuntimeError(f"allscan::{op}: traced for {group_size} rank(s), but this call's shard cut spans "
                           f"{cut.world} (a replaced shard_cut hook without the cut_world that goes with it?)")
