"""The rewired forwards of transformers' linear-attention modules (Gated DeltaNet, KDA): each mirrors the module's
own ``forward`` (transformers 5.25, the cache branches refused) on this rank's contiguous shard, with the module's
own projections, gates, norms and Parameters; what crosses the rank boundaries is allscan's:

- the depthwise causal convolution reads ``conv_size - 1`` tokens of the previous rank
  (:func:`allscan.ops.halo.halo_exchange`, zeros on rank 0 as the module's own left padding);
- the recurrence is allscan's sequence-parallel delta rule (:func:`allscan.ops.delta.zeco_gated_delta_rule`,
  KDA's per-channel forget gate :func:`allscan.ops.delta.zeco_kda`), given exactly what the module gives
  transformers' ``chunk_gated_delta_rule`` / ``chunk_kda``.

Packed rows come as the batch's :class:`allscan.context.SequenceContext`, handed down by the model-level hook
(:mod:`allscan.integrations.hf_call`): the convolution reads nothing before its sequence's start (its mask made
once per batch), the delta rule starts each sequence from a zero state (``cu_seqlens``: the context's global
offsets, copied to the device once per batch).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.context import SequenceContext
from allscan.ops.halo import halo_exchange

from .common import handed_context, op_group

__all__ = ["SequenceParallelForward", "FORWARDS"]


def _layer_call(mod, group, hidden_states, cache, attention_mask, kwargs) -> SequenceContext:
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
    return handed_context(kwargs, group, hidden_states.shape[0], hidden_states.shape[1], name, hidden_states)


_CONV_MASKS: "weakref.WeakKeyDictionary[SequenceContext, dict]" = weakref.WeakKeyDictionary()


def _conv_mask(ctx: SequenceContext, T: int, width: int, device, dtype) -> torch.Tensor:
    """``[width, T]``: 1 where window slot i of local token t reads a token of t's own sequence (global token
    ``p - (width - 1) + i``, ``p = rank * T + t``, at or after the start of ``p``'s sequence), else 0. Made once
    per batch, shape, device and dtype."""
    masks = _CONV_MASKS.setdefault(ctx, {})
    key = (T, width, torch.device(device), dtype)
    got = masks.get(key)
    if got is None:
        pos = ctx.group.rank * T + torch.arange(T, device=device)
        cu = ctx.offsets(device).to(torch.long)
        start = cu[torch.searchsorted(cu, pos, right=True) - 1]
        got = masks[key] = torch.stack([(pos - (width - 1) + i >= start) for i in range(width)]).to(dtype)
    return got


def _causal_conv(mod, mixed_qkv: torch.Tensor, ctx: SequenceContext) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, causal, then ``mod.activation``) over the global sequence:
    ``mixed_qkv [B, T_local, C]`` with the previous rank's last ``kernel - 1`` tokens before it (zeros on rank
    0: the module's own left padding). With packed sequences (``ctx.packed``, B = 1) no window reads before its
    token's sequence start: each sequence is convolved as if alone (zero-padded). Returns ``[B, T_local, C]`` in
    ``mixed_qkv``'s dtype."""
    conv = mod.conv1d
    width = conv.kernel_size[0]
    x = mixed_qkv
    if width > 1:
        x = torch.cat([halo_exchange(mixed_qkv, width - 1, op_group(ctx.group)), mixed_qkv], dim=1)
    weight = conv.weight  # [C, 1, width], as transformers' weight.squeeze(1).unsqueeze(1)
    if not ctx.packed:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, conv.bias, padding=0, groups=conv.groups)
    else:
        # window slot i of local token t reads global token p - (width - 1) + i (p = rank * T + t): counted only
        # from the start of p's sequence on
        T = mixed_qkv.shape[1]
        seen_all = _conv_mask(ctx, T, width, x.device, weight.dtype)
        xw = x.to(weight.dtype)
        out = None
        for i in range(width):
            seen = seen_all[i][None, :, None]
            term = xw[:, i:i + T, :] * weight[:, 0, i] * seen
            out = term if out is None else out + term
        if conv.bias is not None:
            out = out + conv.bias
        out = out.transpose(1, 2)  # [B, C, T], as F.conv1d's
    if mod.activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[mod.activation](out)
    return out.to(mixed_qkv.dtype).transpose(1, 2)


