"""What transformers passes an attention function beside q, k and v that the Ulysses attention honours: a
sliding window (``sliding_window``: Mistral, Gemma 2/3, Qwen3's and GPT-OSS's sliding layers; or only in the
mask, Qwen2-MoE), attention sinks (``s_aux``: GPT-OSS; ``sinks``) and a logit soft-cap (``softcap``: Gemma 2's
``attn_logit_softcapping``). Shared by :mod:`.transformers` (``register()``) and :mod:`.hf_attention` (the
hybrids). Ulysses holds the whole sequence for a subset of heads after its all-to-all, so these per-head
operations are exact there (:mod:`allscan.ops.ulysses.masked`).
"""
from __future__ import annotations

from typing import Optional

import torch

from allscan.ops.ulysses import MaskSpec, masked_attention
from allscan.ops.ulysses.checks import AttentionOptions

from .common import local_attention

__all__ = ["OPTION_KWARGS", "features_of", "one_process_attention"]

OPTION_KWARGS = frozenset({"sliding_window", "s_aux", "sinks", "softcap"})
"""The keyword arguments :func:`features_of` reads (the callers refuse every other unknown one by name)."""


def _window(name: str, what: str, value, S: int) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NotImplementedError(f"{name}: {what} must be a positive number of tokens, got {value!r}")
    return value if value < S else None  # the whole causal sequence: no window


def features_of(name: str, kwargs: dict, S: int, *, mask_known: bool = False,
                mask_window: Optional[int] = None) -> AttentionOptions:
    """The window, soft-cap and sinks among transformers' ``kwargs`` for a whole sequence of ``S`` tokens.
    ``mask_known``: the attention got the mask the model built (its window ``mask_window``, or None); the
    ``sliding_window`` argument must then say the same (transformers' eager and SDPA paths follow the mask,
    its flash path the argument: where they differ the model is ambiguous, refused). Each is the same on
    every rank (the config and the model's code), so a refusal is raised on every rank alike."""
    window = _window(name, "sliding_window", kwargs.get("sliding_window"), S)
    if mask_known:
        masked = _window(name, "the mask's sliding window", mask_window, S)
        if kwargs.get("sliding_window") is not None and masked != window:
            raise NotImplementedError(
                f"{name}: the attention got sliding_window={kwargs.get('sliding_window')} but the model's mask "
                f"has {'no window' if mask_window is None else f'a window of {mask_window}'} (over a sequence of "
                f"{S} tokens); ambiguous, refused")
        window = masked
    cap = kwargs.get("softcap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise NotImplementedError(f"{name}: softcap must be a positive number, got {cap!r}")
    s_aux, sinks = kwargs.get("s_aux"), kwargs.get("sinks")
    if s_aux is not None and sinks is not None:
        raise NotImplementedError(f"{name}: both s_aux and sinks were passed; ambiguous, refused")
    sinks = s_aux if s_aux is not None else sinks
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise NotImplementedError(f"{name}: attention sinks must be a tensor of one logit per head, got "
                                  f"{type(sinks).__name__}")
    return AttentionOptions(window=window, softcap=None if cap is None else float(cap), sinks=sinks)


def one_process_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bounds, causal: bool,
                          features: AttentionOptions) -> torch.Tensor:
    """The attention of a group of one, ``[B, S, H, D]`` in and out (fewer k/v heads repeated): SDPA, or with a
    window, soft-cap or sinks the same local attention Ulysses runs after its all-to-all."""
    if not features.any:
        return local_attention(q, k, v, scale, bounds, causal)
    if features.window is not None and not causal:
        raise NotImplementedError("a sliding window over bidirectional attention is not supported")
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    spec = MaskSpec(scale=scale, causal=causal, window=features.window, softcap=features.softcap,
                    bounds=None if bounds is None else tuple(bounds))
    return masked_attention(q, k, v, spec, features.sinks)
