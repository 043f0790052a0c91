"""Sequence parallelism for transformers' (5.x) linear-attention and Mamba2 hybrids: Gated DeltaNet and KDA on
the matrix All-Scan, Mamba2's SSD on the diagonal All-Scan, their softmax attention on Ulysses.

    from allscan.integrations import transformers as sp    # or hf_hybrids: the same sequence_parallel
    model = AutoModelForCausalLM.from_config(cfg)    # Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear, Nemotron-H, ...
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
- the Mamba2 mixers' SSD is allscan's sequence-parallel :func:`allscan.ops.ssd.zeco_ssd`, given what
  transformers' torch scan computes with (``dt`` after its bias, softplus and ``time_step_limit``, ``A``, B and
  C per group, ``D``; :mod:`~allscan.integrations.hf_mamba2`), Falcon-H1's multipliers and Zamba2's shared
  attention blocks (per token and softmax attention) as the model has them;
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
before its sequence's start, the delta rule and the SSD start each sequence from a zero state
(``cu_seqlens``: the context's offsets), the attention attends within each sequence. The context travels to every layer as the
keyword ``allscan_context``.

The pieces: :mod:`~allscan.integrations.hf_linear` (the rewired Gated DeltaNet / KDA forwards),
:mod:`~allscan.integrations.hf_mamba2` (the Mamba2 mixers'), :mod:`~allscan.integrations.hf_shard` (what they
share: the conv across ranks, the layer-level refusals),
:mod:`~allscan.integrations.hf_attention` (the softmax attention on Ulysses), :mod:`~allscan.integrations.hf_call`
(the call's refusals and the batch's context); this module inspects the model and wires them.

The whole model is inspected before anything changes: a sequence-mixing module this does not know (Mamba-1
and other SSM mixers, a convolution over the sequence, an attention of another kind, a vision tower) raises
``NotImplementedError`` naming its class and where it is, and the model is left as it was; so does a head that
pools each row at one position (``*ForSequenceClassification``: each rank would pool its own last token). At call time
(a forward pre-hook on the model's transformers models, once per outermost call, agreed on by every rank of
the group so that all of them raise together) a KV or recurrent cache (``past_key_values``, ``use_cache=True``),
``output_attentions``, ``labels`` (transformers would shift them within each shard), ``logits_to_keep`` (each
rank would keep its own shard's last tokens), padding masks, several
packed rows in one batch and flash-attention kwargs from the caller (``max_length_*``, ``seq_idx``: the bounds
come from the position ids) are refused by name; position ids that do not count 0, 1, 2, ... restarting at 0
raise ``ValueError``, and so do ids 0 .. T_local - 1 on every rank (each rank made its own, as the model does
by default) unless ``cu_seq_lens_q=shard.cu_seqlens`` confirms that the row packs one sequence per rank
(``cu_seq_lens_q`` / ``_k``, agreed across the group, must match the bounds the position ids mark; they go no
further); ``generate`` raises. Position ids default to the global ones (``rank * T_local +
arange(T_local)``), as one process would make them. Under ``torch.compile`` the same checks run beside the
trace (a graph break before the forward) and position ids must be given; the batch's context cannot enter the
trace, so packed rows are refused there. Compiling ``model.forward`` instead leaves the hooks outside the trace:
packed rows run. A mixture of experts' load-balancing loss (``output_router_logits``) is made the whole
sequence's by the head's forward hook: ``aux_loss`` is this rank's share (:mod:`allscan.integrations.hf_moe`);
under ``torch.compile(model)`` it is refused (the hook runs after the call), compiling ``model.forward`` runs it.
Caching is turned off (``config.use_cache``): sequence parallelism is for training and prefill.
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
from .common import pooling_refusal, positions_refusal, require_transformers
from .hf_call import CallCheck, refuse_generate
from .hf_linear import FORWARDS as LINEAR_FORWARDS
from .hf_mamba2 import CHECKED_HELPERS, helpers_digest
from .hf_mamba2 import FORWARDS as MAMBA2_FORWARDS
from .hf_shard import SequenceParallelForward

__all__ = ["sequence_parallel", "is_sequence_parallel", "attention_implementation", "SUPPORTED", "shard_batch",
           "causal_lm_loss", "reduce_loss", "sync_gradients", "BatchShard", "IGNORE_INDEX", "SequenceParallelForward"]

_TF = "transformers.models."

# model_type -> (linear mixer class, softmax attention class or None, recurrence), in the modeling modules of
# transformers 5.x
SUPPORTED: Dict[str, Tuple[str, Optional[str], str]] = {
    "qwen3_next": ("Qwen3NextGatedDeltaNet", "Qwen3NextAttention", "gated delta rule"),
    "qwen3_5": ("Qwen3_5GatedDeltaNet", "Qwen3_5Attention", "gated delta rule"),
    "qwen3_5_moe": ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention", "gated delta rule"),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet", "OlmoHybridAttention", "gated delta rule"),
    "kimi_linear": ("KimiLinearDeltaAttention", "KimiLinearAttention", "KDA"),
    "mamba2": ("Mamba2Mixer", None, "Mamba2 SSD"),
    "nemotron_h": ("NemotronHMamba2Mixer", "NemotronHAttention", "Mamba2 SSD"),
    "bamba": ("BambaMixer", "BambaAttention", "Mamba2 SSD"),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer", "GraniteMoeHybridAttention", "Mamba2 SSD"),
    "falcon_h1": ("FalconH1Mixer", "FalconH1Attention", "Mamba2 SSD"),
    "zamba2": ("Zamba2MambaMixer", "Zamba2Attention", "Mamba2 SSD"),
}

# The rewired forward of each family's linear mixer
_FORWARDS = {**LINEAR_FORWARDS, **MAMBA2_FORWARDS}

# The forwards this file mirrors, as transformers 5.25.0 wrote them (sha1 of the source of ``cls.forward``): a
# class whose forward differs warns at sequence_parallel(), since its arithmetic may have changed. The Mamba2
# mixers' conv and scan helpers are checked too (hf_mamba2.helpers_digest).
_CHECKED_SOURCES = {
    "Qwen3NextGatedDeltaNet": "69447aee6baf4d4be649090273a2755ef680ba78",
    "Qwen3_5GatedDeltaNet": "1d11b814a309459e8ffc0e083f7862f17a14913c",
    "Qwen3_5MoeGatedDeltaNet": "1d11b814a309459e8ffc0e083f7862f17a14913c",
    "OlmoHybridGatedDeltaNet": "36ff8556e6e45e229ee558091d2e19113006ac47",
    "KimiLinearDeltaAttention": "46e373182a8b14f144e6b45cd8a0460bce6e4005",
    "Mamba2Mixer": "6812178fed7f0747fb48dd55006b0b0114659d46",
    "NemotronHMamba2Mixer": "6812178fed7f0747fb48dd55006b0b0114659d46",
    "BambaMixer": "6812178fed7f0747fb48dd55006b0b0114659d46",
    "GraniteMoeHybridMambaLayer": "6812178fed7f0747fb48dd55006b0b0114659d46",
    "FalconH1Mixer": "8f00c20b11f3c2f1aa3846518dbf836fedc4b451",
    "Zamba2MambaMixer": "6812178fed7f0747fb48dd55006b0b0114659d46",
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
    if spec[1] is not None and cls.__name__ == spec[1]:
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
    """Make ``model`` (a transformers 5.x model of a family in :data:`SUPPORTED`: Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
    OLMo-Hybrid, Kimi Linear, Mamba2, Nemotron-H, Bamba, Granite 4.0 hybrid, Falcon-H1, Zamba2; or a module
    holding one) sequence-parallel over ``group``, in place: each rank runs it on its contiguous shard of
    every sequence (``shard_batch``) and gets what one process gets on the whole sequence, restricted to its
    shard. ``group``: the sequence-parallel process group (rank order = sequence order); None: the default group,
    resolved at each call (one process when torch.distributed is not initialised); a one-dimensional device
    mesh (``mesh["sp"]``); ``allscan.ops.LOCAL``: this process alone. Returns ``model``.

    Raises ``NotImplementedError`` naming every sequence-mixing module it does not support (module docstring),
    before anything is changed."""
    tf = require_transformers("allscan.integrations.hf_hybrids")
    linear, attention, refused = _inspect(model)
    if refused:
        supported = ", ".join(f"{t} ({', '.join(c for c in spec[:2] if c)})" for t, spec in SUPPORTED.items())
        raise NotImplementedError("sequence_parallel: these sequence-mixing modules have no sequence-parallel form "
                                  "here (run on a shard they would compute something else): " + ", ".join(refused)
                                  + f". Supported: {supported}")
    pretrained = [m for n, m in model.named_modules() if isinstance(m, tf.PreTrainedModel)]
    why = pooling_refusal(model, "sequence_parallel") or next(
        (w for w in (positions_refusal(m.config, "sequence_parallel") for m in pretrained) if w), None)
    if why:
        raise NotImplementedError(why)
    outermost = [m for m in pretrained if not any(o is not m and any(s is m for s in o.modules()) for o in pretrained)]
    if attention and not outermost:
        raise NotImplementedError("sequence_parallel: softmax attention modules outside a transformers model (their "
                                  "attention implementation is set through the model's config): "
                                  + ", ".join(n for n, _, _ in attention))
    for cls, model_type in {type(mod): model_type for _, mod, model_type in linear}.items():
        expected = _CHECKED_SOURCES.get(cls.__name__)
        changed = [f"{cls.__name__}.forward"] if expected is not None and _source_digest(cls) != expected else []
        if model_type in MAMBA2_FORWARDS and helpers_digest(model_type) != CHECKED_HELPERS:
            changed.append(f"the conv / scan functions of {cls.__module__}")
        if changed:
            warnings.warn(f"sequence_parallel: {' and '.join(changed)} differ from what this integration mirrors "
                          f"(transformers 5.25.0; this is {tf.__version__}): check that the arithmetic is "
                          "unchanged", stacklevel=2)
    # Everything is checked: change the model.
    if outermost:
        name = attention_implementation(group)
        for m in outermost:
            m.set_attn_implementation(name)
    for _, mod, model_type in linear:
        mod.forward = SequenceParallelForward(mod, model_type, group, _FORWARDS[model_type])
    rewired = [mod for _, mod, _ in linear]
    # where the softmax attention reads its implementation: changed later, it would attend within each shard
    configs = [getattr(mod, "config", None) for _, mod, _ in attention]
    configs += [c for m in outermost for c in (m.config, _text_config(m.config))] if attention else []
    watched = [(c, c._attn_implementation) for c in {id(c): c for c in configs if c is not None}.values()
               if hasattr(c, "_attn_implementation")]
    for m in pretrained:
        for handle in _HOOKS.pop(m, ()):
            handle.remove()
        check = CallCheck(group, rewired, watched)
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
