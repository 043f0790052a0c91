"""The Mamba2 mixer: :class:`Mamba2`, an ``nn.Module`` with transformers' ``Mamba2Mixer`` parameters,
sequence-parallel.

Per token: ``in_proj`` gives the gate z, xBC and dt; xBC goes through the depthwise causal convolution (its
``conv_kernel - 1`` tokens before a rank's first come from the previous rank: :func:`allscan.ops.halo.halo_exchange`;
cut at packed sequence starts) and the activation, then splits into x, B, C; ``dt = clamp(softplus(dt +
dt_bias), time_step_limit)``, ``A = -exp(A_log)``; the SSD over the global sequence is
:func:`allscan.ops.ssd.zeco_ssd` (with the skip term D); then the gated RMSNorm in groups of
``intermediate_size / n_groups`` (the gate after the norm's input, ``norm_before_gate=False``) and ``out_proj``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.ops import own_work
from allscan.ops.batch_context import context_group
from allscan.ops.halo import halo_exchange
from allscan.ops.ssd import METHODS, zeco_ssd

from ._inputs import check_layer_inputs, check_packing
from .causal_conv import depthwise_causal_conv

__all__ = ["Mamba2", "GroupedRMSNormGated"]

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


class GroupedRMSNormGated(nn.Module):
    """transformers' ``Mamba2RMSNormGated``: ``weight * rmsnorm_per_group(x * silu(gate))`` over groups of
    ``group_size`` channels (parameter ``weight``), in fp32 for 16-bit inputs, fp64 for fp64."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size, self.variance_epsilon = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(x.dtype, torch.float32)
        y = x.to(acc) * F.silu(gate.to(acc))
        groups = y.unflatten(-1, (-1, self.group_size))
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        return (self.weight.to(acc) * y).to(x.dtype)


