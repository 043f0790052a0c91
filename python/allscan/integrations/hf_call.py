"""The call of a transformers model made sequence-parallel by :func:`allscan.integrations.hf_hybrids.sequence_parallel`:
a forward pre-hook on each of its transformers models (acting once per outermost call) that refuses by name, on
every rank alike, what sequence parallelism cannot run, gives the model global position ids where none are
passed, and makes the batch's :class:`allscan.context.SequenceContext` once: the group resolved once, the packed
cut found in the whole row from the position ids (:meth:`~allscan.context.SequenceContext.from_position_ids`: one
exchange builds the global offsets on every rank and refuses malformed ids on every rank). The context travels to
every layer as the keyword ``allscan_context`` (transformers hands a model's extra keywords to each decoder layer,
its mixers and attention functions; also when gradient checkpointing recomputes a layer).
"""
from __future__ import annotations

import inspect
import threading

import torch

from .common import (CONTEXT_KWARG, LABELS, LOGITS_TO_KEEP, HeadArguments, agreed_offsets, caller_head_arguments,
                     exchange, keeps_some_logits, of_ranks, positions_context, restarts, sp_group)
from .hf_mask import LOCAL_POSITIONS
from .hf_moe import AUX_LOSS_BASE_ALONE, computes_aux_loss, replace_aux_loss, router_logits_requested
from .hf_shard import SequenceParallelForward

__all__ = ["CallCheck", "refuse_generate"]

_CACHE, _USE_CACHE, _OUTPUT_ATTENTIONS, _LABELS, _PADDING, _FLASH_KWARGS, _POSITIONS_SHAPE, _CONTEXT_GIVEN, \
    _AUX_BASE_ALONE, _LOGITS_TO_KEEP, _POSITIONS_GIVEN, _RESTARTS, _LOCAL_POSITIONS, _OFFSETS_GIVEN, _UNCHECKABLE, \
    _COMPILING, _MIXER_REPLACED, _ATTENTION_CHANGED, _AUX_LOSS = (1 << i for i in range(19))
_REASONS = {
    _CACHE: "a KV or recurrent cache (past_key_values / cache) is not supported: training and prefill only",
    _USE_CACHE: "use_cache=True is not supported (no cache under sequence parallelism); pass use_cache=False",
    _OUTPUT_ATTENTIONS: "output_attentions=True is not supported (Ulysses returns no attention weights)",
    _LABELS: LABELS,
    _PADDING: ("an attention_mask with padding (or a custom mask) is not supported: every sequence is whole "
               "(pack or trim the batch)"),
    _FLASH_KWARGS: ("max_length_* / seq_idx / cu_seqlens are not taken from the caller: pack sequences into one "
                    "row marked by position ids that restart (shard_batch(..., position_ids=)); the bounds are found "
                    "in the whole row"),
    _POSITIONS_SHAPE: "position ids other than [B, T_local] (e.g. multimodal rotary positions) are not supported",
    _CONTEXT_GIVEN: f"{CONTEXT_KWARG} is made by the model's call from the position ids; do not pass it",
    _AUX_BASE_ALONE: AUX_LOSS_BASE_ALONE,
    _LOGITS_TO_KEEP: LOGITS_TO_KEEP,
}
# Changes made to the model after sequence_parallel() that would undo it: each rank's layer would see its shard alone
_UNDONE = {
    _MIXER_REPLACED: "a rewired sequence mixer's forward was replaced after sequence_parallel() (kernelize? another "
                     "wrapper?)",
    _ATTENTION_CHANGED: "the attention implementation was changed after sequence_parallel() (set_attn_implementation? "
                        "config._attn_implementation? sequence_parallel() again on a part of the model, over another "
                        "group?)",
}
_PACKING_KWARGS = ("max_length_q", "max_length_k", "seq_idx", "cu_seqlens")
_OFFSETS_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")  # taken where they match the position ids, then dropped
NAME = "sequence_parallel"

# the module whose call is being checked (nested transformers models skip), and whether its routers' load-balancing
# loss is to be made the whole sequence's (hf_moe) after it
_STATE = threading.local()


def refuse_generate(*args, **kwargs):
    raise NotImplementedError("sequence_parallel: generation is not supported on a sequence-parallel model "
                              "(training and prefill only)")


@torch.compiler.disable
def _check_beside_the_trace(check: "CallCheck", module, bound, kwargs) -> None:
    """Under torch.compile: the call's checks and exchanges, run eagerly (a graph break before the model's
    forward), everything refused as in an eager call, on every rank alike (also where a peer runs eagerly). The
    context cannot enter the trace, so the layers take whole sequences there: packed rows are refused; and the
    model's default position ids would be each shard's own, so the global ones must be given."""
    check._check(module, bound, dict(kwargs), compiling=True)


