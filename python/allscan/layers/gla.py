"""The GLA layer: :class:`GatedLinearAttention`, an ``nn.Module`` with fla's parameters, sequence-parallel.

The op underneath is :func:`allscan.ops.gla.zeco_gla` (ZeCO: the All-Scan of the chunk states);
``allscan.layers.zeco_gla`` and ``allscan.layers.gla.recurrent_gla_reference`` are the same functions.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.ops import own_work
from allscan.ops.batch_context import context_group
from allscan.ops.gla import LOCAL, METHODS, recurrent_gla_reference, zeco_gla

from ._inputs import check_layer_inputs
from .norms import RMSNorm, RMSNormGated, gate_activation

__all__ = ["zeco_gla", "GatedLinearAttention", "recurrent_gla_reference", "LOCAL"]


class GatedLinearAttention(nn.Module):
    """GLA layer with the parameters (names, shapes) of ``fla.layers.gla.GatedLinearAttention``.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (output gate), ``gk_proj`` (two linears:
    hidden -> gate_low_rank_dim -> key_dim, with bias), ``o_proj``, and ``g_norm_swish_gate.weight``
    (fused norm + swish gate, fla's default) or ``g_norm.weight``. A state_dict of fla's layer loads.

    ``group``: the sequence-parallel group, as in :func:`~allscan.ops.gla.zeco_gla`: None is the default
    group (resolved at each call; one process when torch.distributed is not initialised), ``LOCAL`` no
    sequence parallelism; the input ``hidden_states [B, T_local, hidden]`` is this rank's shard. ``method`` as in :func:`zeco_gla`.
    ``forward`` returns ``(o, None, None)`` like fla's layer (no caching).
    Not supported: short convolutions (they need a halo exchange across ranks), feature maps.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, num_kv_heads: Optional[int] = None, *, feature_map: Optional[str] = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, gate_fn: str = "swish", elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16, gate_low_rank_dim: int = 16,
                 clamp_min: Optional[float] = None, fuse_norm: bool = True, layer_idx: Optional[int] = None,
                 group=None, method: str = "zeco"):
        super().__init__()
        if mode not in ("chunk", "fused_recurrent", "fused_chunk"):
            raise ValueError(f"GatedLinearAttention: mode must be chunk, fused_recurrent or fused_chunk, got {mode!r}")
        if use_short_conv:
            raise NotImplementedError("GatedLinearAttention: use_short_conv=True is not supported with sequence "
                                      "parallelism here (the convolution needs the previous rank's last tokens)")
        if feature_map is not None:
            raise NotImplementedError(f"GatedLinearAttention: feature_map={feature_map!r} is not supported")
        if method not in METHODS:
            raise ValueError(f"GatedLinearAttention: method must be one of {sorted(METHODS)}, got {method!r}")
        self.mode = mode
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(f"GatedLinearAttention: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.use_output_gate = use_output_gate
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.clamp_min = clamp_min
        self.layer_idx = layer_idx
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"GatedLinearAttention: key_dim ({self.key_dim}) and value_dim ({self.value_dim}) must be "
                             f"divisible by num_heads ({num_heads})")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim_per_group, bias=True))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        if gate_fn == "swish" and fuse_norm and use_output_gate:
            self.g_norm_swish_gate = RMSNormGated(self.head_v_dim, elementwise_affine=bool(elementwise_affine),
                                                   eps=norm_eps)
            self.fuse_norm_and_gate = True
        else:
            self.fuse_norm_and_gate = False
            self.g_norm = RMSNorm(self.head_v_dim, elementwise_affine=bool(elementwise_affine), eps=norm_eps,
                                   dtype=torch.float32)
            self.gate_fn = gate_activation(gate_fn)
        self.gate_logit_normalizer = gate_logit_normalizer
        self.group = group
        self.method = method

    def _recurrence_inputs(self, hidden_states, attention_mask, past_key_values, use_cache):
        """The input checks, then q, k, v and the log decay gk ``[B, T_local, H, *]`` as zeco_gla takes them."""
        check_layer_inputs("GatedLinearAttention", hidden_states, self.hidden_size, attention_mask, past_key_values, use_cache)
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_k_dim)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        gk = self.gk_proj(hidden_states)
        if self.num_kv_groups > 1:
            hk = self.num_kv_heads
            k, gk = (x.view(B, T, hk, 1, self.head_k_dim).expand(B, T, hk, self.num_kv_groups, self.head_k_dim)
                     .reshape(B, T, self.num_heads, self.head_k_dim) for x in (k, gk))
            v = v.view(B, T, hk, 1, self.head_v_dim).expand(B, T, hk, self.num_kv_groups, self.head_v_dim) \
                .reshape(B, T, self.num_heads, self.head_v_dim)
        else:
            k = k.view(B, T, self.num_heads, self.head_k_dim)
            gk = gk.view(B, T, self.num_heads, self.head_k_dim)
            v = v.view(B, T, self.num_heads, self.head_v_dim)
        gk = F.logsigmoid(gk) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = torch.clamp_min(gk, self.clamp_min)
        return q, k, v, gk

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, context=None, **kwargs):
        """``context``: the batch's :class:`allscan.SequenceContext` (its group and packed cut, agreed once
        per batch), instead of ``cu_seqlens`` (and of the layer's ``group``, which must then be None or
        the context's)."""
        # This rank's own work before the call's first collective: if it raises, the peers waiting there
        # are told instead of waiting until the timeout.
        q, k, v, gk = own_work(context_group(context, self.group, "GatedLinearAttention"), "GatedLinearAttention",
                               "its projections", self._recurrence_inputs, hidden_states, attention_mask,
                               past_key_values, use_cache)
        B, T, _ = hidden_states.shape
        o, _ = zeco_gla(q, k, v, gk, self.group, cu_seqlens=cu_seqlens, method=self.method, context=context)
        if self.use_output_gate:
            gate = self.g_proj(hidden_states)
            if self.fuse_norm_and_gate:
                o = self.g_norm_swish_gate(o, gate.view(B, T, self.num_heads, self.head_v_dim))
                o = o.reshape(B, T, self.value_dim)
            else:
                o = self.g_norm(o).reshape(B, T, self.value_dim) * self.gate_fn(gate)
        else:
            o = self.g_norm(o).reshape(B, T, self.value_dim)
        return self.o_proj(o), None, None
