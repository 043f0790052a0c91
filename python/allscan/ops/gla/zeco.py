"""Gated linear attention with ZeCO sequence parallelism (All-Scan): :func:`zeco_gla`.

A long sequence is cut into contiguous shards, one per rank of ``group`` (rank order = sequence
order). :func:`zeco_gla` returns on each rank exactly what single-GPU ``chunk_gla`` (fla) returns on
the whole sequence, restricted to the rank's shard.

The algorithm (rank p, shard of T tokens, log decays g, G_t = sum_{s<=t} g_s inside the shard)::

    local:      (o_loc, S_loc) = chunk_gla(q, k, v, g, initial_state=0)     # zero incoming state
    All-Scan:   S_in_p = scan(S_loc, gamma=exp(G_T))                       # y_{p+1} = exp(G_T,p) y_p + S_loc_p
    correction: o = o_loc + scale * (q * exp(G)) @ S_in                    # no recomputation
                S_out = S_loc + exp(G_T) * S_in

The scan runs asynchronously while the local intra-chunk attention and output are computed.

Backward, with Z_p the gradient of the state leaving rank p (from the next rank and, on the rank that
returns it, from the caller's ``final_state``): the gradient of the state entering rank p is
``dS_in_p = X_p + exp(G_T) * Z_p`` with ``X_p = scale * sum_t (q_t * exp(G_t)) do_t^T``, and
``Z_{p-1} = dS_in_p``, i.e. ``Z`` is the REVERSE All-Scan of ``X_p + exp(G_T) * dfinal_p`` with the
same decays. ``X_p`` needs only q, g and do, so the reverse scan starts early (after the chunk states
are recomputed: that kernel slows beside a concurrent one) and runs while the local backward prepares
everything else that does not need ``Z``; then the local backward of
``chunk_gla(q, k, v, g, initial_state=S_in)`` with final-state gradient ``Z`` gives exactly dq, dk, dv,
dg (including the decay of the incoming state) and the initial state's gradient. The last rank knows
its ``Z`` (the caller's ``dfinal``) without the scan: on fla's kernels it runs the local state backward
first, and the initial state's gradient that backward computes is its ``dS_in`` (no pass for ``X``).

Variable-length packing (``cu_seqlens`` over the GLOBAL packed sequence, B = 1, equal shard lengths):
the shard is cut into local segments at the sequence boundaries that fall inside it
(:class:`ShardSegments`). Only the first segment can continue a sequence from the previous rank (the
incoming state applies to its tokens only); the state passed on is the last segment's. A rank whose
shard contains a sequence start passes decay 0 to the scan, so no state crosses a sequence start.

Methods (same code, different scan): ``"zeco"`` (pipelined All-Scan, overlapped), ``"lasp1"`` (serial
point-to-point chain, waited for before the local output: LASP-1), ``"lasp2"`` (all-gather of every
state: LASP-2, overlapped).

Collectives (what keeps P ranks from deadlocking): with ``world > 1`` every rank, in every branch
(first, last or inner rank, varlen or not, any method), issues exactly one ``allscan.scan`` in forward
and one reverse ``allscan.scan`` in backward, with the same signature (state ``[B, H, K, V]`` fp32, fp64
for fp64 inputs; gamma of the same shape and dtype on every rank, or None on every rank), and nothing else. Every rank
launches its scans in the same order, and the local work before a launch that may synchronise the
device (Triton compiling or autotuning, ``.item()``; in the backward the chunk states' recomputation,
a middle rank's X, the last rank's state backward) waits only for work already issued, whose scans
every peer launches without waiting for this rank: so every rank reaches each launch. If the last
rank's state backward raises before its launch, it launches from X instead and raises after. Every
async handle is waited on before the function returns. A rank that raises after launching its scan
leaves its peers able to finish that scan; a mismatch of arguments across ranks raises on every rank
in the scan's signature check instead of hanging.

The local work runs on one of two staged backends (:class:`~allscan.ops.gla.fla.FlaGLA` on CUDA with
fla-core, :class:`~allscan.ops.gla.chunk.TorchGLA` otherwise; ``ALLSCAN_GLA_BACKEND`` forces one).

Files: the bodies (:mod:`.body`: :func:`~allscan.ops.gla.body.forward_body`,
:func:`~allscan.ops.gla.body.backward_body`), the checks and the cut (:mod:`.checks`), the custom ops
(:mod:`.compiled`), and here the public function. Eager calls go through :class:`ZecoGLAFunction`;
under torch.compile the layer is the custom ops ``allscan::zeco_gla`` and ``allscan::zeco_gla_backward``
(the tracer sees neither the collectives nor fla's kernels). The scans
are issued, and the eager bodies run, through the op's documented hooks (:mod:`allscan.ops.hooks`:
``gla_scan``, ``gla_body``), which benchmarks replace to time them from outside.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._launch import traced_refusal
from ..hooks import op_hooks
from .._shards import LOCAL, inputs_need_grad, on_device, own_precision
from ..batch_context import context_conflict, context_group
from .body import METHODS, GLARun, backward_body, forward_body, select_backend
from .checks import checked_segments
from .compiled import zeco_gla_op

__all__ = ["zeco_gla", "LOCAL", "METHODS"]


class ZecoGLAFunction(torch.autograd.Function):
    """The autograd function of :func:`zeco_gla` in eager mode (arguments already checked).
    Differentiable once: the backward holds the incoming state as a constant (its own dependence on
    the other ranks' inputs is not in the gradients), so a backward that would make its gradients
    differentiable (``create_graph=True``) raises rather than returning second-order gradients without
    those terms."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, segs: ShardSegments, method: str, want_final: bool):
        be = select_backend(q)
        with own_precision(q.device.type), on_device(q):
            run = GLARun(scale, segs, method, want_final)
            o, final, S_in, gamma, saved = op_hooks.gla_body("forward body", forward_body, be, run, (q, k, v, g, h0))
        ctx.save_for_backward(q, k, v, g, h0, S_in, *saved)
        ctx.be, ctx.run, ctx.gamma = be, run, gamma
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, h0, S_in, *saved = ctx.saved_tensors
        with own_precision(do.device.type), on_device(do):
            grads = op_hooks.gla_body("backward body", backward_body, ctx.be, ctx.run, do, dfinal, (q, k, v, g, h0),
                                      S_in, ctx.gamma, saved)
        return grads + (None, None, None, None)


def zeco_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None, group=None, *,
             scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, method: str = "zeco",
             context=None):
    """Sequence-parallel gated linear attention (fla's ``chunk_gla`` conventions).

    Args:
        q, k: ``[B, T_local, H, K]``; v: ``[B, T_local, H, V]``: this rank's contiguous shard.
        g: natural-log decays (<= 0): ``[B, T_local, H, K]`` (GLA), ``[B, T_local, H]`` (simple GLA, one
            decay per head) or None (plain linear attention).
        group: the sequence-parallel process group (rank order = sequence order). None: the default
            group, as everywhere in torch.distributed (one process, holding the whole sequence, when
            torch.distributed is not initialised). :data:`LOCAL`: no sequence parallelism even in an
            initialised group (this process holds the whole sequence).
        scale: default ``K ** -0.5``.
        initial_state: fp32 (fp64 with fp64 inputs) ``[B, H, K, V]``, the state before the global first
            token (used by group rank 0 only; its gradient is returned there, zeros elsewhere). With
            ``cu_seqlens``: ``[N, H, K, V]``, one per global sequence, used by the rank where that sequence starts (the
            gradient of row i is returned there only: sum over ranks for the full gradient).
        output_final_state: return the final state. Without ``cu_seqlens``: ``[B, H, K, V]``, the state
            after this rank's last token (on the last rank: after the global last token). With
            ``cu_seqlens``: ``[N, H, K, V]`` with the rows of the sequences that END on this rank
            filled, zeros elsewhere.
        cu_seqlens: ``[N+1]`` cumulative lengths over the GLOBAL packed sequence (B = 1, every rank
            holds T_local tokens, ``cu_seqlens[-1] == world_size * T_local``); boundaries may fall
            anywhere, inside a rank or on a rank boundary. Same tensor on every rank.
        method: ``"zeco"`` (pipelined All-Scan overlapped with the local work), ``"lasp1"`` (serial
            chain, waited for: the LASP-1 baseline), ``"lasp2"`` (all-gather: the LASP-2 baseline).
        context: the batch's :class:`allscan.SequenceContext`, instead of ``group`` and ``cu_seqlens``:
            its group and its cut (agreed across ranks once, when it was built; not compared again
            here). Given with ``cu_seqlens`` or with another ``group``: ``ValueError``.

    Returns:
        ``(o [B, T_local, H, V] in v's dtype, final_state or None)``.
    """
    needs_grad = inputs_need_grad(q, k, v, g, initial_state)
    if torch.compiler.is_compiling():
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        conflict = context_conflict(context, group, cu_seqlens, "zeco_gla")
        spg = context_group(context, group, "zeco_gla")
        if conflict is not None:  # refused when the graph runs, on every rank
            return traced_refusal(spg, v, "zeco_gla", conflict), None
        if context is not None:  # the context is not traceable: the op takes its offsets and group name
            cu_seqlens = context.offsets(q.device)
        # the arguments are checked and the shard cut inside the op, when it runs (a failed check
        # traced here could not tell the peers: the trace runs no collective)
        o, final = zeco_gla_op(q, k, v, g, initial_state, cu_seqlens, group_name="" if spg is None else spg.group_name,
                               group_size=op_hooks.cut_world(spg, cu_seqlens is not None), scale=scale, method=method,
                               want_final=bool(output_final_state), needs_grad=needs_grad,
                               agreed=context is not None)[:2]
        return o, (final if output_final_state else None)
    conflict = context_conflict(context, group, cu_seqlens, "zeco_gla")
    spg = context_group(context, group, "zeco_gla")
    segs = checked_segments(spg, q, k, v, g, initial_state, cu_seqlens, method, needs_grad, context=context,
                            conflict=conflict)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final = ZecoGLAFunction.apply(q, k, v, g, initial_state, scale, segs, method, bool(output_final_state))
    return o, (final if output_final_state else None)
