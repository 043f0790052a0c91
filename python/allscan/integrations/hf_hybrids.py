"""Sequence parallelism for transformers' (5.x) linear-attention hybrids: Gated DeltaNet and KDA on the matrix
All-Scan, their softmax attention on Ulysses.

    from allscan.integrations import hf_hybrids as sp
    model = AutoModelForCausalLM.from_config(cfg)    # Qwen3-Next, Qwen3.5 (text), OLMo-Hybrid, Kimi Linear
    sp.sequence_parallel(model, group)               # in place, before building the optimizer
    shard = sp.shard_batch(input_ids, labels, group=group)    # this rank's contiguous slice
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits   # no labels
    loss = sp.causal_lm_loss(logits, shard)          # this rank's share of the whole batch's mean loss
    loss.backward(); sp.sync_gradients(model, group)

``sequence_parallel`` rewires, in place, every linear-attention module of a supported family
(:data:`SUPPORTED`): its ``forward`` becomes one that computes on this rank's contiguous shard exactly what
the module computes on the whole sequence, with the module's own projections, gates, norms and Parameter
objects (nothing is copied or re-created: state_dicts, optimizers and parameter hooks are untouched). What
crosses the rank boundaries:

- the depthwise causal convolution reads ``conv_size - 1`` tokens of the previous rank
  (:func:`allscan.ops.halo.halo_exchange`, zeros on rank 0 as the module's own left padding);
- the recurrence is allscan's sequence-parallel delta rule (:func:`allscan.ops.delta.zeco_gated_delta_rule`,
  KDA's per-channel forget gate :func:`allscan.ops.delta.zeco_kda`), given exactly what the module gives
  transformers' ``chunk_gated_delta_rule`` / ``chunk_kda`` (q, k, v after the convolution, the gates it
  computed in its own dtypes, the in-kernel q/k l2-norm, fewer key than value heads repeated as the module
  does); fla-core's kernels on GPU, allscan's torch backend elsewhere;
- the models' softmax attention (Kimi Linear's MLA included) runs on Ulysses
  (:func:`allscan.ops.ulysses.ulysses_attention`): the model's attention implementation is set to one
  registered here for the group (:func:`attention_implementation`).

Packed rows: sequences packed in one row (B = 1) and marked by position ids that restart (transformers'
``DataCollatorWithFlattening``, which also ignores each sequence's first label; ``shard_batch(...,
position_ids=)`` cuts the row, its positions and its labels) are found in the
whole row at each call and computed each as if alone, also where a sequence starts inside a shard or crosses a
rank boundary: the convolution reads nothing before its sequence's start, the delta rule starts each sequence
from a zero state (``cu_seqlens``), the attention attends within each sequence. Their global bounds travel to
the layers as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (which transformers hands every layer).

The whole model is inspected before anything changes: a sequence-mixing module this does not know (a Mamba
mixer, a convolution over the sequence, an attention of another kind, a vision tower) raises
``NotImplementedError`` naming its class and where it is, and the model is left as it was. At call time
(a forward pre-hook on the model's transformers models, once per outermost call, agreed on by every rank of
the group so that all of them raise together) a KV or recurrent cache (``past_key_values``, ``use_cache=True``),
``output_attentions``, ``labels`` (transformers would shift them within each shard), padding masks, several
packed rows in one batch and flash-attention kwargs from the caller (``cu_seq_lens_*``: the bounds come from the
position ids) are refused by name; ``generate`` raises. Position ids default to the global ones
(``rank * T_local + arange(T_local)``), as one process would make them. Caching is turned off
(``config.use_cache``): sequence parallelism is for training and prefill.
"""
from __future__ import annotations

import hashlib
import inspect
import re
import sys
import threading
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from allscan.ops import sequence_parallel_group
from allscan.ops.halo import halo_exchange

from .batch import IGNORE_INDEX, BatchShard, causal_lm_loss, reduce_loss, shard_batch, sync_gradients  # noqa: F401

__all__ = ["sequence_parallel", "is_sequence_parallel", "attention_implementation", "SUPPORTED", "shard_batch",
           "causal_lm_loss", "reduce_loss", "sync_gradients", "BatchShard", "IGNORE_INDEX"]

_TF = "transformers.models."

