"""Sequence parallelism for transformers' (5.x) linear-attention hybrids: Gated DeltaNet and KDA on the matrix
All-Scan, their softmax attention on Ulysses.

    from allscan.integrations import transformers as sp    # or hf_hybrids: the same sequence_parallel
    model = AutoModelForCausalLM.from_config(cfg)    # Qwen3-Next, Qwen3.5 (text), OLMo-Hybrid, Kimi Linear
    sp.sequence_parallel(model, group)               # in place, before building the optimizer (and before FSDP2)
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

``group``: None (the default process group, looked up at each call), a ProcessGroup, a group name, a
one-dimensional ``DeviceMesh`` (``mesh["sp"]``; data parallelism and FSDP2 over the mesh:
:mod:`allscan.integrations.mesh`), or ``allscan.ops.LOCAL`` / ``allscan.context.LOCAL`` (this process alone).

Packed rows: sequences packed in one row (B = 1) and marked by position ids restarting at 0 (transformers'
``DataCollatorWithFlattening``, which also ignores each sequence's first label; ``shard_batch(...,
position_ids=)`` cuts the row, its positions and its labels) are found once per call, in the whole row, by the
batch's :class:`allscan.context.SequenceContext` (:mod:`allscan.integrations.hf_call`), and computed each as if
alone, also where a sequence starts inside a shard or crosses a rank boundary: the convolution reads nothing
before its sequence's start, the delta rule starts each sequence from a zero state (``cu_seqlens``: the
context's offsets), the attention attends within each sequence. The context travels to every layer as the
keyword ``allscan_context``.

The pieces: :mod:`~allscan.integrations.hf_linear` (the rewired Gated DeltaNet / KDA forwards),
:mod:`~allscan.integrations.hf_attention` (the softmax attention on Ulysses), :mod:`~allscan.integrations.hf_call`
(the call's refusals and the batch's context); this module inspects the model and wires them.

The whole model is inspected before anything changes: a sequence-mixing module this does not know (a Mamba
mixer, a convolution over the sequence, an attention of another kind, a vision tower) raises
``NotImplementedError`` naming its class and where it is, and the model is left as it was. At call time
(a forward pre-hook on the model's transformers models, once per outermost call, agreed on by every rank of
the group so that all of them raise together) a KV or recurrent cache (``past_key_values``, ``use_cache=True``),
``output_attentions``, ``labels`` (transformers would shift them within each shard), padding masks, several
packed rows in one batch and flash-attention kwargs from the caller (``cu_seq_lens_*``: the bounds come from the
position ids) are refused by name; position ids that do not count 0, 1, 2, ... restarting at 0 raise
``ValueError``; ``generate`` raises. Position ids default to the global ones (``rank * T_local +
arange(T_local)``), as one process would make them. Caching is turned off
(``config.use_cache``): sequence parallelism is for training and prefill.
"""
from __future__ import annotations

import hashlib
import inspect
import re
import warnings
import weakref
from typing import Dict, Optional, Tuple

import torch.nn as nn

from .batch import IGNORE_INDEX, BatchShard, causal_lm_loss, reduce_loss, shard_batch, sync_gradients  # noqa: F401
from .hf_attention import attention_implementation
from .common import require_transformers
from .hf_call import CallCheck, refuse_generate
from .hf_linear import SequenceParallelForward

__all__ = ["sequence_parallel", "is_sequence_parallel", "attention_implementation", "SUPPORTED", "shard_batch",
           "causal_lm_loss", "reduce_loss", "sync_gradients", "BatchShard", "IGNORE_INDEX", "SequenceParallelForward"]

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


def is_sequence_parallel(module: nn.Module) -> bool:
    """Whether ``module`` is a linear-attention module :func:`sequence_parallel` rewired (or, for a model, whether
    it holds one)."""
    return any(isinstance(m.__dict__.get("forward"), SequenceParallelForward) for m in module.modules())


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
    tf = require_transformers("allscan.integrations.hf_hybrids")
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
    resolved at each call (one process when torch.distributed is not initialised); a one-dimensional device
    mesh (``mesh["sp"]``); ``allscan.ops.LOCAL``: this process alone. Returns ``model``.

    Raises ``NotImplementedError`` naming every sequence-mixing module it does not support (module docstring),
    before anything is changed."""
    tf = require_transformers("allscan.integrations.hf_hybrids")
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
        check = CallCheck(group, rewired)
        _HOOKS[m] = (m.register_forward_pre_hook(check.pre, with_kwargs=True),
                         m.register_forward_hook(check.post, always_call=True))
        if hasattr(m, "generate"):
            m.generate = refuse_generate
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
