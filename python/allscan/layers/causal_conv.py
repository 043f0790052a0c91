"""The short depthwise causal convolution of the sequence-parallel layers, over the global sequence.

A token reads the ``k - 1`` tokens before it; on a rank's first tokens those live on the previous rank and
come as the ``halo`` (:func:`allscan.ops.halo.halo_exchange`, zeros on rank 0). With packed sequences
(``cu_seqlens``, global offsets) no window reaches across a sequence start: the slots before it read zero,
as each sequence convolved alone (fla's and transformers' varlen convolutions).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["sequence_window_mask", "depthwise_causal_conv"]


def sequence_window_mask(T: int, k: int, offset: int, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """``[T, k]`` bool: window slot i of local token t (global token ``offset + t - (k-1) + i``) is read only if
    it belongs to t's sequence (and is not before the global start)."""
    pos = offset + torch.arange(T, device=device)
    if cu_seqlens is None:
        start = torch.zeros_like(pos)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        start = cu[torch.searchsorted(cu, pos, right=True) - 1]
    src = pos[:, None] - (k - 1) + torch.arange(k, device=device)[None, :]
    return src >= start[:, None]


def depthwise_causal_conv(x: torch.Tensor, halo: Optional[torch.Tensor], weight: torch.Tensor,
                          bias: Optional[torch.Tensor], offset: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """``out[b, t, d] = sum_i x[b, t - (k-1) + i, d] * weight[d, i] (+ bias[d])`` over the global sequence.

    x: ``[B, T, D]``, this rank's tokens, the first at global position ``offset``; halo: ``[B, k-1, D]``, the
    ``k - 1`` tokens before them (None: k = 1); weight: ``[D, k]`` (an ``nn.Conv1d``'s ``weight[:, 0]``),
    computed in x's dtype. Returns ``[B, T, D]`` in x's dtype, before any activation.
    """
    B, T, D = x.shape
    k = weight.shape[-1]
    seq = x if halo is None or k == 1 else torch.cat([halo.to(x.dtype), x], dim=1)
    windows = seq.unfold(1, k, 1)  # [B, T, D, k]: tokens t-k+1 .. t
    mask = sequence_window_mask(T, k, offset, cu_seqlens, x.device).to(x.dtype)  # [T, k]
    out = torch.einsum("btdk,tk,dk->btd", windows, mask, weight.to(x.dtype))
    return out if bias is None else out + bias.to(x.dtype)
