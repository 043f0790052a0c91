"""The Ulysses attention layer: an ``nn.Module`` over :func:`allscan.ops.ulysses.ulysses_attention`
(head-chunked all-to-all overlapped with SDPA, forward and backward)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from allscan.ops.ulysses import choose_num_chunks, clear_auto_cache, pick_measured, ulysses_attention

__all__ = ["UlyssesAttention", "ulysses_attention", "choose_num_chunks", "pick_measured", "clear_auto_cache"]


class UlyssesAttention(torch.nn.Module):
    """Ulysses sequence-parallel softmax attention with head-chunked overlap (HCMS).

    ``forward(q, k, v, *, causal=False, scale=None, cu_seqlens=None)`` takes this rank's shard ``[B,
    S_local, H, D]`` of the sequence (k and v may have fewer heads than q: grouped-query attention, H_q a
    multiple of H_kv) and returns the attention output ``[B, S_local, H_q, D]``, equal to softmax
    attention (``torch.nn.functional.scaled_dot_product_attention``) over the whole sequence.
    ``cu_seqlens``: sequences packed in one row (B = 1), their offsets in the whole sequence (the same on
    every rank; a GPU tensor is read once per call); each is attended on its own, one SDPA call per
    sequence (compared across ranks on every call; under torch.compile left to eager). Differentiable
    in q, k and v; the backward is pipelined like the forward.

    ``num_chunks``: an int forces the number of head chunks C (1 = plain Ulysses). ``"auto"`` measures,
    once per shape (and per forward-only / training use), the attention and all-to-all costs at one
    and at all heads per rank, fits a per-chunk overhead, picks the C that minimises the modelled
    pipeline time, then times the layer at that C against C = 1 (forward, or forward+backward when
    the inputs need gradients) and keeps C only if it is at least 1% faster; 1 when overlap cannot
    pay (always 1 on CPU, where there is no second stream). ``last_info["auto"]`` holds the
    measurements (packed sequences are timed as one sequence). The first call of a shape runs the
    layer about a dozen times to measure (for training on copies of q, k, v: one extra forward's
    memory, once). ``chunk_weights`` (with an int C)
    sizes the chunks unequally, e.g. ``[1, 2, 2, 1]``: the first scatter and the last gather are the
    exposed ones, so small end chunks hide more.
    """

    def __init__(self, group=None, num_chunks: Union[int, str] = "auto", *, chunk_weights=None,
                 max_chunks: Optional[int] = None):
        super().__init__()
        self.group = group
        self.num_chunks = num_chunks
        self.chunk_weights = chunk_weights
        self.max_chunks = max_chunks
        self.last_info = None

    def forward(self, q, k, v, *, causal: bool = False, scale: Optional[float] = None, cu_seqlens=None,
                context=None):
        """``context``: the batch's :class:`allscan.SequenceContext`, instead of ``cu_seqlens`` (and of the
        module's ``group``, which must then be None or the context's)."""
        out, info = ulysses_attention(q, k, v, self.group, causal=causal, scale=scale, num_chunks=self.num_chunks,
                                      chunk_weights=self.chunk_weights, max_chunks=self.max_chunks,
                                      cu_seqlens=cu_seqlens, return_info=True, context=context)
        self.last_info = info
        return out

    def extra_repr(self) -> str:
        return f"num_chunks={self.num_chunks!r}"
