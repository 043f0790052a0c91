"""What the transformers integrations share: the sequence-parallel group resolved once, a small exchange of
per-rank facts (so that every rank raises alike), and the batch's :class:`allscan.context.SequenceContext`
(the packed cut, made once per forward and handed to every layer).

- :func:`sp_group`: ``group`` as the integrations take it (None, ``allscan.ops.LOCAL`` or
  ``allscan.context.LOCAL``, a ProcessGroup, a group name, a one-dimensional ``DeviceMesh`` such as
  ``mesh["sp"]``) -> an :class:`allscan.context.SPGroup`; :func:`op_group` turns it back into what
  allscan's ops take.
- :func:`exchange`: one all-gather of a few integers per rank (the facts each refusal is decided on).
- :func:`positions_context`: the context of a batch from this rank's position ids (one exchange,
  :meth:`SequenceContext.from_position_ids`), after refusing several packed rows by name.
- :func:`pooling_refusal`: a model whose head pools each row at one position (sequence classification), which no
  rank's shard holds, named (both integrations refuse it).
- :func:`agreed_offsets`: offsets a caller passed (transformers' flash kwargs ``cu_seq_lens_q`` /
  ``cu_seq_lens_k``), agreed across the group: offsets missing, unreadable or different on some rank
  raise ``ValueError`` on every rank, never a hang.
"""
from __future__ import annotations

import re
import sys
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from allscan import ops as _ops
from allscan.context import SequenceContext, SPGroup, offsets_digest, resolve_sp_group

__all__ = ["CONTEXT_KWARG", "sp_group", "op_group", "comm_device", "exchange", "restarts", "positions_context",
           "agreed_offsets", "offsets_of", "local_attention", "handed_context", "pooling_refusal",
           "caller_head_arguments", "HeadArguments", "positions_refusal", "config_and_text"]

CONTEXT_KWARG = "allscan_context"
"""The keyword under which a model-level hook hands the batch's SequenceContext to every layer (transformers
passes a model's extra keyword arguments down to each decoder layer, its mixers and attention functions)."""


def require_transformers(who: str):
    """The transformers package, or an ImportError that names the install."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{who} needs Hugging Face transformers 5.x: pip install 'transformers>=5,<6'") from e
    return transformers


# Heads that read one position of the whole sequence per row (transformers' sequence classification pools the
# logits at each row's last non-padding token): on a shard each rank would pool its own last token.
_POOLING_HEAD = re.compile(r"For(SequenceClassification|MultipleChoice)$")


def pooling_refusal(model: torch.nn.Module, where: str) -> Optional[str]:
    """Why ``model``'s head cannot run on a shard (None: it can): a head that pools each row at one position."""
    for name, mod in model.named_modules():
        head = next((c.__name__ for c in type(mod).__mro__ if _POOLING_HEAD.search(c.__name__)), None)
        if head is not None:
            return (f"{where}: {name or '<model>'} ({type(mod).__name__}) pools each row at one position (its last "
                    f"token, as {head} does), which only one rank's shard holds: each rank would pool its own last "
                    "token. Run its base model (per-token hidden states, sequence-parallel) and pool on the rank "
                    "holding that position")
    return None


def config_and_text(config) -> List[object]:
    """``config`` and its text config (a multimodal model's), once each; only ``config`` where it has none (or is
    not a transformers config)."""
    try:
        text = config.get_text_config()
    except Exception:  # noqa: BLE001 - not a transformers config: only its own attributes
        text = config
    return [c for c in {id(c): c for c in (config, text)}.values() if c is not None]


def positions_refusal(config, where: str) -> Optional[str]:
    """Why a model with this config cannot run on a shard (None: it can): options whose arithmetic reads the
    call's positions as if they were the whole sequence's: a rope whose frequencies follow the largest position id
    of the call (transformers' ``dynamic`` and ``longrope``: each rank would see its own shard's), Llama 4's
    attention temperature tuning (scales from the cache positions, 0 .. T_local - 1 on every rank)."""
    if config is None:
        return None
    found = []
    for cfg in config_and_text(config):
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        per_kind = isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values())
        for params in (rope.values() if per_kind else [rope]):
            kind = str((params.get("rope_type") or params.get("type") or "")) if isinstance(params, dict) else ""
            if "dynamic" in kind or kind == "longrope":
                found.append(f"rope_type {kind!r} is not supported under sequence parallelism: its frequencies follow "
                             "the call's largest position id, which each rank sees for its own shard (one process "
                             "sees the whole sequence's)")
        if getattr(cfg, "attn_temperature_tuning", False) and not all(getattr(cfg, "no_rope_layers", None) or [1]):
            found.append("attn_temperature_tuning=True is not supported under sequence parallelism: the NoPE layers' "
                         "attention scales follow the cache positions, 0 .. T_local - 1 on every rank (they leave 1 "
                         "past floor_scale tokens; turning the tuning off changes the model there)")
    return f"{where}: " + "; ".join(sorted(set(found))) if found else None


