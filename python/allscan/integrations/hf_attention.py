"""The hybrids' softmax attention (Qwen3-Next's, Qwen3.5's and OLMo-Hybrid's gated attention, Kimi Linear's MLA)
on Ulysses (:func:`allscan.ops.ulysses.ulysses_attention`), registered in transformers' attention and mask
registries under one name per group (:func:`attention_implementation`): causal over the whole sequence, each
packed sequence alone (the batch's :class:`allscan.context.SequenceContext`, handed down by the model-level hook);
a sliding window (the mask's ``sliding_window_overlay`` and the ``sliding_window`` argument, agreed), a logit
soft-cap and attention sinks honoured (:mod:`.hf_options`); other masks, dropout, a KV cache, attention weights
and any argument it does not know raise naming them.
"""
from __future__ import annotations

import sys
from typing import List, Tuple

import torch
import torch.nn.functional as F

from allscan.ops import own_work

from .common import CONTEXT_KWARG, handed_context, require_transformers, sp_group
from .hf_options import OPTION_KWARGS, features_of, one_process_attention

__all__ = ["attention_implementation"]

# Arguments transformers passes to an attention function that do not change it.
_HARMLESS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
                       "num_items_in_batch", "deterministic", "layer_idx", "return_dict", "cache", CONTEXT_KWARG,
                       "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})
_PACKING_KWARGS = ("seq_idx", "cu_seqlens")




_ATTENTION_NAMES: List[Tuple[object, str]] = []  # (group key, name), one name per group


class WindowMask:
    """What the mask function hands the attention of a sliding layer in place of a mask: its window (tokens)."""

    __slots__ = ("window",)

    def __init__(self, window: int):
        self.window = window

    def __repr__(self):
        return f"WindowMask(window={self.window})"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_unsupported(name, module, query, key, attention_mask, dropout, kwargs) -> None:
    """What the attention function cannot run, refused by name (this rank's own checks)."""
    if attention_mask is not None and not isinstance(attention_mask, WindowMask):
        raise NotImplementedError(f"{name}: an attention mask ({_short(attention_mask)}: padding or a custom "
                                  "mask) is not supported; every sequence is whole")
    if dropout:
        raise NotImplementedError(f"{name}: attention dropout is not supported (got {dropout})")
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(f"{name}: a KV cache (query length {query.shape[2]}, key length {key.shape[2]}) "
                                  "is not supported; call the model with use_cache=False")
    for arg, val in kwargs.items():
        if val is None or arg in _HARMLESS or arg in OPTION_KWARGS:
            continue
        if arg == "output_attentions":
            if val:
                raise NotImplementedError(f"{name}: output_attentions=True is not supported (Ulysses returns no "
                                          "attention weights)")
        elif arg == "is_causal":
            if not val:
                raise NotImplementedError(f"{name}: bidirectional attention (is_causal=False) is not supported")
        elif arg in _PACKING_KWARGS:
            raise NotImplementedError(f"{name}: {arg} is not supported (packed sequences come as position ids "
                                      "restarting at 0, or cu_seq_lens_q / cu_seq_lens_k: global offsets in the "
                                      "whole row)")
        else:
            raise NotImplementedError(f"{name}: the attention function got an argument it does not know, "
                                      f"{arg}={_short(val)}; it might change the result, so it is refused")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{name}: {type(module).__name__} is not causal; only causal attention is "
                                  "supported")