# model_type -> (linear mixer class, softmax attention class, recurrence), in the modeling modules of transformers 5.x
SUPPORTED: Dict[str, Tuple[str, str, str]] = {
    "qwen3_next": ("Qwen3NextGatedDeltaNet", "Qwen3NextAttention", "gated delta rule"),
    "qwen3_5": ("Qwen3_5GatedDeltaNet", "Qwen3_5Attention", "gated delta rule"),
    "qwen3_5_moe": ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention", "gated delta rule"),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet", "OlmoHybridAttention", "gated delta rule"),
    "kimi_linear": ("KimiLinearDeltaAttention", "KimiLinearAttention", "KDA"),
}

# The forwards this file mirrors, as transformers 5.25.0 wrote them (sha1 of the source of ``cls.forward``): a
# class whose forward differs warns at sequence_parallel(), since its arithmetic may have changed.
_CHECKED_SOURCES = {
    "Qwen3NextGatedDeltaNet": "69447aee6baf4d4be649090273a2755ef680ba78",
    "Qwen3_5GatedDeltaNet": "1d11b814a309459e8ffc0e083f7862f17a14913c",
    "Qwen3_5MoeGatedDeltaNet": "1d11b814a309459e8ffc0e083f7862f17a14913c",
    "OlmoHybridGatedDeltaNet": "36ff8556e6e45e229ee558091d2e19113006ac47",
    "KimiLinearDeltaAttention": "46e373182a8b14f144e6b45cd8a0460bce6e4005",
}

# Class names of sequence mixers (anything else is per token, or a container of what is checked on its own);
# convolutions with a kernel wider than 1 count too, named by their owner.
_MIXER_NAME = re.compile(r"(Attention|Attn|DeltaNet|Mixer|MambaLayer|Mamba|SSM|Rglru|RecurrentBlock|LSTMLayer|"
                         r"LSTMBackend|ShortConv|Retention|HyenaOperator)$")

# Arguments transformers passes to an attention function that do not change it.
_HARMLESS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
                       "num_items_in_batch", "deterministic", "layer_idx", "return_dict", "cache"})
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "cu_seqlens")


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("allscan.integrations.hf_hybrids needs Hugging Face transformers 5.x: "
                          "pip install 'transformers>=5,<6'") from e
    return transformers


def _family_of(cls) -> Optional[Tuple[str, str]]:
    """(model_type, "linear" / "attention") of a transformers class this file supports exactly (no subclass:
    its forward may compute something else), else None."""
    module = cls.__module__
    if not module.startswith(_TF):
        return None
    model_type = module[len(_TF):].split(".", 1)[0]
    spec = SUPPORTED.get(model_type)
    if spec is None or module != f"{_TF}{model_type}.modeling_{model_type}":
        return None
    if cls.__name__ == spec[0]:
        return model_type, "linear"
    if cls.__name__ == spec[1]:
        return model_type, "attention"
    return None


# ------------------------------------------------------------------------------------------------
# The rewired forwards: each mirrors the module's own forward (transformers 5.25), the cache branches
# refused, the convolution and the recurrence across ranks
# ------------------------------------------------------------------------------------------------

def _layer_call(mod, hidden_states, cache, attention_mask, kwargs) -> Optional[torch.Tensor]:
    """What the model-level check refuses, once more at the layer (a layer called on its own); returns the
    packed sequences' bounds ``cu_seq_lens_q`` (global offsets in the whole row, B = 1) or None."""
    name = type(mod).__name__
    if cache is not None or kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: a recurrent cache is not supported "
                                  "(training and prefill only; call the model with use_cache=False)")
    if attention_mask is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: a padding mask is not supported (every "
                                  "sequence is whole: pack or trim the batch)")
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError(f"{name} under sequence parallelism: seq_idx / cu_seqlens are not supported (packed "
                                  "sequences come as cu_seq_lens_q, global offsets in the whole row)")
    return _packed_bounds(name, hidden_states.shape[0], kwargs)


