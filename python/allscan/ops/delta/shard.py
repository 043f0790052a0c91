"""One shard of a delta-rule layer with the state entering it: its forward, its backward, and the
autograd function around them (the custom ops of :mod:`.compiled` run the same two functions).

Forward, on each rank but the chain head (``be`` the local backend, :class:`~allscan.ops.delta.fla.FlaDelta`
or :class:`~allscan.ops.delta.chunk.TorchDelta`; ``segments`` the shard cut at packed sequences)::

    finals, M, staged = be.states(...)               every segment's final state from its own initial
                                                     state; M the first segment's transition (its
                                                     forward runs on [v | 0] from [h0 | I]); staged
                                                     what the outputs are computed from
    pending = scan(x, transition=M_scan, init=init,  x the state crossing the shard's end; in flight
                   async_op=True)                    while the other segments' outputs are issued
    o_head, Q', o_tail, saved = be.outputs(staged, incoming)
                                                     incoming() waits for the scan and returns S_in;
                                                     o_head the first segment's outputs from h0 + S_in
                                                     (its local outputs plus Q' S_in, one kernel on GPU),
                                                     Q' the map from a state added to its initial state
                                                     to its outputs; o_tail the other segments'
    o = [o_head | o_tail],  final_0 = h_0 + M S_in

The chain head (group rank 0) knows its incoming state before anything runs: the caller's
``initial_state`` (or zeros). So it runs the plain forward from it (V columns: no Q', no M, no fold)
and joins the scan with its final state and a zero transition (``y_1 = 0 init + x_0``, that final
state); in the backward it sends nothing (rank 0's part of the reverse scan reaches no one) and runs
the plain backward from its initial state, whose gradient is the one of ``initial_state``. Every rank
issues both scans alike.

Backward. The state a rank passes on is its shard's final state from the whole incoming state, so the
gradient of everything local (q, k, v, g, beta, the gate parameters and the initial states) is the
local backward of the segments run from their whole initial states (``S_full = h0 + S_in`` for the
first, but on the chain head), given ``do`` and the gradients of their final states; the one crossing the shard's end also
gets ``r``, the gradient arriving from later ranks: the reverse scan with the transposed transitions
of each rank's direct gradient of its incoming state, ``dy = Q'^T do + M^T dfinal_0`` (zeros on the chain head)::

    reverse = reverse_scan(...)                      not issued yet:
        dy = Q'^T do + M^T dfinal_0                  be.fold_state_grad (outputs_state_grad)
        r = scan(dy, transition=M_scan^T,            (exclusive: r_p = dy_{p+1} + M_{p+1}^T r_{p+1})
                 reverse=True)
    grads = be.backward(..., FinalGrads(...))        one backward over the shard, V columns only; it
                                                     issues ``reverse`` beside its recomputation of
                                                     the chunk states (:class:`allscan.ops._beside.Beside`)
                                                     and asks for r where its state kernel needs the
                                                     final state's gradient; Q' is freed there

So the backward never runs over the K extra columns the forward needs for Q' and M (nor their
gradients), the transitions never need a gradient of their own, and on fla's kernels ``Q'^T do`` and
the wait for the next rank's gradient overlap the recomputation of the chunk states, the longest step
before the one that needs ``r``. (Under torch.compile ``Q'^T do`` is an op of its own before the
backward's, and only the scan overlaps; the torch backend asks for ``r`` first.)

What crosses the shard's end (``cross``): ``"own"``, the first segment's final state (one segment in
the shard); ``"ext"``, the final state of the shard's last packed segment (its gradient gets ``r``;
the transition is cut from the scan: no incoming state reaches that sequence); ``"none"``, zeros (a
sequence ends exactly at the shard's end). With one rank there is no scan: the segments run from
their initial states.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch

from .._beside import Beside
from .._launch import refuse_double_backward, tell_peers_of_failure
from ..hooks import op_hooks
from ..matrix_scan import OP as MATRIX_SCAN_OP
from .._shards import own_precision, world_and_rank
from .chunk import DeltaInputs, compute_dtype


class ShardRun(NamedTuple):
    """What one call does besides its tensors."""

    backend: Any            # FlaDelta or TorchDelta
    opts: Any               # DeltaOptions (A_log and dt_bias the tensors of this call)
    scale: float
    group: Any              # the sequence-parallel process group (None: one process)
    world: int
    head: bool              # group rank 0: the scan's chain head (a widened one gets init as S_in)
    wide: bool              # the first segment runs on [v | 0] from [h0 | I] (Q', M): runs_widened
    method: str             # the scan's method: "pipelined" or "allgather"
    bounds: Tuple[int, ...]  # the local segments' bounds [0, ..., T_local]
    rows: Tuple[Any, ...]   # per segment, the initial_state rows it starts from (an int, or None: all)
    own: Tuple[bool, ...]   # per segment, whether it starts its sequence (from its initial_state rows)
    ends: Tuple[bool, ...]  # per segment, whether its sequence ends in this shard
    varlen: bool
    num_seqs: int           # rows of the final state: B, or the packed sequences N
    cross: str              # what crosses the shard's end: "own", "ext" or "none" (module docstring)
    want_final: bool


def plan(segs, backend, opts, scale: float, group, method: str, want_final: bool,
         plain_head: bool = True) -> ShardRun:
    """The :class:`ShardRun` of a shard cut ``segs`` (:class:`allscan.ops._shards.ShardSegments`);
    ``plain_head``: see :func:`runs_widened`."""
    n = segs.nseg
    if segs.world == 1 or not (segs.varlen and segs.ends_here[-1]):
        cross = "ext" if n > 1 else "own"
    else:
        cross = "none"
    wide = runs_widened(segs, plain_head)
    # every segment starts its sequence but a first one that continues it from the previous rank (or,
    # on a widened head, from the scan's init)
    own = tuple(not wide or j > 0 or (segs.varlen and segs.rank > 0 and not segs.continued) for j in range(n))
    head = group is None or world_and_rank(group)[1] == 0  # the scan's chain head: its group's rank 0
    return ShardRun(backend, opts, scale, group, segs.world, head, wide, method, tuple(segs.bounds),
                    tuple(segs.seq_ids) if segs.varlen else (None,), own, tuple(segs.ends_here), segs.varlen,
                    segs.num_seqs, cross, want_final)


def runs_widened(segs, plain_head: bool = True) -> bool:
    """Whether a shard's first segment runs widened (for Q' and M): every rank of a chain but, with
    ``plain_head``, its head (group rank 0), which starts from the caller's initial state. The custom
    ops under torch.compile widen the head too: their results' shapes must not depend on the rank,
    since a graph compiled on one rank is cached for all (the head's incoming state then comes
    through the scan's init)."""
    return segs.world > 1 and (segs.rank > 0 or not plain_head)


def _rows(t: torch.Tensor, row):
    return t if row is None else t[row:row + 1]


def _initial_states(run: ShardRun, h0: Optional[torch.Tensor]):
    return [_rows(h0, run.rows[j]) if h0 is not None and run.own[j] else None for j in range(len(run.own))]


def _scan_init(run: ShardRun, h0: Optional[torch.Tensor]):
    """The scan's init: given on every rank alike (a signature the ranks compare; the head's zero
    transition leaves it out of the state it passes on), the first row with packing."""
    return None if h0 is None else (h0[:1] if run.varlen else h0)


def _crossing(run: ShardRun) -> Optional[int]:
    return {"own": 0, "ext": len(run.own) - 1}.get(run.cross)


def shard_forward(run: ShardRun, q, k, v, g, beta, h0):
    """``(o, final or None, Q', M, S_in, saved)``: the outputs in v's dtype and the final states
    (``[N, HV, K, V]`` rows of the sequences ending here, zeros elsewhere, with packing); what the
    backward needs (Q', M, S_in None unless ``run.wide``)."""
    be = run.backend
    try:
        finals, M, staged = be.states(DeltaInputs(q, k, v, g, beta), run, _initial_states(run, h0))
        if run.world > 1:
            c = _crossing(run)
            x = (torch.zeros_like(finals[0]) if c is None else finals[c]).contiguous()
            M_scan = M if run.wide and run.cross == "own" else _zero_transition(x)
    except Exception as e:
        if run.world > 1:  # the peers are waiting in the scan for this rank's part
            tell_peers_of_failure(run.group, MATRIX_SCAN_OP, "its forward before the scan", e)
        raise
    S_in = None
    if run.world > 1:
        pending = op_hooks.delta_scan(x, group=run.group, transition=M_scan, init=_scan_init(run, h0),
                                      method=run.method, async_op=True)

    def incoming():
        nonlocal S_in
        S_in = pending.wait()
        return S_in

    o_head, q_eff, o_tail, saved = be.outputs(staged, incoming if run.wide else None)
    if run.world > 1 and S_in is None:
        pending.wait()  # the plain head's: its own init, already in its outputs
    if run.wide:
        if run.want_final and run.ends[0]:
            finals[0] = finals[0] + M @ S_in
        o = o_head.to(v.dtype) if o_tail is None else torch.cat([o_head.to(v.dtype), o_tail.to(v.dtype)], 1)
    else:
        o, S_in = o_tail.to(v.dtype), None
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


def _zero_transition(state: torch.Tensor) -> torch.Tensor:
    """A zero transition ``[.., K, K]`` for a state ``[.., K, V]``: nothing of the incoming state passes."""
    return state.new_zeros(*state.shape[:-1], state.shape[-2])


def outputs_state_grad(backend, q_eff, do):
    """``Q'^T do``: the gradient the state entering the shard gets through its outputs (None without
    Q': one rank, or the chain head)."""
    if q_eff is None:
        return None
    return backend.fold_state_grad(q_eff, do[:, :q_eff.shape[1]])


def zero_if_absent(do, v):
    """The outputs' gradient, zeros when autograd gave none (the loss reads only the final state)."""
    return torch.zeros(*v.shape, dtype=v.dtype, device=v.device) if do is None else do


def _final_grads(run: ShardRun, dfinal, dt):
    """Per segment, its final state's gradient from the caller's ``dfinal`` (None: zero)."""
    dhts = [None] * len(run.own)
    if dfinal is not None:
        for j in range(len(run.own)):
            if run.ends[j]:
                dhts[j] = _rows(dfinal, run.rows[j]).to(dt)
    return dhts


def reverse_scan(run: ShardRun, q, v, M, dfinal, q_eff=None, do=None, dy_out=None) -> Optional[Beside]:
    """The reverse All-Scan of the gradients of the states entering the shards, to be issued beside the
    local backward (None with one rank): ``r = scan(dy, transition=M^T, reverse=True)`` with ``dy = Q'^T
    do + M^T dfinal_0`` (``Q'^T do`` from ``q_eff`` and ``do``, or given as ``dy_out``), zeros on the
    chain head. It holds Q' until the backward joins it."""
    if run.world == 1:
        return None

    def work():
        dt = compute_dtype(v)

        # every rank issues the reverse scan, whatever it does with r (zeros from the chain head: they
        # reach no one); a rank that fails to compute its part tells its peers, which raise too
        dy = MT = None
        try:
            if run.wide:
                dy = dy_out if q_eff is None else outputs_state_grad(run.backend, q_eff, do)
                dht0 = _final_grads(run, dfinal, dt)[0]
                if dht0 is not None:
                    dy = dy + M.transpose(-1, -2) @ dht0
                if run.cross == "own":
                    MT = M.transpose(-1, -2).contiguous()
            if dy is None:
                dy = v.new_zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1], dtype=dt)
            dy = dy.contiguous()
            if MT is None:
                MT = _zero_transition(dy)
        except Exception as e:
            tell_peers_of_failure(run.group, MATRIX_SCAN_OP, "its backward before the reverse scan", e)
            raise
        return op_hooks.delta_scan(dy, group=run.group, transition=MT, reverse=True, method=run.method)

    return Beside(v.device, work, keep=(q_eff, do, dy_out, M, dfinal))


