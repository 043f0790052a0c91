"""Sequence parallelism for Hugging Face transformers (5.x) models through their attention registry.

    from allscan.integrations import transformers as sp
    name = sp.register(group)                       # once per process; group=None: the default group
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)   # or model.set_attn_implementation(name)
    shard = sp.shard_batch(input_ids, labels, group=group)                   # this rank's contiguous slice
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, shard)          # this rank's share of the whole batch's mean loss
    loss.backward(); sp.sync_gradients(model, group) # parameter gradients summed over the group
    sp.reduce_loss(loss, group)                      # the single-process loss, for logging

Every rank holds the same parameters and a contiguous slice of every sequence (rank order = sequence
order). Attention runs as Ulysses: the chunked all-to-all gives each rank the whole sequence for its
share of the heads, SDPA runs on it, the inverse all-to-all returns the slice
(:func:`allscan.ops.ulysses.ulysses_attention`). Everything else in the model must be per token. So the
model needs global position ids (``shard_batch`` makes them), labels shifted across the rank
boundaries before cutting (``shard_batch``), and a loss normalised by the whole batch's token count
(``causal_lm_loss``); those helpers are :mod:`allscan.integrations.batch`'s.

Packed rows: sequences packed in one row and marked by position ids that restart (the way transformers'
``DataCollatorWithFlattening`` packs them; transformers starts a new sequence wherever a position is not
the one before plus one) are honoured, as transformers' own attention honours them on one process: the
mask function gathers the group's position ids once per forward (two small all-gathers and a host
synchronisation) and hands the global sequence bounds to every attention call, which attends each sequence
alone (``ulysses_attention(..., cu_seqlens=)``); ``shard_batch(..., position_ids=)`` ignores the labels
across each sequence's end and keeps the bounds in ``BatchShard.cu_seqlens``. One packed row at a time
(B = 1). The flash-attention kwargs ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (global offsets) may be passed
too and must agree. Position ids 0 .. S_local - 1 on every rank (what the model makes when it is called
without the shard's position ids) raise ``ValueError``, unless ``cu_seq_lens_q=shard.cu_seqlens`` confirms
that the row really packs one sequence per rank.

Refused, with ``NotImplementedError`` naming the cause, on every rank (never a silently wrong result):

- a model with a sequence mixer other than softmax attention (linear attention, an SSM, a convolution
  over the sequence: Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear, Nemotron-H, Bamba, Mamba2,
  Granite-4, ...; any ``layer_types`` entry other than full, sliding or chunked attention and per-token
  blocks): at its first forward (a forward pre-hook on transformers models configured with this
  attention, which also catches pure recurrent models that never call attention) and in every mask and
  attention call. :func:`check_model` runs the same check on demand. The message points the Gated
  DeltaNet / KDA hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear) to
  :func:`allscan.integrations.hf_hybrids.sequence_parallel`; for the others sequence parallelism is not yet
  supported (``allscan.integrations.transformers.sequence_parallel`` is planned);
- a sliding window shorter than the whole sequence, chunked attention with chunks shorter than it,
  attention sinks (``s_aux``, ``sinks``), a logit soft-cap, a position bias, attention dropout, an
  ``or``/block mask (bidirectional image tokens), and any other argument the attention function does not
  know that is not None;
- padding masks (each sequence is whole), 4-D masks, decoding with a KV cache (training and prefill only),
  ``output_attentions``, several packed rows in one batch, a packed row with an attention mask or a cache
  (transformers would attend across its sequences then).

What no hook can catch: a module that mixes the sequence without a recognisable class (see ``_MIXER_NAME``)
or Conv1d, in a model whose config declares no non-attention ``layer_types``; a model run under
``torch.compile`` without one eager forward first (the pre-hook is skipped while compiling; the mask and
attention checks still run).
"""
from __future__ import annotations

