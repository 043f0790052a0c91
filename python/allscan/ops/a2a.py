"""Chunked all-to-all for Ulysses sequence parallelism: scatter-heads and gather-heads.

Tensors are laid out ``[B, S_local, H, D]`` on the sequence-sharded side (rank ``p`` holds shard
``p`` of the sequence) and ``[B, P * S_local, n_r, D]`` on the head-sharded side (rank ``r`` holds
the whole sequence for its heads ``[lo_r, hi_r)``). A *head map* is the list of the ``P`` ranges
``(lo_r, hi_r)``; ranges may be empty, uneven and, for grouped-query attention's replicated k/v
heads, overlap.

- :func:`scatter_heads`: ``out_r[:, p*S_local + s, j] = x_p[:, s, lo_r + j]``.
- :func:`gather_heads`: ``out_p[:, s, h] = sum over r with lo_r <= h < hi_r of y_r[:, p*S_local + s, h - lo_r]``
  (one term for disjoint ranges: then it is scatter's inverse; in general it is scatter's adjoint,
  so each is the other's backward). Heads that no rank holds are zero.

CUDA tensors on an NCCL group go through the C++ core (``allscan._C``: fused pack/unpack kernels
around one NCCL group of send/recv pairs, q/k/v of a chunk in one call). Anything else (CPU tensors
on gloo, or ``ALLSCAN_A2A_IMPL=torch``) goes through :mod:`allscan.ops._a2a_dist`
(``all_to_all_single``), which is also the correctness oracle of the C++ path.

Both ops are ``torch.library`` custom ops (``allscan::scatter_heads``, ``allscan::gather_heads``) with
fake implementations and autograd; the group travels as its name. The head maps are built in
:mod:`allscan.ops._a2a_maps` (re-exported here), the arguments checked in :mod:`allscan.ops._a2a_checks`.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C, _comm
from .._agreement import announce_invalid, check_across_ranks, signature_hash
from .._dtypes import DTYPE_CODES
from .._settings import settings
from .._threads import one_thread
from ._launch import traced_refusal, validated_group
from . import _a2a_dist
from ._a2a_checks import check_head_map, check_tensor, resolve_head_map, signature_fields, validate_call
from ._a2a_dist import GATHER, SCATTER, HeadMap, Range, overlaps
from ._a2a_maps import chunk_head_ranges, kv_head_ranges, split_heads

__all__ = [
    "SCATTER",
    "GATHER",
    "split_heads",
    "kv_head_ranges",
    "chunk_head_ranges",
    "scatter_heads",
    "gather_heads",
    "scatter_heads_multi",
    "gather_heads_multi",
    "a2a_multi",
]


# ------------------------------------------------------------------------------------------------
# Launch: the C++ core on NCCL, else torch.distributed (ops/_a2a_dist.py)
# ------------------------------------------------------------------------------------------------

def use_cpp(group, x: torch.Tensor) -> bool:
    return settings.a2a_impl != "torch" and _comm.uses_nccl(group, x)


def _cpp_a2a(direction: int, xs: Sequence[torch.Tensor], maps: Sequence[HeadMap], num_heads: Sequence[int],
             group, outs: Optional[Sequence[torch.Tensor]], accumulate: Sequence[bool],
             stream: Optional["torch.cuda.Stream"] = None, event=None, signature: int = 0) -> List[torch.Tensor]:
    x0 = xs[0]
    device = x0.device
    comm = _comm.get_communicator(group, device)
    P, me = comm.size, comm.rank
    B, S, _, D = x0.shape
    Sl = S if direction == SCATTER else S // P
    if outs is None:
        outs = []
        for x, hm, H, acc in zip(xs, maps, num_heads, accumulate):
            if direction == SCATTER:
                outs.append(x.new_empty(B, P * Sl, hm[me][1] - hm[me][0], D))
            else:
                covered = sum(hi - lo for lo, hi in hm) >= H and not overlaps(hm)
                outs.append(x.new_empty(B, Sl, H, D) if covered else x.new_zeros(B, Sl, H, D))
    code = DTYPE_CODES[x0.dtype]
    specs = [
        (x.data_ptr(), o.data_ptr(), int(H), [lo for lo, _ in hm], [hi for _, hi in hm], int(bool(acc)))
        for x, o, hm, H, acc in zip(xs, outs, maps, num_heads, accumulate)
    ]
    stream = stream if stream is not None else torch.cuda.current_stream(device)
    ws_bytes = _C.a2a_workspace_size(P, me, direction, B, Sl, D, code, specs, check_comm=comm.handle,
                                     signature=signature)
    ws_ptr = 0
    ws = None
    if ws_bytes:
        # Allocated with `stream` current: the caching allocator only hands this block to later work
        # on the same stream, which runs after the all-to-all.
        with torch.cuda.stream(stream):
            ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
        ws_ptr = ws.data_ptr()
    # The completion event is recorded through torch after the enqueue, never passed to C++ as a raw
    # handle: torch.cuda.Event creates its cudaEvent lazily on first record(), so a fresh event's
    # `cuda_event` is 0, the C++ side then recorded nothing, and a stream.wait_event() on it was a
    # silent no-op (the Ulysses pipeline read its scatter buffers before the all-to-all wrote them).
    _C.a2a(comm.nccl, P, direction, B, Sl, D, code, specs, ws_ptr, ws_bytes, stream.cuda_stream, 0,
           check_comm=comm.handle, signature=signature)
    if event is not None:
        event.record(stream)
    return list(outs)


def a2a_multi(direction: int, xs: Sequence[torch.Tensor], maps: Sequence[Sequence[Range]], num_heads: Sequence[int],
              group=None, *, outs: Optional[Sequence[torch.Tensor]] = None, accumulate: Optional[Sequence[bool]] = None,
              names: Optional[Sequence[str]] = None, stream=None, event=None, check: bool = True,
              call_signature: int = 0) -> List[torch.Tensor]:
    """Scatter-heads (direction 0) or gather-heads (1) of up to 4 tensors in one collective.

    ``outs`` (optional) are written in place (gather: only the heads some rank holds; with
    ``accumulate[t]`` added to). ``stream`` (CUDA only): enqueue there instead of on the current
    stream; ``event`` is then recorded on it after the call. ``call_signature``: a hash of the calling
    op's own arguments (Ulysses: causal, scale, packing), folded into the in-band signature on the
    core, so that ranks switching to different signatures each checked before are caught as ranks
    switching the all-to-all's own shapes are. No autograd (see :func:`scatter_heads`).
    """
    options = dict(outs=outs, accumulate=accumulate, names=names, stream=stream, event=event, check=check,
                   call_signature=call_signature)
    if torch.compiler.is_compiling():  # traced into a graph: no host-thread bookkeeping there
        return _a2a_multi(direction, xs, maps, num_heads, group, **options)
    with one_thread(group, "a2a") as busy:
        return _a2a_multi(direction, xs, maps, num_heads, busy.group, **options)


def _a2a_multi(direction, xs, maps, num_heads, group, *, outs, accumulate, names, stream, event, check,
               call_signature):
    group = _comm.normalize_group(group)
    names = list(names) if names is not None else [f"tensors[{i}]" for i in range(len(xs))]
    accumulate = list(accumulate) if accumulate is not None else [False] * len(xs)
    P = dist.get_world_size(group)
    me = dist.get_rank(group)
    op = "a2a.scatter_heads" if direction == SCATTER else "a2a.gather_heads"
    try:
        xs = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in xs]
        _, _, _, maps = validate_call(direction, xs, list(maps), list(num_heads), P, me, names)
        if direction == SCATTER and any(accumulate):
            raise ValueError("allscan.a2a: accumulate is only defined for gather-heads")
        if outs is not None:
            outs = list(outs)
            for o, x, hm, H, n in zip(outs, xs, maps, num_heads, names):
                B, S, _, D = x.shape
                want = (B, S * P, hm[me][1] - hm[me][0], D) if direction == SCATTER else (B, S // P, H, D)
                if tuple(o.shape) != want or not o.is_contiguous() or o.dtype != x.dtype or o.device != x.device:
                    raise ValueError(
                        f"allscan.a2a: output for {n} must be a contiguous {x.dtype} tensor of shape {want} on {x.device}, "
                        f"got {o.dtype} {tuple(o.shape)} on {o.device}"
                    )
    except Exception as e:  # a bad argument, or out of memory making the inputs contiguous
        if check:
            # The other ranks may be in the signature exchange: join it, so they raise too.
            device = xs[0].device if xs and isinstance(xs[0], torch.Tensor) else torch.device("cpu")
            announce_invalid(group, device, op, str(e))
        raise
    cpp = use_cpp(group, xs[0])
    signs = cpp and settings.check not in ("trust", "never")
    fields = signature_fields(direction, xs, maps, num_heads, accumulate) if check or signs else None
    if cpp:
        if check:
            check_across_ranks(group, xs[0].device, op, fields)
        # The in-band signature travels whether or not this call checked on the host (the Ulysses
        # layer checks once per forward, then moves its chunks with check=False).
        in_band = fields + [("call signature", call_signature)] if call_signature else fields
        return _cpp_a2a(direction, xs, maps, num_heads, group, outs, accumulate, stream, event,
                        signature_hash(op, in_band) if signs else 0)
    on_stream = stream is not None and xs[0].is_cuda
    with torch.cuda.stream(stream) if on_stream else contextlib.nullcontext():
        try:
            # its buffers before the check: a rank out of memory here tells its peers in the check
            exchange = _a2a_dist.prepare(direction, xs, maps, num_heads, group, outs, accumulate)
        except Exception as e:
            if check:
                announce_invalid(group, xs[0].device, op, f"its buffers failed: {type(e).__name__}: {e}")
            raise
        if check:
            check_across_ranks(group, xs[0].device, op, fields)
        res = exchange()
        if on_stream and event is not None:
            event.record(stream)
    return res


def scatter_heads_multi(xs, maps, group=None, **kw) -> List[torch.Tensor]:
    """Scatter-heads of several tensors (q, k, v) in one collective; ``maps[t]`` is tensor t's head map."""
    return a2a_multi(SCATTER, xs, maps, [x.shape[2] for x in xs], group, **kw)