def _gated_delta_rule(q, k, v, g, beta, ctx: SequenceContext):
    """What the module asks of ``chunk_gated_delta_rule`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_gated_delta_rule

    o, _ = zeco_gated_delta_rule(q, k, v, g, beta, op_group(ctx.group), use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=ctx.offsets(q.device))
    return o


def _kda(q, k, v, g, beta, ctx: SequenceContext):
    """What the module asks of ``chunk_kda`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_kda

    o, _ = zeco_kda(q, k, v, g, beta, op_group(ctx.group), use_qk_l2norm_in_kernel=True,
                    cu_seqlens=ctx.offsets(q.device))
    return o


def _qwen3_next_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    ctx = _layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    projected_states_qkvz = mod.in_proj_qkvz(hidden_states)
    projected_states_ba = mod.in_proj_ba(hidden_states)
    query, key, value, z, b, a = mod.fix_query_key_value_ordering(projected_states_qkvz, projected_states_ba)
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    mixed_qkv = _causal_conv(mod, torch.cat((query, key, value), dim=-1), ctx)
    query, key, value = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    query = query.reshape(query.shape[0], query.shape[1], -1, mod.head_k_dim)
    key = key.reshape(key.shape[0], key.shape[1], -1, mod.head_k_dim)
    value = value.reshape(value.shape[0], value.shape[1], -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    core_attn_out = _gated_delta_rule(query, key, value, g, beta, ctx)
    z_shape_og = z.shape
    core_attn_out = core_attn_out.reshape(-1, core_attn_out.shape[-1])
    z = z.reshape(-1, z.shape[-1])
    core_attn_out = mod.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(z_shape_og)
    core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
    return mod.out_proj(core_attn_out)


def _qwen3_5_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    ctx = _layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = mod.in_proj_qkv(hidden_states)
    z = mod.in_proj_z(hidden_states)
    z = z.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    b = mod.in_proj_b(hidden_states)
    a = mod.in_proj_a(hidden_states)
    mixed_qkv = _causal_conv(mod, mixed_qkv, ctx)
    query, key, value = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    core_attn_out = _gated_delta_rule(query, key, value, g, beta, ctx)
    core_attn_out = core_attn_out.reshape(-1, mod.head_v_dim)
    z = z.reshape(-1, mod.head_v_dim)
    core_attn_out = mod.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)
    return mod.out_proj(core_attn_out)


def _olmo_hybrid_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    ctx = _layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = _causal_conv(mod, mixed_qkv, ctx)
    q, k, v = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    k = k.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    v = v.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    beta = mod.b_proj(hidden_states).sigmoid()
    if mod.allow_neg_eigval:
        beta = beta * 2.0
    g = -mod.A_log.float().exp() * F.softplus(mod.a_proj(hidden_states).float() + mod.dt_bias)
    output = _gated_delta_rule(q, k, v, g, beta, ctx)
    gate = mod.g_proj(hidden_states)
    output = output.reshape(-1, mod.head_v_dim)
    gate = gate.reshape(-1, mod.head_v_dim)
    output = mod.o_norm(output, gate)
    output = output.reshape(batch_size, seq_len, -1)
    return mod.o_proj(output)


def _kimi_linear_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    ctx = _layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len = hidden_states.shape[:2]
    hidden_shape = (batch_size, seq_len, -1, mod.head_dim)
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = _causal_conv(mod, mixed_qkv, ctx)
    query, key, value = torch.split(mixed_qkv, [mod.qkv_dim] * 3, dim=-1)
    query = query.reshape(hidden_shape)
    key = key.reshape(hidden_shape)
    value = value.reshape(hidden_shape)
    g = mod.forget_gate(hidden_states)
    beta = torch.sigmoid(mod.b_proj(hidden_states))
    core_attn_out = _kda(query, key, value, g, beta, ctx)
    gate = mod.g_b_proj(mod.g_a_proj(hidden_states)).view(hidden_shape)
    output = mod.o_norm(core_attn_out, gate).reshape(batch_size, seq_len, -1)
    return mod.o_proj(output)


FORWARDS = {"qwen3_next": _qwen3_next_forward, "qwen3_5": _qwen3_5_forward, "qwen3_5_moe": _qwen3_5_forward,
             "olmo_hybrid": _olmo_hybrid_forward, "kimi_linear": _kimi_linear_forward}


class SequenceParallelForward:
    """The ``forward`` of a rewired linear-attention module (held in the module's ``__dict__``): the module's own
    arithmetic on this rank's shard of the sequence, over ``group``."""

    def __init__(self, module: nn.Module, model_type: str, group):
        self.module, self.model_type, self.group = module, model_type, group

    def __call__(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return FORWARDS[self.model_type](self.module, self.group, hidden_states, cache, attention_mask, kwargs)

    def __deepcopy__(self, memo):  # the module is copied, the process group is not
        import copy

        return SequenceParallelForward(copy.deepcopy(self.module, memo), self.model_type, self.group)

    def __repr__(self):
        return f"SequenceParallelForward({type(self.module).__name__}, {self.model_type!r})"