def _make_attention(group, name):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # the batch's context: handed down by the model-level hook (a layer called alone: the caller's offsets,
        # agreed across the group)
        ctx = handed_context(kwargs, group, query.shape[0], query.shape[2], name, query)
        # this rank's own checks, before Ulysses' first collective: a refusal on one rank alone (a module left in
        # train mode with dropout, say) is told to the peers waiting there
        own_work(None if ctx.group.size == 1 else ctx.group.process_group, name, "its checks", _refuse_unsupported,
                 name, module, query, key, attention_mask, dropout, kwargs)
        marked = isinstance(attention_mask, WindowMask)
        # transformers passes [B, heads, S_local, D]; Ulysses takes [B, S_local, heads, D], one head dim for q, k
        # and v: MLA's value heads (narrower than its query/key heads) are padded with zeros and cut back
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        d_qk, d_v = q.shape[-1], v.shape[-1]
        scale = float(scaling) if scaling is not None else d_qk ** -0.5
        if d_v < d_qk:
            v = F.pad(v, (0, d_qk - d_v))
        elif d_v > d_qk:
            q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
        bounds = None if ctx.cu_seqlens is None else list(ctx.cu_seqlens)
        # a window (the mask's, agreed with the argument), soft-cap and sinks, honoured on the whole sequence
        features = features_of(name, kwargs, query.shape[2] * ctx.group.size, mask_known=True,
                               mask_window=attention_mask.window if marked else None)
        if ctx.group.size == 1:
            out = one_process_attention(q, k, v, scale, bounds, True, features)
        else:
            from allscan.ops.ulysses import ulysses_attention

            out = ulysses_attention(q, k, v, causal=True, scale=scale, context=ctx, **features.as_kwargs())
        return out[..., :d_v], None

    return attention


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return {} if code is None else {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _causal_or_packed(fn, mu, windows: list) -> bool:
    """Whether transformers composed ``fn`` from the causal mask, its sliding-window overlay (each window
    appended to ``windows``) and its packed-sequence overlays alone."""
    if fn is mu.causal_mask_function:
        return True
    if getattr(fn, "__module__", None) != mu.__name__:
        return False
    qual = getattr(fn, "__qualname__", "")
    if qual == "and_masks.<locals>.and_mask":
        return all(_causal_or_packed(f, mu, windows) for f in _closure(fn).get("mask_functions", ()))
    if qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _causal_or_packed(_closure(fn).get("mask_function"), mu, windows)
    if qual == "sliding_window_overlay.<locals>.inner_mask":
        windows.append(_closure(fn).get("sliding_window"))
        return True
    return qual == "packed_sequence_mask_function.<locals>.inner_mask"


def _make_mask_function(name):
    def mask_function(*args, mask_function=None, **kwargs):
        """No mask: the attention is causal over the whole sequence, each packed sequence alone (their global
        bounds come to the attention as cu_seq_lens_q from the model-level check, which found them in the whole
        row on every rank; the packing transformers sees in this shard's positions is part of it); a sliding
        window comes as a :class:`WindowMask`. Anything else on top of the causal mask (chunks, tokens that see
        ahead) is refused: from the config, the same on every rank."""
        mu = sys.modules.get("transformers.masking_utils")
        windows: list = []
        if mask_function is not None and (mu is None or not _causal_or_packed(mask_function, mu, windows)):
            what = getattr(mask_function, "__qualname__", repr(mask_function))
            raise NotImplementedError(f"{name}: the model asks for a mask other than the causal or sliding-window "
                                      f"one ({what}: chunked attention or a custom mask); not supported")
        return WindowMask(min(windows)) if windows else None

    return mask_function


def _group_key(group):
    """One name per group: None (the default group, looked up at each call) or the resolved process group
    (None for one process)."""
    if group is None:
        return "default"
    sp = sp_group(group, "sequence_parallel")
    return sp.process_group if sp.process_group is not None else "local"


def attention_implementation(group=None) -> str:
    """The name of the attention implementation (registered in transformers' attention and mask registries on
    first use) that runs the hybrids' softmax attention on Ulysses over ``group``: causal over the whole
    sequence, each packed sequence alone (the batch's SequenceContext, or ``cu_seq_lens_q`` agreed across the
    group for a layer called alone), a sliding window, soft-cap and sinks honoured; other masks, dropout, a KV
    cache, attention weights and any argument it does not know raise naming them. One name per group (a device-mesh dimension counts as its process group)."""
    tf = require_transformers("allscan.integrations.hf_hybrids")
    key = _group_key(group)
    for g, name in _ATTENTION_NAMES:
        if g is key or (isinstance(key, str) and g == key):
            return name
    name = "allscan_hybrid_ulysses" + (f"_{len(_ATTENTION_NAMES)}" if _ATTENTION_NAMES else "")
    tf.AttentionInterface.register(name, _make_attention(group, name))
    tf.AttentionMaskInterface.register(name, _make_mask_function(name))
    _ATTENTION_NAMES.append((key, name))
    return name
