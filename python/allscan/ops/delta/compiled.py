"""The delta-rule layers under torch.compile: the shard's forward and backward
(:mod:`allscan.ops.delta.shard`) as custom ops, opaque to the tracer (no graph break, no collective
while tracing; every rank runs them as the eager layer does, the checks and the shard's cut included):
the forward, the backward's first step ``Q'^T do`` (its own op, so that the compiled backward frees Q'
before the rest allocates), and the rest of the backward.

The options travel as keyword-only arguments (the schema's ``*``): :func:`_options_of` writes a call's
:class:`~allscan.ops.delta.prepare.DeltaCall` as them and :func:`_call_of` reads them back.

Absent results travel as empty tensors (a schema has no optional outputs). Which ones are absent, and
every shape, depends on shapes, options and the group only, so the fake kernels know them; Q' covers
the first packed segment only, so the op pads it with zero rows to the shard's length (its length
depends on ``cu_seqlens``' values, which a fake kernel cannot read).
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch

from allscan._comm import resolve_group
from allscan.context import LOCAL, SequenceContext

from .._launch import absent, or_empty, refuse_double_backward, tell_peers_of_failure
from .._shards import own_precision
from ..hooks import check_cut_world, op_hooks
from ..matrix_scan import OP as MATRIX_SCAN_OP
from .chunk import DeltaInputs, compute_dtype
from .gates import DeltaOptions
from .shard import NOT_TWICE, outputs_state_grad, reverse_scan, shard_backward, shard_forward, zero_if_absent
from .prepare import DeltaCall, prepared, select_backend, shard_cut, shard_plan

_Tensors = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]


def _op_name(per_key: bool) -> str:
    return "zeco_kda" if per_key else "zeco_gated_delta_rule"


def _group(group_name: str):
    return resolve_group(group_name) if group_name else None


def _options_of(call: DeltaCall, group, group_size: int) -> dict:
    """A call's options as the custom ops' keyword-only arguments (plain values a schema takes)."""
    o = call.options
    return dict(group_name="" if group is None else group.group_name, group_size=group_size, per_key=bool(o.per_key),
                scale=float(call.scale), l2norm=bool(o.use_qk_l2norm_in_kernel), gate=bool(o.use_gate_in_kernel),
                beta_sigmoid=bool(o.use_beta_sigmoid_in_kernel), neg_eigval=bool(o.allow_neg_eigval),
                safe_gate=bool(o.safe_gate), lower_bound=None if o.lower_bound is None else float(o.lower_bound),
                method=call.method, want_final=bool(call.output_final_state))


def _call_of(kw: dict, A_log, dt_bias, cu_seqlens, needs_grad: bool = False) -> DeltaCall:
    """The :class:`DeltaCall` of the custom ops' keyword-only arguments ``kw``."""
    options = DeltaOptions(kw["per_key"], kw["l2norm"], kw["gate"], A_log, dt_bias, kw["beta_sigmoid"],
                           kw["neg_eigval"], kw["safe_gate"], kw["lower_bound"])
    return DeltaCall(_op_name(kw["per_key"]), options, kw["method"], kw["scale"], kw["want_final"], cu_seqlens,
                     needs_grad=needs_grad)


