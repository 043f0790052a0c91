"""Which transformers models ``register()`` (softmax attention on Ulysses) cannot run, and why: sequence mixers
other than softmax attention (linear attention, SSMs, convolutions over the sequence), found in the config's
``layer_types`` (or the older ``layers_block_type`` / ``block_types``), the model type, and the model's modules;
heads that pool each row at one position (sequence classification,
:func:`~allscan.integrations.common.pooling_refusal`); and, over more than one rank, models whose forward takes no
position ids (each rank would number its shard from 0).
The refusal's text names the mixers and points the Gated DeltaNet / KDA hybrids to
``allscan.integrations.transformers.sequence_parallel``. Local: the same verdict on every rank.
"""
from __future__ import annotations

import inspect
import re
import sys
from typing import List, Optional, Tuple

import torch

from .common import config_and_text, pooling_refusal, positions_refusal, require_transformers

__all__ = ["SEQUENCE_PARALLEL", "config_refusal", "model_refusal", "registered_implementation", "modeling_module_of"]

SEQUENCE_PARALLEL = "allscan.integrations.transformers.sequence_parallel"  # the refusals name it: it exists

# ``layer_types`` entries (and the older ``layers_block_type`` / ``block_types``) register() can run: softmax
# attention (sliding and chunked windows are checked against the sequence at each call) and per-token blocks.
# Anything else, known or not, is refused.
_LAYER_TYPES_OK = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention",
                             "moe", "mlp", "dense", "sparse"})
# Families whose configs may carry no ``layer_types`` and whose layers are (partly) recurrent.
_RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2",
                                    "bamba", "granitemoehybrid", "nemotron_h", "recurrent_gemma", "rwkv", "xlstm",
                                    "lfm2", "lfm2_moe", "lfm3", "minimax", "qwen3_next", "olmo_hybrid",
                                    "kimi_linear", "bailing_hybrid"})
# Class names of transformers' sequence mixers other than softmax attention (any module that owns a
# Conv1d of kernel > 1 counts too).
_MIXER_NAME = re.compile(r"(GatedDeltaNet|DeltaNet|DeltaAttention|Mixer|MambaLayer|LightningAttention|Rglru|"
                         r"RecurrentBlock|RwkvSelfAttention|LSTMLayer|LSTMBackend|ShortConv\w*)$")

def _mixer_classes_in(module_name: Optional[str]) -> List[str]:
    """The sequence-mixer classes (by name) a transformers modeling module defines (for a message)."""
    mod = sys.modules.get(module_name or "")
    if mod is None:
        return []
    found = []
    for attr, obj in vars(mod).items():
        if (isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module_name
                and _MIXER_NAME.search(attr) and not attr.endswith("PreTrainedModel")):
            found.append(attr)
    return sorted(found)


def modeling_module_of(config) -> str:
    return type(config).__module__.replace(".configuration_", ".modeling_")


def _layer_kinds(config) -> Tuple[Optional[str], List[Tuple[str, List[int]]]]:
    """The attribute that declares the config's per-layer kinds (``layer_types``, else the older
    ``layers_block_type`` / ``block_types``; None: none does) and the kinds in it register() cannot run,
    each with its layer indices (pattern indices for ``block_types``)."""
    for attr in ("layer_types", "layers_block_type", "block_types"):
        try:
            kinds = getattr(config, attr, None)
        except Exception:  # noqa: BLE001 - a property that cannot compute: treat as undeclared
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds:
            bad: dict = {}
            for i, kind in enumerate(kinds):
                if str(kind) not in _LAYER_TYPES_OK:
                    bad.setdefault(str(kind), []).append(i)
            return attr, list(bad.items())
    return None, []


def config_refusal(config, where: str, modeling: Optional[str] = None) -> Optional[str]:
    """Why register() cannot run a model with this config (None: it can), from the config alone."""
    if config is None:
        return None
    problems, classes = [], []
    for cfg in config_and_text(config):
        attr, bad = _layer_kinds(cfg)
        model_type = str(getattr(cfg, "model_type", "") or "")
        if bad:
            problems += [f"{attr} {kind!r} at layers {', '.join(map(str, idx))}" for kind, idx in bad]
        elif attr is None and model_type in _RECURRENT_MODEL_TYPES:
            problems.append(f"model_type {model_type!r} (recurrent or convolution layers; no layer_types to tell "
                            "which)")
        else:
            continue
        classes += _mixer_classes_in(modeling or modeling_module_of(cfg))
    if not problems:
        return None
    what = f" ({', '.join(sorted(set(classes)))})" if classes else ""
    return _refusal_text(where, f"its config declares sequence mixers other than softmax attention{what}: "
                                + "; ".join(problems), sorted(set(classes)))


def _hybrid_families() -> dict:
    """``allscan.integrations.hf_hybrids.SUPPORTED`` (model type -> linear class, attention class, rule)."""
    from .hf_hybrids import SUPPORTED

    return dict(SUPPORTED)


