"""The public function :func:`ulysses_attention`: checks (on every rank, a refusal announced to the
peers), ``num_chunks="auto"``, the cached plan, then the autograd function or the forward pass alone;
under torch.compile the traced form (:mod:`.traced`)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..._comm import normalize_group
from ..._contract import announce_invalid, check_across_ranks
from ...context import SequenceContext
from .._launch import PlanCache, traced_refusal
from ..batch_context import context_conflict, context_fields
from .checks import OP, check_inputs, check_options, packed_bounds, refuse_packed_while_tracing, signature
from .passes import UlyssesFn, forward_pass
from .pipeline import use_streams
from .plan import CallSpec, ChunkPlan
from .traced import traced_attention
from .tune import measure

_AUTO_CACHE = PlanCache()  # key -> (chosen chunk count, timings); bounded LRU
_PLANS = PlanCache()  # key -> ChunkPlan; bounded LRU


def clear_auto_cache() -> None:
    """Forget every chunk count ``num_chunks="auto"`` chose and every cached plan."""
    _AUTO_CACHE.clear()
    _PLANS.clear()


def ulysses_attention(q, k, v, group=None, *, causal: bool = False, scale: Optional[float] = None,
                      num_chunks: Union[int, str] = "auto", chunk_weights: Optional[Sequence[float]] = None,
                      max_chunks: Optional[int] = None, cu_seqlens=None, return_info: bool = False,
                      window: Optional[int] = None, softcap: Optional[float] = None,
                      sinks: Optional[torch.Tensor] = None, context=None):
    """Functional form of :class:`UlyssesAttention` (see there). Traced by torch.compile it is plain
    Ulysses with one head chunk (:mod:`allscan.ops.ulysses.traced`), without packed sequences.

    Per-head options, honoured exactly on the whole sequence each rank holds after the all-to-all
    (:mod:`.masked`): ``window`` (causal only: token i sees keys ``i - window < j <= i``, never across a
    packed sequence's start), ``softcap`` (scores ``softcap * tanh(scores / softcap)``), ``sinks`` (``[Hq]``,
    one logit per query head in the softmax denominator, GPT-OSS; differentiable: each rank's gradient holds
    its heads' share, summed over the group it is one process's). Not traced by torch.compile.

    ``context``: the batch's :class:`allscan.SequenceContext`, instead of ``group`` and ``cu_seqlens`` (its
    packed offsets were agreed across the ranks when it was built: not compared again per call)."""
    conflict = context_conflict(context, group, cu_seqlens, OP)
    given = conflict is None and context is not None
    if isinstance(context, SequenceContext):  # its group, where its peers are (a conflict is told there too)
        group = context.group.process_group
        if group is None:  # one process: no peer to tell
            raise conflict or ValueError(f"{OP}: the context's group is one process; Ulysses attention needs a "
                                         "process group")
    else:
        group = normalize_group(group)
    if torch.compiler.is_compiling():
        if conflict is not None:  # refused when the graph runs, on every rank
            return traced_refusal(group, q, OP, conflict)
        if cu_seqlens is not None or (given and context.packed):
            refuse_packed_while_tracing(OP)
        if window is not None or softcap is not None or sinks is not None:
            raise NotImplementedError(f"{OP}: a sliding window, soft-cap or sinks under torch.compile are not "
                                      "traced; call it eagerly")
        chunks = 0 if num_chunks == "auto" else num_chunks
        if not (chunks == 0 or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1)):
            chunks = -1  # refused by the op, on every rank, when it runs
        out = traced_attention(q, k, v, group, causal, scale, chunks)
        return (out, {"num_chunks": 1, "auto": None}) if return_info else out
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    # the packed cut changes from batch to batch: compared every call, unless a context agreed on it once per
    # batch (a rank whose context conflicts tells its peers as their context path expects)
    every_call = cu_seqlens is not None and not isinstance(context, SequenceContext)
    try:
        if conflict is not None:
            raise conflict
        B, Sl, Hq, Hkv, D = check_inputs(q, k, v, world)
        if isinstance(num_chunks, str):
            if num_chunks != "auto":
                raise ValueError(f"UlyssesAttention: num_chunks must be a positive int or 'auto', got {num_chunks!r}")
        elif isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or not 1 <= num_chunks <= Hq:
            raise ValueError(f"UlyssesAttention: num_chunks must be 'auto' or an int in [1, {q.shape[2]}] (query heads), got {num_chunks!r}")
        if chunk_weights is not None and (num_chunks == "auto" or len(chunk_weights) != num_chunks
                                          or any(w <= 0 for w in chunk_weights)):
            raise ValueError("UlyssesAttention: chunk_weights needs an int num_chunks and one positive weight per chunk")
        if given:
            context.cut(Sl, B, OP)  # its tokens per rank and, packed, one row
            bounds = context.cu_seqlens
        else:
            bounds = packed_bounds(cu_seqlens, B, Sl * world)
        options = check_options(window, softcap, sinks, q, causal, Sl * world)
    except (ValueError, TypeError) as e:
        # The other ranks may be in the signature exchange: join it, so they raise too. Calls packed by
        # cu_seqlens exchange on every call (their bounds change from batch to batch and are read on the host
        # anyway); a context's were agreed when it was built.
        announce_invalid(group, q.device if isinstance(q, torch.Tensor) else torch.device("cpu"), OP, str(e),
                         every_call=every_call)
        raise
    # A mismatch raises on every rank instead of hanging in an all-to-all.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    fields = signature(q, k, causal, scale, 0 if num_chunks == "auto" else num_chunks, needs_grad,
                       None if given else bounds, options) + context_fields(context if given else None)
    check_across_ranks(group, q.device, OP, fields, every_call=every_call)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    info = None
    if num_chunks == "auto":
        if q.is_cuda and world > 1 and use_streams(q):
            train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            # measured once per shape: packed sequences (whose bounds change from batch to batch) are timed
            # as one sequence
            key = (group.group_name, B, Sl, Hq, Hkv, D, q.dtype, bool(causal), scale, max_chunks, train)
            hit = _AUTO_CACHE.get(key)
            if hit is None:
                with torch.no_grad():
                    spec = CallSpec(group=group, world=world, me=me, B=B, Sl=Sl, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
                                    scale=scale)  # bounds None: timed as one sequence
                    hit = measure(spec, q, k, v, max_chunks, train=train)
                _AUTO_CACHE[key] = hit
            num_chunks, info = hit
        else:
            num_chunks = 1  # no second stream: nothing to overlap
    pkey = (group.group_name, world, me, B, Sl, Hq, Hkv, D, int(num_chunks),
            tuple(chunk_weights) if chunk_weights is not None else None, bool(causal), scale, bounds,
            options.window, options.softcap, options.sinks is not None)
    plan = _PLANS.get(pkey)
    if plan is None:
        spec = CallSpec(group=group, world=world, me=me, B=B, Sl=Sl, Hq=Hq, Hkv=Hkv, D=D, causal=causal, scale=scale,
                        bounds=bounds, window=options.window, softcap=options.softcap, sinks=options.sinks is not None)
        plan = ChunkPlan(spec, int(num_chunks), chunk_weights)
        _PLANS[pkey] = plan
    sinks = options.sinks
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None):
        out = UlyssesFn.apply(q, k, v, sinks, plan)
    else:
        out, _ = forward_pass(plan, q, k, v, keep_graph=False, sinks=sinks)
    if return_info:
        return out, {"num_chunks": int(num_chunks), "auto": info}
    return out
