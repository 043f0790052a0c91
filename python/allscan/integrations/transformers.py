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
(:func:`allscan.ops.ulysses.ulysses_attention`). What transformers passes beside q, k and v and that acts per
head on the whole sequence is honoured exactly there (:mod:`allscan.integrations.hf_options`): a sliding
window (the mask's ``sliding_window_overlay``, the ``sliding_window`` argument: Mistral, Gemma 2, Qwen3's and
GPT-OSS's sliding layers; never across a packed sequence's start), a logit soft-cap (``softcap``: Gemma 2) and
attention sinks (``s_aux`` / ``sinks``: GPT-OSS; their gradient summed by ``sync_gradients`` like any other).
Everything else in the model must be per token. So the
model needs global position ids (``shard_batch`` makes them), labels shifted across the rank
boundaries before cutting (``shard_batch``), and a loss normalised by the whole batch's token count
(``causal_lm_loss``); those helpers are :mod:`allscan.integrations.batch`'s.

Hybrids (Gated DeltaNet and KDA beside softmax attention: Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear):
:func:`sequence_parallel` (:mod:`allscan.integrations.hf_hybrids`'s, re-exported here) makes them
sequence-parallel in place; ``register()`` refuses them. A DP x SP device mesh with FSDP2:
:mod:`allscan.integrations.mesh` (the group is then ``mesh["sp"]``).

Packed rows: sequences packed in one row and marked by position ids restarting at 0 (the way
transformers' ``DataCollatorWithFlattening`` packs them) are honoured, as transformers' own attention
honours them on one process: the forward's first mask call makes the batch's
:class:`allscan.context.SequenceContext` from the group's position ids
(:meth:`~allscan.context.SequenceContext.from_position_ids`: one exchange builds the global offsets on
every rank and refuses malformed ids on every rank), shared by the forward's other masks and every
attention call, which attends each sequence alone (``ulysses_attention(..., context=)``);
``shard_batch(..., position_ids=)`` ignores the labels across each sequence's end and keeps the bounds in
``BatchShard.cu_seqlens``. One packed row at a time (B = 1). The flash-attention kwargs ``cu_seq_lens_q``
/ ``cu_seq_lens_k`` (global offsets) may be passed too: they are agreed across the group once per forward
(offsets that differ between ranks, or given on some ranks only, raise ``ValueError`` on every rank) and
must match the position ids. Position ids 0 .. S_local - 1 on every rank (what the model makes when it
is called without the shard's position ids) raise ``ValueError``, unless ``cu_seq_lens_q=shard.cu_seqlens``
confirms that the row really packs one sequence per rank.

A mixture of experts' load-balancing loss (``output_router_logits``, by the call or the config) is made the whole
sequence's: the head's ``aux_loss`` becomes this rank's share (:mod:`allscan.integrations.hf_moe`; the forward's
first mask call agrees across the ranks that it is asked for).

Refused, with ``NotImplementedError`` naming the cause, on every rank (never a silently wrong result):

- a model with a sequence mixer other than softmax attention (linear attention, an SSM, a convolution
  over the sequence: Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear, Nemotron-H, Bamba, Mamba2,
  Granite-4, ...; any ``layer_types`` entry other than full, sliding or chunked attention and per-token
  blocks): at its first forward (a forward pre-hook on transformers models configured with this
  attention, which also catches pure recurrent models that never call attention) and in every mask and
  attention call. :func:`check_model` runs the same check on demand. The message points the Gated
  DeltaNet / KDA hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear) to :func:`sequence_parallel`;
  for the others it says that sequence parallelism is not yet supported for them;
- chunked attention with chunks shorter than the sequence, a position bias, attention dropout, an
  ``or``/block mask (bidirectional image tokens), a ``sliding_window`` argument that differs from the
  model's mask, and any other argument the attention function does not know that is not None;
- padding masks (each sequence is whole), 4-D masks, decoding with a KV cache (training and prefill only),
  ``output_attentions``, several packed rows in one batch, a packed row with an attention mask or a cache
  (transformers would attend across its sequences then);
- over more than one rank, a model whose forward takes no ``position_ids`` (BLOOM, MPT, CPM-Ant, BART-family
  decoders: each rank would number its shard from 0) or numbers them from ``padding_idx + 1`` (RoBERTa-style
  embeddings); one that takes them, called without them where its masks get none, counts as numbering its tokens
  itself (``ValueError`` as above); one whose first sharded forward reaches neither the registered mask function
  nor the attention (OpenAI GPT, XLM: attention in its own code), after that forward;
- ``labels`` or ``logits_to_keep`` given to the causal-LM head (transformers would shift the labels and keep the
  last tokens within each shard), read from the head's forward on the stack by the forward's first mask call;
- ``torch.compile`` of the model (its mask and attention exchange across the ranks, which a trace cannot): the
  pre-hook raises beside the trace.

What no hook can catch: a module that mixes the sequence without a recognisable class (see
``allscan.integrations.hf_refusals``) or Conv1d, in a model whose config declares no non-attention
``layer_types``.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from allscan.ops import own_work

from .batch import IGNORE_INDEX, BatchShard, causal_lm_loss, reduce_loss, shard_batch, sync_gradients  # noqa: F401
from .common import offsets_of, require_transformers, sp_group
from .hf_options import OPTION_KWARGS, features_of, one_process_attention
from .hf_hybrids import sequence_parallel  # noqa: F401  (the hybrids' entry, under the name issue 53 gives it)
from .hf_mask import (FORWARDS, LOCAL_POSITIONS, UlyssesMask, batch_of, caller_mask_arguments, given_offsets,
                      mask_shape)
from .hf_moe import computes_aux_loss, replace_aux_loss
from .hf_refusals import SEQUENCE_PARALLEL, config_refusal, model_refusal, registered_implementation  # noqa: F401

__all__ = ["register", "sequence_parallel", "check_model", "shard_batch", "causal_lm_loss", "reduce_loss",
           "sync_gradients", "BatchShard", "IGNORE_INDEX", "NAME"]

NAME = "allscan_ulysses"

# Arguments the attention function knows and ignores: they do not change the attention (the cache is
# refused through the key length, packing through the mask, the flash kwargs are checked below).
_HARMLESS = frozenset({"position_ids", "use_cache", "cache_position", "output_router_logits", "output_hidden_states",
                       "num_items_in_batch", "deterministic", "seq_idx", "layer_idx", "return_dict"})

_NOT_COMPILED = ("{name}: torch.compile of a model set to register()'s attention is not supported (its mask and "
                 "attention agree on the batch across the ranks, which a trace cannot); call the model eagerly")
_NAMES = {}  # name -> group, of every register() in this process
_HOOK = None
_PASSED = weakref.WeakKeyDictionary()  # model -> (attention implementation, sharded) it passed check_model with
_AUX_HOOKS = weakref.WeakKeyDictionary()  # MoE head -> its forward hook (hf_moe: the whole sequence's aux_loss)
_UNSEEN = weakref.WeakKeyDictionary()  # sharded model -> its forward hook, until a forward reached our mask/attention


def check_model(model: torch.nn.Module, name: Optional[str] = None) -> None:
    """Raise ``NotImplementedError`` naming every sequence mixer of ``model`` that register()'s attention
    does not make sequence-parallel (linear attention, SSMs, convolutions over the sequence, layer types
    other than softmax attention), a head that pools each row at one position (sequence classification), or an
    option that reads the shard's positions as the whole sequence's (a ``dynamic`` or ``longrope`` rope, Llama 4's
    attention temperature tuning).
    Runs by itself at the first forward of any transformers model configured with a registered name; call it
    to check earlier. Local: the same verdict on every rank."""
    where = name or registered_implementation(getattr(model, "config", None), _NAMES) or NAME
    why = model_refusal(model, where, where not in _NAMES or sp_group(_NAMES[where], where).size > 1)
    if why:
        raise NotImplementedError(why)


@torch.compiler.disable
def _refuse_compiled(name: str) -> None:
    """Raised beside the trace (a graph break): raised inside it, dynamo would run the frame again eagerly and
    trace the frames it calls one by one, where the checks cannot see that they are compiled."""
    raise NotImplementedError(_NOT_COMPILED.format(name=name))


def _pre_forward(module, args):
    """Global forward pre-hook: the first forward of a transformers model set to a registered name checks
    the whole model (models that never call attention, e.g. Mamba2, are caught here only)."""
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
    impl = registered_implementation(cfg, _NAMES)
    if impl is None:
        return None
    if torch.compiler.is_compiling():
        _refuse_compiled(impl)
    FORWARDS.serial += 1  # a new forward: its first mask call finds its batch again
    if module in _UNSEEN:
        FORWARDS.attended = False  # this forward must reach the registered mask or attention (_attention_ran)
    sharded = sp_group(_NAMES[impl], impl).size > 1
    if _PASSED.get(module) == (impl, sharded):  # checked again when the name's group grows past one rank
        return None
    why = model_refusal(module, impl, sharded)
    if why:
        raise NotImplementedError(why)
    _PASSED[module] = (impl, sharded)
    if sharded and module not in _UNSEEN:
        FORWARDS.attended = False
        _UNSEEN[module] = module.register_forward_hook(_attention_ran)
    if computes_aux_loss(module) and module not in _AUX_HOOKS:
        _AUX_HOOKS[module] = module.register_forward_hook(_whole_aux_loss)
    return None


def _attention_ran(module, args, output):
    """A sharded model's forward hook until one of its forwards reached the registered mask function or attention
    (the mask function runs eagerly even where the decoder layers are compiled). A model that computes attention in
    its own code (OpenAI GPT, XLM, Reformer: transformers accepts any registered name for them) would attend within
    each rank's shard alone: refused by name (the same model code on every rank, the same verdict). Coarse: one
    such call anywhere in the forward passes it."""
    if FORWARDS.attended:
        _UNSEEN.pop(module).remove()
        return None
    impl = registered_implementation(module.config, _NAMES)
    raise NotImplementedError(
        f"{impl}: {type(module).__name__} computes its attention in its own code, never through the registered "
        "attention function, so each rank would attend only within its own shard; register() cannot make it "
        "sequence-parallel")


def _whole_aux_loss(module, args, output):
    """A MoE head's forward hook: where this forward's routers' load-balancing loss was asked for (agreed on every
    rank by the forward's first mask call), this rank's share of the whole sequence's replaces the shard's."""
    forward = FORWARDS.last
    if forward is None or forward.aux_head is None or forward.aux_head() is not module:
        return None
    forward.aux_head = None  # once
    impl = registered_implementation(module.config, _NAMES)
    return replace_aux_loss(module, output, sp_group(_NAMES[impl], impl), impl)


# ------------------------------------------------------------------------------------------------
# register()
# ------------------------------------------------------------------------------------------------

def _check_kwargs(name: str, kwargs: dict) -> None:
    """Refuse, naming it, each argument transformers passed beside q, k and v that would change the result."""
    for key, value in kwargs.items():
        if value is None or key in _HARMLESS or key in ("is_causal", "cu_seq_lens_q", "cu_seq_lens_k",
                                                         "max_length_q", "max_length_k"):
            continue
        if key == "logits_to_keep" and not isinstance(value, torch.Tensor) and value == 0:
            continue  # every logit (GOT-OCR2 passes it down): the head's own value is checked with the batch
        if key in OPTION_KWARGS:
            continue  # honoured: features_of reads them
        if key == "position_bias":
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
    """Register Ulysses attention over ``group`` as the attention implementation ``name``, with its mask
    function (it builds no mask: it hands the attention what the mask would have said, see the module
    docstring). ``group``: None (the default process group, looked up at each call), a ProcessGroup, a group
    name, a one-dimensional ``DeviceMesh`` (``mesh["sp"]``: see :mod:`allscan.integrations.mesh`) or
    ``allscan.context.LOCAL`` (this process alone). Returns ``name``, for ``attn_implementation=``.
    Registering the same name again replaces the group. Also installs (once per process) a forward
    pre-hook that checks, at its first forward, every transformers model configured with a registered
    name (:func:`check_model`)."""
    global _HOOK
    tf = require_transformers("allscan.integrations.transformers")
    from allscan.ops.ulysses import ulysses_attention

    fixed = None if group is None else sp_group(group, "register")

    def resolved():
        return fixed if fixed is not None else sp_group(None, name)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if not torch.compiler.is_compiling():
            FORWARDS.attended = True
        config = getattr(module, "config", None)
        why = config_refusal(config, name, type(module).__module__) if config is not None else None
        if why:
            raise NotImplementedError(why)
        sp = resolved()
        B, S = query.shape[0], query.shape[2] * sp.size
        mask = attention_mask if isinstance(attention_mask, UlyssesMask) else None

        def own_checks():
            if attention_mask is not None and mask is None:
                raise NotImplementedError(f"{name}: an attention mask tensor ({_short(attention_mask)}: padding or a "
                                          "custom 4-D mask) is not supported; every sequence is whole (pack or trim "
                                          "the batch)")
            if dropout:
                raise NotImplementedError(f"{name}: attention dropout is not supported (got {dropout})")
            if query.shape[2] != key.shape[2]:
                raise NotImplementedError(f"{name}: a KV cache (query length {query.shape[2]}, key length "
                                          f"{key.shape[2]}) is not supported; call the model with use_cache=False")
            _check_kwargs(name, kwargs)

        # The caller's packed offsets, agreed first (an exchange at the forward's first attention call); then this
        # rank's own checks, whose refusal on one rank alone (a module left in train mode with dropout, say) is
        # told to the peers waiting in Ulysses
        given = given_offsets(mask.forward if mask is not None else None, sp, kwargs, name, query)
        own_work(sp.process_group if sp.size > 1 else None, name, "its checks", own_checks)
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
            if mask.chunk is not None and mask.chunk < S:
                raise NotImplementedError(f"{name}: chunked attention (chunks of {mask.chunk} tokens over a sequence "
                                          f"of {S}) is not supported yet")
            bounds = mask.bounds
        # the window (the mask's and the argument's, agreed), soft-cap and sinks: honoured on the whole sequence
        features = features_of(name, kwargs, S, mask_known=mask is not None,
                               mask_window=None if mask is None else mask.window)
        if features.window is not None and not causal:
            raise NotImplementedError(f"{name}: a sliding window over bidirectional attention is not supported")
        # Everything above is the same on every rank (the config, the model's code, the agreed batch); the
        # caller's packed offsets were agreed before they are judged, so a rank whose offsets differ raises on
        # every rank.
        if mask is not None and mask.local_only and given is None:
            raise ValueError(LOCAL_POSITIONS.format(name=name))
        if given is not None:
            want = tuple(bounds) if bounds is not None else (0, S)
            if B != 1 or given != want:
                got = [offsets_of(kwargs.get(k)) for k in ("cu_seq_lens_q", "cu_seq_lens_k")]
                raise ValueError(f"{name}: cu_seq_lens_q/k {got[0]} / {got[1]} do not match the packed sequences the "
                                 f"position ids mark ({list(want)}, global offsets in the whole row of {S} tokens)")
        # transformers passes [B, heads, S_local, D]; Ulysses takes and returns [B, S_local, heads, D]
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if sp.size == 1:
            scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
            return one_process_attention(q, k, v, scale, bounds, causal, features), None
        # the forward's context: its packed offsets were agreed once, not again per layer
        packing = dict(context=mask.context) if mask is not None else {}
        out = ulysses_attention(q, k, v, sp.process_group, causal=causal, scale=scaling, num_chunks=num_chunks,
                                **packing, **features.as_kwargs())
        return out, None

    def mask_function(*args, attention_mask=None, config=None, mask_function=None, batch_size=None,
                      q_length=None, kv_length=None, **kwargs):
        if not torch.compiler.is_compiling():
            FORWARDS.attended = True
        # Everything that depends on the config or the model's code alone raises here, before any
        # collective: it is the same on every rank.
        why = config_refusal(config, name)
        if why:
            raise NotImplementedError(why)
        shape = {}
        if mask_function is not None:
            mask_shape(mask_function, name, shape)
        bases = shape.get("base", {"causal"})
        if len(bases) != 1:
            raise NotImplementedError(f"{name}: a mask both causal and bidirectional is not supported")
        position_ids, cache = caller_mask_arguments()
        B, Sq = int(batch_size), int(q_length)
        kv = int(kv_length if kv_length is not None else Sq)
        # The forward's batch is found once (its first mask call) and shared by its other masks: the pre-hook
        # counts forwards, the same on every rank.
        key = (FORWARDS.serial, name, B, Sq, kv)
        objs = (position_ids, attention_mask, cache)
        forward = FORWARDS.last
        if forward is None or torch.compiler.is_compiling() or not forward.matches(key, objs):
            forward = batch_of(resolved(), name, B, Sq, kv, position_ids, attention_mask, cache, key)
            FORWARDS.last = forward
        return UlyssesMask("causal" in bases, shape.get("window"), shape.get("chunk"), forward, B, Sq, name)

    tf.AttentionInterface.register(name, attention)
    tf.AttentionMaskInterface.register(name, mask_function)
    _NAMES[name] = group
    if _HOOK is None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        _HOOK = register_module_forward_pre_hook(_pre_forward)
    return name