import re
import sys
import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .._comm import normalize_group
from .batch import (IGNORE_INDEX, BatchShard, causal_lm_loss, packed_bounds_of, reduce_loss,  # noqa: F401
                    shard_batch, sync_gradients)

__all__ = ["register", "check_model", "shard_batch", "causal_lm_loss", "reduce_loss", "sync_gradients",
           "BatchShard", "IGNORE_INDEX", "NAME"]

NAME = "allscan_ulysses"
SEQUENCE_PARALLEL = "allscan.integrations.transformers.sequence_parallel"
HYBRIDS_SEQUENCE_PARALLEL = "allscan.integrations.hf_hybrids.sequence_parallel"

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

# Arguments the attention function knows and ignores: they do not change the attention (the cache is
# refused through the key length, packing through the mask, the flash kwargs are checked below).
_HARMLESS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
                       "num_items_in_batch", "deterministic", "seq_idx", "layer_idx", "return_dict"})

_NAMES = {}  # name -> group, of every register() in this process
_HOOK = None
_PASSED = weakref.WeakKeyDictionary()  # model -> the attention implementation it passed check_model with


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("allscan.integrations.transformers needs Hugging Face transformers 5.x: "
                          "pip install 'transformers>=5,<6'") from e
    return transformers


# ------------------------------------------------------------------------------------------------
# Models register() cannot run: sequence mixers other than softmax attention
# ------------------------------------------------------------------------------------------------

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


def _modeling_module_of(config) -> str:
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


def _config_refusal(config, where: str, modeling: Optional[str] = None) -> Optional[str]:
    """Why register() cannot run a model with this config (None: it can), from the config alone."""
    if config is None:
        return None
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001
        text = config
    problems, classes = [], []
    for cfg in {id(c): c for c in (config, text)}.values():
        attr, bad = _layer_kinds(cfg)
        model_type = str(getattr(cfg, "model_type", "") or "")
        if bad:
            problems += [f"{attr} {kind!r} at layers {', '.join(map(str, idx))}" for kind, idx in bad]
        elif attr is None and model_type in _RECURRENT_MODEL_TYPES:
            problems.append(f"model_type {model_type!r} (recurrent or convolution layers; no layer_types to tell "
                            "which)")
        else:
            continue
        classes += _mixer_classes_in(modeling or _modeling_module_of(cfg))
    if not problems:
        return None
    what = f" ({', '.join(sorted(set(classes)))})" if classes else ""
    return _refusal_text(where, f"its config declares sequence mixers other than softmax attention{what}: "
                                + "; ".join(problems), sorted(set(classes)))


def _hybrid_families() -> dict:
    """``allscan.integrations.hf_hybrids.SUPPORTED`` (model type -> linear class, attention class, rule), or {}."""
    try:
        from . import hf_hybrids
        return dict(hf_hybrids.SUPPORTED)
    except Exception:  # noqa: BLE001 - only a message depends on it
        return {}


def _refusal_text(where: str, what: str, classes) -> str:
    text = (f"{where}: {what}. register() makes only softmax attention sequence-parallel: run on its shard alone, "
            "each rank would compute such a layer over its own tokens only (a silently wrong loss and gradients)")
    families = _hybrid_families()
    linear = {v[0] for v in families.values()}
    if classes and set(classes) <= linear:
        return (text + f". Make this model sequence-parallel with {HYBRIDS_SEQUENCE_PARALLEL}(model, group) "
                "instead of register() (it rewires these layers and runs the attention on Ulysses)")
    known = f"; {HYBRIDS_SEQUENCE_PARALLEL} covers {', '.join(sorted(families))}" if families else ""
    return (text + ". Sequence parallelism for these layers is not yet supported "
            f"({SEQUENCE_PARALLEL}, for every family, is planned{known}); train such a model without register()")


def _mixer_class(mod: torch.nn.Module) -> Optional[str]:
    """The name of the sequence-mixer class ``mod`` is (or derives from), or None."""
    return next((c.__name__ for c in type(mod).__mro__ if _MIXER_NAME.search(c.__name__)), None)


