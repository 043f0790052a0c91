"""One shard of a delta-rule layer with the state entering it: its forward, its backward, and the
autograd function around them (the custom ops of :mod:`.compiled` run the same two functions).

Forward, on each rank (``be`` the local backend, :class:`~allscan.ops.delta.fla.FlaDelta` or
:class:`~allscan.ops.delta.chunk.TorchDelta`; ``segments`` the shard cut at packed sequences)::

    finals, M = be.states(...)                       every segment's final state from its own initial
                                                     state; M the first segment's transition (its
                                                     forward runs on [v | 0] from [h0 | I])
    S_in = scan(x, transition=M_scan, init=init)     x the state crossing the shard's end; in flight
                                                     during the next line
    o_head, Q', o_tail = be.outputs(...)             the outputs from the segments' own initial states,
                                                     and the map Q' from a state added to the first
                                                     segment's to its outputs
    o = [o_head + Q' S_in | o_tail],  final_0 = h_0 + M S_in

Backward. The state a rank passes on is its shard's final state from the whole incoming state, so the
gradient of everything local (q, k, v, g, beta, the gate parameters and the initial states) is the
local backward of the segments run from their whole initial states (``S_full = h0 + S_in`` for the
first), given ``do`` and the gradients of their final states; the one crossing the shard's end also
gets ``r``, the gradient arriving from later ranks: the reverse scan with the transposed transitions
of each rank's direct gradient of its incoming state, ``dy = Q'^T do + M^T dfinal_0``::

    dy = Q'^T do + M^T dfinal_0                      be.fold_state_grad (outputs_state_grad), first:
                                                     Q' is read once, and freed before the rest runs
    r = scan(dy, transition=M_scan^T, reverse=True)  (exclusive: r_p = dy_{p+1} + M_{p+1}^T r_{p+1})
    grads = be.backward(...)                         one backward over the shard, V columns only

So the backward never runs over the K extra columns the forward needs for Q' and M (nor their
gradients), and the transitions never need a gradient of their own. The chain head (group rank 0)
gets the gradient of ``init`` (the backward's gradient of its initial state).

What crosses the shard's end (``cross``): ``"own"``, the first segment's final state (one segment in
the shard); ``"ext"``, the final state of the shard's last packed segment (its gradient gets ``r``;
the transition is cut from the scan: no incoming state reaches that sequence); ``"none"``, zeros (a
sequence ends exactly at the shard's end). With one rank there is no scan: the segments run from
their initial states.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch

from .._shards import world_and_rank
from .chunk import compute_dtype


class ShardRun(NamedTuple):
    """What one call does besides its tensors."""

    backend: Any            # FlaDelta or TorchDelta
    opts: Any               # DeltaOptions (A_log and dt_bias the tensors of this call)
    scale: float
    group: Any              # the sequence-parallel process group (None: one process)
    world: int
    head: bool              # group rank 0: the scan's init is its incoming state
    method: str             # the scan's method: "pipelined" or "allgather"
    bounds: Tuple[int, ...]  # the local segments' bounds [0, ..., T_local]
    rows: Tuple[Any, ...]   # per segment, the initial_state rows it starts from (an int, or None: all)
    own: Tuple[bool, ...]   # per segment, whether it starts its sequence (from its initial_state rows)
    ends: Tuple[bool, ...]  # per segment, whether its sequence ends in this shard
    varlen: bool
    num_seqs: int           # rows of the final state: B, or the packed sequences N
    cross: str              # what crosses the shard's end: "own", "ext" or "none" (module docstring)
    want_final: bool


def plan(segs, backend, opts, scale: float, group, method: str, want_final: bool) -> ShardRun:
    """The :class:`ShardRun` of a shard cut ``segs`` (:class:`allscan.ops._shards.ShardSegments`)."""
    n = segs.nseg
    if segs.world == 1 or not (segs.varlen and segs.ends_here[-1]):
        cross = "ext" if n > 1 else "own"
    else:
        cross = "none"
    # with one rank every segment starts its sequence; else the first one does where the shard starts one
    # (rank 0's first segment reads initial_state through the scan's init)
    own = tuple(segs.world == 1 or j > 0 or (segs.varlen and segs.rank > 0 and not segs.continued)
                for j in range(n))
    head = group is None or world_and_rank(group)[1] == 0  # the scan's chain head: its group's rank 0
    return ShardRun(backend, opts, scale, group, segs.world, head, method, tuple(segs.bounds),
                    tuple(segs.seq_ids) if segs.varlen else (None,), own, tuple(segs.ends_here), segs.varlen,
                    segs.num_seqs, cross, want_final)


def _rows(t: torch.Tensor, row):
    return t if row is None else t[row:row + 1]


def _initial_states(run: ShardRun, h0: Optional[torch.Tensor]):
    return [_rows(h0, run.rows[j]) if h0 is not None and run.own[j] else None for j in range(len(run.own))]


def _scan_init(run: ShardRun, h0: Optional[torch.Tensor]):
    """The scan's init: given on every rank alike (the chain head reads it), the first row with packing."""
    return None if h0 is None else (h0[:1] if run.varlen else h0)


def _crossing(run: ShardRun) -> Optional[int]:
    return {"own": 0, "ext": len(run.own) - 1}.get(run.cross)


