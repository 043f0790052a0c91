"""What a call of :func:`~allscan.ops.delta.zeco_gated_delta_rule` or :func:`~allscan.ops.delta.zeco_kda`
does before it runs, eager or compiled (:mod:`allscan.ops.delta.compiled`): the local checks, the
signature compared across ranks, this rank's cut of the packed sequences (:func:`prepared`), the local
backend (:func:`select_backend`) and the shard's plan (:func:`shard_plan`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from allscan._agreement import check_across_ranks
from allscan._dtypes import DTYPE_CODES, dtype_code
from allscan.context import SequenceContext

from .._launch import validated_group
from .._shards import ShardSegments, checked_cut
from ..batch_context import context_fields
from ..hooks import op_hooks
from .chunk import TorchDelta, compute_dtype
from .fla import FlaDelta
from .fla_imports import fla_delta_available
from .gates import DeltaOptions
from .shard import ShardRun, plan

__all__ = ["METHODS", "SCAN_METHOD", "DeltaCall", "fla_usable", "select_backend", "shard_cut", "prepared",
           "shard_plan"]

SCAN_METHOD = {"zeco": "pipelined", "allgather": "allgather", "fla_cp": None}
METHODS = tuple(SCAN_METHOD)  # the ``method=`` values of zeco_gated_delta_rule and zeco_kda

_WARNED: list = []


@dataclass(frozen=True)
class DeltaCall:
    """What a call of zeco_gated_delta_rule (``options.per_key`` False) or zeco_kda passes besides its
    tensors q, k, v, g, beta and initial_state, as the caller gave it (checked by :func:`prepared`):
    the op's name, its input options (``A_log``, ``dt_bias`` among them), ``method``, ``scale`` (None:
    ``K ** -0.5``), ``output_final_state``, the packed offsets or the batch's
    :class:`allscan.SequenceContext`, and whether the call differentiates (compared across ranks)."""

    op: str
    options: DeltaOptions
    method: str = "zeco"
    scale: Optional[float] = None
    output_final_state: bool = False
    cu_seqlens: Optional[torch.Tensor] = None
    context: Any = None
    needs_grad: bool = False

    @property
    def per_key(self) -> bool:
        return self.options.per_key

    def packed_count(self) -> Optional[int]:
        """The number of sequences packed in the row (None: whole sequences), from the offsets or the context."""
        if self.context is not None:
            return len(self.context.cu_seqlens) - 1 if self.context.packed else None
        return None if self.cu_seqlens is None else self.cu_seqlens.numel() - 1


def fla_usable(q: torch.Tensor) -> bool:
    """Whether fla-core's kernels take these inputs: CUDA, bf16 / fp16 / fp32, fla-core importable."""
    return q.is_cuda and q.dtype != torch.float64 and fla_delta_available()


def select_backend(q: torch.Tensor):
    """The local backend: fla-core's kernels (:class:`FlaDelta`) for CUDA tensors in bf16 / fp16 / fp32
    when fla-core imports, else the torch chunked delta rule (CPU, fp64, or CUDA without fla-core,
    with a warning once: correct but slow and memory-hungry)."""
    if fla_usable(q):
        return FlaDelta
    if q.is_cuda and q.dtype != torch.float64:
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn("allscan.ops.delta: fla-core is not importable; using the torch chunked delta rule on "
                          "CUDA (correct, but slow and memory-hungry). pip install allscan[gla] for fla-core's kernels.")
    return TorchDelta