@torch.library.custom_op("allscan::zeco_delta_rule", mutates_args=())
def zeco_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                       cu_seqlens: Optional[torch.Tensor], *, group_name: str, group_size: int, per_key: bool,
                       scale: float,
                       l2norm: bool, gate: bool, beta_sigmoid: bool, neg_eigval: bool, safe_gate: bool,
                       lower_bound: Optional[float], method: str, want_final: bool, needs_grad: bool,
                       agreed: bool = False) -> _Tensors:
    """:func:`zeco_gated_delta_rule` / :func:`zeco_kda` (``per_key``) forward under torch.compile
    (``group_name`` "" = one process, ``group_size`` its ranks, 1 for one process: the fake's shapes depend
    on it; ``agreed``: ``cu_seqlens`` are a context's offsets, checked as the
    eager call with that context checks them): ``(o, final, Q', M, S_in, saved)``, each absent one empty."""
    kw = dict(group_name=group_name, group_size=group_size, per_key=per_key, scale=scale, l2norm=l2norm, gate=gate,
              beta_sigmoid=beta_sigmoid, neg_eigval=neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
              method=method, want_final=want_final)
    group = _group(group_name)
    call = _call_of(kw, A_log, dt_bias, cu_seqlens, needs_grad)
    if agreed and cu_seqlens is not None:
        call = replace(call, cu_seqlens=None,
                       context=SequenceContext.from_agreed_offsets(LOCAL if group is None else group, cu_seqlens))
    segs, opts, scale = prepared(call, group, q, k, v, g, beta, h0)
    check_cut_world(segs, group_size, "zeco_delta_rule")
    # the head widened too: every rank's results have the fake's shapes (shard.runs_widened)
    run = shard_plan(segs, q, opts, scale, group, method, want_final, plain_head=False)
    with own_precision(q.device.type):
        o, final, q_eff, M, S_in, saved = shard_forward(run, q, k, v, g, beta, h0)
    if q_eff is not None and q_eff.shape[1] != q.shape[1]:  # packed: the first segment's rows, then zeros
        padded = q_eff.new_zeros(*q.shape[:2], *q_eff.shape[2:])
        padded[:, :q_eff.shape[1]] = q_eff
        q_eff = padded
    return (o.contiguous(), or_empty(final, q), or_empty(q_eff, q), or_empty(M, q), or_empty(S_in, q),
            [or_empty(t, q) for t in saved])


@zeco_delta_rule_op.register_fake
def _zeco_delta_rule_fake(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, **kw):
    if q.dim() != 4 or v.dim() != 4 or (cu_seqlens is not None and cu_seqlens.dim() != 1):
        # arguments the op will refuse when it runs, on every rank (its checks reach the peers): shapes
        # of no consequence, so that this rank's trace does not fail alone and leave its peers waiting
        return (v.new_empty(v.shape), *(q.new_empty(0, dtype=torch.float32) for _ in range(4)), [])
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    be = select_backend(q)
    dt = compute_dtype(v)
    sp = kw["group_size"] > 1
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = v.new_empty(n, HV, K, V, dtype=dt) if kw["want_final"] else None
    q_eff = v.new_empty(B, T, HV, K, dtype=be.q_eff_dtype(v)) if sp else None
    M = v.new_empty(B, HV, K, K, dtype=dt) if sp else None
    S_in = v.new_empty(B, HV, K, V, dtype=dt) if sp else None
    opts = _call_of(kw, A_log, dt_bias, cu_seqlens).options
    return (v.new_empty(B, T, HV, V), or_empty(final, q), or_empty(q_eff, q), or_empty(M, q), or_empty(S_in, q),
            [or_empty(t, q) for t in be.saved_like(DeltaInputs(q, k, v, g, beta), opts)])


@torch.library.custom_op("allscan::zeco_delta_rule_state_grad", mutates_args=())
def zeco_delta_rule_state_grad_op(q_eff: torch.Tensor, do: torch.Tensor, q: torch.Tensor,
                                  cu_seqlens: Optional[torch.Tensor], group_name: str, group_size: int,
                                  per_key: bool) -> torch.Tensor:
    """The backward's first step, ``Q'^T do`` (:func:`~allscan.ops.delta.shard.outputs_state_grad`;
    empty with one rank): an op of its own, so that the compiled backward can free Q' before the
    backward op allocates."""
    group = _group(group_name)
    segs = shard_cut(group, q, cu_seqlens, _op_name(per_key))
    if segs.world == 1:
        return or_empty(None, q)
    q_eff = q_eff[:, :segs.bounds[1]]  # the padding's zero rows dropped
    with own_precision(do.device.type):
        try:
            return or_empty(outputs_state_grad(select_backend(q), q_eff, do), q)
        except Exception as e:  # the peers are waiting in the reverse scan for this rank's part
            tell_peers_of_failure(group, MATRIX_SCAN_OP, "its backward before the reverse scan", e)
            raise


@zeco_delta_rule_state_grad_op.register_fake
def _zeco_delta_rule_state_grad_fake(q_eff, do, q, cu_seqlens, group_name, group_size, per_key):
    if group_size == 1:
        return or_empty(None, q)
    B, _, HV, V = do.shape
    return do.new_empty(B, HV, q.shape[-1], V, dtype=compute_dtype(do))


_Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor]