def gather_heads_multi(ys, maps, num_heads, group=None, **kw) -> List[torch.Tensor]:
    """Gather-heads of several tensors in one collective (the inverse / adjoint of scatter)."""
    return a2a_multi(GATHER, ys, maps, num_heads, group, **kw)


# ------------------------------------------------------------------------------------------------
# Custom ops with autograd
# ------------------------------------------------------------------------------------------------

def _maps_from_lists(head_lo: List[int], head_hi: List[int]) -> HeadMap:
    return list(zip(head_lo, head_hi))


# The ops take this rank's place in the group (``group_rank``): the fake's shapes and the traced gradient's
# depend on it, and a compiled graph's cache key holds the ops' arguments, not the group's (docs/design.md,
# torch.compile).
@torch.library.custom_op("allscan::scatter_heads", mutates_args=())
def _scatter_heads_op(x: torch.Tensor, group_name: str, group_rank: int, head_lo: List[int],
                      head_hi: List[int]) -> torch.Tensor:
    group = _comm.resolve_group(group_name)
    return a2a_multi(SCATTER, [x], [_maps_from_lists(head_lo, head_hi)], [x.shape[2]], group, names=["x"])[0]


@_scatter_heads_op.register_fake
def _(x, group_name, group_rank, head_lo, head_hi):
    P = len(head_lo)
    return x.new_empty(x.shape[0], x.shape[1] * P, head_hi[group_rank] - head_lo[group_rank], x.shape[3])