class FinalGrads:
    """The gradients of a shard's segments' final states as the local backward takes them: the caller's,
    and on the segment crossing the shard's end also ``r``, the reverse All-Scan's result. The backward
    calls :meth:`mark` before the step the scan is to run beside, :meth:`start` right after issuing
    that step, and :meth:`get` (the list, None = zero) where it needs the gradients."""

    def __init__(self, dhts, crossing: Optional[int] = None, reverse: Optional[Beside] = None):
        self._dhts = dhts
        self._crossing = crossing
        self._reverse = reverse

    def mark(self) -> None:
        if self._reverse is not None:
            self._reverse.mark()

    def start(self) -> None:
        if self._reverse is not None:
            self._reverse.issue()

    def get(self):
        reverse, self._reverse = self._reverse, None
        if reverse is not None:
            r = reverse.result()
            c = self._crossing
            if c is not None:
                self._dhts[c] = r if self._dhts[c] is None else self._dhts[c] + r
        return self._dhts


def shard_backward(run: ShardRun, q, k, v, g, beta, h0, *, reverse: Optional[Beside], S_in, saved, do, dfinal):
    """The gradients ``(dq, dk, dv, dg, dbeta, dA_log, dt_bias, dh0)`` (None where not an input) from
    ``do`` (not None: :func:`zero_if_absent`) and ``dfinal`` (None: zeros), given :func:`shard_forward`'s
    ``S_in, saved`` and the reverse scan (:func:`reverse_scan`), which the local backward issues and
    joins."""
    be = run.backend
    n = len(run.own)
    dt = compute_dtype(v)
    try:
        h0s = _initial_states(run, h0)
        if run.wide:
            h0s[0] = S_in if h0s[0] is None else S_in + h0s[0].to(S_in.dtype)
        finals = FinalGrads(_final_grads(run, dfinal, dt), _crossing(run), reverse)
        dq, dk, dv, dg, dbeta, dh0s, dA_log, ddt_bias = be.backward(saved, DeltaInputs(q, k, v, g, beta), run, h0s,
                                                                     do, finals)
    finally:
        if reverse is not None:  # issued (or its failure told to the peers) and joined, whatever happened
            reverse.result()
    dh0 = None
    if h0 is not None:
        dh0 = torch.zeros_like(h0)
        for j in range(n):
            if run.own[j]:
                _rows(dh0, run.rows[j]).add_(dh0s[j].to(dh0.dtype))
        if run.wide and run.head:  # a widened head's incoming state is the scan's init
            (dh0[:1] if run.varlen else dh0).add_(dh0s[0].to(dh0.dtype))
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _drop_saved(ctx):
    """Drop autograd's references to the saved tensors (unless the graph is kept for another
    backward), so that each is freed once the backward drops its own: Q' once the reverse scan that
    reads it is joined.
    Nothing is freed that anything else still holds (a gradient graph of the backward, a hook's
    buffer)."""
    clear = getattr(ctx, "maybe_clear_saved_tensors", None)  # torch's own compiled backward does the same
    if clear is not None:
        clear()


