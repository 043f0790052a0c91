"""Sequence-parallel Gated DeltaNet and KDA with the matrix All-Scan: :func:`zeco_gated_delta_rule`,
:func:`zeco_kda`.

A long sequence is cut into contiguous shards, one per rank of ``group`` (rank order = sequence
order); each returns on every rank what fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` returns on
the whole sequence, restricted to the rank's shard. The state after a token is an affine function of
the state before it (``S_t = A_t S_{t-1} + beta_t k_t v_t^T``, ``A_t = (I - beta_t k_t k_t^T)
diag(exp(g_t))``), so a shard is summarised by its transition ``M_p = A_T ... A_1`` ``[B, H, K, K]``
and its final state from a zero incoming state ``h_p``; the state entering rank p is the matrix
All-Scan ``y_{p+1} = M_p y_p + h_p`` (only the ``[K, V]`` state crosses a boundary)::

    local:    the shard's chunk states and final state without an incoming state, and M_p   (the first
              packed segment's forward on V + K columns, the others' on V)
    All-Scan: S_in = allscan.scan(h_p, transition=M_p, init=initial_state)
    outputs:  o = o_local + Q' S_in (the first segment's, computed once S_in is known; the other
              segments' beside the scan), final = h_p + M_p S_in

Rank 0, the chain's head, has its incoming state from the start (``initial_state`` or zeros): it runs
the plain forward from it and joins the scan with its final state and a zero transition.

The backward is the shard's own backward from its whole incoming state (V columns only), after one
reverse scan with the transposed transitions has brought each rank the gradient of its final state
(:mod:`allscan.ops.delta.shard`), so the gradients of q, k, v, g, beta and ``initial_state`` cross
ranks with one state per boundary.

Packed sequences (``cu_seqlens`` over the GLOBAL sequence, B = 1, equal shard lengths) are cut as
``zeco_gla`` cuts them (:class:`allscan.ops._shards.ShardSegments`): only the first local segment
receives the incoming state; a segment that starts inside the shard starts from its own initial
state. The state a rank passes on is the one of the sequence crossing its end: with a sequence
starting inside the shard the transition is cut (``M_p = 0``, ``h_p`` that sequence's final state);
when a sequence ends exactly at the shard's end nothing crosses (``M_p = 0``, ``h_p = 0``), so the
next rank's first sequence starts from exactly its own initial state.

Collectives: with more than one rank every rank, in every branch, issues the same one signature
check and one ``allscan.scan`` (state ``[B, H, K, V]``, transition ``[B, H, K, K]``, init given or
not on every rank alike) in the forward, and one reverse scan in the backward: every rank's loss must
depend on its outputs or final state (a rank whose backward does not run leaves its peers waiting).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .._launch import traced_refusal
from .._shards import inputs_need_grad, own_precision
from ..batch_context import context_conflict, context_group
from .compiled import compiled_delta_rule
from .chunk import DeltaInputs
from .fla_cp import fla_context_parallel
from .gates import DeltaOptions
from .prepare import METHODS, DeltaCall, prepared, shard_plan
from .shard import ShardFunction

__all__ = ["zeco_gated_delta_rule", "zeco_kda", "METHODS"]


def _delta_rule(call: DeltaCall, q, k, v, g, beta, group, initial_state):
    conflict = context_conflict(call.context, group, call.cu_seqlens, call.op)
    group = context_group(call.context, group, call.op)
    opts = call.options
    # a rank whose inputs need no gradient runs no backward: its peers would wait in the reverse scan
    call = replace(call, needs_grad=inputs_need_grad(q, k, v, g, beta, initial_state, opts.A_log, opts.dt_bias))
    if torch.compiler.is_compiling() and call.method != "fla_cp":
        if conflict is not None:  # refused when the graph runs, on every rank
            return traced_refusal(group, v, call.op, conflict), None
        # checked, cut and run inside the custom op, when it runs (the trace runs no collective)
        return compiled_delta_rule(call, q, k, v, g, beta, group, initial_state)
    segs, opts, scale = prepared(call, group, q, k, v, g, beta, initial_state, conflict)
    if call.method == "fla_cp":
        cu_seqlens = call.cu_seqlens if call.context is None else call.context.offsets(q.device)
        o = fla_context_parallel(DeltaInputs(q, k, v, g, beta), opts, scale, group if segs.world > 1 else None,
                                 cu_seqlens, q.shape[1] * segs.world)
        return o, None
    run = shard_plan(segs, q, opts, scale, group, call.method, call.output_final_state)
    with own_precision(q.device.type):  # the compute dtype is ours
        return ShardFunction.apply(q, k, v, g, beta, opts.A_log, opts.dt_bias, initial_state, run)


def zeco_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          group=None, *, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                          output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                          use_qk_l2norm_in_kernel: bool = False, method: str = "zeco",
                          use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                          dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                          allow_neg_eigval: bool = False, context=None):
    """Sequence-parallel Gated DeltaNet (fla's ``chunk_gated_delta_rule`` conventions).

    Args:
        q, k: ``[B, T_local, H, K]``; v: ``[B, T_local, HV, V]`` (HV a multiple of H: grouped values):
            this rank's contiguous shard.
        g: ``[B, T_local, HV]``, natural-log decays (or, with ``use_gate_in_kernel``, the raw gate input:
            ``g = -exp(A_log) * softplus(g + dt_bias)``, ``A_log`` and ``dt_bias`` ``[HV]``).
        beta: ``[B, T_local, HV]`` (or raw logits with ``use_beta_sigmoid_in_kernel``: ``sigmoid(beta)``,
            ``2 * sigmoid(beta)`` with ``allow_neg_eigval``).
        group: the sequence-parallel process group (rank order = sequence order); None: the default
            group (one process when torch.distributed is not initialised); ``allscan.ops.LOCAL``:
            this process alone.
        scale: default ``K ** -0.5``. use_qk_l2norm_in_kernel: l2-normalise q and k first (as fla).
        initial_state, output_final_state, cu_seqlens: as :func:`allscan.ops.gla.zeco_gla` (states
            ``[B, HV, K, V]``, or ``[N, HV, K, V]`` with ``cu_seqlens``; float32, float64 for float64
            inputs): the initial state is used where its sequence starts (its gradient returned there,
            zeros elsewhere); the final state is the state after this rank's last token (without
            ``cu_seqlens``) or the rows of the sequences ending on this rank (zeros elsewhere).
        method: ``"zeco"`` (the pipelined matrix All-Scan), ``"allgather"`` (every rank's state and
            transition all-gathered, predecessors folded locally: fla's CP pattern, same code) or
            ``"fla_cp"`` (fla's own CP, the baseline: CUDA and fla-core only, and what fla supports:
            B = 1, no ``initial_state``, no final state).
        context: the batch's :class:`allscan.SequenceContext`, instead of ``group`` and ``cu_seqlens``
            (as :func:`allscan.ops.gla.zeco_gla`): its group and its cut, agreed across ranks once
            when it was built and not compared again here.

    Returns:
        ``(o [B, T_local, HV, V] in v's dtype, final_state or None)``.
    """
    options = DeltaOptions(False, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval)
    call = DeltaCall("zeco_gated_delta_rule", options, method, scale, output_final_state, cu_seqlens, context)
    return _delta_rule(call, q, k, v, g, beta, group, initial_state)


def zeco_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, group=None, *,
             scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
             use_qk_l2norm_in_kernel: bool = False, method: str = "zeco", use_gate_in_kernel: bool = False,
             A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
             use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
             lower_bound: Optional[float] = None, context=None):
    """Sequence-parallel KDA (fla's ``chunk_kda`` conventions): :func:`zeco_gated_delta_rule` with one
    decay per key dimension, g ``[B, T_local, HV, K]``. With ``use_gate_in_kernel`` g is the raw gate
    input: ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]``), or with
    ``lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` optional there).
    ``safe_gate`` is a kernel hint in fla (gates within ``[lower_bound, 0)``); here it only checks
    ``lower_bound``, as fla does. ``context``: the batch's :class:`allscan.SequenceContext`, as in
    :func:`zeco_gated_delta_rule`."""
    options = DeltaOptions(True, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                           use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound)
    call = DeltaCall("zeco_kda", options, method, scale, output_final_state, cu_seqlens, context)
    return _delta_rule(call, q, k, v, g, beta, group, initial_state)