def _model_refusal(model: torch.nn.Module, where: str) -> Optional[str]:
    """Why register() cannot run ``model`` (None: it can): its config, and every module in it."""
    tf = _transformers()
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
    from_config = _config_refusal(config, where, _modeling_module_of(config) if config is not None else None)
    if not mixers:
        return from_config
    listed = "; ".join(f"{cls} at {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
                       for cls, names in sorted(mixers.items()))
    return _refusal_text(where, f"{type(model).__name__} has sequence mixers other than softmax attention: {listed}",
                         [c for c in mixers if " (" not in c] if all(" (" not in c for c in mixers) else None)


def _uses(config, names) -> Optional[str]:
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


def check_model(model: torch.nn.Module, name: Optional[str] = None) -> None:
    """Raise ``NotImplementedError`` naming every sequence mixer of ``model`` that register()'s attention
    does not make sequence-parallel (linear attention, SSMs, convolutions over the sequence, layer types
    other than softmax attention). Runs by itself at the first forward of any transformers model configured
    with a registered name; call it to check earlier. Local: the same verdict on every rank."""
    where = name or _uses(getattr(model, "config", None), _NAMES) or NAME
    why = _model_refusal(model, where)
    if why:
        raise NotImplementedError(why)


def _pre_forward(module, args):
    """Global forward pre-hook: the first forward of a transformers model set to a registered name checks
    the whole model (models that never call attention, e.g. Mamba2, are caught here only)."""
    if torch.compiler.is_compiling():
        return None
    cfg = module.__dict__.get("config")
    if cfg is None:
        inner = module.__dict__.get("_modules", {}).get("_orig_mod")  # torch.compile's wrapper
        if inner is None:
            return None
        module, cfg = inner, inner.__dict__.get("config")
        if cfg is None:
            return None
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(module, tf.PreTrainedModel):
        return None
    impl = _uses(cfg, _NAMES)
    if impl is None or _PASSED.get(module) == impl:
        return None
    why = _model_refusal(module, impl)
    if why:
        raise NotImplementedError(why)
    _PASSED[module] = impl
    return None


# ------------------------------------------------------------------------------------------------
# The mask transformers would have built, as what the attention needs to know
# ------------------------------------------------------------------------------------------------

class UlyssesMask:
    """What the mask function hands every attention call in place of a mask: whether the attention is
    causal, a sliding window or chunk size (or None), and the packed sequences' global bounds (None: each
    row is one sequence). Built once per forward and mask kind, the same on every rank."""

    __slots__ = ("causal", "window", "chunk", "bounds", "batch", "q_length", "name", "local_only")

    def __init__(self, causal, window, chunk, bounds, batch, q_length, name, local_only=False):
        self.causal, self.window, self.chunk, self.bounds = causal, window, chunk, bounds
        self.batch, self.q_length, self.name, self.local_only = batch, q_length, name, local_only

    def __repr__(self):
        return (f"UlyssesMask(causal={self.causal}, window={self.window}, chunk={self.chunk}, bounds={self.bounds}, "
                f"batch={self.batch}, q_length={self.q_length})")


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _mask_shape(fn, name: str, out: dict) -> None:
    """Read the mask function transformers composed (masking_utils' building blocks, ANDed) into ``out``:
    base ("causal"/"bidirectional"), window, chunk. Anything else raises, naming it."""
    mu = sys.modules.get("transformers.masking_utils")
    qual = getattr(fn, "__qualname__", repr(fn))
    if mu is not None and fn is getattr(mu, "causal_mask_function", None):
        out.setdefault("base", set()).add("causal")
    elif mu is not None and fn is getattr(mu, "bidirectional_mask_function", None):
        out.setdefault("base", set()).add("bidirectional")
    elif getattr(fn, "__module__", None) != "transformers.masking_utils":
        raise NotImplementedError(f"{name}: the model builds its attention mask with a mask function of its own "
                                  f"({getattr(fn, '__module__', '?')}.{qual}); only transformers' causal, "
                                  "bidirectional, sliding-window, chunked and packed-sequence masks are supported")
    elif qual == "and_masks.<locals>.and_mask":
        for part in _closure(fn).get("mask_functions", ()):
            _mask_shape(part, name, out)
    elif qual in ("sliding_window_overlay.<locals>.inner_mask",
                  "sliding_window_bidirectional_overlay.<locals>.inner_mask"):
        w = _closure(fn).get("sliding_window")
        out["window"] = w if out.get("window") is None else min(out["window"], w)
    elif qual == "chunked_overlay.<locals>.inner_mask":
        c = _closure(fn).get("chunk_size")
        out["chunk"] = c if out.get("chunk") is None else min(out["chunk"], c)
    elif qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        _mask_shape(_closure(fn).get("mask_function"), name, out)  # packing: from the gathered position ids
    elif qual == "packed_sequence_mask_function.<locals>.inner_mask":
        pass
    elif qual == "or_masks.<locals>.or_mask":
        raise NotImplementedError(f"{name}: an or_mask_function (tokens that see past the causal mask, e.g. "
                                  "bidirectional image tokens) is not supported")
    elif qual == "blockwise_overlay.<locals>.inner_mask":
        raise NotImplementedError(f"{name}: a blockwise mask (block_sequence_ids: bidirectional blocks) is not "
                                  "supported")
    else:
        raise NotImplementedError(f"{name}: transformers' mask function {qual} is not supported")


