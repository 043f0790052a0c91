"""Sequence parallelism for flash-linear-attention (0.6.x) models: swap fla's layers for allscan's.

    from allscan.integrations import fla as sp
    model = GLAForCausalLM(config).cuda()           # or GatedDeltaNetForCausalLM, KDAForCausalLM, hybrids of them
    sp.sequence_parallel(model, group)               # in place, before building the optimizer
    shard = sp.shard_batch(input_ids, labels, group=group)    # this rank's contiguous slice
    logits = model(input_ids=shard.input_ids).logits            # no labels: fla would shift them per shard
    loss = sp.causal_lm_loss(logits, shard)          # this rank's share of the whole batch's mean loss
    loss.backward(); sp.sync_gradients(model, group)

``sequence_parallel`` replaces every ``fla.layers.GatedLinearAttention`` by
:class:`allscan.layers.GatedLinearAttention`, every ``fla.layers.GatedDeltaNet`` by
:class:`allscan.layers.GatedDeltaNet`, every ``fla.layers.KimiDeltaAttention`` by
:class:`allscan.layers.KimiDeltaAttention` and every softmax ``fla.layers.Attention`` (the attention
layers of fla's hybrid models, ``config.attn``) by :class:`allscan.layers.Attention` (Ulysses; full
causal attention only: a sliding ``window_size`` is refused) and every ``fla.layers.Mamba2`` by
:class:`allscan.layers.Mamba2` (the same parameters; a skip per channel ``D_has_hdim``, ``rmsnorm=False``
and ``norm_before_gate=True`` are refused; with ``n_groups > 1`` head h reads group ``h // (num_heads /
n_groups)``, as fla's mamba_ssm path and transformers do, not as fla's torch fallback, which tiles them), built with the same options and holding the very same
``Parameter`` objects (so an optimizer or parameter hooks made before keep working, though the
optimizer is best built after; forward hooks registered on the old layer modules do not carry over).
Swap after the weights are initialised or loaded: fla's ``_init_weights`` draws ``A_log`` and ``dt_bias``
only inside its own layer classes, so a later ``model.init_weights()`` leaves allscan's layers' gate
parameters as they are (their projections and norms are re-initialised as fla's are). Everything else in
these models is per token. A model that holds any other fla sequence-mixing layer (DeltaNet, ...) raises
``NotImplementedError`` naming it, before anything is swapped: run on a shard, it would silently compute
something else. Caching is turned off (``config.use_cache``):
sequence parallelism is for training and prefill. A call of the model with ``labels`` (fla would shift them
within each shard) or ``logits_to_keep`` (each shard's last tokens) raises NotImplementedError on every rank.
"""
from __future__ import annotations

import inspect
from typing import Dict

import torch
import torch.nn as nn

from .batch import IGNORE_INDEX, BatchShard, causal_lm_loss, reduce_loss, shard_batch, sync_gradients  # noqa: F401
from .common import LABELS, LOGITS_TO_KEEP, caller_head_arguments, exchange, keeps_some_logits, of_ranks, sp_group

__all__ = ["sequence_parallel", "shard_batch", "causal_lm_loss", "reduce_loss", "sync_gradients", "BatchShard",
           "IGNORE_INDEX"]


def _fla_layers():
    try:
        import fla.layers
    except ImportError as e:
        raise ImportError("allscan.integrations.fla needs flash-linear-attention 0.6.x (its models and layers): "
                          "pip install 'allscan[fla]'") from e
    return fla.layers


def _gate_name(old) -> str:
    """The name fla's GLA layer was given for its output gate's activation (it keeps only the function)."""
    if hasattr(old, "g_norm_swish_gate") or not hasattr(old, "gate_fn"):
        return "swish"
    from fla.modules.activations import ACT2FN

    return next((name for name, fn in ACT2FN.items() if fn is old.gate_fn), repr(old.gate_fn))


def _gla_options(old) -> Dict:
    fused = hasattr(old, "g_norm_swish_gate")
    norm = old.g_norm_swish_gate if fused else old.g_norm
    if getattr(old, "feature_map_fn", None) is not None:
        raise NotImplementedError(f"sequence_parallel: {type(old).__name__} with a feature_map is not supported")
    return dict(mode=old.mode, hidden_size=old.hidden_size, expand_k=old.expand_k, expand_v=old.expand_v,
                num_heads=old.num_heads, num_kv_heads=old.num_kv_heads, use_short_conv=old.use_short_conv,
                conv_size=old.conv_size, conv_bias=old.conv_bias, use_output_gate=old.use_output_gate,
                gate_fn=_gate_name(old), fuse_norm=fused, elementwise_affine=getattr(norm, "weight", None) is not None,
                norm_eps=norm.eps, gate_logit_normalizer=old.gate_logit_normalizer,
                gate_low_rank_dim=old.gk_proj[0].out_features, clamp_min=old.clamp_min, layer_idx=old.layer_idx)


