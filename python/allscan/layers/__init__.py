"""Sequence-parallel attention layers built on allscan's collectives.

- :mod:`allscan.layers.gla`: gated linear attention with ZeCO sequence parallelism (All-Scan).
- :mod:`allscan.layers.gated_deltanet`, :mod:`allscan.layers.kda`: Gated DeltaNet and Kimi Delta Attention
  (the matrix All-Scan), with fla's parameters.
- :mod:`allscan.layers.mamba2`: Mamba2's mixer with transformers' parameters (SSD by the diagonal All-Scan).
- :mod:`allscan.layers.ulysses`: Ulysses attention with head-chunked overlap (chunked all-to-all).
- :mod:`allscan.layers.attention`: softmax attention with fla's parameters (projections, rotary), on Ulysses.
"""
import importlib

_LAZY = {
    "zeco_gla": "gla",
    "GatedLinearAttention": "gla",
    "UlyssesAttention": "ulysses",
    "Attention": "attention",
    "GatedDeltaNet": "gated_deltanet",
    "KimiDeltaAttention": "kda",
    "Mamba2": "mamba2",
    "zeco_gated_delta_rule": ".ops.delta",  # the ops themselves: allscan.ops.delta
    "zeco_kda": ".ops.delta",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'allscan.layers' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