def _packed_bounds(name, batch, kwargs) -> Optional[torch.Tensor]:
    """``cu_seq_lens_q`` (= ``cu_seq_lens_k``) of a packed row: what the model-level check passes down, the
    sequences' bounds in the whole row (global offsets); None for unpacked rows."""
    cu, ck = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu is None and ck is None:
        return None
    if cu is None or ck is None or (cu is not ck and not torch.equal(torch.as_tensor(cu).cpu(),
                                                                      torch.as_tensor(ck).cpu())):
        raise NotImplementedError(f"{name}: cu_seq_lens_q and cu_seq_lens_k must be given together and equal "
                                  "(self-attention over packed sequences)")
    if batch != 1:
        raise NotImplementedError(f"{name}: packed sequences need one row (B = 1), got B = {batch}")
    return torch.as_tensor(cu)


def _causal_conv(mod, mixed_qkv: torch.Tensor, group, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, causal, then ``mod.activation``) over the global sequence:
    ``mixed_qkv [B, T_local, C]`` with the previous rank's last ``kernel - 1`` tokens before it (zeros on rank
    0: the module's own left padding). With ``cu_seqlens`` (packed sequences, global bounds, B = 1) no window
    reads before its token's sequence start: each sequence is convolved as if alone (zero-padded). Returns
    ``[B, T_local, C]`` in ``mixed_qkv``'s dtype."""
    conv = mod.conv1d
    width = conv.kernel_size[0]
    x = mixed_qkv
    if width > 1:
        x = torch.cat([halo_exchange(mixed_qkv, width - 1, group), mixed_qkv], dim=1)
    weight = conv.weight  # [C, 1, width], as transformers' weight.squeeze(1).unsqueeze(1)
    if cu_seqlens is None:
        out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, conv.bias, padding=0, groups=conv.groups)
    else:
        # window slot i of local token t reads global token p - (width - 1) + i (p = rank * T + t): counted only
        # from the start of p's sequence on
        T = mixed_qkv.shape[1]
        pg = sequence_parallel_group(group, type(mod).__name__)
        rank = 0 if pg is None else dist.get_rank(pg)
        pos = rank * T + torch.arange(T, device=x.device)
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        start = cu[torch.searchsorted(cu, pos, right=True) - 1]
        xw = x.to(weight.dtype)
        out = None
        for i in range(width):
            seen = (pos - (width - 1) + i >= start).to(weight.dtype)[None, :, None]
            term = xw[:, i:i + T, :] * weight[:, 0, i] * seen
            out = term if out is None else out + term
        if conv.bias is not None:
            out = out + conv.bias
        out = out.transpose(1, 2)  # [B, C, T], as F.conv1d's
    if mod.activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[mod.activation](out)
    return out.to(mixed_qkv.dtype).transpose(1, 2)


