"""The rewired forwards of transformers' linear-attention modules (Gated DeltaNet, KDA): each mirrors the module's
own ``forward`` (transformers 5.25, the cache branches refused) on this rank's contiguous shard, with the module's
own projections, gates, norms and Parameters; what crosses the rank boundaries is allscan's:

- the depthwise causal convolution reads ``conv_size - 1`` tokens of the previous rank
  (:func:`allscan.ops.halo.halo_exchange`, zeros on rank 0 as the module's own left padding);
- the recurrence is allscan's sequence-parallel delta rule (:func:`allscan.ops.delta.zeco_gated_delta_rule`,
  KDA's per-channel forget gate :func:`allscan.ops.delta.zeco_kda`), given exactly what the module gives
  transformers' ``chunk_gated_delta_rule`` / ``chunk_kda``.

Packed rows come as the batch's :class:`allscan.context.SequenceContext`, handed down by the model-level hook
(:mod:`allscan.integrations.hf_call`): the convolution reads nothing before its sequence's start
(:func:`allscan.integrations.hf_shard.causal_conv`, shared with the Mamba2 mixers), the delta rule starts each
sequence from a zero state (the ops take the context itself: its cut agreed once per batch, not per layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from allscan.context import SequenceContext

from .hf_shard import causal_conv, collective_begins, layer_call

__all__ = ["FORWARDS"]


def _gated_delta_rule(q, k, v, g, beta, ctx: SequenceContext):
    """What the module asks of ``chunk_gated_delta_rule`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_gated_delta_rule

    collective_begins()
    o, _ = zeco_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, context=ctx)
    return o


def _kda(q, k, v, g, beta, ctx: SequenceContext):
    """What the module asks of ``chunk_kda`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_kda

    collective_begins()
    o, _ = zeco_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, context=ctx)
    return o


def _qwen3_next_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    ctx = layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    projected_states_qkvz = mod.in_proj_qkvz(hidden_states)
    projected_states_ba = mod.in_proj_ba(hidden_states)
    query, key, value, z, b, a = mod.fix_query_key_value_ordering(projected_states_qkvz, projected_states_ba)
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    mixed_qkv = causal_conv(mod, torch.cat((query, key, value), dim=-1), ctx)
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
    ctx = layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = mod.in_proj_qkv(hidden_states)
    z = mod.in_proj_z(hidden_states)
    z = z.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    b = mod.in_proj_b(hidden_states)
    a = mod.in_proj_a(hidden_states)
    mixed_qkv = causal_conv(mod, mixed_qkv, ctx)
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
    ctx = layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = causal_conv(mod, mixed_qkv, ctx)
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
    ctx = layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len = hidden_states.shape[:2]
    hidden_shape = (batch_size, seq_len, -1, mod.head_dim)
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = causal_conv(mod, mixed_qkv, ctx)
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
