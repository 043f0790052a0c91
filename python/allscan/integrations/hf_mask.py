"""The mask transformers would have built, as what allscan's Ulysses attention needs to know
(:mod:`allscan.integrations.transformers`): the mask function hands every attention call a
:class:`UlyssesMask` (causal or not, window, chunk) in place of a mask, and the forward's batch
(:class:`ForwardBatch`: its SequenceContext, made and agreed once per forward)."""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Optional, Tuple

import torch

from .common import (LABELS, LOGITS_TO_KEEP, agreed_offsets, caller_head_arguments, exchange, of_ranks,
                     positions_context, restarts)
from .hf_moe import computes_aux_loss, router_logits_requested

__all__ = ["ForwardBatch", "Forwards", "FORWARDS", "UlyssesMask", "MaskUsedAsTensor", "mask_shape",
           "caller_mask_arguments", "LOCAL_POSITIONS", "batch_of", "given_offsets"]


class ForwardBatch:
    """One forward's batch as its first mask call found it, shared by the forward's other masks (sliding and
    full layers) and every attention call: its :class:`~allscan.context.SequenceContext` (the packed cut, made
    and agreed once), whether every rank numbered its slice from 0, and the caller's packed offsets once agreed.
    Reused only within one forward (the model-level pre-hook counts forwards) and for the very same inputs, so
    every rank reuses it alike. ``aux_head``: the head whose routers' load-balancing loss this forward computes
    (agreed on every rank; its forward hook makes the loss the whole sequence's, once), held weakly, else None."""

    __slots__ = ("key", "refs", "context", "local_only", "given", "given_offsets", "aux_head")

    def __init__(self, key, objs, context, local_only, aux_head=None):
        self.key, self.context, self.local_only = key, context, local_only
        self.aux_head = None if aux_head is None else weakref.ref(aux_head)
        try:
            self.refs = tuple(None if o is None else weakref.ref(o) for o in objs)
        except TypeError:  # an input that takes no weak reference: never reused
            self.refs = None
        self.given, self.given_offsets = None, None

    def matches(self, key, objs) -> bool:
        return self.refs is not None and self.key == key and all(
            (r is None and o is None) or (r is not None and r() is o) for r, o in zip(self.refs, objs))


class Forwards(threading.local):
    serial = 0  # transformers models (set to a registered name) that started a forward on this thread
    last: Optional[ForwardBatch] = None
    attended = False  # the registered mask or attention ran since an unchecked model's forward began (transformers.py)


FORWARDS = Forwards()


class UlyssesMask:
    """What the mask function hands every attention call in place of a mask: whether the attention is
    causal, a sliding window or chunk size (or None), and the forward's batch (its SequenceContext: the
    packed sequences' global bounds, None for whole rows). The same on every rank."""

    __slots__ = ("causal", "window", "chunk", "batch", "q_length", "name", "forward")

    def __init__(self, causal, window, chunk, forward: ForwardBatch, batch, q_length, name):
        self.causal, self.window, self.chunk, self.forward = causal, window, chunk, forward
        self.batch, self.q_length, self.name = batch, q_length, name

    @property
    def context(self):
        return self.forward.context

    @property
    def bounds(self):
        return self.forward.context.cu_seqlens

    @property
    def local_only(self) -> bool:
        return self.forward.local_only

    def __repr__(self):
        return (f"UlyssesMask(causal={self.causal}, window={self.window}, chunk={self.chunk}, bounds={self.bounds}, "
                f"batch={self.batch}, q_length={self.q_length})")

    def __getattr__(self, attr):  # (only for what the class does not have)
        if attr.startswith("__") or attr not in _TENSOR_ATTRIBUTES:
            raise AttributeError(attr)
        raise self._used_as_tensor(f".{attr}")

    def _used_as_tensor(self, how: str) -> "MaskUsedAsTensor":
        return MaskUsedAsTensor(
            f"{object.__getattribute__(self, 'name')}: the model uses its attention mask as a tensor ({how}): it "
            "builds or edits its masks itself, which register()'s attention, handed what the mask says instead of a "
            "mask, cannot run; this model is not supported by register()")

    def _operator(symbol: str):  # noqa: N805 - builds the operators below
        def refuse(self, *args):
            raise self._used_as_tensor(symbol)
        return refuse

    __add__ = __radd__ = _operator("+")
    __sub__ = __rsub__ = _operator("-")
    __mul__ = __rmul__ = _operator("*")
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = _operator("a logical operator")
    __getitem__ = _operator("indexing")
    del _operator