class Mamba2(nn.Module):
    """Mamba2's mixer with the parameters (names, shapes, initialisation) of transformers'
    ``Mamba2Mixer``: ``in_proj`` (z, xBC, dt; ``.bias`` with ``use_bias``), ``conv1d`` (depthwise over xBC,
    ``conv_kernel``, ``.bias`` with ``use_conv_bias``), ``dt_bias``, ``A_log``, ``D`` (one per head),
    ``norm.weight`` (gated RMSNorm in ``n_groups`` groups), ``out_proj``. A state_dict of transformers' mixer
    loads; :meth:`from_config` builds one from a ``Mamba2Config``.

    ``group``: the sequence-parallel group, as in :func:`~allscan.ops.ssd.zeco_ssd` (None: the default group,
    resolved at each call; ``allscan.ops.LOCAL``: no sequence parallelism). ``hidden_states [B, T_local,
    hidden]`` is this rank's contiguous shard (``T_local >= conv_kernel - 1`` with several ranks);
    ``cu_seqlens`` (batch 1) are offsets over the global packed row: the convolution and the scan are cut at
    every sequence start, also across ranks. ``forward`` returns ``(o, None, None)`` like the other layers
    (no caching, no padding mask).
    """

    def __init__(self, hidden_size: int = 2048, num_heads: Optional[int] = None, head_dim: int = 64,
                 state_size: int = 128, expand: float = 2, *, n_groups: int = 1, conv_kernel: int = 4,
                 use_conv_bias: bool = True, use_bias: bool = False, hidden_act: str = "silu",
                 layer_norm_epsilon: float = 1e-5, time_step_limit: Tuple[float, float] = (0.0, float("inf")),
                 time_step_min: float = 0.001, time_step_max: float = 0.1, time_step_floor: float = 1e-4,
                 layer_idx: Optional[int] = None, group=None, method: str = "zeco", **kwargs):
        super().__init__()
        name = type(self).__name__
        self.hidden_size, self.head_dim, self.ssm_state_size = hidden_size, head_dim, state_size
        self.intermediate_size = int(expand * hidden_size)
        self.num_heads = self.intermediate_size // head_dim if num_heads is None else num_heads
        if self.num_heads * head_dim != self.intermediate_size:
            raise ValueError(f"{name}: num_heads * head_dim = {self.num_heads} * {head_dim} must equal "
                             f"expand * hidden_size = {self.intermediate_size}")
        if n_groups < 1 or self.num_heads % n_groups != 0:
            raise ValueError(f"{name}: n_groups={n_groups} must divide num_heads={self.num_heads}")
        if not isinstance(conv_kernel, int) or conv_kernel < 1:
            raise ValueError(f"{name}: conv_kernel must be a positive int, got {conv_kernel!r}")
        if hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"{name}: hidden_act={hidden_act!r} is not supported ({sorted(_ACTIVATIONS)})")
        if method not in METHODS:
            raise ValueError(f"{name}: method must be one of {sorted(METHODS)}, got {method!r}")
        if len(tuple(time_step_limit)) != 2:
            raise ValueError(f"{name}: time_step_limit must be (min, max), got {time_step_limit!r}")
        self.n_groups, self.conv_kernel_size = n_groups, conv_kernel
        self.use_conv_bias, self.use_bias, self.activation = use_conv_bias, use_bias, hidden_act
        self.time_step_limit = tuple(float(v) for v in time_step_limit)
        self.time_step_min, self.time_step_max, self.time_step_floor = time_step_min, time_step_max, time_step_floor
        self.layer_idx, self.group, self.method = layer_idx, group, method
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias)
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=use_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GroupedRMSNormGated(self.intermediate_size, self.intermediate_size // n_groups,
                                        eps=layer_norm_epsilon)
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)
        self.reset_ssm_parameters()

    @classmethod
    def from_config(cls, config, layer_idx: Optional[int] = None, *, group=None, method: str = "zeco") -> "Mamba2":
        """The mixer of a transformers ``Mamba2Config`` (its attribute names)."""
        return cls(config.hidden_size, config.num_heads, config.head_dim, config.state_size, config.expand,
                   n_groups=config.n_groups, conv_kernel=config.conv_kernel, use_conv_bias=config.use_conv_bias,
                   use_bias=config.use_bias, hidden_act=config.hidden_act,
                   layer_norm_epsilon=config.layer_norm_epsilon, time_step_limit=tuple(config.time_step_limit),
                   time_step_min=config.time_step_min, time_step_max=config.time_step_max,
                   time_step_floor=config.time_step_floor, layer_idx=layer_idx, group=group, method=method)

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """transformers' initialisation: ``A = 1..H``, ``D = 1``, dt log-uniform in [time_step_min,
        time_step_max] (at least time_step_floor) and ``dt_bias = softplus^-1(dt)``."""
        self.A_log.copy_(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        lo, hi = math.log(self.time_step_min), math.log(self.time_step_max)
        dt = torch.exp(torch.rand(self.num_heads) * (hi - lo) + lo).clamp(min=self.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _project(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, context):
        """The input checks, then z, xBC and dt (xBC contiguous: the halo's message)."""
        name = type(self).__name__
        check_layer_inputs(name, hidden_states, self.hidden_size, attention_mask, past_key_values, use_cache)
        check_packing(name, hidden_states, self.group, cu_seqlens, context)
        gate, xBC, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
        return gate, xBC.contiguous(), dt

    def _scan_inputs(self, xBC, halo, dt, rank: int, cu_seqlens):
        """x, dt, A, B, C as the SSD takes them: the convolution over the global sequence, its activation,
        dt's bias, softplus and clamp (in fp32 for 16-bit inputs)."""
        b, T, _ = xBC.shape
        conv = depthwise_causal_conv(xBC, halo, self.conv1d.weight[:, 0], self.conv1d.bias, rank * T, cu_seqlens)
        x, B, C = _ACTIVATIONS[self.activation](conv).split(
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], -1)
        acc = torch.promote_types(dt.dtype, torch.float32)
        dt = torch.clamp(F.softplus(dt.to(acc) + self.dt_bias.to(acc)), *self.time_step_limit)
        A = -torch.exp(self.A_log.to(acc))
        groups = (b, T, self.n_groups, self.ssm_state_size)
        return x.reshape(b, T, self.num_heads, self.head_dim), dt, A, B.reshape(groups), C.reshape(groups)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, context=None, **kwargs):
        """``context``: the batch's :class:`allscan.SequenceContext` (its group and packed cut, agreed once
        per batch), instead of ``cu_seqlens`` (and of the layer's ``group``, which must then be None or
        the context's)."""
        name = type(self).__name__
        pg = context_group(context, self.group, name)
        # this rank's own work before each collective (the halo exchange, the scan's first): if it raises,
        # the peers waiting there are told instead of waiting until the timeout
        gate, xBC, dt = own_work(pg, name, "its input projection", self._project, hidden_states, attention_mask,
                                 past_key_values, use_cache, cu_seqlens, context)
        k = self.conv_kernel_size
        halo = halo_exchange(xBC, k - 1, self.group, context=context) if k > 1 else None
        rank = 0 if pg is None else torch.distributed.get_rank(pg)
        offsets = cu_seqlens if context is None else context.offsets(hidden_states.device)
        x, dt, A, B, C = own_work(pg, name, "its convolution", self._scan_inputs, xBC, halo, dt, rank, offsets,
                                  every_call=cu_seqlens is not None)
        y, _ = zeco_ssd(x, dt, A, B, C, self.D, self.group, cu_seqlens=cu_seqlens, method=self.method,
                        context=context)
        b, T = hidden_states.shape[:2]
        o = self.norm(y.reshape(b, T, self.intermediate_size), gate)
        return self.out_proj(o.to(hidden_states.dtype)), None, None
