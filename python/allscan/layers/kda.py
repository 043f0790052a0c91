"""The Kimi Delta Attention layer: :class:`KimiDeltaAttention`, an ``nn.Module`` with fla's parameters,
sequence-parallel.

Its short convolutions and their halo are :class:`~allscan.layers._delta_layer.DeltaRuleLayer`'s; the
recurrence is :func:`allscan.ops.delta.zeco_kda` (one decay per key dimension).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from allscan.ops.delta import zeco_kda

from ._delta_layer import DeltaRuleLayer
from .norms import RMSNormGated

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaRuleLayer):
    """KDA (Kimi Linear's linear attention) with the parameters (names, shapes, defaults) of fla 0.6.0's
    ``fla.layers.KimiDeltaAttention``: ``q_proj``, ``k_proj``, ``v_proj``, ``{q,k,v}_conv1d.weight``
    (``.bias`` with ``conv_bias``), ``f_proj`` (two linear maps through ``head_v_dim``: the decay's
    logits ``[HV * head_dim]``), ``b_proj``, ``A_log`` ``[HV]``, ``dt_bias`` ``[HV * head_dim]``,
    ``g_proj`` (two linear maps, the second with a bias: the output gate), ``o_norm.weight`` (RMSNorm
    gated by a sigmoid), ``o_proj``. A state_dict of fla's layer loads.

    The decay per key dimension is ``-exp(A_log) * softplus(f_proj(x) + dt_bias)``, or with
    ``lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))`` (as fla's ``chunk_kda``);
    ``safe_gate`` needs ``lower_bound`` in ``[-5, 0)``. ``group``, ``method``, ``cu_seqlens`` and the
    shard as for :class:`~allscan.layers.GatedDeltaNet`; ``forward`` returns ``(o, None, None)`` like
    fla's layer (no caching).
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: Optional[int] = None, *, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: Optional[int] = None,
                 norm_eps: float = 1e-5, group=None, method: str = "zeco", **kwargs):
        super().__init__()
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"KimiDeltaAttention: safe_gate=True needs lower_bound in [-5, 0), got {lower_bound!r}")
        self._init_heads(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode=mode,
                         use_short_conv=use_short_conv, conv_size=conv_size, conv_bias=conv_bias,
                         allow_neg_eigval=allow_neg_eigval, layer_idx=layer_idx, group=group, method=method)
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        self.gate_dim = self.num_v_heads * self.head_k_dim  # one decay per value head and key dimension
        self._init_projections()
        self._init_convolutions()
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # fla's initialisation: A in U(1, 16) (zeros with safe_gate), dt log-uniform in [1e-3, 0.1] per
        # gate entry, dt_bias = softplus^-1(dt)
        if safe_gate:
            A_log = torch.zeros(self.num_v_heads, dtype=torch.float32)
        else:
            A_log = torch.log(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16))
        self.A_log = nn.Parameter(A_log)
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.gate_dim, dtype=torch.float32) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _gates(self, hidden_states):
        """The decay's logits ``[B, T, HV, head_dim]`` and beta's ``[B, T, HV]``."""
        B, T, _ = hidden_states.shape
        return (self.f_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_k_dim),
                self.b_proj(hidden_states))

    def _recurrence(self, q, k, v, g, beta, cu_seqlens, context):
        o, _ = zeco_kda(q, k, v, g, beta, self.group, cu_seqlens=cu_seqlens, context=context,
                        use_qk_l2norm_in_kernel=True, method=self.method, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                        safe_gate=self.safe_gate, lower_bound=self.lower_bound)
        return o

    def _output(self, o, hidden_states):
        B, T, _ = hidden_states.shape
        g = self.g_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return self.o_proj(self.o_norm(o, g).reshape(B, T, self.value_dim))
