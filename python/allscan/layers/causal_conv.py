"""The short depthwise causal convolution of the sequence-parallel layers, over the global sequence.

A token reads the ``k - 1`` tokens before it; on a rank's first tokens those live on the previous rank and
come as the ``halo`` (:func:`allscan.ops.halo.halo_exchange`, zeros on rank 0). With packed sequences
(``cu_seqlens``, global offsets) no window reaches across a sequence start: the slots before it read zero,
as each sequence convolved alone (fla's and transformers' varlen convolutions).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from allscan.ops import refuse_double_backward
from allscan.ops.halo import halo_shift

__all__ = ["sequence_window_mask", "depthwise_causal_conv", "conv_with_halo"]


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
    seen = sequence_window_mask(T, k, offset, cu_seqlens, x.device)  # [T, k]
    # zeros, not a multiply by 0: an inf or NaN of another sequence stays out (0 * inf is NaN)
    windows = windows.masked_fill(~seen[:, None, :], 0)
    out = torch.einsum("btdk,dk->btd", windows, weight.to(x.dtype))
    return out if bias is None else out + bias.to(x.dtype)


_NOT_TWICE = ("its backward holds the previous rank's last tokens as constants and sends the halo's gradient back "
              "outside autograd")


class _ConvWithHalo(torch.autograd.Function):
    """``nn.Conv1d``'s depthwise causal convolution of ``x [B, T, C]`` with the previous rank's last ``k - 1``
    tokens before it, in one autograd node: the backward sends the halo's gradient back to its rank and adds
    what arrives (the gradient of this shard's last ``k - 1`` tokens) in place, instead of autograd's
    full-size zeros for the sliced halo and a full-size add into x's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_name: str):
        T, C = x.shape[1], x.shape[2]
        w = weight.shape[-1] - 1
        # zeros on rank 0 and alone (where a shard shorter than the halo is allowed: with several ranks the
        # op refuses it on every rank)
        send = x[:, T - w:].contiguous() if T >= w else x.new_zeros(x.shape[0], w, C)
        halo = halo_shift(send, group_name, True, T)
        out = F.conv1d(torch.cat([halo, x], 1).transpose(1, 2), weight, bias, groups=C)
        ctx.save_for_backward(x, halo, weight)
        ctx.group_name, ctx.has_bias = group_name, bias is not None
        return out  # [B, C, T]

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.group_name:  # one process: the halo is zeros, and aten's convolution backward is differentiable
            refuse_double_backward("the causal convolution's halo exchange", _NOT_TWICE)
        x, halo, weight = ctx.saved_tensors
        C, w = x.shape[2], halo.shape[1]
        seq = torch.cat([halo, x], 1).transpose(1, 2)
        want = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        g_seq, g_weight, g_bias = torch.ops.aten.convolution_backward(
            grad_out, seq, weight, [C] if ctx.has_bias else None, [1], [0], [1], False, [0], C, want)
        g_x = None
        if g_seq is not None:
            g_seq = g_seq.transpose(1, 2)  # [B, T + w, C], ours to change
            g_x = g_seq[:, w:]
            if ctx.group_name and w:  # the halo's gradient to its sender; the next rank's to these last w tokens
                g_x[:, g_x.shape[1] - w:] += halo_shift(g_seq[:, :w].contiguous(), ctx.group_name, False, -1)
        return g_x, g_weight, g_bias, None


def conv_with_halo(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   group_name: str) -> torch.Tensor:
    """``F.conv1d`` of the depthwise ``weight [C, 1, k]`` over the global sequence: ``x [B, T, C]`` (T >= k - 1
    with several ranks) with the previous rank's last ``k - 1`` tokens of the group ``group_name`` before it
    (zeros on its first rank; ``""``: one process). Returns ``[B, C, T]``, as ``nn.Conv1d`` does, before any
    activation; under autocast in autocast's dtype, as ``F.conv1d``'s (the casts are autograd's, outside the
    node, so the parameters' gradients come back in their own dtype)."""
    if weight.shape[-1] == 1:
        return F.conv1d(x.transpose(1, 2), weight, bias, groups=x.shape[2])
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return _ConvWithHalo.apply(x, weight, bias, group_name)
    dt = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return _ConvWithHalo.apply(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt), group_name)