def _gated_delta_rule(q, k, v, g, beta, group, cu_seqlens=None):
    """What the module asks of ``chunk_gated_delta_rule`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_gated_delta_rule

    o, _ = zeco_gated_delta_rule(q, k, v, g, beta, group, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o


def _kda(q, k, v, g, beta, group, cu_seqlens=None):
    """What the module asks of ``chunk_kda`` (no state in, none out), on the whole sequence."""
    from allscan.ops.delta import zeco_kda

    o, _ = zeco_kda(q, k, v, g, beta, group, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return o


def _qwen3_next_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    cu = _layer_call(mod, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    projected_states_qkvz = mod.in_proj_qkvz(hidden_states)
    projected_states_ba = mod.in_proj_ba(hidden_states)
    query, key, value, z, b, a = mod.fix_query_key_value_ordering(projected_states_qkvz, projected_states_ba)
    query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
    mixed_qkv = _causal_conv(mod, torch.cat((query, key, value), dim=-1), group, cu)
    query, key, value = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    query = query.reshape(query.shape[0], query.shape[1], -1, mod.head_k_dim)
    key = key.reshape(key.shape[0], key.shape[1], -1, mod.head_k_dim)
    value = value.reshape(value.shape[0], value.shape[1], -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    core_attn_out = _gated_delta_rule(query, key, value, g, beta, group, cu)
    z_shape_og = z.shape
    core_attn_out = core_attn_out.reshape(-1, core_attn_out.shape[-1])
    z = z.reshape(-1, z.shape[-1])
    core_attn_out = mod.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(z_shape_og)
    core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
    return mod.out_proj(core_attn_out)


def _qwen3_5_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    cu = _layer_call(mod, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = mod.in_proj_qkv(hidden_states)
    z = mod.in_proj_z(hidden_states)
    z = z.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    b = mod.in_proj_b(hidden_states)
    a = mod.in_proj_a(hidden_states)
    mixed_qkv = _causal_conv(mod, mixed_qkv, group, cu)
    query, key, value = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    core_attn_out = _gated_delta_rule(query, key, value, g, beta, group, cu)
    core_attn_out = core_attn_out.reshape(-1, mod.head_v_dim)
    z = z.reshape(-1, mod.head_v_dim)
    core_attn_out = mod.norm(core_attn_out, z)
    core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)
    return mod.out_proj(core_attn_out)


def _olmo_hybrid_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    cu = _layer_call(mod, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len, _ = hidden_states.shape
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = _causal_conv(mod, mixed_qkv, group, cu)
    q, k, v = torch.split(mixed_qkv, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    k = k.reshape(batch_size, seq_len, -1, mod.head_k_dim)
    v = v.reshape(batch_size, seq_len, -1, mod.head_v_dim)
    beta = mod.b_proj(hidden_states).sigmoid()
    if mod.allow_neg_eigval:
        beta = beta * 2.0
    g = -mod.A_log.float().exp() * F.softplus(mod.a_proj(hidden_states).float() + mod.dt_bias)
    output = _gated_delta_rule(q, k, v, g, beta, group, cu)
    gate = mod.g_proj(hidden_states)
    output = output.reshape(-1, mod.head_v_dim)
    gate = gate.reshape(-1, mod.head_v_dim)
    output = mod.o_norm(output, gate)
    output = output.reshape(batch_size, seq_len, -1)
    return mod.o_proj(output)


def _kimi_linear_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    cu = _layer_call(mod, hidden_states, cache, attention_mask, kwargs)
    batch_size, seq_len = hidden_states.shape[:2]
    hidden_shape = (batch_size, seq_len, -1, mod.head_dim)
    mixed_qkv = torch.cat([mod.q_proj(hidden_states), mod.k_proj(hidden_states), mod.v_proj(hidden_states)], dim=-1)
    mixed_qkv = _causal_conv(mod, mixed_qkv, group, cu)
    query, key, value = torch.split(mixed_qkv, [mod.qkv_dim] * 3, dim=-1)
    query = query.reshape(hidden_shape)
    key = key.reshape(hidden_shape)
    value = value.reshape(hidden_shape)
    g = mod.forget_gate(hidden_states)
    beta = torch.sigmoid(mod.b_proj(hidden_states))
    core_attn_out = _kda(query, key, value, g, beta, group, cu)
    gate = mod.g_b_proj(mod.g_a_proj(hidden_states)).view(hidden_shape)
    output = mod.o_norm(core_attn_out, gate).reshape(batch_size, seq_len, -1)
    return mod.o_proj(output)


_FORWARDS = {"qwen3_next": _qwen3_next_forward, "qwen3_5": _qwen3_5_forward, "qwen3_5_moe": _qwen3_5_forward,
             "olmo_hybrid": _olmo_hybrid_forward, "kimi_linear": _kimi_linear_forward}


class SequenceParallelForward:
    """The ``forward`` of a rewired linear-attention module (held in the module's ``__dict__``): the module's own
    arithmetic on this rank's shard of the sequence, over ``group``."""

    def __init__(self, module: nn.Module, model_type: str, group):
        self.module, self.model_type, self.group = module, model_type, group

    def __call__(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        return _FORWARDS[self.model_type](self.module, self.group, hidden_states, cache, attention_mask, kwargs)

    def __deepcopy__(self, memo):  # the module is copied, the process group is not
        import copy

        return SequenceParallelForward(copy.deepcopy(self.module, memo), self.model_type, self.group)

    def __repr__(self):
        return f"SequenceParallelForward({type(self.module).__name__}, {self.model_type!r})"


def is_sequence_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a linear-attention module :func:`sequence_parallel` rewired (or, for a model, whether
    it holds one)."""
    return any(isinstance(m.__dict__.get("forward"), SequenceParallelForward) for m in module.modules())


# ------------------------------------------------------------------------------------------------
# Softmax attention: Ulysses, registered in transformers' attention registry
# ------------------------------------------------------------------------------------------------

_ATTENTION_NAMES: List[Tuple[object, str]] = []  # (group, name), one name per group


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _local_attention(q, k, v, scale, bounds=None):
    """Causal SDPA of one process, ``[B, S, H, D]`` in and out, grouped k/v heads; each packed sequence alone."""
    if bounds is not None:
        return torch.cat([_local_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale)
                          for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=scale)
    return o.transpose(1, 2)


def _make_attention(group, name):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError(f"{name}: an attention mask ({_short(attention_mask)}: padding or a custom "
                                      "mask) is not supported; every sequence is whole")
        if dropout:
            raise NotImplementedError(f"{name}: attention dropout is not supported (got {dropout})")
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError(f"{name}: a KV cache (query length {query.shape[2]}, key length {key.shape[2]}) "
                                      "is not supported; call the model with use_cache=False")
        cu = _packed_bounds(name, query.shape[0], kwargs)
        for arg, val in kwargs.items():
            if val is None or arg in _HARMLESS or arg in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                          "max_length_k"):
                continue
            if arg == "output_attentions":
                if val:
                    raise NotImplementedError(f"{name}: output_attentions=True is not supported (Ulysses returns no "
                                              "attention weights)")
            elif arg == "is_causal":
                if not val:
                    raise NotImplementedError(f"{name}: bidirectional attention (is_causal=False) is not supported")
            elif arg in _PACKING_KWARGS:
                raise NotImplementedError(f"{name}: {arg} is not supported (packed sequences come as "
                                          "cu_seq_lens_q / cu_seq_lens_k, global offsets in the whole row)")
            else:
                raise NotImplementedError(f"{name}: the attention function got an argument it does not know, "
                                          f"{arg}={_short(val)}; it might change the result, so it is refused")
        if not getattr(module, "is_causal", True):
            raise NotImplementedError(f"{name}: {type(module).__name__} is not causal; only causal attention is "
                                      "supported")
        # transformers passes [B, heads, S_local, D]; Ulysses takes [B, S_local, heads, D], one head dim for q, k
        # and v: MLA's value heads (narrower than its query/key heads) are padded with zeros and cut back
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        d_qk, d_v = q.shape[-1], v.shape[-1]
        scale = float(scaling) if scaling is not None else d_qk ** -0.5
        if d_v < d_qk:
            v = F.pad(v, (0, d_qk - d_v))
        elif d_v > d_qk:
            q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
        bounds = None if cu is None else [int(b) for b in cu.tolist()]
        pg = sequence_parallel_group(group, name)
        if pg is None:
            out = _local_attention(q, k, v, scale, bounds)
        else:
            from allscan.ops.ulysses import ulysses_attention

            out = ulysses_attention(q, k, v, pg, causal=True, scale=scale, cu_seqlens=bounds)
        return out[..., :d_v], None

    return attention


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return {} if code is None else {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _causal_or_packed(fn, mu) -> bool:
    """Whether transformers composed ``fn`` from the causal mask and its packed-sequence overlays alone."""
    if fn is mu.causal_mask_function:
        return True
    if getattr(fn, "__module__", None) != mu.__name__:
        return False
    qual = getattr(fn, "__qualname__", "")
    if qual == "and_masks.<locals>.and_mask":
        return all(_causal_or_packed(f, mu) for f in _closure(fn).get("mask_functions", ()))
    if qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return _causal_or_packed(_closure(fn).get("mask_function"), mu)
    return qual == "packed_sequence_mask_function.<locals>.inner_mask"


def _make_mask_function(name):
    def mask_function(*args, mask_function=None, **kwargs):
        """No mask: the attention is causal over the whole sequence, each packed sequence alone (their global
        bounds come to the attention as cu_seq_lens_q from the model-level check, which found them in the whole
        row on every rank; the packing transformers sees in this shard's positions is part of it). Anything
        else on top of the causal mask (a sliding window, chunks, tokens that see ahead) is refused: from the
        config, the same on every rank."""
        mu = sys.modules.get("transformers.masking_utils")
        if mask_function is not None and (mu is None or not _causal_or_packed(mask_function, mu)):
            what = getattr(mask_function, "__qualname__", repr(mask_function))
            raise NotImplementedError(f"{name}: the model asks for a mask other than the plain causal one ({what}: a "
                                      "sliding window, chunked attention or a custom mask); not supported")
        return None

    return mask_function


def attention_implementation(group=None) -> str:
    """The name of the attention implementation (registered in transformers' attention and mask registries on
    first use) that runs the hybrids' softmax attention on Ulysses over ``group``: causal over the whole
    sequence, each packed sequence alone (``cu_seq_lens_q``, global offsets); masks, windows, dropout, a KV
    cache, attention weights and any argument it does not know raise naming them. One name per group."""
    tf = _transformers()
    for g, name in _ATTENTION_NAMES:
        if g is group:
            return name
    name = "allscan_hybrid_ulysses" + (f"_{len(_ATTENTION_NAMES)}" if _ATTENTION_NAMES else "")
    tf.AttentionInterface.register(name, _make_attention(group, name))
    tf.AttentionMaskInterface.register(name, _make_mask_function(name))
    _ATTENTION_NAMES.append((group, name))
    return name


# ------------------------------------------------------------------------------------------------
# The model's call: what is refused, agreed on by every rank; global position ids
# ------------------------------------------------------------------------------------------------

_CACHE, _USE_CACHE, _OUTPUT_ATTENTIONS, _LABELS, _PADDING, _FLASH_KWARGS, _POSITIONS_SHAPE, _POSITIONS_GIVEN = (
    1 << i for i in range(8))
_REASONS = {
    _CACHE: "a KV or recurrent cache (past_key_values / cache) is not supported: training and prefill only",
    _USE_CACHE: "use_cache=True is not supported (no cache under sequence parallelism); pass use_cache=False",
    _OUTPUT_ATTENTIONS: "output_attentions=True is not supported (Ulysses returns no attention weights)",
    _LABELS: ("labels are not supported: transformers would shift them within each shard and average over the "
              "shard; pass no labels and use causal_lm_loss(logits, shard_batch(input_ids, labels, ...))"),
    _PADDING: ("an attention_mask with padding (or a custom mask) is not supported: every sequence is whole "
               "(pack or trim the batch)"),
    _FLASH_KWARGS: ("cu_seq_lens_* / max_length_* / seq_idx are not taken from the caller: pack sequences into one "
                    "row marked by position ids that restart (shard_batch(..., position_ids=)); the bounds are found "
                    "in the whole row"),
    _POSITIONS_SHAPE: "position ids other than [B, T_local] (e.g. multimodal rotary positions) are not supported",
}

_STATE = threading.local()  # the module whose call is being checked (nested transformers models skip)


def _comm_device(pg, like: torch.Tensor) -> torch.device:
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend and ("gloo" not in backend or like.is_cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(pg, row: torch.Tensor) -> List[List[int]]:
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(rows, row, group=pg)
    return [r.tolist() for r in rows]


class _CallCheck:
    """Forward pre-hook (and its closing forward hook) of a transformers model made sequence-parallel."""

    def __init__(self, group, rewired):
        self.group, self.rewired = group, rewired

    def pre(self, module, args, kwargs):
        if getattr(_STATE, "owner", None) is not None:
            return None
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        except TypeError:
            return None  # the forward raises on its own
        if torch.compiler.is_compiling():
            # no collective while tracing (the eager call before compiling checked the rest): the model's
            # default position ids would be each shard's own, so they must be given
            if bound.arguments.get("position_ids") is None and "position_ids" not in kwargs:
                raise NotImplementedError("sequence_parallel: under torch.compile pass position_ids (the global "
                                          "ones: shard_batch(...).position_ids)")
            return None
        _STATE.owner = module
        try:
            kwargs = self._check(module, bound, dict(kwargs))
        except BaseException:
            _STATE.owner = None
            raise
        return args, kwargs

    def post(self, module, args, output):
        if getattr(_STATE, "owner", None) is module:
            _STATE.owner = None
        return None

    def _check(self, module, bound, kwargs):
        name = "sequence_parallel"
        for m in self.rewired:
            if not isinstance(m.__dict__.get("forward"), SequenceParallelForward):
                raise RuntimeError(f"{name}: {type(m).__name__}'s forward was replaced after sequence_parallel() "
                                   "(kernelize? another wrapper?); call sequence_parallel() last")
        a = dict(bound.arguments)
        for p in bound.signature.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                a.update(a.pop(p.name, {}) or {})
        x = a.get("input_ids")
        if x is None:
            x = a.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return kwargs  # the forward raises on its own
        B, T = int(x.shape[0]), int(x.shape[1])
        flags = 0
        if any(a.get(k) is not None for k in ("past_key_values", "cache", "cache_params")):
            flags |= _CACHE
        if a.get("use_cache"):
            flags |= _USE_CACHE
        if a.get("output_attentions"):
            flags |= _OUTPUT_ATTENTIONS
        if a.get("labels") is not None:
            flags |= _LABELS
        mask = a.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
            flags |= _PADDING
        if any(a.get(k) is not None for k in _PACKING_KWARGS):
            flags |= _FLASH_KWARGS
        positions = a.get("position_ids")
        if positions is not None:
            flags |= _POSITIONS_GIVEN
            if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != T \
                    or positions.shape[0] not in (1, B):
                flags |= _POSITIONS_SHAPE
        pg = sequence_parallel_group(self.group, name)
        world, rank = (1, 0) if pg is None else (dist.get_world_size(pg), dist.get_rank(pg))
        rows = [[B, T, flags]]
        device = None
        if world > 1:
            device = _comm_device(pg, x)
            rows = _gather(pg, torch.tensor([B, T, flags], dtype=torch.int64, device=device))
        if any(r[:2] != rows[0][:2] for r in rows):
            raise ValueError(f"{name}: the ranks passed different batch sizes / local lengths [B, T_local]: "
                             f"{[r[:2] for r in rows]} (every rank holds an equal contiguous shard)")
        refused = [(bit, [i for i, r in enumerate(rows) if r[2] & bit]) for bit in _REASONS]
        refused = [(bit, ranks) for bit, ranks in refused if ranks]
        if refused:
            raise NotImplementedError(f"{name}: " + "; ".join(
                _REASONS[bit] + ("" if world == 1 else f" (rank{'s' if len(ranks) > 1 else ''} "
                                                       f"{', '.join(map(str, ranks))} of the group)")
                for bit, ranks in refused))
        given = [bool(r[2] & _POSITIONS_GIVEN) for r in rows]
        if any(given) and not all(given):
            raise ValueError(f"{name}: some ranks passed position_ids and others none")
        if positions is None:
            # the global positions one process would use (the model's own default is 0 .. T_local-1 on every rank)
            kwargs["position_ids"] = (torch.arange(T, device=x.device) + rank * T).unsqueeze(0).expand(B, T)
            return kwargs
        # Packed rows: sequences marked by position ids that restart, found in the whole row as transformers
        # finds them on one process (the same verdict on every rank), handed down as cu_seq_lens_q / _k (global
        # offsets), which transformers passes to every layer (also when gradient checkpointing recomputes one)
        whole = positions.expand(B, T).to(torch.int64)
        if world > 1:
            parts = [torch.empty((B, T), dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(parts, whole.to(device).contiguous(), group=pg)
            whole = torch.cat(parts, dim=1)
        whole = whole.cpu()
        bounds = [_packed_bounds_of(whole[b]) for b in range(B)]
        if any(b is not None for b in bounds):
            if B != 1:
                raise NotImplementedError(f"{name}: packed rows (position ids that restart) in a batch of {B} rows "
                                          "are not supported; pack the sequences into one row per batch (B = 1)")
            cu = torch.tensor(bounds[0], dtype=torch.int32, device=x.device)
            kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"] = cu, cu
        return kwargs


def _packed_bounds_of(positions: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The bounds ``(0, ..., T)`` of the sequences packed in one row of position ids ``[T]``, as transformers
    finds them (``masking_utils.find_packed_sequence_indices``: a sequence starts wherever a position is not the
    one before plus one); None when the row is one sequence."""
    starts = (torch.nonzero(positions[1:] - positions[:-1] != 1).flatten() + 1).tolist()
    return None if not starts else (0, *starts, positions.shape[0])


def _refuse_generate(*args, **kwargs):
    raise NotImplementedError("sequence_parallel: generation is not supported on a sequence-parallel model "
                              "(training and prefill only)")


# ------------------------------------------------------------------------------------------------
# sequence_parallel()
# ------------------------------------------------------------------------------------------------

_HOOKS = weakref.WeakKeyDictionary()  # transformers model -> its hook handles (replaced by a later sequence_parallel)


def _source_digest(cls) -> Optional[str]:
    try:
        return hashlib.sha1(inspect.getsource(cls.forward).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def _inspect(model: nn.Module):
    """(linear mixers, softmax attention modules, refused) as lists of (name, module[, model_type])."""
    tf = _transformers()
    linear, attention, refused, seen = [], [], [], []
    named = dict(model.named_modules())
    for name, mod in named.items():
        if any(name == s or name.startswith(s + ".") for s in seen if s) or "" in seen:
            continue  # inside a module already taken or refused
        cls = type(mod)
        family = _family_of(cls)
        if family is not None:
            (linear if family[1] == "linear" else attention).append((name, mod, family[0]))
            seen.append(name)
        elif isinstance(mod, tf.PreTrainedModel):
            continue
        elif _MIXER_NAME.search(cls.__name__):
            refused.append(f"{name or '<model>'} ({cls.__name__})")
            seen.append(name)
        elif isinstance(mod, nn.modules.conv._ConvNd) and any(k > 1 for k in mod.kernel_size):
            owner = name.rpartition(".")[0]
            refused.append(f"{owner or '<model>'} ({type(named.get(owner, model)).__name__}: a {cls.__name__} of "
                           f"kernel {tuple(mod.kernel_size)})")
            seen.append(owner)
    return linear, attention, refused


def sequence_parallel(model: nn.Module, group=None) -> nn.Module:
    """Make ``model`` (a transformers 5.x Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid or Kimi Linear model, or
    a module holding one) sequence-parallel over ``group``, in place: each rank runs it on its contiguous shard of
    every sequence (``shard_batch``) and gets what one process gets on the whole sequence, restricted to its
    shard. ``group``: the sequence-parallel process group (rank order = sequence order); None: the default group,
    resolved at each call (one process when torch.distributed is not initialised); ``allscan.ops.LOCAL``: this
    process alone. Returns ``model``.

    Raises ``NotImplementedError`` naming every sequence-mixing module it does not support (module docstring),
    before anything is changed."""
    tf = _transformers()
    linear, attention, refused = _inspect(model)
    if refused:
        supported = ", ".join(f"{t} ({spec[0]}, {spec[1]})" for t, spec in SUPPORTED.items())
        raise NotImplementedError("sequence_parallel: these sequence-mixing modules have no sequence-parallel form "
                                  "here (run on a shard they would compute something else): " + ", ".join(refused)
                                  + f". Supported: {supported}")
    pretrained = [m for n, m in model.named_modules() if isinstance(m, tf.PreTrainedModel)]
    outermost = [m for m in pretrained if not any(o is not m and any(s is m for s in o.modules()) for o in pretrained)]
    if attention and not outermost:
        raise NotImplementedError("sequence_parallel: softmax attention modules outside a transformers model (their "
                                  "attention implementation is set through the model's config): "
                                  + ", ".join(n for n, _, _ in attention))
    for name, mod, _ in linear:
        expected = _CHECKED_SOURCES.get(type(mod).__name__)
        digest = _source_digest(type(mod))
        if expected is not None and digest != expected:
            warnings.warn(f"sequence_parallel: {type(mod).__name__}.forward differs from the one this integration "
                          f"mirrors (transformers 5.25.0; this is {tf.__version__}): check that its arithmetic is "
                          "unchanged", stacklevel=2)
    # Everything is checked: change the model.
    if outermost:
        name = attention_implementation(group)
        for m in outermost:
            m.set_attn_implementation(name)
    for _, mod, model_type in linear:
        mod.forward = SequenceParallelForward(mod, model_type, group)
    rewired = [mod for _, mod, _ in linear]
    for m in pretrained:
        for handle in _HOOKS.pop(m, ()):
            handle.remove()
        check = _CallCheck(group, rewired)
        _HOOKS[m] = (m.register_forward_pre_hook(check.pre, with_kwargs=True),
                         m.register_forward_hook(check.post, always_call=True))
        if hasattr(m, "generate"):
            m.generate = _refuse_generate
        config = getattr(m, "config", None)
        if config is not None:
            for cfg in {id(c): c for c in (config, _text_config(config))}.values():
                if hasattr(cfg, "use_cache"):
                    cfg.use_cache = False
    return model


def _text_config(config):
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001
        return config
