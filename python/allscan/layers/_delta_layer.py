"""What the delta-rule layers (:class:`~allscan.layers.GatedDeltaNet`, :class:`~allscan.layers.KimiDeltaAttention`)
share: fla's q, k, v projections and short causal convolutions over the global sequence, and the order of
one call's work and collectives.

The convolutions read ``conv_size - 1`` tokens before each token: on a rank's first tokens those live on
the previous rank, so they come by :func:`allscan.ops.halo.halo_exchange` (one message: q, k and v
projected side by side); the recurrence is the subclass's sequence-parallel delta rule.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.ops import own_work
from allscan.ops.batch_context import context_group
from allscan.ops.delta import METHODS
from allscan.ops.halo import halo_exchange

from ._inputs import check_layer_inputs, check_packing
from .causal_conv import depthwise_causal_conv

__all__ = ["DeltaRuleLayer", "ShortConvolution"]


class ShortConvolution(nn.Conv1d):
    """fla's ``ShortConvolution`` parameters: a depthwise Conv1d, ``weight [D, 1, k]``, optional ``bias [D]``."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False):
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias)


class DeltaRuleLayer(nn.Module):
    """The common part of fla's delta-rule layers. A subclass calls :meth:`_init_heads`, then builds its
    parameters in fla's order (:meth:`_init_projections` and :meth:`_init_convolutions` among them), and
    defines ``_gates(hidden_states) -> (g, beta)`` (the gate logits its delta rule takes),
    ``_recurrence(q, k, v, g, beta, cu_seqlens, context) -> o`` (``[B, T, HV, head_v_dim]``) and
    ``_output(o, hidden_states)`` (the output norm and projection)."""

    def _init_heads(self, hidden_size: int, expand_v: float, head_dim: int, num_heads: int,
                    num_v_heads: Optional[int], *, mode: str, use_short_conv: bool, conv_size: int,
                    conv_bias: bool, allow_neg_eigval: bool, layer_idx: Optional[int], group, method: str) -> None:
        """The sizes (fla's attribute names) and options, checked: each error names the argument."""
        name = type(self).__name__
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"{name}: mode must be chunk or fused_recurrent, got {mode!r}")
        if method not in METHODS:
            raise ValueError(f"{name}: method must be one of {sorted(METHODS)}, got {method!r}")
        if use_short_conv and (not isinstance(conv_size, int) or conv_size < 1):
            raise ValueError(f"{name}: conv_size must be a positive int, got {conv_size!r}")
        self.mode, self.allow_neg_eigval = mode, allow_neg_eigval
        self.hidden_size, self.expand_v = hidden_size, expand_v
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.head_dim, self.num_heads = head_dim, num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = int(num_heads * self.head_k_dim)
        self.value_dim = int(self.num_v_heads * self.head_v_dim)
        self.layer_idx = layer_idx
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"{name}: expand_v={expand_v} times head_dim={head_dim} is not an integer")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"{name}: num_v_heads={self.num_v_heads} must be a multiple of num_heads={num_heads}")
        self.group, self.method = group, method

    def _init_projections(self) -> None:
        """``q_proj``, ``k_proj``, ``v_proj``."""
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)

    def _init_convolutions(self) -> None:
        """``{q,k,v}_conv1d`` with short convolutions."""
        if self.use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size, self.conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size, self.conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size, self.conv_bias)

    def _short_conv(self, qkv: torch.Tensor, halo: torch.Tensor, rank: int,
                    cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """silu(causal depthwise conv) over the global sequence, q, k and v concatenated (one halo message:
        ``halo``, the previous rank's last ``conv_size - 1`` tokens of ``qkv``)."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = torch.cat([c.weight[:, 0, :] for c in convs])  # [D, k]
        bias = torch.cat([c.bias for c in convs]) if self.conv_bias else None
        out = depthwise_causal_conv(qkv, halo, weight, bias, rank * qkv.shape[1], cu_seqlens)
        return F.silu(out)

    def _projections(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, context):
        """The input checks, then q, k and v projected and concatenated (the halo's message)."""
        name = type(self).__name__
        check_layer_inputs(name, hidden_states, self.hidden_size, attention_mask, past_key_values, use_cache)
        check_packing(name, hidden_states, self.group, cu_seqlens, context)
        return torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)

    def _recurrence_inputs(self, hidden_states, qkv, halo, rank, cu_seqlens):
        """q, k, v (after the convolutions) and the gate logits g, beta, as the delta rule takes them."""
        B, T, _ = hidden_states.shape
        qkv = self._short_conv(qkv, halo, rank, cu_seqlens) if self.use_short_conv else F.silu(qkv)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_heads, self.head_k_dim), k.reshape(B, T, self.num_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim), *self._gates(hidden_states))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, context=None, **kwargs):
        """``context``: the batch's :class:`allscan.SequenceContext` (its group and packed cut, agreed once
        per batch), instead of ``cu_seqlens`` (and of the layer's ``group``, which must then be None or
        the context's)."""
        name = type(self).__name__
        pg = context_group(context, self.group, name)
        # This rank's own work before each collective of the call (the halo exchange, the delta rule's
        # first): if it raises, the peers waiting there are told instead of waiting until the timeout.
        qkv = own_work(pg, name, "its projections", self._projections, hidden_states, attention_mask,
                       past_key_values, use_cache, cu_seqlens, context)
        halo = halo_exchange(qkv, self.conv_size - 1, self.group, context=context) if self.use_short_conv else None
        rank = 0 if pg is None else torch.distributed.get_rank(pg)
        offsets = cu_seqlens if context is None else context.offsets(hidden_states.device)
        q, k, v, g, beta = own_work(pg, name, "its convolutions", self._recurrence_inputs, hidden_states, qkv, halo,
                                    rank, offsets)
        o = self._recurrence(q, k, v, g, beta, cu_seqlens, context)
        return self._output(o, hidden_states), None, None
