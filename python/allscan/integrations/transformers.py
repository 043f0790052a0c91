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
(``causal_lm_loss``); those helpers are :mod:`allscan.integrations.batch`'s. Not supported: padding or packed-sequence attention masks (the sequences are
whole, causal; a mask is checked on every rank together, so pass one on every rank or on none), KV
caches (training and prefill only), attention dropout.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._comm import normalize_group
from .batch import IGNORE_INDEX, BatchShard, causal_lm_loss, reduce_loss, shard_batch, sync_gradients  # noqa: F401

NAME = "allscan_ulysses"


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
