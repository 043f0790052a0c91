"""The Gated DeltaNet layer: :class:`GatedDeltaNet`, an ``nn.Module`` with fla's parameters, sequence-parallel.

Its short convolutions and their halo are :class:`~allscan.layers._delta_layer.DeltaRuleLayer`'s; the
recurrence is :func:`allscan.ops.delta.zeco_gated_delta_rule`.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn as nn

from allscan.ops.delta import zeco_gated_delta_rule

from ._delta_layer import DeltaRuleLayer
from .norms import RMSNorm, RMSNormGated

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet with the parameters (names, shapes, defaults) of fla 0.6.0's
    ``fla.layers.GatedDeltaNet``: ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``, ``A_log``,
    ``dt_bias``, ``{q,k,v}_conv1d.weight`` (``[D, 1, conv_size]``, ``.bias`` with ``conv_bias``),
    ``g_proj`` and ``o_norm.weight`` (gated RMSNorm; plain RMSNorm without ``use_gate``), ``o_proj``.
    A state_dict of fla's layer loads.

    ``group``: the sequence-parallel group, as in :func:`~allscan.ops.delta.zeco_gated_delta_rule`: None is
    the default group (resolved at each call), ``allscan.ops.LOCAL`` no sequence parallelism. The input
    ``hidden_states [B, T_local, hidden]`` is this rank's contiguous shard (``T_local >= conv_size - 1``
    with several ranks); ``cu_seqlens`` (B = 1) are over the global packed sequence: the convolution and
    the recurrence are cut at every sequence start, also across ranks. ``method`` as in
    ``zeco_gated_delta_rule``. ``forward`` returns ``(o, None, None)`` like fla's layer (no caching).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 2, head_dim: int = 256, num_heads: int = 6,
                 num_v_heads: Optional[int] = None, *, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: Optional[int] = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", group=None, method: str = "zeco", **kwargs):
        super().__init__()
        self._init_heads(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode=mode,
                         use_short_conv=use_short_conv, conv_size=conv_size, conv_bias=conv_bias,
                         allow_neg_eigval=allow_neg_eigval, layer_idx=layer_idx, group=group, method=method)
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError("GatedDeltaNet: output_gate_activation must be 'swish', 'silu', or 'sigmoid', "
                             f"got {output_gate_activation!r}")
        self.use_gate = use_gate
        self._init_projections()
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # fla's initialisation: A in U(0, 16), dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt)
        A = torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        dt = torch.clamp(dt, min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self._init_convolutions()
        if not use_short_conv:
            warnings.warn("GatedDeltaNet: use_short_conv=False (fla warns: short convolutions are crucial to "
                          "the performance)")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _gates(self, hidden_states):
        """The decay's logits a ``[B, T, HV]`` and beta's ``[B, T, HV]``."""
        return self.a_proj(hidden_states), self.b_proj(hidden_states)

    def _recurrence(self, q, k, v, a, b, cu_seqlens, context):
        o, _ = zeco_gated_delta_rule(q, k, v, a, b, self.group, cu_seqlens=cu_seqlens, context=context,
                                     use_qk_l2norm_in_kernel=True, method=self.method,
                                     use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)
        return o

    def _output(self, o, hidden_states):
        B, T, _ = hidden_states.shape
        if self.use_gate:
            g = self.g_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_v_dim)
            o = self.o_norm(o, g)
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim))