@torch.library.custom_op("allscan::gather_heads", mutates_args=())
def _gather_heads_op(y: torch.Tensor, group_name: str, group_rank: int, num_heads: int, head_lo: List[int],
                     head_hi: List[int]) -> torch.Tensor:
    group = _comm.resolve_group(group_name)
    return a2a_multi(GATHER, [y], [_maps_from_lists(head_lo, head_hi)], [num_heads], group, names=["y"])[0]


@_gather_heads_op.register_fake
def _(y, group_name, group_rank, num_heads, head_lo, head_hi):
    P = len(head_lo)
    return y.new_empty(y.shape[0], y.shape[1] // P, num_heads, y.shape[3])


def _scatter_setup(ctx, inputs, output):
    x, group_name, group_rank, head_lo, head_hi = inputs
    ctx.group_name, ctx.group_rank, ctx.head_lo, ctx.head_hi, ctx.num_heads = (group_name, group_rank, head_lo,
                                                                               head_hi, x.shape[2])


def _scatter_backward(ctx, grad):
    return (_gather_heads_op(grad.contiguous(), ctx.group_name, ctx.group_rank, ctx.num_heads, ctx.head_lo,
                             ctx.head_hi), None, None, None, None)


def _gather_setup(ctx, inputs, output):
    y, group_name, group_rank, num_heads, head_lo, head_hi = inputs
    ctx.group_name, ctx.group_rank, ctx.head_lo, ctx.head_hi = group_name, group_rank, head_lo, head_hi


def _gather_backward(ctx, grad):
    return (_scatter_heads_op(grad.contiguous(), ctx.group_name, ctx.group_rank, ctx.head_lo, ctx.head_hi),
            None, None, None, None, None)


_scatter_heads_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)
_gather_heads_op.register_autograd(_gather_backward, setup_context=_gather_setup)