def _gdn_options(old) -> Dict:
    return dict(hidden_size=old.hidden_size, expand_v=old.expand_v, head_dim=old.head_dim, num_heads=old.num_heads,
                num_v_heads=old.num_v_heads, mode=old.mode, use_gate=old.use_gate,
                use_short_conv=old.use_short_conv, allow_neg_eigval=old.allow_neg_eigval, conv_size=old.conv_size,
                conv_bias=old.conv_bias, layer_idx=old.layer_idx, norm_eps=old.o_norm.eps,
                output_gate_activation=getattr(old.o_norm, "activation", "swish"))


def _kda_options(old) -> Dict:
    return dict(hidden_size=old.hidden_size, expand_v=old.expand_v, head_dim=old.head_dim, num_heads=old.num_heads,
                num_v_heads=old.num_v_heads, mode=old.mode, use_short_conv=old.use_short_conv,
                allow_neg_eigval=old.allow_neg_eigval, safe_gate=old.safe_gate, lower_bound=old.lower_bound,
                conv_size=old.conv_size, conv_bias=old.conv_bias, layer_idx=old.layer_idx, norm_eps=old.o_norm.eps)


def _mamba2_options(old) -> Dict:
    name = type(old).__name__
    for option, value, runs in (("D_has_hdim", old.D_has_hdim, False), ("rmsnorm", old.rmsnorm, True),
                                ("norm_before_gate", old.norm_before_gate, False)):
        if bool(value) != runs:
            raise NotImplementedError(f"sequence_parallel: {name} with {option}={value} is not supported "
                                      f"(allscan's Mamba2 is transformers' mixer: {option}={runs})")
    return dict(hidden_size=old.hidden_size, num_heads=old.num_heads, head_dim=old.head_dim,
                state_size=old.ssm_state_size, expand=old.expand, n_groups=old.n_groups,
                conv_kernel=old.conv_kernel_size, use_conv_bias=old.use_conv_bias, use_bias=old.use_bias,
                hidden_act=old.activation, layer_norm_epsilon=old.norm.eps, time_step_limit=tuple(old.dt_limit),
                layer_idx=old.layer_idx)


def _attention_options(old) -> Dict:
    rotary = old.rotary
    if rotary.scale_base is not None or rotary.interleaved or not rotary.pos_idx_in_fp32:
        raise NotImplementedError(f"sequence_parallel: {type(old).__name__} with rotary embeddings other than fla's "
                                  f"default ({rotary!r}) is not supported")
    return dict(hidden_size=old.hidden_size, num_heads=old.num_heads, num_kv_heads=old.num_kv_heads,
                qkv_bias=old.qkv_bias, qk_norm=old.qk_norm, window_size=old.window_size, rope_theta=old.rope_theta,
                max_position_embeddings=old.max_position_embeddings, layer_idx=old.layer_idx)


def _adopt_parameters(new: nn.Module, old: nn.Module) -> None:
    """Make ``new`` (built on the meta device) hold ``old``'s Parameter objects and buffers, name for name
    (same names and shapes); raise if any of its own is left (it would hold no data)."""
    got = {n: p.shape for n, p in old.named_parameters()}
    want = {n: p.shape for n, p in new.named_parameters()}
    if got != want:
        raise RuntimeError(f"sequence_parallel: {type(old).__name__}'s parameters do not match allscan's layer "
                           f"(fla {sorted(got.items())} vs allscan {sorted(want.items())}); is fla 0.6.x installed?")
    for name, p in old.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, p)
    for name, b in old.named_buffers():
        owner, _, leaf = name.rpartition(".")
        source = old.get_submodule(owner) if owner else old
        (new.get_submodule(owner) if owner else new).register_buffer(
            leaf, b, persistent=leaf not in source._non_persistent_buffers_set)
    left = [n for n, t in (*new.named_parameters(), *new.named_buffers()) if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"sequence_parallel: allscan's {type(new).__name__} has tensors {type(old).__name__} lacks: "
                           f"{left}; is fla 0.6.x installed?")


_REFUSED_ARGUMENTS = (
    ("labels", lambda v: v is not None, LABELS),
    ("logits_to_keep", keeps_some_logits, LOGITS_TO_KEEP))


