"""Sequence parallelism for Hugging Face transformers (5.x) models through their attention registry.

    from allscan.integrations import transformers as sp
    name = sp.register(group)                       # once per process; group=None: the default group
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)   # or model.set_attn_implementation(name)
    shard = sp.shard_batch(input_ids, labels, group=group)                   # this rank's contiguous slice
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, shard)          # this rank's share of the whole batch's mean loss
    loss.backward(); sp.sync_gradients(model, group) # parameter gradients summed over the group
    sp.reduce_loss(loss, group)                      # the single-process loss, for logging

Every rank holds the same parameters and a contiguous slice of every sequence (rank order = sequence
order). Attention runs as Ulysses: the chunked all-to-all gives each rank the whole sequence for its
share of the heads, SDPA runs causal on it, the inverse all-to-all returns the slice
(:func:`allscan.ops.ulysses.ulysses_attention`). Everything else in the model is per token. So the
model needs global position ids (``shard_batch`` makes them), labels shifted across the rank
boundaries before cutting (``shard_batch``), and a loss normalised by the whole batch's token count
(``causal_lm_loss``). Not supported: padding or packed-sequence attention masks (the sequences are
whole, causal; a mask is checked on every rank together, so pass one on every rank or on none), KV
caches (training and prefill only), attention dropout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .._comm import normalize_group

NAME = "allscan_ulysses"
IGNORE_INDEX = -100


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("allscan.integrations.transformers needs Hugging Face transformers 5.x: "
                          "pip install 'transformers>=5,<6'") from e
    return transformers


def register(group=None, *, name: str = NAME, num_chunks="auto") -> str:
    """Register Ulysses attention over ``group`` (None: the default process group) as the attention
    implementation ``name`` (and a mask function that builds no mask: the attention is causal over
    the whole sequence by construction). Returns ``name``, for ``attn_implementation=``. Registering
    the same name again replaces the group."""
    tf = _transformers()
    from allscan.ops.ulysses import ulysses_attention

    group = normalize_group(group)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise NotImplementedError(f"{name}: attention dropout is not supported (got {dropout})")
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError(f"{name}: a KV cache (query length {query.shape[2]}, key length "
                                      f"{key.shape[2]}) is not supported; call the model with use_cache=False")
        # transformers passes [B, heads, S_local, D]; Ulysses takes and returns [B, S_local, heads, D]
        out = ulysses_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group,
                                causal=bool(getattr(module, "is_causal", True)), scale=scaling,
                                num_chunks=num_chunks)
        return out, None

    def no_mask(*args, attention_mask=None, **kwargs):
        if attention_mask is None:
            return None
        # Padding sits on some ranks only (usually the last): agree first, so that every rank raises
        # instead of the others waiting in the attention's all-to-all.
        padded = torch.tensor([0 if attention_mask.dim() != 2 else int(not bool(attention_mask.all()))],
                              device=attention_mask.device)
        dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=group)
        if padded.item():
            raise NotImplementedError(f"{name}: padding attention masks are not supported (every sequence is "
                                      "whole and causal; pack or trim the batch); a rank of the group got one")
        return None

    tf.AttentionInterface.register(name, attention)
    tf.AttentionMaskInterface.register(name, no_mask)
    return name


@dataclass
class BatchShard:
    """This rank's part of a batch: ``input_ids`` and ``position_ids`` ``[B, T / P]``, ``shift_labels``
    (the next token of each position, shifted over the whole sequence before cutting; IGNORE_INDEX
    after each sequence's last token) and ``num_items`` (non-ignored labels in the WHOLE batch)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: Optional[torch.Tensor]
    num_items: Optional[int]


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *, group=None,
                position_ids: Optional[torch.Tensor] = None) -> BatchShard:
    """Cut a batch ``[B, T]`` (the same on every rank) into this rank's contiguous slice of ``T / P``
    tokens. ``labels`` (default: none) are the usual causal-LM labels (same positions as the inputs,
    IGNORE_INDEX where ignored); they are shifted by one over the whole sequence here, so the last
    token of a slice is scored against the first token of the next slice. ``position_ids`` default to
    ``0 .. T-1``."""
    group = normalize_group(group)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    if input_ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [B, T], got {list(input_ids.shape)}")
    B, T = input_ids.shape
    if T % P:
        raise ValueError(f"shard_batch: the sequence length T = {T} must be a multiple of the group size {P}")
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"shard_batch: position_ids must have input_ids' shape {list(input_ids.shape)}, "
                         f"got {list(position_ids.shape)}")
    sl = slice(r * (T // P), (r + 1) * (T // P))
    shift, items = None, None
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"shard_batch: labels must have input_ids' shape {list(input_ids.shape)}, "
                             f"got {list(labels.shape)}")
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        items = int((shift != IGNORE_INDEX).sum())
        shift = shift[:, sl].contiguous()
    return BatchShard(input_ids[:, sl].contiguous(), position_ids[:, sl].contiguous(), shift, items)


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