def scatter_heads(x: torch.Tensor, group=None, *, head_range: Optional[Range] = None,
                  head_map: Optional[Sequence[Range]] = None) -> torch.Tensor:
    """Sequence-sharded ``[B, S_local, H, D]`` -> whole sequence, this rank's heads ``[B, P*S_local, n, D]``.

    The heads moved are ``head_range = (h0, h1)`` (default all) split unevenly over the ranks
    (:func:`split_heads`), or an explicit ``head_map`` (one ``(lo, hi)`` per rank). Differentiable
    (the backward is :func:`gather_heads`); a ``torch.library`` custom op.
    """
    group = _comm.normalize_group(group)
    P, me = dist.get_world_size(group), dist.get_rank(group)  # traced too: no cache
    hm = []

    def validate():
        check_tensor(x, "x")
        hm.extend(check_head_map(resolve_head_map(head_map, head_range, x.shape[2], P), x.shape[2], P, "head_map"))

    try:
        validated_group(group, x, "a2a.scatter_heads", validate)
    except (TypeError, ValueError) as e:  # under torch.compile: refused when the graph runs, on every rank
        return traced_refusal(group, x, "a2a.scatter_heads", e)
    return _scatter_heads_op(x.contiguous(), _comm.group_name(group), me, [lo for lo, _ in hm],
                             [hi for _, hi in hm])


def gather_heads(y: torch.Tensor, group=None, *, num_heads: Optional[int] = None, head_range: Optional[Range] = None,
                 head_map: Optional[Sequence[Range]] = None) -> torch.Tensor:
    """Whole sequence, this rank's heads ``[B, S, n, D]`` -> sequence-sharded ``[B, S/P, num_heads, D]``.

    The inverse of :func:`scatter_heads` with the same ``head_range``/``head_map`` (with an
    overlapping map it sums the copies: scatter's adjoint). ``num_heads`` is the head count of the
    output: required unless ``head_map`` is given (then it defaults to the largest ``hi``); with
    ``head_range`` the output keeps all ``num_heads`` heads and those outside the range are zero.
    """
    group = _comm.normalize_group(group)
    P, me = dist.get_world_size(group), dist.get_rank(group)  # traced too: no cache
    hm = []

    def validate():
        nonlocal num_heads
        check_tensor(y, "y")
        if num_heads is None:
            if head_map is None:
                raise ValueError("allscan.a2a.gather_heads: num_heads (heads of the output) is required unless "
                                 "head_map is given")
            num_heads = max(int(hi) for _, hi in head_map)
        hm.extend(check_head_map(resolve_head_map(head_map, head_range, num_heads, P), num_heads, P, "head_map"))

    try:
        validated_group(group, y, "a2a.gather_heads", validate)
    except (TypeError, ValueError) as e:  # under torch.compile: refused when the graph runs, on every rank
        return traced_refusal(group, y, "a2a.gather_heads", e)
    return _gather_heads_op(y.contiguous(), _comm.group_name(group), me, int(num_heads),
                            [lo for lo, _ in hm], [hi for _, hi in hm])
