"""The Gated DeltaNet layer: :class:`GatedDeltaNet`, an ``nn.Module`` with fla's parameters, sequence-parallel.

The short causal convolutions read ``conv_size - 1`` tokens before each token: on a rank's first tokens
those live on the previous rank, so they come by :func:`allscan.ops.halo.halo_exchange`; the recurrence is
:func:`allscan.ops.delta.zeco_gated_delta_rule`.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.ops.delta import METHODS, zeco_gated_delta_rule
from allscan.ops import sequence_parallel_group
from allscan.ops._launch import own_work
from allscan.ops.halo import halo_exchange

from ._inputs import check_layer_inputs
from .norms import RMSNorm, RMSNormGated

__all__ = ["GatedDeltaNet"]


class _ShortConvolution(nn.Conv1d):
    """fla's ``ShortConvolution`` parameters: a depthwise Conv1d, ``weight [D, 1, k]``, optional ``bias [D]``."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False):
        super().__init__(hidden_size, hidden_size, kernel_size, padding=kernel_size - 1, groups=hidden_size,
                         bias=bias)


def _first_visible(T: int, k: int, offset: int, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """``[T, k]`` mask: window slot i of local token t (global token offset + t - (k-1) + i) is read only if
    it belongs to t's sequence (and is not before the global start)."""
    pos = offset + torch.arange(T, device=device)
    if cu_seqlens is None:
        start = torch.zeros_like(pos)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        start = cu[torch.searchsorted(cu, pos, right=True) - 1]
    src = pos[:, None] - (k - 1) + torch.arange(k, device=device)[None, :]
    return src >= start[:, None]


class GatedDeltaNet(nn.Module):
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
                 num_v_heads: Optional[int] = None, mode: str = "chunk", use_gate: bool = True,
                 use_short_conv: bool = True, allow_neg_eigval: bool = False, conv_size: int = 4,
                 conv_bias: bool = False, layer_idx: Optional[int] = None, norm_eps: float = 1e-5,
                 output_gate_activation: str = "swish", group=None, method: str = "zeco", **kwargs):
        super().__init__()
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"GatedDeltaNet: mode must be chunk or fused_recurrent, got {mode!r}")
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError("GatedDeltaNet: output_gate_activation must be 'swish', 'silu', or 'sigmoid', "
                             f"got {output_gate_activation!r}")
        if method not in METHODS:
            raise ValueError(f"GatedDeltaNet: method must be one of {sorted(METHODS)}, got {method!r}")
        if use_short_conv and (not isinstance(conv_size, int) or conv_size < 1):
            raise ValueError(f"GatedDeltaNet: conv_size must be a positive int, got {conv_size!r}")
        self.mode, self.allow_neg_eigval = mode, allow_neg_eigval
        self.hidden_size, self.expand_v = hidden_size, expand_v
        self.use_gate, self.use_short_conv = use_gate, use_short_conv
        self.conv_size, self.conv_bias = conv_size, conv_bias
        self.head_dim, self.num_heads = head_dim, num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = int(num_heads * self.head_k_dim)
        self.value_dim = int(self.num_v_heads * self.head_v_dim)
        self.layer_idx = layer_idx
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"GatedDeltaNet: expand_v={expand_v} times head_dim={head_dim} is not an integer")
        if self.num_v_heads % num_heads != 0:
            raise ValueError(f"GatedDeltaNet: num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_heads={num_heads}")
        self.group, self.method = group, method

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
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
        if use_short_conv:
            self.q_conv1d = _ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.k_conv1d = _ShortConvolution(self.key_dim, conv_size, conv_bias)
            self.v_conv1d = _ShortConvolution(self.value_dim, conv_size, conv_bias)
        else:
            warnings.warn("GatedDeltaNet: use_short_conv=False (fla warns: short convolutions are crucial to "
                          "the performance)")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def _short_conv(self, qkv: torch.Tensor, halo: torch.Tensor, rank: int,
                    cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """silu(causal depthwise conv) over the global sequence, q, k and v concatenated (one halo message:
        ``halo``, the previous rank's last ``conv_size - 1`` tokens of ``qkv``)."""
        k = self.conv_size
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = torch.cat([c.weight[:, 0, :] for c in convs]).to(qkv.dtype)  # [D, k]
        B, T, D = qkv.shape
        windows = torch.cat([halo, qkv], dim=1).unfold(1, k, 1)  # [B, T, D, k]: tokens t-k+1 .. t
        mask = _first_visible(T, k, rank * T, cu_seqlens, qkv.device).to(qkv.dtype)  # [T, k]
        out = torch.einsum("btdk,tk,dk->btd", windows, mask, weight)
        if self.conv_bias:
            out = out + torch.cat([c.bias for c in convs]).to(qkv.dtype)
        return F.silu(out)

    def _projections(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens):
        """The input checks, then q, k and v projected and concatenated (the halo's message)."""
        check_layer_inputs("GatedDeltaNet", hidden_states, self.hidden_size, attention_mask, past_key_values, use_cache)
        if cu_seqlens is not None and hidden_states.shape[0] != 1:
            raise ValueError(f"GatedDeltaNet: with cu_seqlens the batch size must be 1, got {hidden_states.shape[0]}")
        return torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)

    def _recurrence_inputs(self, hidden_states, qkv, halo, rank, cu_seqlens):
        """q, k, v (after the convolutions) and the gates' logits a, b, as the delta rule takes them."""
        B, T, _ = hidden_states.shape
        qkv = self._short_conv(qkv, halo, rank, cu_seqlens) if self.use_short_conv else F.silu(qkv)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_heads, self.head_k_dim), k.reshape(B, T, self.num_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim), self.a_proj(hidden_states),
                self.b_proj(hidden_states))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, **kwargs):
        pg = sequence_parallel_group(self.group, "GatedDeltaNet")
        # This rank's own work before each collective of the call (the halo exchange, the delta rule's
        # first): if it raises, the peers waiting there are told instead of waiting until the timeout.
        qkv = own_work(pg, "GatedDeltaNet", "its projections", self._projections, hidden_states, attention_mask,
                       past_key_values, use_cache, cu_seqlens)
        halo = halo_exchange(qkv, self.conv_size - 1, self.group) if self.use_short_conv else None
        rank = 0 if pg is None else torch.distributed.get_rank(pg)
        q, k, v, a, b = own_work(pg, "GatedDeltaNet", "its convolutions", self._recurrence_inputs, hidden_states,
                                 qkv, halo, rank, cu_seqlens)
        B, T, _ = hidden_states.shape
        o, _ = zeco_gated_delta_rule(q, k, v, a, b, self.group,
                                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, method=self.method,
                                     use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)
        if self.use_gate:
            g = self.g_proj(hidden_states).reshape(B, T, self.num_v_heads, self.head_v_dim)
            o = self.o_norm(o, g)
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, self.value_dim)), None, None
