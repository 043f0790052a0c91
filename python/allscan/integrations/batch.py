"""A batch cut along the sequence, and the loss and gradients of the whole batch back: what every
sequence-parallel model needs around its layers, whichever library the model comes from.

Every rank holds the same parameters and a contiguous slice of every sequence (rank order = sequence
order). So the model needs global position ids (``shard_batch`` makes them), labels shifted across
the rank boundaries before cutting (``shard_batch``), a loss normalised by the whole batch's token
count (``causal_lm_loss``), and parameter gradients summed over the group (``sync_gradients``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from allscan.context import LOCAL, SequenceContext

from .common import comm_device, exchange, sp_group

__all__ = ["IGNORE_INDEX", "BatchShard", "shard_batch", "causal_lm_loss", "reduce_loss", "sync_gradients"]

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


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *, group=None,
                position_ids: Optional[torch.Tensor] = None) -> BatchShard:
    """Cut a batch ``[B, T]`` (the same on every rank) into this rank's contiguous slice of ``T / P``
    tokens. ``labels`` (default: none) are the usual causal-LM labels (same positions as the inputs,
    IGNORE_INDEX where ignored); they are shifted by one over the whole sequence here, so the last
    token of a slice is scored against the first token of the next slice. ``position_ids`` default to
    ``0 .. T-1``. Position ids that restart mark sequences packed in one row (transformers'
    ``DataCollatorWithFlattening``; read as :meth:`allscan.context.SequenceContext.from_position_ids` reads
    them: ids counting 0, 1, 2, ... that restart at 0 where a sequence starts, else ValueError): then no label
    crosses a sequence's end (IGNORE_INDEX at each sequence's last token, as that collator leaves them) and
    ``cu_seqlens`` holds the bounds; one packed row per batch (B = 1), else NotImplementedError (on every rank:
    the batch is the same on every rank). ``group``: the sequence-parallel group (None: the default group, one
    process where torch.distributed is not initialised; a ProcessGroup, a group name, ``mesh["sp"]``, or
    ``allscan.context.LOCAL``). For a DP x SP device mesh see :func:`allscan.integrations.mesh.shard_batch`
    (the token count of the whole global batch)."""
    sp = sp_group(group, "shard_batch")
    P, r = sp.size, sp.rank
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
        # the whole row is here: the context of one process holding it cuts it (no exchange), by the rule
        # every layer's context uses
        bounds = SequenceContext.from_position_ids(position_ids, LOCAL).cu_seqlens
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
    the whole batch's label count (``shard.num_items``), so the shares of the group add up to the
    single-process loss (and their gradients to its gradients). Computed in float32 at least (float64
    logits stay float64)."""
    if shard.shift_labels is None:
        raise ValueError("causal_lm_loss: the shard has no labels (pass labels to shard_batch)")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    total = torch.nn.functional.cross_entropy(logits.to(dtype).reshape(-1, logits.shape[-1]),
                                              shard.shift_labels.reshape(-1).to(logits.device),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(shard.num_items, 1)


def reduce_loss(loss: torch.Tensor, group=None) -> torch.Tensor:
    """The single-process loss from every rank's share (a detached sum over the group)."""
    out = loss.detach().clone()
    sp = sp_group(group, "reduce_loss")
    if sp.size > 1:
        dist.all_reduce(out, group=sp.process_group)
    return out


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return False
    return isinstance(t, DTensor)


_BUCKET = 1 << 25  # elements summed in one all-reduce at most


def sync_gradients(model: torch.nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the group: each rank's backward gave the gradient of its
    share of the loss, the sum is the gradient of the whole loss. A parameter whose gradient is None on
    some ranks and not on others (an expert no token of this rank's shard reached) counts as zeros
    there and gets the sum on every rank; one that has none anywhere stays None. The ranks first agree on
    the parameters (their count and shapes) and on which have gradients, so a mismatch raises on every
    rank instead of pairing the wrong tensors. Gradients are summed in buckets of one dtype and device.
    (A DP x SP device mesh: :func:`allscan.integrations.mesh.sync_gradients`; FSDP2 reduces gradients
    itself: :func:`allscan.integrations.mesh.fully_shard`.)"""
    sp = sp_group(group, "sync_gradients")
    params = [p for p in model.parameters() if p.requires_grad]
    if any(_is_dtensor(p) for p in params):
        raise ValueError("sync_gradients: the model's parameters are DTensors (FSDP2's fully_shard, or tensor "
                         "parallelism): their gradients are reduced by FSDP; shard the model with "
                         "allscan.integrations.mesh.fully_shard(model, mesh), which sums them over the mesh")
    if sp.size == 1:
        return
    like = params[0] if params else None
    shapes = zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    rows = exchange(sp, [len(params), shapes], like)
    if any(row != rows[0] for row in rows):
        raise ValueError(f"sync_gradients: the ranks hold different parameters (count, shape/dtype digest per rank: "
                         f"{rows}); every rank of the group must hold the same model")
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=comm_device(sp, like))
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=sp.process_group)
    buckets: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for p, anywhere in zip(params, has.tolist()):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():  # the same keys, in the same order, on every rank
        start = 0
        while start < len(grads):
            end, size = start, 0
            while end < len(grads) and (end == start or size + grads[end].numel() <= _BUCKET):
                size += grads[end].numel()
                end += 1
            part = grads[start:end]
            flat = torch.cat([g.reshape(-1) for g in part])
            dist.all_reduce(flat, group=sp.process_group)
            offset = 0
            for g in part:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            start = end