class CallCheck:
    """Forward pre-hook (:meth:`pre`, with kwargs) and its closing forward hook (:meth:`post`) of a transformers
    model made sequence-parallel over ``group``; ``rewired``: its linear-attention modules; ``attention``: the
    configs its softmax attention reads its implementation from, with the value sequence_parallel() set."""

    def __init__(self, group, rewired, attention):
        self.group, self.rewired, self.attention = group, rewired, attention

    def pre(self, module, args, kwargs):
        if getattr(_STATE, "owner", None) is not None:
            return None
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        except TypeError:
            bound = None  # the forward raises on its own, after the check's exchange tells the peers
        if torch.compiler.is_compiling():
            _check_beside_the_trace(self, module, bound, kwargs)
            return None
        _STATE.owner, _STATE.aux_loss = module, False
        try:
            kwargs = self._check(module, bound, dict(kwargs))
        except BaseException:
            _STATE.owner = None
            raise
        return args, kwargs

    def post(self, module, args, output):
        if getattr(_STATE, "owner", None) is not module:
            return None
        _STATE.owner, aux_loss = None, _STATE.aux_loss
        if aux_loss and output is not None:  # (None: the forward raised)
            return replace_aux_loss(module, output, sp_group(self.group, NAME), NAME)
        return None

    def _undone(self) -> int:
        flags = 0
        if any(not isinstance(m.__dict__.get("forward"), SequenceParallelForward) for m in self.rewired):
            flags |= _MIXER_REPLACED
        if any(getattr(cfg, "_attn_implementation", None) != set_to for cfg, set_to in self.attention):
            flags |= _ATTENTION_CHANGED
        return flags

    def _check(self, module, bound: "inspect.BoundArguments | None", kwargs, compiling: bool = False):
        config = getattr(module, "config", None)
        undone = self._undone()
        a = dict(bound.arguments) if bound is not None else {}
        for p in bound.signature.parameters.values() if bound is not None else ():
            if p.kind is p.VAR_KEYWORD:
                a.update(a.pop(p.name, {}) or {})
        x = a.get("input_ids")
        if x is None:
            x = a.get("inputs_embeds")
        sp = sp_group(self.group, NAME)
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            # arguments the forward does not take, or no input [B, T_local]: the forward raises on its own on this
            # rank, once the exchange has told its peers (which would otherwise wait in their first collective)
            like = next((v for v in a.values() if isinstance(v, torch.Tensor)), None)
            exchange(sp, [-1, -1, _UNCHECKABLE | undone], like)
            return kwargs
        B, T = int(x.shape[0]), int(x.shape[1])
        flags = undone | (_COMPILING if compiling else 0)
        if any(a.get(k) is not None for k in ("past_key_values", "cache", "cache_params")):
            flags |= _CACHE
        if a.get("use_cache"):
            flags |= _USE_CACHE
        if a.get("output_attentions"):
            flags |= _OUTPUT_ATTENTIONS
        # a head's labels / logits_to_keep: here, or where this is a base model (no such parameters of its own), in
        # the forward of the head around it
        own = bound is not None and any(k in bound.signature.parameters for k in ("labels", "logits_to_keep"))
        head = HeadArguments() if own else caller_head_arguments()
        if a.get("labels") is not None or head.labels:
            flags |= _LABELS
        mask = a.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all())):
            flags |= _PADDING
        if any(a.get(k) is not None for k in _PACKING_KWARGS):
            flags |= _FLASH_KWARGS
        if any(a.get(k) is not None for k in _OFFSETS_KWARGS):
            flags |= _OFFSETS_GIVEN
        if a.get(CONTEXT_KWARG) is not None:
            flags |= _CONTEXT_GIVEN
        # the routers' load-balancing loss: made the whole sequence's by this head's forward hook (hf_moe); a head
        # around a base model made sequence-parallel alone would take its shard's
        if own and router_logits_requested(config, a.get("output_router_logits")) and computes_aux_loss(module):
            flags |= _AUX_LOSS
        if head.head is not None and router_logits_requested(head.head.config, head.router_logits) \
                and computes_aux_loss(head.head):
            flags |= _AUX_BASE_ALONE
        if keeps_some_logits(a.get("logits_to_keep")) or head.keeps_some:
            flags |= _LOGITS_TO_KEEP
        positions = a.get("position_ids")
        if positions is not None:
            flags |= _POSITIONS_GIVEN
            if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != T \
                    or positions.shape[0] not in (1, B):
                flags |= _POSITIONS_SHAPE
            else:
                if restarts(positions, sp.rank):
                    flags |= _RESTARTS
                if bool((positions == torch.arange(T, device=positions.device)).all()):
                    flags |= _LOCAL_POSITIONS
        rows = exchange(sp, [B, T, flags], x)
        unchecked = [i for i, r in enumerate(rows) if r[2] & _UNCHECKABLE]
        if unchecked:
            raise ValueError(f"{NAME}: the model was called with arguments its forward does not take, or without "
                             f"input_ids / inputs_embeds of shape [B, T_local] {of_ranks(unchecked)}")
        undone = [(bit, [i for i, r in enumerate(rows) if r[2] & bit]) for bit in _UNDONE]
        undone = [_UNDONE[bit] + ("" if sp.size == 1 else " " + of_ranks(ranks)) for bit, ranks in undone if ranks]
        if undone:
            raise RuntimeError(f"{NAME}: " + "; ".join(undone) + ": each rank's layers would see its shard alone; "
                               "call sequence_parallel() last")
        if any(r[:2] != rows[0][:2] for r in rows):
            raise ValueError(f"{NAME}: the ranks passed different batch sizes / local lengths [B, T_local]: "
                             f"{[r[:2] for r in rows]} (every rank holds an equal contiguous shard)")
        refused = [(bit, [i for i, r in enumerate(rows) if r[2] & bit]) for bit in _REASONS]
        refused = [(bit, ranks) for bit, ranks in refused if ranks]
        if refused:
            raise NotImplementedError(f"{NAME}: " + "; ".join(
                _REASONS[bit] + ("" if sp.size == 1 else " " + of_ranks(ranks)) for bit, ranks in refused))
        aux = [bool(r[2] & _AUX_LOSS) for r in rows]
        if any(aux) and not all(aux):
            raise ValueError(f"{NAME}: some ranks asked for the routers' load-balancing loss (output_router_logits) "
                             f"and others not {of_ranks([i for i, x in enumerate(aux) if x])}")
        given = [bool(r[2] & _POSITIONS_GIVEN) for r in rows]
        if any(given) and not all(given):
            raise ValueError(f"{NAME}: some ranks passed position_ids and others none")
        compiled = [i for i, r in enumerate(rows) if r[2] & _COMPILING]
        under_compile = "" if sp.size == 1 else " " + of_ranks(compiled)
        if compiled and any(aux):
            raise NotImplementedError(f"{NAME}: output_router_logits under torch.compile(model) is not supported (the "
                                      "whole sequence's load-balancing loss is made after the model's call, which a "
                                      f"trace does not run); compile model.forward instead{under_compile}")
        if compiled and not any(given):
            raise NotImplementedError(f"{NAME}: under torch.compile pass position_ids (the global ones: "
                                      f"shard_batch(...).position_ids){under_compile}")
        # The caller's packed offsets, agreed across the group (one more exchange, only where some rank passed
        # them): they may confirm what the position ids mark, and go no further
        offsets = agreed_offsets(sp, a.get("cu_seq_lens_q"), a.get("cu_seq_lens_k"), NAME, x) \
            if any(r[2] & _OFFSETS_GIVEN for r in rows) else None
        for k in _OFFSETS_KWARGS:
            kwargs.pop(k, None)
        # Every rank's ids 0 .. T_local - 1: most likely each rank made its own (as the model does), rarely a row
        # packing one sequence per rank, which the caller's offsets must then confirm (as under register())
        if sp.size > 1 and all(r[2] & _LOCAL_POSITIONS for r in rows) and offsets is None:
            raise ValueError(LOCAL_POSITIONS.format(name=NAME))
        if positions is None:
            # the global positions one process would use (the model's own default is 0 .. T_local-1 on every rank)
            kwargs["position_ids"] = (torch.arange(T, device=x.device) + sp.rank * T).unsqueeze(0).expand(B, T)
        # The batch's context, once for the whole model: packed rows (position ids restarting at 0) found in the
        # whole row (the same cut on every rank, malformed ids refused on every rank); whole sequences without an
        # exchange where no position ids were given
        context = positions_context(positions.expand(B, T) if positions is not None else None, sp, NAME, B,
                                    any(r[2] & _RESTARTS for r in rows))
        marked = context.cu_seqlens or (0, sp.size * T)
        if offsets is not None and offsets != marked:
            raise ValueError(f"{NAME}: cu_seq_lens_q/k {list(offsets)} do not match the packed sequences the position "
                             f"ids mark ({list(marked)}, global offsets in the whole row of {sp.size * T} tokens)")
        if compiled and context.packed:
            raise NotImplementedError(f"{NAME}: packed rows (position ids that restart) are not supported under "
                                      "torch.compile: the batch's context cannot enter the trace; call the model "
                                      f"eagerly for packed rows (the layers' ops themselves compile){under_compile}")
        kwargs[CONTEXT_KWARG] = context
        _STATE.aux_loss = any(aux)
        return kwargs