class MaskUsedAsTensor(NotImplementedError, AttributeError):
    """A model's own code used the mask register() hands its attention as a tensor (XGLM, MVP, ...). An
    AttributeError too, so that ``hasattr`` / ``getattr(..., default)`` probes behave as before."""


_TENSOR_ATTRIBUTES = frozenset(n for n in dir(torch.Tensor) if not n.startswith("_"))


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def mask_shape(fn, name: str, out: dict) -> None:
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
            mask_shape(part, name, out)
    elif qual in ("sliding_window_overlay.<locals>.inner_mask",
                  "sliding_window_bidirectional_overlay.<locals>.inner_mask"):
        w = _closure(fn).get("sliding_window")
        out["window"] = w if out.get("window") is None else min(out["window"], w)
    elif qual == "chunked_overlay.<locals>.inner_mask":
        c = _closure(fn).get("chunk_size")
        out["chunk"] = c if out.get("chunk") is None else min(out["chunk"], c)
    elif qual == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        mask_shape(_closure(fn).get("mask_function"), name, out)  # packing: from the gathered position ids
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


def caller_mask_arguments():
    """``position_ids`` and the cache that transformers' create_*_mask (the mask function's caller) got:
    transformers detects packed rows from them (not passed to the mask function itself). A model that builds its
    masks without its position ids (GPT-OSS, AFMoE, ...: transformers' eager and sdpa attention would then attend
    across packed sequences, its flash attention would not) gets those of the model's forward that called
    create_*_mask (:func:`_as_rows`): packed rows are each attended alone, as the packing asks, and a model called
    without the shard's position ids is caught as one that numbers its tokens itself."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            break
        if f.f_code.co_name.startswith("create_") and f.f_code.co_filename.endswith("masking_utils.py"):
            loc = f.f_locals
            positions = loc.get("position_ids")
            if positions is None:  # the model forward's own, past transformers' decorators' wrappers
                up = f.f_back
                for _ in range(3):
                    if up is None or up.f_code.co_name == "forward":
                        break
                    up = up.f_back
                if up is not None and up.f_code.co_name == "forward" and "position_ids" in up.f_code.co_varnames:
                    positions = _as_rows(up.f_locals.get("position_ids"), loc.get("inputs_embeds"))
            return positions, loc.get("cache", loc.get("past_key_values"))
        f = f.f_back
    return None, None  # not called by create_*_mask: transformers would look for no packed rows either


def _as_rows(positions, embeds):
    """A model forward's position ids as ``[B or 1, S]``; none yet (the forward numbers the tokens itself after
    making its masks: BERT-like embeddings, BioGPT), the 0 .. S - 1 it will use."""
    if positions is None and isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
    if isinstance(positions, torch.Tensor) and positions.dim() == 1:
        return positions.unsqueeze(0)
    return positions


LOCAL_POSITIONS = (
    "{name}: every rank's position ids are 0 .. S_local - 1, so each rank's slice would be a sequence of its "
    "own: the model was most likely called without the shard's global position ids; pass "
    "position_ids=shard.position_ids (shard_batch's). If the row really packs one sequence per rank, confirm "
    "it with cu_seq_lens_q=shard.cu_seqlens (a model that does not pass its keyword arguments on to its attention, "
    "Nemotron for one, cannot be told: pack the row so that not every rank holds exactly one whole sequence)")


def batch_of(sp, name: str, B: int, Sq: int, kv: int, position_ids, attention_mask, cache, key) -> ForwardBatch:
    """The forward's batch (:class:`ForwardBatch`), from what every rank's create_*_mask got: one exchange of the facts
    each refusal is decided on (raised on every rank alike, so none waits in the attention's all-to-all), then
    the batch's SequenceContext from the position ids (one more exchange: packed rows found in the whole row)."""
    device = position_ids.device if isinstance(position_ids, torch.Tensor) else None
    like = attention_mask if isinstance(attention_mask, torch.Tensor) else position_ids
    pos, odd_pos = None, 0
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != Sq \
                or position_ids.shape[0] not in (1, B):
            odd_pos = 1  # raised below, on every rank
        else:
            pos = position_ids.expand(B, Sq)
    padded = int(isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                 and not bool(attention_mask.all()))
    local = int(pos is not None and bool((pos == torch.arange(Sq, device=device)).all()))
    head = caller_head_arguments()
    aux = head.head is not None and router_logits_requested(head.head.config, head.router_logits) \
        and computes_aux_loss(head.head)
    rows = exchange(sp, [B, Sq, kv, padded, odd_pos, int(pos is not None), local,
                         int(pos is not None and restarts(pos, sp.rank)), int(attention_mask is not None),
                         int(cache is not None), int(head.labels), int(head.keeps_some), int(aux)], like)
    if any(r[:3] != rows[0][:3] for r in rows):
        raise ValueError(f"{name}: the ranks passed different batch / query / key lengths: {[r[:3] for r in rows]}")
    if any(r[12] != rows[0][12] for r in rows):
        raise ValueError(f"{name}: some ranks asked for the routers' load-balancing loss (output_router_logits) and "
                         f"others not {of_ranks([k for k, r in enumerate(rows) if r[12]])}")
    for i, why in ((10, LABELS), (11, LOGITS_TO_KEEP)):
        if any(r[i] for r in rows):
            raise NotImplementedError(f"{name}: {why} {of_ranks([k for k, r in enumerate(rows) if r[i]])}")
    if any(r[3] for r in rows):
        raise NotImplementedError(f"{name}: padding attention masks are not supported (every sequence is whole "
                                  "and causal; pack or trim the batch); a rank of the group got one")
    if any(r[4] for r in rows):
        raise NotImplementedError(f"{name}: position ids of another shape than the batch's [B, S_local] = "
                                  f"[{B}, {Sq}] (e.g. multimodal 3-D positions) are not supported; a rank of "
                                  "the group got such")
    if any(r[5] != rows[0][5] for r in rows):
        raise ValueError(f"{name}: some ranks passed position ids and others none")
    if kv != Sq:
        raise NotImplementedError(f"{name}: a KV cache (query length {Sq}, key length {kv}) is not supported; call "
                                  "the model with use_cache=False")
    # Every rank's slice 0 .. S_local - 1: most likely the model computed local positions because none were
    # passed (the attention then asks for the packed offsets to confirm them).
    local_only = pos is not None and sp.size > 1 and all(r[6] for r in rows)
    if local_only and B != 1:
        raise ValueError(LOCAL_POSITIONS.format(name=name))
    context = positions_context(pos, sp, name, B, any(r[7] for r in rows))
    if context.packed and any(r[8] or r[9] for r in rows):
        raise NotImplementedError(
            f"{name}: a packed row (position ids that restart) with "
            f"{'an attention mask' if any(r[8] for r in rows) else 'a KV cache'}: transformers then attends "
            "across the sequences; pass no attention mask and use_cache=False")
    return ForwardBatch(key, (position_ids, attention_mask, cache), context, local_only, head.head if aux else None)


def given_offsets(forward: Optional[ForwardBatch], sp, kwargs: dict, name: str, like) -> Optional[Tuple[int, ...]]:
    """The caller's ``cu_seq_lens_q`` / ``cu_seq_lens_k``, agreed across the group once per forward (every
    attention call of a forward gets the very same objects; others are agreed again)."""
    q, k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if forward is not None and forward.given is not None and forward.given[0] is q and forward.given[1] is k:
        return forward.given_offsets
    offsets = agreed_offsets(sp, q, k, name, like)
    if forward is not None:
        forward.given, forward.given_offsets = (q, k), offsets
    return offsets