@torch.library.custom_op("allscan::zeco_delta_rule_backward", mutates_args=())
def zeco_delta_rule_backward_op(do: torch.Tensor, dfinal: Optional[torch.Tensor], inputs: List[Optional[torch.Tensor]],
                                cu_seqlens: Optional[torch.Tensor], dy_out: Optional[torch.Tensor],
                                M: Optional[torch.Tensor], S_in: Optional[torch.Tensor], saved: List[torch.Tensor], *,
                                group_name: str, per_key: bool, scale: float, l2norm: bool, gate: bool,
                                beta_sigmoid: bool, neg_eigval: bool, safe_gate: bool, lower_bound: Optional[float],
                                method: str, want_final: bool) -> _Grads:
    """The backward op after :func:`zeco_delta_rule_state_grad_op` (``dy_out``): ``(dq, dk, dv, dg,
    dbeta, dA_log, ddt_bias, dh0)`` of the forward's ``inputs`` ``[q, k, v, g, beta, A_log, dt_bias,
    h0]`` (one list: a schema takes no keyword-only tensors), an absent one empty (the forward op
    checked the arguments)."""
    q, k, v, g, beta, A_log, dt_bias, h0 = inputs
    group = _group(group_name)
    segs = shard_cut(group, q, cu_seqlens, _op_name(per_key))
    opts = DeltaOptions(per_key, l2norm, gate, A_log, dt_bias, beta_sigmoid, neg_eigval, safe_gate, lower_bound)
    run = shard_plan(segs, q, opts, scale, group, method, want_final, plain_head=False)
    with own_precision(do.device.type):
        reverse = reverse_scan(run, q, v, M, dfinal, dy_out=dy_out)
        grads = shard_backward(run, q, k, v, g, beta, h0, reverse=reverse, S_in=S_in,
                               saved=[absent(t) for t in saved], do=do, dfinal=dfinal)
    return tuple(or_empty(None if d is None else d.to(x.dtype), q) for d, x in zip(grads, inputs))


@zeco_delta_rule_backward_op.register_fake
def _zeco_delta_rule_backward_fake(do, dfinal, inputs, *_, **__):
    return tuple(or_empty(None if x is None else x.new_empty(x.shape), inputs[0]) for x in inputs)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens = inputs
    _, _, q_eff, M, S_in, saved = output
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, q_eff, M, S_in, *saved)
    # needs_grad and agreed: the forward's checks only; group_size: the fakes' (the backward op's are its inputs')
    ctx.group_size = keyword_only_inputs["group_size"]
    ctx.options = {name: value for name, value in keyword_only_inputs.items()
                   if name not in ("needs_grad", "agreed", "group_size")}


def _backward(ctx, do, dfinal, *_):
    refuse_double_backward(_op_name(ctx.options["per_key"]), NOT_TWICE)
    q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens, q_eff, M, S_in, *saved = ctx.saved_tensors
    do = zero_if_absent(do, v)
    # Q' is read here for the last time: a compiled backward frees it before the backward op runs
    dy_out = zeco_delta_rule_state_grad_op(q_eff, do, q, cu_seqlens, ctx.options["group_name"], ctx.group_size,
                                           ctx.options["per_key"])
    inputs = [q, k, v, g, beta, A_log, dt_bias, h0]
    grads = zeco_delta_rule_backward_op(do, absent(dfinal), inputs, cu_seqlens, absent(dy_out), absent(M),
                                        absent(S_in), saved, **ctx.options)
    return tuple(None if x is None else d for d, x in zip(grads, inputs)) + (None,)


zeco_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_delta_rule(call: DeltaCall, q, k, v, g, beta, group, initial_state):
    """The layer's call as traced by torch.compile: ``(o, final or None)`` from the forward op (``call``'s
    context already turned into its offsets)."""
    scale = q.shape[-1] ** -0.5 if call.scale is None else float(call.scale)
    cu_seqlens = call.cu_seqlens if call.context is None else call.context.offsets(q.device)
    o, final = zeco_delta_rule_op(q, k, v, g, beta, call.options.A_log, call.options.dt_bias, initial_state,
                                  cu_seqlens, needs_grad=bool(call.needs_grad), agreed=call.context is not None,
                                  **_options_of(replace(call, scale=scale), group,
                                                op_hooks.cut_world(group, cu_seqlens is not None)))[:2]
    return o, (final if call.output_final_state else None)
