"""The first segment of a shard and the state entering it: one autograd function around the All-Scan.

Forward, on each rank (``be`` the local backend, :class:`~allscan.ops.delta.fla.FlaDelta` or
:class:`~allscan.ops.delta.chunk.TorchDelta`)::

    h, M = be.wide_states(...)                       the shard's final state h from its own initial
                                                     state and its transition M
    S_in = scan(x, transition=M_scan, init=init)     x = h (or the last packed segment's final state),
                                                     in flight during the next line
    o_loc, Q' = be.wide_outputs(...)                 the outputs from the shard's own initial state and
                                                     the map Q' from an added incoming state to them
    o = o_loc + Q' S_in,  final = h + M S_in

Backward. The state a rank passes on is its shard's final state from the whole incoming state, so the
gradient of everything local (q, k, v, g, beta, the gate parameters and the incoming state) is the
local backward of the shard run from that state, ``S_full = h0 + S_in``, given ``do`` and the gradient
of its final state, ``dht = dfinal + r``; ``r``, the gradient arriving from later ranks, is the reverse
scan with the transposed transitions of each rank's direct gradient of its incoming state,
``dy = Q'^T do + M^T dfinal``::

    dy = Q'^T do + M^T dfinal                        be.fold_state_grad
    r = scan(dy, transition=M_scan^T, reverse=True)  (exclusive: r_p = dy_{p+1} + M_{p+1}^T r_{p+1})
    grads = be.narrow_backward(S_full, do, dht)      the backward on the V value columns only

So the backward never runs over the K extra columns the forward needs for Q' and M (nor their
gradients), and the transitions never need a gradient of their own. The chain head (group rank 0)
gets the gradient of ``init`` (the backward's gradient of its initial state); other ranks zeros.

Packed sequences (``cross``): ``"own"`` passes this segment's final state on (one segment in the
shard); ``"ext"`` passes ``x_ext``, the final state of the shard's last packed segment (its gradient
is ``r``; this segment's transition is cut from the scan: no incoming state reaches that sequence);
``"none"`` passes zeros (a sequence ends exactly at the shard's end).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class IncomingRun(NamedTuple):
    """What one call does besides its tensors."""

    backend: Any        # FlaDelta or TorchDelta
    opts: Any           # DeltaOptions (its A_log and dt_bias are the function's inputs of the same name)
    scale: float
    group: Any          # the sequence-parallel process group
    method: str         # the scan's method: "pipelined" or "allgather"
    cross: str          # what crosses the shard's end: "own", "ext" or "none" (module docstring)
    need_final: bool    # return this segment's final state (with the incoming state)


class _FirstSegment(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, init, x_ext, run: IncomingRun):
        from allscan import scan

        be = run.backend
        h, M, staged = be.wide_states(q, k, v, g, beta, run.opts, run.scale, h0)
        x = {"own": h, "ext": x_ext, "none": None}[run.cross]
        x = torch.zeros_like(h) if x is None else x.to(h.dtype)
        M_scan = M if run.cross == "own" else torch.zeros_like(M)
        pending = scan(x.contiguous(), group=run.group, transition=M_scan, init=init, method=run.method,
                       async_op=True)
        o_loc, q_eff, saved = be.wide_outputs(staged)
        S_in = pending.wait()
        o, q_eff = be.fold(o_loc, q_eff, S_in)
        final = h + M @ S_in if run.need_final else None
        S_full = S_in if h0 is None else S_in + h0.to(S_in.dtype)
        ctx.run = run
        ctx.device_type = q.device.type
        ctx.h0_given = h0 is not None
        ctx.init_shape = None if init is None else init.shape
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, q_eff, M, S_full, *saved)
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        with torch.autocast(device_type=ctx.device_type, enabled=False):  # the forward's arithmetic, whatever the caller's
            return _FirstSegment._backward(ctx, do, dfinal)

    @staticmethod
    def _backward(ctx, do, dfinal):
        from allscan import scan

        run = ctx.run
        be = run.backend
        q, k, v, g, beta, A_log, dt_bias, q_eff, M, S_full, *saved = ctx.saved_tensors
        if do is None:
            do = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
        dy = be.fold_state_grad(q_eff, do)
        dfinal = None if dfinal is None else dfinal.to(dy.dtype)
        if dfinal is not None:
            dy = dy + M.transpose(-1, -2) @ dfinal
        M_scan = M if run.cross == "own" else torch.zeros_like(M)
        # every rank issues the reverse scan, whatever it does with r
        r = scan(dy.contiguous(), group=run.group, transition=M_scan.transpose(-1, -2).contiguous(), reverse=True,
                 method=run.method)
        dht = dfinal
        if run.cross == "own":
            dht = r if dht is None else dht + r
        dq, dk, dv, dg, dbeta, dS, dA_log, ddt_bias = be.narrow_backward(saved, q, k, v, g, beta, run.opts, run.scale,
                                                                         S_full, do, dht)
        dh0 = dS if ctx.h0_given and ctx.needs_input_grad[7] else None
        dinit = None
        if ctx.init_shape is not None and ctx.needs_input_grad[8]:
            head = run.group.rank() == 0  # the chain head: its incoming state is init itself
            dinit = dS if head else torch.zeros(ctx.init_shape, dtype=dS.dtype, device=dS.device)
        dx_ext = r if run.cross == "ext" and ctx.needs_input_grad[9] else None
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, dinit, dx_ext, None


def first_segment_with_incoming(q, k, v, g, beta, h0: Optional[torch.Tensor], init: Optional[torch.Tensor],
                                x_ext: Optional[torch.Tensor], run: IncomingRun):
    """``(o, final or None)`` of the shard's first segment with the state the All-Scan delivers
    (module docstring); q, k, v, g, beta that segment's slices, ``h0`` its own initial state."""
    return _FirstSegment.apply(q, k, v, g, beta, run.opts.A_log, run.opts.dt_bias, h0, init, x_ext, run)