class _CallCheck:
    """Forward pre-hook (with kwargs) of a model made sequence-parallel: refuses, by name and on every rank alike
    (one exchange of a few integers per call), the arguments that fla's model would apply to each shard as if it
    were the whole sequence."""

    def __init__(self, group, signature: inspect.Signature):
        self.group, self.signature = group, signature

    # Under torch.compile too, beside the trace (a graph break before the forward): raised inside it on one rank,
    # dynamo would run the hook again eagerly on that rank alone, whose exchange then met its peers' next collective
    @torch.compiler.disable
    def __call__(self, module, args, kwargs):
        try:
            given, unbound = self.signature.bind_partial(*args, **kwargs).arguments, 0
        except TypeError:  # the forward raises on its own, after the exchange tells the peers
            given, unbound = {}, 1
        # here, or where this is a base model (no such parameters of its own), in the forward of the head around it
        own = any(name in self.signature.parameters for name, _, _ in _REFUSED_ARGUMENTS)
        head = (False, False) if own else caller_head_arguments()[:2]
        flags = [int(refused(given.get(name)) or in_head)
                 for (name, refused, _), in_head in zip(_REFUSED_ARGUMENTS, head)]
        flags.append(unbound)
        like = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        sp = sp_group(self.group, "sequence_parallel")
        rows = exchange(sp, flags, like)
        if unbound:
            return None
        why = [(text, [r for r, row in enumerate(rows) if row[i]]) for i, (_, _, text) in enumerate(_REFUSED_ARGUMENTS)]
        why = [text + ("" if sp.size == 1 else f" {of_ranks(ranks)}") for text, ranks in why if ranks]
        if why:
            raise NotImplementedError("sequence_parallel: " + "; ".join(why))
        others = [r for r, row in enumerate(rows) if row[-1]]
        if others:
            raise ValueError(f"sequence_parallel: the model was called with arguments its forward does not take "
                             f"{of_ranks(others)}")
        return None


def sequence_parallel(model: nn.Module, group=None, *, method: str = "zeco") -> nn.Module:
    """Swap ``model``'s fla GLA, Gated DeltaNet, KDA, Mamba2 and softmax attention layers (in place) for allscan's,
    sequence-parallel over ``group`` (None: the default process group, resolved at each call); the linear
    layers with ``method`` (as in ``zeco_gla`` / ``zeco_gated_delta_rule`` / ``zeco_kda`` / ``zeco_ssd``). Returns
    ``model``.
    Raises NotImplementedError naming any other fla sequence-mixing layer the model holds, or an option
    allscan's layer cannot run, before anything is swapped."""
    from allscan.layers import Attention, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention, Mamba2

    fla_layers = _fla_layers()
    linear = dict(method=method)
    swaps = {fla_layers.GatedLinearAttention: (GatedLinearAttention, _gla_options, linear),
             fla_layers.GatedDeltaNet: (GatedDeltaNet, _gdn_options, linear),
             fla_layers.KimiDeltaAttention: (KimiDeltaAttention, _kda_options, linear),
             fla_layers.Mamba2: (Mamba2, _mamba2_options, linear),
             fla_layers.Attention: (Attention, _attention_options, {})}
    todo, unsupported, seen = [], [], []
    for name, module in model.named_modules():
        kind = type(module)
        if any(name.startswith(s + ".") for s in seen if s) or "" in seen:
            continue  # inside a layer already swapped or refused
        if kind in swaps:
            todo.append((name, module))
            seen.append(name)
        elif kind.__module__.startswith("fla.layers."):
            unsupported.append(f"{name or '<model>'} ({kind.__name__})")
            seen.append(name)
    if unsupported:
        raise NotImplementedError("sequence_parallel: these fla sequence-mixing layers have no sequence-parallel "
                                  "allscan layer (run on a shard they would compute something else): "
                                  + ", ".join(unsupported))
    built = []
    for name, old in todo:
        # every new layer first, holding the old one's tensors: an option allscan cannot run or parameters
        # that do not match raise before anything is swapped; built on the meta device, so no layer's own
        # parameters are ever allocated or initialised
        cls, options, extra = swaps[type(old)]
        with torch.device("meta"):
            new = cls(**options(old), group=group, **extra)
        _adopt_parameters(new, old)
        built.append((name, old, new))
    for name, old, new in built:
        new.train(old.training)
        if name:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, new)
        else:
            model = new
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    signature = inspect.signature(model.forward)
    # a head's forward takes these; a base model's head may run around it (its arguments are read on the stack)
    from transformers import PreTrainedModel

    if any(name in signature.parameters for name, _, _ in _REFUSED_ARGUMENTS) or isinstance(model, PreTrainedModel):
        model.register_forward_pre_hook(_CallCheck(group, signature), with_kwargs=True)
    return model