def _caller_mask_arguments():
    """``position_ids`` and the cache that transformers' create_*_mask (the mask function's caller) got:
    transformers detects packed rows from them (not passed to the mask function itself)."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            break
        if f.f_code.co_name.startswith("create_") and f.f_code.co_filename.endswith("masking_utils.py"):
            loc = f.f_locals
            return loc.get("position_ids"), loc.get("cache", loc.get("past_key_values"))
        f = f.f_back
    return None, None  # not called by create_*_mask: transformers would look for no packed rows either


def _comm_device(group, like: Optional[torch.Tensor]) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and ("gloo" not in backend or (like is not None and like.is_cuda)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(group, row: torch.Tensor) -> List[torch.Tensor]:
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return rows


# ------------------------------------------------------------------------------------------------
# register()
# ------------------------------------------------------------------------------------------------

_LOCAL_POSITIONS = (
    "{name}: every rank's position ids are 0 .. S_local - 1, so each rank's slice would be a sequence of its "
    "own: the model was most likely called without the shard's global position ids; pass "
    "position_ids=shard.position_ids (shard_batch's). If the row really packs one sequence per rank, confirm "
    "it with cu_seq_lens_q=shard.cu_seqlens")


def _check_kwargs(name: str, kwargs: dict, S: int) -> None:
    """Refuse, naming it, each argument transformers passed beside q, k and v that would change the result."""
    for key, value in kwargs.items():
        if value is None or key in _HARMLESS or key in ("is_causal", "cu_seq_lens_q", "cu_seq_lens_k",
                                                         "max_length_q", "max_length_k"):
            continue
        if key == "sliding_window":
            if isinstance(value, bool) or not isinstance(value, int) or value < S:
                raise NotImplementedError(
                    f"{name}: a sliding window of {value} tokens over a sequence of {S} is not supported yet "
                    "(the attention would see the whole causal sequence; a window at least as long as the whole "
                    "sequence changes nothing and passes)")
        elif key in ("s_aux", "sinks"):
            raise NotImplementedError(f"{name}: attention sinks ({key}) are not supported yet")
        elif key == "softcap":
            raise NotImplementedError(f"{name}: a logit soft-cap (softcap={value}) is not supported yet")
        elif key == "position_bias":
            raise NotImplementedError(f"{name}: an additive position bias (position_bias) is not supported")
        elif key == "output_attentions":
            if value:
                raise NotImplementedError(f"{name}: output_attentions=True is not supported (Ulysses returns no "
                                          "attention weights)")
        else:
            raise NotImplementedError(
                f"{name}: the attention function got an argument it does not know, {key}={_short(value)}; it "
                "might change the result, so it is refused rather than ignored")


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def register(group=None, *, name: str = NAME, num_chunks="auto") -> str:
    """Register Ulysses attention over ``group`` (None: the default process group) as the attention
    implementation ``name``, with its mask function (it builds no mask: it hands the attention what the
    mask would have said, see the module docstring). Returns ``name``, for ``attn_implementation=``.
    Registering the same name again replaces the group. Also installs (once per process) a forward
    pre-hook that checks, at its first forward, every transformers model configured with a registered
    name (:func:`check_model`)."""
    global _HOOK
    tf = _transformers()
    from allscan.ops.ulysses import ulysses_attention

    group = normalize_group(group)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        config = getattr(module, "config", None)
        why = _config_refusal(config, name, type(module).__module__) if config is not None else None
        if why:
            raise NotImplementedError(why)
        world = dist.get_world_size(group)
        B, S = query.shape[0], query.shape[2] * world
        mask = attention_mask if isinstance(attention_mask, UlyssesMask) else None
        if attention_mask is not None and mask is None:
            raise NotImplementedError(f"{name}: an attention mask tensor ({_short(attention_mask)}: padding or a "
                                      "custom 4-D mask) is not supported; every sequence is whole (pack or trim "
                                      "the batch)")
        if dropout:
            raise NotImplementedError(f"{name}: attention dropout is not supported (got {dropout})")
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError(f"{name}: a KV cache (query length {query.shape[2]}, key length "
                                      f"{key.shape[2]}) is not supported; call the model with use_cache=False")
        _check_kwargs(name, kwargs, S)
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        bounds = None
        if mask is not None:
            if mask.batch != B or mask.q_length != query.shape[2]:
                raise ValueError(f"{name}: the attention got a mask made for another batch ({mask!r}, query "
                                 f"{tuple(query.shape)})")
            if mask.causal != causal:
                raise NotImplementedError(f"{name}: the model's mask is {'causal' if mask.causal else 'bidirectional'} "
                                          f"but its attention module says is_causal={causal}; ambiguous, refused")
            if mask.window is not None and mask.window < S:
                raise NotImplementedError(
                    f"{name}: a sliding window of {mask.window} tokens over a sequence of {S} is not supported yet "
                    "(a window at least as long as the whole sequence changes nothing and passes)")
            if mask.chunk is not None and mask.chunk < S:
                raise NotImplementedError(f"{name}: chunked attention (chunks of {mask.chunk} tokens over a sequence "
                                          f"of {S}) is not supported yet")
            bounds = mask.bounds
        given = kwargs.get("cu_seq_lens_q")
        if mask is not None and mask.local_only and given is None:
            raise ValueError(_LOCAL_POSITIONS.format(name=name))
        if given is not None or kwargs.get("cu_seq_lens_k") is not None:
            got = [None if t is None else [int(b) for b in (t.tolist() if isinstance(t, torch.Tensor) else t)]
                   for t in (given, kwargs.get("cu_seq_lens_k"))]
            want = list(bounds) if bounds is not None else [0, S]
            if B != 1 or any(g is not None and g != want for g in got):
                raise ValueError(f"{name}: cu_seq_lens_q/k {got[0]} / {got[1]} do not match the packed sequences the "
                                 f"position ids mark ({want}, global offsets in the whole row of {S} tokens)")
        # transformers passes [B, heads, S_local, D]; Ulysses takes and returns [B, S_local, heads, D]
        out = ulysses_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group,
                                causal=causal, scale=scaling, num_chunks=num_chunks,
                                cu_seqlens=None if bounds is None else list(bounds))
        return out, None

    def mask_function(*args, attention_mask=None, config=None, mask_function=None, batch_size=None,
                      q_length=None, kv_length=None, **kwargs):
        # Everything that depends on the config or the model's code alone raises here, before any
        # collective: it is the same on every rank.
        why = _config_refusal(config, name)
        if why:
            raise NotImplementedError(why)
        shape = {}
        if mask_function is not None:
            _mask_shape(mask_function, name, shape)
        bases = shape.get("base", {"causal"})
        if len(bases) != 1:
            raise NotImplementedError(f"{name}: a mask both causal and bidirectional is not supported")
        position_ids, cache = _caller_mask_arguments()
        like = attention_mask if attention_mask is not None else position_ids
        device = _comm_device(group, like)
        B, Sq = int(batch_size), int(q_length)
        pos, odd_pos = None, 0
        if position_ids is not None:
            if position_ids.dim() != 2 or position_ids.shape[-1] != Sq or position_ids.shape[0] not in (1, B):
                odd_pos = 1  # raised below, on every rank
            else:
                pos = position_ids.expand(B, Sq).to(device=device, dtype=torch.int64).contiguous()
        padded = 0
        if attention_mask is not None:
            padded = int(attention_mask.dim() == 2 and not bool(attention_mask.all()))
        # Every check that depends on this rank's data is exchanged first, then raised on every rank alike
        # (none waits in the attention's all-to-all); then the position ids are gathered: packed rows are
        # found in the whole row, as transformers finds them on one process.
        header = torch.tensor([B, Sq, int(kv_length if kv_length is not None else Sq), padded, odd_pos,
                               int(pos is not None), int(pos is not None and bool((pos == torch.arange(
                                   Sq, device=device)).all()))], dtype=torch.int64, device=device)
        rows = [r.tolist() for r in _gather(group, header)]
        if any(r[:3] != rows[0][:3] for r in rows):
            raise ValueError(f"{name}: the ranks passed different batch / query / key lengths: {[r[:3] for r in rows]}")
        if any(r[3] for r in rows):
            raise NotImplementedError(f"{name}: padding attention masks are not supported (every sequence is whole "
                                      "and causal; pack or trim the batch); a rank of the group got one")
        if any(r[4] for r in rows):
            raise NotImplementedError(f"{name}: position ids of another shape than the batch's [B, S_local] = "
                                      f"[{B}, {Sq}] (e.g. multimodal 3-D positions) are not supported; a rank of "
                                      "the group got such")
        if any(r[5] != rows[0][5] for r in rows):
            raise ValueError(f"{name}: some ranks passed position ids and others none")
        bounds, local_only = None, False
        if pos is not None:
            whole = torch.cat(_gather(group, pos), dim=1).cpu()
            per_row = [packed_bounds_of(whole[b]) for b in range(B)]
            if any(b is not None for b in per_row):
                # Every rank's slice 0 .. S_local - 1: most likely the model computed local positions
                # because none were passed (the attention then asks for the bounds to confirm).
                local_only = len(rows) > 1 and all(r[6] for r in rows)
                if local_only and B != 1:
                    raise ValueError(_LOCAL_POSITIONS.format(name=name))
                if B != 1:
                    raise NotImplementedError(f"{name}: packed rows (position ids that restart) in a batch of {B} "
                                              "rows are not supported; pack one row per batch (B = 1)")
                if attention_mask is not None or cache is not None:
                    raise NotImplementedError(
                        f"{name}: a packed row (position ids that restart) with "
                        f"{'an attention mask' if attention_mask is not None else 'a KV cache'}: transformers then "
                        "attends across the sequences; pass no attention mask and use_cache=False")
                bounds = per_row[0]
        return UlyssesMask("causal" in bases, shape.get("window"), shape.get("chunk"), bounds, B, Sq, name,
                           local_only)

    tf.AttentionInterface.register(name, attention)
    tf.AttentionMaskInterface.register(name, mask_function)
    _NAMES[name] = group
    if _HOOK is None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        _HOOK = register_module_forward_pre_hook(_pre_forward)
    return name