def sp_group(group, op: str) -> SPGroup:
    """``group`` resolved once (see the module docstring; ``allscan.ops.LOCAL`` is one process)."""
    return resolve_sp_group(group, op)


LABELS = ("labels are not supported: the model would shift them within each shard and average over the shard; "
          "pass no labels and use causal_lm_loss(logits, shard_batch(input_ids, labels, ...))")
LOGITS_TO_KEEP = ("logits_to_keep (the logits of the last k tokens, or of given indices) is not supported: each rank "
                  "would keep those of its own shard; pass none and take the logits you need from the rank that "
                  "holds their tokens")


def of_ranks(ranks: Sequence[int]) -> str:
    """``(rank 1 of the group)`` / ``(ranks 0, 1 of the group)``: which ranks a refusal is for."""
    return f"(rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of the group)"


def keeps_some_logits(value) -> bool:
    """Whether a model's ``logits_to_keep`` argument asks for less than every token's logits (0 or None: all)."""
    return value is not None and not (isinstance(value, int) and value == 0)


def op_group(sp: SPGroup):
    """The group as allscan's ops take it: the process group, or ``allscan.ops.LOCAL`` for one process."""
    return _ops.LOCAL if sp.process_group is None else sp.process_group


def comm_device(sp: SPGroup, like: Optional[torch.Tensor] = None) -> torch.device:
    """Where a small exchange on ``sp`` lives: the current CUDA device on NCCL, else the CPU."""
    if sp.process_group is None:
        return torch.device("cpu")
    backend = str(dist.get_backend(sp.process_group)).lower()
    if "nccl" in backend and ("gloo" not in backend or (like is not None and like.is_cuda)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(sp: SPGroup, values: Sequence[int], like: Optional[torch.Tensor] = None) -> List[List[int]]:
    """Every rank's ``values`` (a few integers, as many on every rank), in rank order: one all-gather and one
    host copy. With one process, ``[values]``."""
    if sp.size == 1:
        return [[int(v) for v in values]]
    row = torch.tensor([int(v) for v in values], dtype=torch.int64, device=comm_device(sp, like))
    rows = [torch.empty_like(row) for _ in range(sp.size)]
    dist.all_gather(rows, row, group=sp.process_group)
    return torch.stack(rows).tolist()


def restarts(positions: torch.Tensor, rank: int) -> bool:
    """Whether this rank's position ids ``[B, T_local]`` start a sequence anywhere but at the whole row's first
    token: a step other than +1 inside the shard, or an id 0 at the first token of a rank after the first (what
    this rank sees alone; the exchange in :func:`positions_context` sees the rest)."""
    if positions.shape[-1] > 1 and bool((positions[..., 1:] - positions[..., :-1] != 1).any()):
        return True
    return rank > 0 and bool((positions[..., 0] == 0).any())


def positions_context(positions: Optional[torch.Tensor], sp: SPGroup, name: str, batch: int,
                      any_restarts: bool) -> SequenceContext:
    """The batch's context from this rank's position ids ``[B, T_local]`` (None: whole sequences, no exchange).
    ``any_restarts``: whether some rank's ids restart (:func:`restarts`, exchanged by the caller), the same on
    every rank: several rows that restart are refused with ``NotImplementedError`` before the exchange. Ids that
    are not whole sequences counted from 0 raise ``ValueError`` on every rank (the context's own check)."""
    if positions is None:
        return SequenceContext(sp)
    if batch != 1 and any_restarts:
        raise NotImplementedError(f"{name}: packed rows (position ids that restart) in a batch of {batch} rows are "
                                  "not supported; pack the sequences into one row per batch (B = 1)")
    return SequenceContext.from_position_ids(positions, sp)


def offsets_of(value) -> Optional[List[int]]:
    """Offsets passed as a tensor or a sequence of ints, as a list of ints (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def agreed_offsets(sp: SPGroup, cu_q, cu_k, name: str,
                   like: Optional[torch.Tensor] = None) -> Optional[Tuple[int, ...]]:
    """The packed offsets a caller passed as ``cu_seq_lens_q`` / ``cu_seq_lens_k``, agreed across the group in one
    exchange: None where no rank passed any; the offsets where every rank passed the same ones (q equal to k);
    otherwise ``ValueError`` on every rank, naming what differs (never a rank waiting for its peers). Whether
    they are valid for the batch is the caller's to judge: they are the same on every rank."""
    problem = ""
    try:
        q, k = offsets_of(cu_q), offsets_of(cu_k)
    except (TypeError, ValueError, RuntimeError):
        q = k = None
        problem = (f"cu_seq_lens_q / cu_seq_lens_k must be integer tensors or sequences of global offsets, got "
                   f"{type(cu_q).__name__} / {type(cu_k).__name__}")
    if not problem and q is not None and k is not None and q != k:
        problem = f"cu_seq_lens_q {q} and cu_seq_lens_k {k} differ (self-attention over packed sequences)"
    cu = q if q is not None else k
    mine = [int(q is not None), int(k is not None), int(bool(problem)), len(cu or ()),
            offsets_digest(cu) if cu is not None else 0]
    rows = exchange(sp, mine, like)

    def ranks(rs):
        return "" if sp.size == 1 else " " + of_ranks(rs)

    bad = [r for r, row in enumerate(rows) if row[2]]
    if bad:
        raise ValueError(f"{name}: {problem or 'the packed offsets passed are not valid on some ranks'}{ranks(bad)}")
    if any(row[:2] != rows[0][:2] for row in rows):
        given = [r for r, row in enumerate(rows) if row[0] or row[1]]
        raise ValueError(f"{name}: some ranks passed cu_seq_lens_q / cu_seq_lens_k and others none{ranks(given)}; "
                         "pass the same global offsets on every rank")
    if any(row[3:] != rows[0][3:] for row in rows):
        differ = [r for r, row in enumerate(rows) if row[3:] != rows[0][3:]]
        raise ValueError(f"{name}: the ranks passed different cu_seq_lens_q / cu_seq_lens_k (rank"
                         f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} differ from rank 0); pass "
                         "the same global offsets on every rank")
    return None if cu is None else tuple(cu)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bounds=None,
                    causal: bool = True) -> torch.Tensor:
    """SDPA of one process (a group of one), ``[B, S, H, D]`` in and out, fewer key/value heads than query heads
    repeated; with ``bounds`` (global offsets of packed sequences) each sequence attends to itself alone."""
    if bounds is not None:
        return torch.cat([local_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale, None, causal)
                          for a, b in zip(bounds[:-1], bounds[1:]) if b > a], dim=1)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def handed_context(kwargs: dict, group, batch: int, local_len: int, name: str,
                   like: Optional[torch.Tensor] = None) -> SequenceContext:
    """The batch's context at a layer: the one the model-level hook handed down (``kwargs[CONTEXT_KWARG]``);
    for a layer called on its own, the caller's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` agreed across the group
    (:func:`agreed_offsets`: one exchange at every such call, so a rank never waits alone), or whole sequences.
    Packed offsets need one row (B = 1)."""
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is not None:
        if not isinstance(ctx, SequenceContext):
            raise TypeError(f"{name}: {CONTEXT_KWARG} must be an allscan.context.SequenceContext, got "
                            f"{type(ctx).__name__}")
        return ctx
    sp = sp_group(group, name)
    if torch.compiler.is_compiling():  # no exchange while tracing: the model-level hook hands the context down
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise NotImplementedError(f"{name}: packed offsets (cu_seq_lens_q / _k) of a layer called on its own "
                                      "under torch.compile are not supported; call the whole model")
        return SequenceContext(sp)
    offsets = agreed_offsets(sp, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), name, like)
    if offsets is None:
        return SequenceContext(sp)
    if batch != 1:
        raise NotImplementedError(f"{name}: packed sequences need one row (B = 1), got B = {batch}")
    if offsets[-1] != sp.size * local_len:
        raise ValueError(f"{name}: cu_seq_lens_q must end at the whole row's length {sp.size} * {local_len} = "
                         f"{sp.size * local_len} (global offsets), got {list(offsets)}")
    return SequenceContext(sp, cu_seqlens=list(offsets))