NOT_TWICE = ("its backward holds the state entering each shard, Q' and M as constants (their dependence on the "
             "inputs, through the other ranks too, is not in the gradients) and runs kernels that autograd cannot "
             "differentiate")


class ShardFunction(torch.autograd.Function):
    """:func:`shard_forward` and :func:`shard_backward` for eager calls. Differentiable once: the
    backward's gradients hold the incoming state, Q' and M as constants (their own dependence on the
    inputs, through other ranks too, is not in them), so a backward that would make its gradients
    differentiable (``create_graph=True``) raises rather than returning second-order gradients without
    those terms."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, run: ShardRun):
        # Kept for the backward: the contiguous copies the kernels read, not the inputs, which are often
        # views of one fused projection (a conv's output split into q, k, v) that they would keep whole;
        # and not q, k at all where the backend keeps their activated (l2-normalised) form, as fla does.
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, final, q_eff, M, S_in, saved = shard_forward(run, q, k, v, g, beta, h0)
        ctx.run = run
        ctx.device_type = q.device.type
        activated = run.backend.activated_qk(saved) is not None
        ctx.save_for_backward(None if activated else q, None if activated else k, v, g, beta, h0, q_eff, M, S_in,
                              *saved)
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0, q_eff, M, S_in, *saved = ctx.saved_tensors
        if q is None:  # their activated form stands in (shapes and dtypes are the inputs')
            q, k = ctx.run.backend.activated_qk(saved)
        _drop_saved(ctx)
        try:
            refuse_double_backward("zeco_kda" if ctx.run.opts.per_key else "zeco_gated_delta_rule", NOT_TWICE)
            do = zero_if_absent(do, v)
        except Exception as e:
            if ctx.run.world > 1:  # the peers are waiting in the reverse scan for this rank's part
                tell_peers_of_failure(ctx.run.group, MATRIX_SCAN_OP, "its backward before the reverse scan", e)
            raise
        # the forward's arithmetic, whatever the caller's autocast
        with own_precision(ctx.device_type):
            reverse = reverse_scan(ctx.run, q, v, M, dfinal, q_eff=q_eff, do=do)
            del q_eff, M  # held by the scan until the local backward joins it: Q' is freed there
            dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = shard_backward(ctx.run, q, k, v, g, beta, h0,
                                                                          reverse=reverse, S_in=S_in, saved=saved,
                                                                          do=do, dfinal=dfinal)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None