def shard_forward(run: ShardRun, q, k, v, g, beta, h0):
    """``(o, final or None, Q', M, S_in, saved)``: the outputs in v's dtype and the final states
    (``[N, HV, K, V]`` rows of the sequences ending here, zeros elsewhere, with packing); what the
    backward needs (Q', M, S_in None with one rank)."""
    from allscan import scan

    be = run.backend
    sp = run.world > 1
    finals, M, staged = be.states(q, k, v, g, beta, run.opts, run.scale, run.bounds, _initial_states(run, h0), sp)
    if sp:
        c = _crossing(run)
        x = torch.zeros_like(finals[0]) if c is None else finals[c]
        M_scan = M if run.cross == "own" else torch.zeros_like(M)
        pending = scan(x.contiguous(), group=run.group, transition=M_scan, init=_scan_init(run, h0),
                       method=run.method, async_op=True)
    o_head, q_eff, o_tail, saved = be.outputs(staged)
    S_in = None
    if sp:
        S_in = pending.wait()
        o_head, q_eff = be.fold(o_head, q_eff, S_in)
        if run.want_final and run.ends[0]:
            finals[0] = finals[0] + M @ S_in
        o = o_head.to(v.dtype) if o_tail is None else torch.cat([o_head.to(v.dtype), o_tail.to(v.dtype)], 1)
    else:
        o = o_tail.to(v.dtype)
    final = None
    if run.want_final:
        final = finals[0] if not run.varlen else _final_rows(run, finals)
    return o, final, q_eff, M, S_in, saved


def _final_rows(run: ShardRun, finals):
    rows = finals[0].new_zeros(run.num_seqs, *finals[0].shape[1:])
    for j, f in enumerate(finals):
        if run.ends[j]:
            rows[run.rows[j]] = f[0]
    return rows


def outputs_state_grad(backend, world: int, q_eff, do):
    """``Q'^T do``: the gradient the state entering the shard gets through its outputs (None with one
    rank). The backward's first step, so that Q' (a tensor of q's size) can be freed before the local
    backward allocates."""
    if world == 1:
        return None
    return backend.fold_state_grad(q_eff, do[:, :q_eff.shape[1]])


def zero_if_absent(do, v):
    """The outputs' gradient, zeros when autograd gave none (the loss reads only the final state)."""
    return torch.zeros(*v.shape, dtype=v.dtype, device=v.device) if do is None else do


def shard_backward(run: ShardRun, q, k, v, g, beta, h0, dy_out, M, S_in, saved, do, dfinal):
    """The gradients ``(dq, dk, dv, dg, dbeta, dA_log, dt_bias, dh0)`` (None where not an input) from
    ``do`` (not None: :func:`zero_if_absent`) and ``dfinal`` (None: zeros), given :func:`shard_forward`'s
    ``M, S_in, saved`` and ``dy_out`` (:func:`outputs_state_grad`)."""
    from allscan import scan

    be = run.backend
    n = len(run.own)
    dt = compute_dtype(v)
    dhts = [None] * n
    if dfinal is not None:
        for j in range(n):
            if run.ends[j]:
                dhts[j] = _rows(dfinal, run.rows[j]).to(dt)
    h0s = _initial_states(run, h0)
    if run.world > 1:
        dy = dy_out if dhts[0] is None else dy_out + M.transpose(-1, -2) @ dhts[0]
        M_scan = M if run.cross == "own" else torch.zeros_like(M)
        # every rank issues the reverse scan, whatever it does with r
        r = scan(dy.contiguous(), group=run.group, transition=M_scan.transpose(-1, -2).contiguous(), reverse=True,
                 method=run.method)
        c = _crossing(run)
        if c is not None:
            dhts[c] = r if dhts[c] is None else dhts[c] + r
        h0s[0] = S_in if h0s[0] is None else S_in + h0s[0].to(S_in.dtype)
    dq, dk, dv, dg, dbeta, dh0s, dA_log, ddt_bias = be.backward(saved, q, k, v, g, beta, run.opts, run.scale,
                                                                 run.bounds, h0s, do, dhts)
    dh0 = None
    if h0 is not None:
        dh0 = torch.zeros_like(h0)
        for j in range(n):
            if run.own[j]:
                _rows(dh0, run.rows[j]).add_(dh0s[j].to(dh0.dtype))
        if run.world > 1 and run.head:  # the chain head's incoming state is the scan's init
            (dh0[:1] if run.varlen else dh0).add_(dh0s[0].to(dh0.dtype))
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _drop_saved(ctx):
    """Drop autograd's references to the saved tensors (unless the graph is kept for another
    backward), so that each is freed once the backward drops its own: Q' right after its one read.
    Nothing is freed that anything else still holds (a gradient graph of the backward, a hook's
    buffer)."""
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)  # torch's own compiled backward does the same
    if clear is not None:
        clear()


class ShardFunction(torch.autograd.Function):
    """:func:`shard_forward` and :func:`shard_backward` for eager calls."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, run: ShardRun):
        o, final, q_eff, M, S_in, saved = shard_forward(run, q, k, v, g, beta, h0)
        ctx.run = run
        ctx.device_type = q.device.type
        ctx.save_for_backward(q, k, v, g, beta, h0, q_eff, M, S_in, *saved)
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0, q_eff, M, S_in, *saved = ctx.saved_tensors
        _drop_saved(ctx)
        do = zero_if_absent(do, v)
        # the forward's arithmetic, whatever the caller's autocast
        with torch.autocast(device_type=ctx.device_type, enabled=False):
            dy_out = outputs_state_grad(ctx.run.backend, ctx.run.world, q_eff, do)
            del q_eff  # the backward's own reference: Q' is freed here unless something else holds it
            dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = shard_backward(ctx.run, q, k, v, g, beta, h0, dy_out, M,
                                                                          S_in, saved, do, dfinal)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None