def _refusal_text(where: str, what: str, classes, fla_model: bool = False) -> str:
    text = (f"{where}: {what}. register() makes only softmax attention sequence-parallel: run on its shard alone, "
            "each rank would compute such a layer over its own tokens only (a silently wrong loss and gradients)")
    if fla_model:  # fla registers its models under transformers' Auto classes ("mamba2", ...)
        return (text + ". This is flash-linear-attention's model: make it sequence-parallel with "
                "allscan.integrations.fla.sequence_parallel(model, group) instead of register() (it swaps fla's layers "
                "for allscan's)")
    families = _hybrid_families()
    linear = {v[0] for v in families.values()}
    if classes and set(classes) <= linear:
        return (text + f". Make this model sequence-parallel with {SEQUENCE_PARALLEL}(model, group) instead of "
                "register() (it rewires these layers and runs the attention on Ulysses)")
    known = f" ({SEQUENCE_PARALLEL} covers {', '.join(sorted(families))})" if families else ""
    return (text + f". Sequence parallelism for these layers is not yet supported{known}; train such a model "
            "without register()")


def _unpositioned(model: torch.nn.Module, where: str) -> Optional[str]:
    """A model whose forward takes no ``position_ids`` (BART-family and TrOCR decoders, BLOOM, MPT, CPM-Ant, ...) numbers
    each rank's shard from 0 itself (its position embeddings, biases or ALiBi see the shard as the whole sequence)."""
    try:
        takes = "position_ids" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return None
    if takes:
        return None
    return (f"{where}: {type(model).__name__}.forward takes no position_ids, so each rank's shard would be numbered "
            "from 0 (its positions, position biases or ALiBi would see the shard as the whole sequence); "
            "register() runs only models that take the shard's global position ids")


def _offset_positions(model: torch.nn.Module, where: str) -> Optional[str]:
    """RoBERTa-style embeddings (RoBERTa, XLM-R, CamemBERT, Data2VecText, X-MOD, ...) number a row's tokens from
    ``padding_idx + 1`` themselves, while the shards' position ids (and the packed rows' restarts) count from 0:
    every position would read another row of the position embeddings, with no error."""
    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # no token embeddings to look at (transformers raises for some)
        tokens = None
    if tokens is None:
        return None
    for mod in model.modules():  # the embeddings of the sharded tokens only (not a tower beside them)
        table = getattr(mod, "position_embeddings", None)
        if (getattr(mod, "word_embeddings", None) is tokens
                and isinstance(table, torch.nn.Embedding) and table.padding_idx is not None):
            first = table.padding_idx + 1
            return (f"{where}: {type(mod).__name__} numbers a row's positions from padding_idx + 1 = {first}, but a "
                    "sharded batch's position ids count from 0, so each position would read another row of its "
                    "position embeddings; register() cannot run this model over more than one rank")
    return None


def _mixer_class(mod: torch.nn.Module) -> Optional[str]:
    """The name of the sequence-mixer class ``mod`` is (or derives from), or None."""
    return next((c.__name__ for c in type(mod).__mro__ if _MIXER_NAME.search(c.__name__)), None)


def model_refusal(model: torch.nn.Module, where: str, sharded: bool = True) -> Optional[str]:
    """Why register() cannot run ``model`` (None: it can): its config, every module in it, and (``sharded``: over
    more than one rank) a forward that takes no position ids or numbers positions from another origin."""
    tf = require_transformers("allscan.integrations.transformers")
    mixers = {}
    named = dict(model.named_modules())
    for name, mod in named.items():
        if isinstance(mod, tf.PreTrainedModel):
            continue
        cls = _mixer_class(mod)
        if cls is not None:
            mixers.setdefault(cls, []).append(name)
        elif isinstance(mod, torch.nn.Conv1d) and mod.kernel_size[0] > 1:
            owner_name = name.rpartition(".")[0]
            owner = named.get(owner_name, model)
            if _mixer_class(owner) is None:  # else counted above
                label = f"{type(owner).__name__} (a {mod.kernel_size[0]}-wide Conv1d over the sequence)"
                mixers.setdefault(label, []).append(owner_name or "<model>")
    config = getattr(model, "config", None)
    from_config = config_refusal(config, where, modeling_module_of(config) if config is not None else None)
    if not mixers:
        return from_config or pooling_refusal(model, where) or positions_refusal(config, where) or (
            (_unpositioned(model, where) or _offset_positions(model, where)) if sharded else None)
    listed = "; ".join(f"{cls} at {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                       for cls, names in sorted(mixers.items()))
    return _refusal_text(where, f"{type(model).__name__} has sequence mixers other than softmax attention: {listed}",
                         [c for c in mixers if " (" not in c] if all(" (" not in c for c in mixers) else None,
                         fla_model=type(model).__module__.startswith("fla."))


def registered_implementation(config, names) -> Optional[str]:
    """The registered attention implementation ``config`` (or a sub-config of it) is set to, if any."""
    seen, todo = set(), [config]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen or len(seen) > 64:
            continue
        seen.add(id(cfg))
        impl = getattr(cfg, "_attn_implementation", None)
        if isinstance(impl, str) and impl in names:
            return impl
        for key in getattr(cfg, "sub_configs", None) or ():
            todo.append(getattr(cfg, key, None))
    return None
