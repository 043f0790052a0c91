"""How a sequence-parallel op takes the batch's :class:`allscan.SequenceContext` (``context=``): its group
and its cut of the packed sequences come from the context, which agreed on them across ranks once per
batch, so the op compares neither again (its other arguments are checked as without a context).

A context replaces ``cu_seqlens=`` and ``group=``: one given beside it is refused (a ``group=`` naming the
context's own group is accepted), inside the op's local checks so that the refusal reaches every rank.
"""
from __future__ import annotations

from typing import Optional

from allscan.context import SequenceContext

from ._shards import sequence_parallel_group

__all__ = ["context_group", "context_conflict", "context_fields"]


def context_group(context, group, op: str):
    """The process group an op runs on (None: one process): the context's when one is given, else
    ``group`` by :func:`~allscan.ops._shards.sequence_parallel_group`'s rule."""
    if isinstance(context, SequenceContext):
        return context.group.process_group
    return sequence_parallel_group(group, op)


def context_conflict(context, group, cu_seqlens, op: str) -> Optional[Exception]:
    """What is wrong with an op's ``context=`` beside its other arguments (None: nothing), for the op's
    local checks to raise: not a SequenceContext, given with ``cu_seqlens=``, or with a ``group=`` that
    is not the context's."""
    if context is None:
        return None
    if not isinstance(context, SequenceContext):
        return TypeError(f"{op}: context must be an allscan.SequenceContext, got {type(context).__name__}")
    if cu_seqlens is not None:
        return ValueError(f"{op}: context= and cu_seqlens= given together: the context holds the batch's packed "
                          "offsets; pass one of them")
    if group is not None and sequence_parallel_group(group, op) is not context.group.process_group:
        mine = context.group.name or "one process"
        return ValueError(f"{op}: context= and group= name different groups (group={group!r}, the context's: "
                          f"{mine}); pass the context alone")
    return None


def context_fields(context) -> list:
    """The signature fields that stand for the cut when a context gives it (the cut itself was agreed
    when the context was built, so its per-batch hash is left out and a repeated shape is checked once):
    whether a context is given, and whether it is packed."""
    return [("SequenceContext (0 none, 1 whole sequences, 2 packed)",
             0 if context is None else 1 + int(context.packed))]