def _check_tensor(op, name, t, shape, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {what} = {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def _validate(call: DeltaCall, q, k, v, g, beta, initial_state):
    op, per_key, cu_seqlens, method = call.op, call.per_key, call.cu_seqlens, call.method
    if method not in SCAN_METHOD:
        raise ValueError(f"{op}: method must be one of {list(METHODS)}, got {method!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor [B, T_local, heads, dim], got {list(t.shape)}")
        dtype_code(t.dtype, f"{op}: {name}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{op}: k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.shape[:2] != q.shape[:2] or v.shape[2] % H:
        raise ValueError(f"{op}: v must be [B, T_local, HV, V] with [B, T_local] = {[B, T]} and HV a multiple of "
                         f"H = {H}, got {list(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if T == 0:
        raise ValueError(f"{op}: every rank needs at least one token (T_local = 0)")
    if B == 0:
        raise ValueError(f"{op}: q, k and v need at least one batch row (B = 0)")
    HV, V = v.shape[2], v.shape[3]
    if per_key:
        _check_tensor(op, "g", g, (B, T, HV, K), "[B, T_local, HV, K]")
    else:
        _check_tensor(op, "g", g, (B, T, HV), "[B, T_local, HV]")
    _check_tensor(op, "beta", beta, (B, T, HV), "[B, T_local, HV]")
    for t in (k, v, g, beta):
        if t.device != q.device:
            raise ValueError(f"{op}: q, k, v, g and beta must be on one device, got {q.device} and {t.device}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be a 1-D integer tensor [N+1] or None, got {type(cu_seqlens).__name__}")
    if initial_state is not None:
        n = call.packed_count()
        _check_tensor(op, "initial_state", initial_state, (B if n is None else n, HV, K, V),
                      "[B, HV, K, V]" if n is None else "[N, HV, K, V] (N packed sequences)")
        if initial_state.dtype != compute_dtype(v):
            raise TypeError(f"{op}: initial_state must be {compute_dtype(v)} (the states' dtype for {v.dtype} "
                            f"inputs), got {initial_state.dtype}")
    if method == "fla_cp":
        _check_fla_cp(op, q, initial_state, call.output_final_state)


def _check_fla_cp(op, q, initial_state, output_final_state):
    """What fla's own context parallelism supports (fla-core 0.6.0 asserts these deep inside)."""
    if not fla_usable(q):
        raise NotImplementedError(
            f"{op}: method='fla_cp' (flash-linear-attention's own context parallelism) needs fla-core's GPU "
            f"kernels: CUDA tensors in bf16, fp16 or fp32 and fla-core installed; got {q.dtype} on {q.device}"
            + ("" if not q.is_cuda or fla_delta_available() else " (fla-core does not import: pip install allscan[gla])"))
    if initial_state is not None:
        raise ValueError(f"{op}: method='fla_cp' does not take initial_state (fla's CP refuses it); "
                         "use method='zeco'")
    if output_final_state:
        raise ValueError(f"{op}: method='fla_cp' does not return a final state (fla's CP refuses "
                         "output_final_state); use method='zeco'")
    if q.shape[0] != 1:
        raise ValueError(f"{op}: method='fla_cp' needs B = 1 (fla's CP runs one packed batch), got q with "
                         f"B = {q.shape[0]}; use method='zeco'")


def _check_gate_options(op, opts: DeltaOptions, HV, K):
    per_key, A_log, dt_bias, lower_bound = opts.per_key, opts.A_log, opts.dt_bias, opts.lower_bound
    use_gate_in_kernel, allow_neg_eigval = opts.use_gate_in_kernel, opts.allow_neg_eigval
    if allow_neg_eigval and not opts.use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            raise ValueError(f"{op}: A_log and dt_bias are read only with use_gate_in_kernel=True")
        return
    if A_log is None and not (per_key and lower_bound is not None):
        raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log"
                         + (" (or lower_bound)" if per_key else ""))
    if A_log is not None:
        _check_tensor(op, "A_log", A_log, (HV,), "[HV]")
    if dt_bias is not None:
        _check_tensor(op, "dt_bias", dt_bias, (HV * K,) if per_key else (HV,), "[HV * K]" if per_key else "[HV]")
    if opts.safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"{op}: safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), "
                         f"got {lower_bound}")


def _signature(call: DeltaCall, q, v, segs, h0, opts):
    B, T, H, K = q.shape
    method, given = call.method, call.context is not None  # a context's cut was agreed when it was built
    return [
        ("dtype", DTYPE_CODES[q.dtype]),
        ("B", B),
        ("H (q heads)", H),
        ("HV (v heads)", v.shape[2]),
        ("K", K),
        ("V", v.shape[3]),
        ("T_local (packed sequences, fla_cp)", T if segs.varlen or method == "fla_cp" else 0),
        ("number of packed sequences", segs.num_seqs if segs.varlen and not given else 0),
        ("packed sequence boundaries (hash; none: 0)", 0 if given else segs.digest),
        *context_fields(call.context),
        ("method", METHODS.index(method)),
        ("initial_state given", int(h0 is not None)),
        ("options (l2norm, gate, beta sigmoid, negative eigenvalues, safe gate)", opts.flags()),
        ("lower_bound (float64 bits; none: -1)", opts.lower_bound_bits()),
        # a rank whose inputs need no gradient runs no backward: its peers would wait in the reverse scan
        ("inputs need gradients", int(call.needs_grad)),
    ]


def shard_cut(group, q, cu_seqlens, op) -> ShardSegments:
    """This rank's shard cut at the packed sequences' boundaries (checked)."""
    return op_hooks.shard_cut(group, q.shape[1], q.shape[0], cu_seqlens, op)


def prepared(call: DeltaCall, group, q, k, v, g, beta, initial_state, conflict: Optional[Exception] = None):
    """Every check of a call on ``group`` (a process group, None: one process): the local ones (a rank
    whose arguments fail tells its peers, whose signature exchange then fails too; ``conflict``: what
    :func:`~allscan.ops.batch_context.context_conflict` found), then across ranks: ``(segs, opts,
    scale)``, the shard's cut (a repeated call's: :func:`~allscan.ops._shards.checked_cut`; the
    context's, agreed once per batch, when the call has one), the options and the scale."""
    given = call.options  # as the caller gave them: the check-skipping key reads their values
    opts = replace(given, use_qk_l2norm_in_kernel=bool(given.use_qk_l2norm_in_kernel),
                   use_gate_in_kernel=bool(given.use_gate_in_kernel),
                   use_beta_sigmoid_in_kernel=bool(given.use_beta_sigmoid_in_kernel),
                   allow_neg_eigval=bool(given.allow_neg_eigval), safe_gate=bool(given.safe_gate))
    op, context, cu_seqlens = call.op, call.context, call.cu_seqlens
    # the cut changes from batch to batch: compared every call (a context agreed on it once per batch)
    packed = cu_seqlens is not None and not isinstance(context, SequenceContext)

    def check():
        segs = None

        def validate():  # every local check, the packed sequences' cut of this shard included
            nonlocal segs
            if conflict is not None:
                raise conflict
            _validate(call, q, k, v, g, beta, initial_state)
            _check_gate_options(op, given, v.shape[2], q.shape[-1])
            segs = shard_cut(group, q, cu_seqlens, op) if context is None else context.cut(q.shape[1], q.shape[0], op)

        if group is None:
            validate()
        else:
            validated_group(group, q, op, validate, every_call=packed)
        signature = None
        if segs.world > 1:
            signature = check_across_ranks(group, q.device, op, _signature(call, q, v, segs, initial_state, opts),
                                           every_call=packed)
        return segs, signature

    tensors = None if packed else (q, k, v, g, beta, initial_state, given.A_log, given.dt_bias)
    options = (call.output_final_state, call.method, given.use_qk_l2norm_in_kernel, given.use_gate_in_kernel,
               given.use_beta_sigmoid_in_kernel, given.allow_neg_eigval, given.safe_gate, given.lower_bound,
               call.needs_grad)
    if conflict is not None:
        check()  # raises it (told to the peers) on every call: never a cached pass of an earlier call's shapes
    if context is not None:  # what the checks read of the context (its cut is its own, made once per shape)
        options += (context.local_len, call.packed_count())
    segs = checked_cut(op, group, q.device if isinstance(q, torch.Tensor) else None, tensors, options, check)
    if context is not None:
        segs = context.cut(q.shape[1], q.shape[0], op)
    return segs, opts, q.shape[-1] ** -0.5 if call.scale is None else float(call.scale)


def shard_plan(segs, q, opts, scale, group, method, output_final_state, plain_head=True) -> ShardRun:
    """The :class:`~allscan.ops.delta.shard.ShardRun` of a checked call (not ``fla_cp``)."""
    return plan(segs, select_backend(q), opts, scale, group, SCAN_METHOD[method], bool(output_final_state),
                plain_head)
