"""The input contract the fla-compatible layers share: fla's forward signature, of which sequence
parallelism supports packed sequences (``cu_seqlens``) but no padding mask and no cache."""
from __future__ import annotations

import torch

from allscan.ops.batch_context import context_conflict


def check_layer_inputs(layer: str, hidden_states: torch.Tensor, hidden_size: int, attention_mask,
                       past_key_values, use_cache) -> None:
    """Raise naming ``layer`` and the argument for what a sequence-parallel layer cannot take."""
    if attention_mask is not None:
        raise NotImplementedError(f"{layer}: attention_mask is not supported; pack sequences "
                                  "and pass cu_seqlens (over the global sequence)")
    if past_key_values is not None or use_cache:
        raise NotImplementedError(f"{layer}: caching (past_key_values/use_cache) is not supported")
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"{layer}: hidden_states must be [B, T_local, {hidden_size}], "
                         f"got {tuple(hidden_states.shape)}")


def check_packing(layer: str, hidden_states: torch.Tensor, group, cu_seqlens, context) -> None:
    """The layer's packed sequences: ``context=`` not beside ``cu_seqlens=`` or another group, one row when
    packed (either way)."""
    conflict = context_conflict(context, group, cu_seqlens, layer)
    if conflict is not None:
        raise conflict
    packed = cu_seqlens is not None or (context is not None and context.packed)
    if packed and hidden_states.shape[0] != 1:
        raise ValueError(f"{layer}: with packed sequences the batch size must be 1, got {hidden_states.shape[0]}")