class HeadArguments(NamedTuple):
    """What the forward of the head above a hook got (:func:`caller_head_arguments`)."""

    labels: bool = False       # labels given
    keeps_some: bool = False   # logits_to_keep keeps only some tokens' logits
    router_logits: Optional[bool] = None  # its output_router_logits (None: not given, the config's then)
    head: Optional[object] = None  # the head (a transformers PreTrainedModel); None where none is on the stack


def caller_head_arguments() -> HeadArguments:
    """What the transformers (or fla) model forward above the caller (the nearest enclosing one with a ``labels``
    or ``logits_to_keep`` parameter: a head's, e.g. ``*ForCausalLM``) got: read from that frame, for hooks that see
    no call arguments (register()'s mask functions) or sit on the base model inside a head; all unset where there
    is none (a bare model, or a call the stack does not show, as under torch.compile)."""
    tf = sys.modules.get("transformers")
    f = sys._getframe(2)
    for _ in range(32):
        if f is None or tf is None:
            break
        names = f.f_code.co_varnames
        if f.f_code.co_name == "forward" and ("labels" in names or "logits_to_keep" in names) \
                and isinstance(f.f_locals.get("self"), tf.PreTrainedModel):
            loc = f.f_locals
            router = loc.get("output_router_logits")
            return HeadArguments(loc.get("labels") is not None, keeps_some_logits(loc.get("logits_to_keep")),
                                 None if router is None else bool(router), loc["self"])
        f = f.f_back
    return HeadArguments()
