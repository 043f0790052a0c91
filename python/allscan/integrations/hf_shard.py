"""What the rewired sequence mixers of transformers' hybrids share (:mod:`~allscan.integrations.hf_linear`'s
Gated DeltaNet / KDA, :mod:`~allscan.integrations.hf_mamba2`'s Mamba2 mixers):

- :class:`SequenceParallelForward`: the ``forward`` put in a rewired module's ``__dict__``, calling the family's
  mirrored forward on this rank's shard;
- :func:`layer_call`: what the model-level check refuses, once more at the layer (a layer called on its own),
  and the batch's :class:`allscan.context.SequenceContext`;
- :func:`causal_conv`: the modules' depthwise causal convolution over the global sequence: the previous rank's
  last ``kernel - 1`` tokens before this shard (:func:`allscan.ops.halo.halo_exchange`), and with packed rows
  no window reading before its token's sequence start (a mask made once per batch).
"""
from __future__ import annotations

import copy
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.context import SequenceContext
from allscan.layers.causal_conv import conv_with_halo, sequence_window_mask
from allscan.ops import tell_peers_of_failure
from allscan.ops.halo import halo_exchange

from .common import handed_context, op_group

__all__ = ["SequenceParallelForward", "layer_call", "collective_begins", "causal_conv", "conv_mask"]

# The rewired mixer's call in progress on this thread: its context once its checks passed, and whether its first
# collective began (a failure before it is told to the peers waiting there)
_PROGRESS = threading.local()


def layer_call(mod, group, hidden_states, cache, attention_mask, kwargs) -> SequenceContext:
    """What the model-level check refuses, once more at the layer (a layer called on its own); returns the batch's
    context (handed down by the model-level hook; for a layer called alone, from the caller's ``cu_seq_lens_q``,
    agreed across the group)."""
    name = type(mod).__name__
    if cache is not None or kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: a recurrent cache is not supported "
                                  "(training and prefill only; call the model with use_cache=False)")
    if attention_mask is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: a padding mask is not supported (every "
                                  "sequence is whole: pack or trim the batch)")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: seq_idx / cu_seqlens are not supported (packed "
                                  "sequences come as position ids restarting at 0, or cu_seq_lens_q: global offsets "
                                  "in the whole row)")
    ctx = handed_context(kwargs, group, hidden_states.shape[0], hidden_states.shape[1], name, hidden_states)
    if not torch.compiler.is_compiling():
        _PROGRESS.ctx, _PROGRESS.communicating = ctx, False
    return ctx


def collective_begins() -> None:
    """Called by the rewired mixers at their first collective (the convolution's halo exchange, or the scan)."""
    if not torch.compiler.is_compiling():
        _PROGRESS.communicating = True


_CONV_MASKS: "weakref.WeakKeyDictionary[SequenceContext, dict]" = weakref.WeakKeyDictionary()


def conv_mask(ctx: SequenceContext, T: int, width: int, device) -> torch.Tensor:
    """``[width, T, 1]`` bool: True where window slot i of local token t reads a token of t's own sequence
    (global token ``p - (width - 1) + i``, ``p = rank * T + t``, at or after the start of ``p``'s sequence).
    Made once per batch, shape and device."""
    masks = _CONV_MASKS.setdefault(ctx, {})
    key = (T, width, torch.device(device))
    got = masks.get(key)
    if got is None:
        seen = sequence_window_mask(T, width, ctx.group.rank * T, ctx.offsets(device), device)  # [T, width]
        got = masks[key] = seen.t().contiguous()[:, :, None]
    return got


def causal_conv(mod, x_local: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, causal, then ``mod.activation``) of ``mod.conv1d`` over the
    global sequence: ``x_local [B, T_local, C]`` with the previous rank's last ``kernel - 1`` tokens before it
    (zeros on rank 0: the module's own left padding). With packed sequences (``ctx.packed``, B = 1) no window
    reads before its token's sequence start: each sequence is convolved as if alone (zero-padded). Returns
    ``[B, T_local, C]`` in ``x_local``'s dtype."""
    conv = mod.conv1d
    width = conv.kernel_size[0]
    if width > 1:  # the halo exchange (a kernel of 1 reads no other token: the scan is the first collective)
        collective_begins()
    weight = conv.weight  # [C, 1, width], as transformers' weight.squeeze(1).unsqueeze(1)
    if not ctx.packed and not torch.compiler.is_compiling():  # one autograd node, halo included
        out = conv_with_halo(x_local.to(weight.dtype), weight, conv.bias, ctx.group.name if ctx.group.size > 1 else "")
    else:
        x = x_local
        if width > 1:
            x = torch.cat([halo_exchange(x_local, width - 1, op_group(ctx.group)), x_local], dim=1)
        if ctx.packed:
            out = _packed_conv(x.to(weight.dtype), weight, conv.bias, conv_mask(ctx, x_local.shape[1], width, x.device))
        else:
            out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, conv.bias, padding=0, groups=conv.groups)
    if mod.activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[mod.activation](out)
    return out.to(x_local.dtype).transpose(1, 2)


def _packed_conv(x, weight, bias, seen_all):
    """The depthwise causal conv of ``x [B, width - 1 + T, C]`` (halo first) with window slot i of local token t
    counted only where ``seen_all[i, t, 0]`` (its token is of t's own sequence): ``[B, C, T]``, as ``F.conv1d``'s.
    Unseen slots read zero, not a multiply by 0: an inf or NaN of another sequence stays out (0 * inf is NaN)."""
    width, T = seen_all.shape[:2]
    out = None
    for i in range(width):
        term = x[:, i:i + T, :].masked_fill(~seen_all[i], 0) * weight[:, 0, i]
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias
    return out.transpose(1, 2)


class SequenceParallelForward:
    """The ``forward`` of a rewired sequence mixer (held in the module's ``__dict__``): ``forward(module, group,
    hidden_states, cache, attention_mask, kwargs)``, the module's own arithmetic on this rank's shard of the
    sequence, over ``group``; ``model_type`` names the family."""

    def __init__(self, module: nn.Module, model_type: str, group, forward):
        self.module, self.model_type, self.group, self.forward = module, model_type, group, forward

    def __call__(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if torch.compiler.is_compiling():  # traced: no collective runs, and no graph break for the bookkeeping
            return self.forward(self.module, self.group, hidden_states, cache, attention_mask, kwargs)
        _PROGRESS.ctx = None
        try:
            return self.forward(self.module, self.group, hidden_states, cache, attention_mask, kwargs)
        except Exception as e:
            # this rank's own work (its projections) failed before the first collective: the peers waiting in it
            # are told, as allscan's own layers tell them (ops.own_work), instead of waiting until the timeout
            ctx = _PROGRESS.ctx
            if ctx is not None and not _PROGRESS.communicating and ctx.group.size > 1:
                tell_peers_of_failure(ctx.group.process_group, type(self.module).__name__, "its projections", e)
            raise
        finally:
            _PROGRESS.ctx = None

    def __deepcopy__(self, memo):  # the module is copied, the process group is not
        return SequenceParallelForward(copy.deepcopy(self.module, memo), self.model_type, self.group, self.forward)

    def __repr__(self):
        return f"SequenceParallelForward({type(self.module).__name__}, {self.model_type!r})"
