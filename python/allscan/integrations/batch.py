"""A batch cut along the sequence, and the loss and gradients of the whole batch back: what every
sequence-parallel model needs around its layers, whichever library the model comes from.

Every rank holds the same parameters and a contiguous slice of every sequence (rank order = sequence
order). So the model needs global position ids (``shard_batch`` makes them), labels shifted across
the rank boundaries before cutting (``shard_batch``), a loss normalised by the whole batch's token
count (``causal_lm_loss``), and parameter gradients summed over the group (``sync_gradients``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .._comm import normalize_group

__all__ = ["IGNORE_INDEX", "BatchShard", "shard_batch", "causal_lm_loss", "reduce_loss", "sync_gradients",
           "packed_bounds_of"]

IGNORE_INDEX = -100


@dataclass
class BatchShard:
    """This rank's part of a batch: ``input_ids`` and ``position_ids`` ``[B, T / P]``, ``shift_labels``
    (the next token of each position, shifted over the whole sequence before cutting; IGNORE_INDEX
    after each sequence's last token), ``num_items`` (non-ignored labels in the WHOLE batch) and
    ``cu_seqlens`` (a packed row, B = 1: the sequences' bounds in the whole row, ``[0, ..., T]``, int32,
    the same on every rank; None when every row is one sequence)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: Optional[torch.Tensor]
    num_items: Optional[int]
    cu_seqlens: Optional[torch.Tensor] = None


def packed_bounds_of(positions: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The bounds ``(0, ..., T)`` of the sequences packed in one row, from its position ids ``[T]``, as
    transformers finds them (``masking_utils.find_packed_sequence_indices``: a sequence starts wherever a
    position is not the one before plus one); None when the row is one sequence."""
    if positions.dim() != 1:
        raise ValueError(f"packed_bounds_of: one row of position ids [T], got {list(positions.shape)}")
    starts = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    if not starts:
        return None
    return (0, *starts, positions.shape[0])


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *, group=None,
                position_ids: Optional[torch.Tensor] = None) -> BatchShard:
    """Cut a batch ``[B, T]`` (the same on every rank) into this rank's contiguous slice of ``T / P``
    tokens. ``labels`` (default: none) are the usual causal-LM labels (same positions as the inputs,
    IGNORE_INDEX where ignored); they are shifted by one over the whole sequence here, so the last
    token of a slice is scored against the first token of the next slice. ``position_ids`` default to
    ``0 .. T-1``. Position ids that restart mark sequences packed in one row (transformers'
    ``DataCollatorWithFlattening``; a new sequence wherever a position is not the one before plus one):
    then no label crosses a sequence's end (IGNORE_INDEX at each sequence's last token, as that collator
    leaves them) and ``cu_seqlens`` holds the bounds; one packed row per batch (B = 1), else
    NotImplementedError (on every rank: the batch is the same on every rank)."""
    group = normalize_group(group)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    if input_ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [B, T], got {list(input_ids.shape)}")
    B, T = input_ids.shape
    if T % P:
        raise ValueError(f"shard_batch: the sequence length T = {T} must be a multiple of the group size {P}")
    bounds = None
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(f"shard_batch: position_ids must have input_ids' shape {list(input_ids.shape)}, "
                         f"got {list(position_ids.shape)}")
    elif T > 1 and bool(((position_ids[:, 1:] - position_ids[:, :-1]) != 1).any()):
        if B != 1:
            raise NotImplementedError(
                f"shard_batch: packed rows (position ids that restart) in a batch of {B} rows are not supported; "
                "pack the sequences into one row per batch (B = 1)")
        bounds = packed_bounds_of(position_ids[0])
    sl = slice(r * (T // P), (r + 1) * (T // P))
    shift, items = None, None
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"shard_batch: labels must have input_ids' shape {list(input_ids.shape)}, "
                             f"got {list(labels.shape)}")
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if bounds is not None:
            shift[:, [b - 1 for b in bounds[1:-1]]] = IGNORE_INDEX  # a sequence's last token predicts no next one
        items = int((shift != IGNORE_INDEX).sum())
        shift = shift[:, sl].contiguous()
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return BatchShard(input_ids[:, sl].contiguous(), position_ids[:, sl].contiguous(), shift, items, cu)


def causal_lm_loss(logits: torch.Tensor, shard: BatchShard) -> torch.Tensor:
    """This rank's share of the whole batch's mean cross-entropy: the sum over its tokens divided by
    the whole batch's label count, so the shares of the group add up to the single-process loss (and
    their gradients to its gradients)."""
    if shard.shift_labels is None:
        raise ValueError("causal_lm_loss: the shard has no labels (pass labels to shard_batch)")
    total = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                              shard.shift_labels.reshape(-1).to(logits.device),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(shard.num_items, 1)


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The single-process loss from every rank's share (a detached sum over the group)."""
    out = loss.detach().clone()
    dist.all_reduce(out, group=normalize_group(group))
    return out


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the group: each rank's backward gave the gradient of its
    share of the loss, the sum is the gradient of the whole loss. (Data parallelism on top: average
    over the data-parallel group as usual.)"""
    group = normalize_group(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
