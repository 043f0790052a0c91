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

import warnings
from typing import Optional

import torch

from allscan._agreement import check_across_ranks
from allscan._dtypes import DTYPE_CODES, dtype_code

from .._launch import validated_group
from .._shards import ShardSegments, checked_cut, inputs_need_grad, own_precision, sequence_parallel_group
from .chunk import TorchDelta, compute_dtype
from .fla import FlaDelta, fla_context_parallel, fla_delta_available, fla_kernel
from .gates import DeltaOptions
from .shard import ShardFunction, ShardRun, plan

__all__ = ["zeco_gated_delta_rule", "zeco_kda", "METHODS"]

_SCAN_METHOD = {"zeco": "pipelined", "allgather": "allgather", "fla_cp": None}
METHODS = tuple(_SCAN_METHOD)  # the ``method=`` values of zeco_gated_delta_rule and zeco_kda

_WARNED: list = []


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


def _validate(op, q, k, v, g, beta, per_key, initial_state, output_final_state, cu_seqlens, method):
    if method not in _SCAN_METHOD:
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
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        _check_tensor(op, "initial_state", initial_state, (n, HV, K, V),
                      "[B, HV, K, V]" if cu_seqlens is None else "[N, HV, K, V] (N sequences in cu_seqlens)")
        if initial_state.dtype != compute_dtype(v):
            raise TypeError(f"{op}: initial_state must be {compute_dtype(v)} (the states' dtype for {v.dtype} "
                            f"inputs), got {initial_state.dtype}")
    if method == "fla_cp":
        _check_fla_cp(op, q, initial_state, output_final_state)


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


def _check_gate_options(op, per_key, HV, K, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, safe_gate, lower_bound):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
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
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
        raise ValueError(f"{op}: safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), "
                         f"got {lower_bound}")


def _signature(q, v, segs, method, h0, opts, needs_grad):
    B, T, H, K = q.shape
    return [
        ("dtype", DTYPE_CODES[q.dtype]),
        ("B", B),
        ("H (q heads)", H),
        ("HV (v heads)", v.shape[2]),
        ("K", K),
        ("V", v.shape[3]),
        ("T_local (packed sequences, fla_cp)", T if segs.varlen or method == "fla_cp" else 0),
        ("number of packed sequences", segs.num_seqs if segs.varlen else 0),
        ("packed sequence boundaries (hash; none: 0)", segs.digest),
        ("method", METHODS.index(method)),
        ("initial_state given", int(h0 is not None)),
        ("options (l2norm, gate, beta sigmoid, negative eigenvalues, safe gate)", opts.flags()),
        ("lower_bound (float64 bits; none: -1)", opts.lower_bound_bits()),
        # a rank whose inputs need no gradient runs no backward: its peers would wait in the reverse scan
        ("inputs need gradients", int(needs_grad)),
    ]


def shard_cut(group, q, cu_seqlens, op) -> ShardSegments:
    """This rank's shard cut at the packed sequences' boundaries (checked)."""
    return ShardSegments(group, q.shape[1], q.shape[0], cu_seqlens, op)


def prepared(op, per_key, q, k, v, g, beta, group, scale, initial_state, output_final_state, cu_seqlens,
             use_qk_l2norm_in_kernel, method, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, safe_gate, lower_bound, needs_grad):
    """Every check of a call (the local ones, then across ranks: a rank whose arguments fail tells its
    peers, whose signature exchange then fails too): ``(segs, opts, scale)``, the shard's cut (a
    repeated call's: :func:`~allscan.ops._shards.checked_cut`), the options and the scale."""
    opts = DeltaOptions(per_key, bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), A_log, dt_bias,
                        bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(safe_gate), lower_bound)

    packed = cu_seqlens is not None  # the cut changes from batch to batch: compared on every call

    def check():
        segs = None

        def validate():  # every local check, the packed sequences' cut of this shard included
            nonlocal segs
            _validate(op, q, k, v, g, beta, per_key, initial_state, output_final_state, cu_seqlens, method)
            _check_gate_options(op, per_key, v.shape[2], q.shape[-1], use_gate_in_kernel, A_log, dt_bias,
                                use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound)
            segs = shard_cut(group, q, cu_seqlens, op)

        if group is None:
            validate()
        else:
            validated_group(group, q, op, validate, every_call=packed)
        signature = None
        if segs.world > 1:
            signature = check_across_ranks(group, q.device, op, _signature(q, v, segs, method, initial_state,
                                                                           opts, needs_grad), every_call=packed)
        return segs, signature

    tensors = None if cu_seqlens is not None else (q, k, v, g, beta, initial_state, A_log, dt_bias)
    options = (output_final_state, method, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
               allow_neg_eigval, safe_gate, lower_bound, needs_grad)
    segs = checked_cut(op, group, q.device if isinstance(q, torch.Tensor) else None, tensors, options, check)
    return segs, opts, q.shape[-1] ** -0.5 if scale is None else float(scale)


def shard_plan(segs, q, opts, scale, group, method, output_final_state, plain_head=True) -> ShardRun:
    """The :class:`~allscan.ops.delta.shard.ShardRun` of a checked call (not ``fla_cp``)."""
    return plan(segs, select_backend(q), opts, scale, group, _SCAN_METHOD[method], bool(output_final_state),
                plain_head)


def _delta_rule(op, per_key, q, k, v, g, beta, group, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, method, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, safe_gate=False, lower_bound=None):
    group = sequence_parallel_group(group, op)
    # a rank whose inputs need no gradient runs no backward: its peers would wait in the reverse scan
    needs_grad = inputs_need_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    args = (q, k, v, g, beta, group, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            method, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
            lower_bound)
    if torch.compiler.is_compiling() and method != "fla_cp":
        # checked, cut and run inside the custom op, when it runs (the trace runs no collective)
        from .compiled import compiled_delta_rule

        return compiled_delta_rule(op, per_key, *args, needs_grad)
    segs, opts, scale = prepared(op, per_key, *args, needs_grad)
    if method == "fla_cp":
        fn, kw = fla_kernel(opts)
        o = fla_context_parallel(fn, kw, q, k, v, g, beta, scale, group if segs.world > 1 else None, cu_seqlens,
                                 q.shape[1] * segs.world)
        return o, None
    run = shard_plan(segs, q, opts, scale, group, method, output_final_state)
    with own_precision(q.device.type):  # the compute dtype is ours
        return ShardFunction.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, run)


def zeco_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          group=None, *, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                          output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                          use_qk_l2norm_in_kernel: bool = False, method: str = "zeco",
                          use_gate_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
                          dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                          allow_neg_eigval: bool = False):
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

    Returns:
        ``(o [B, T_local, HV, V] in v's dtype, final_state or None)``.
    """
    return _delta_rule("zeco_gated_delta_rule", False, q, k, v, g, beta, group, scale, initial_state,
                       output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, method, use_gate_in_kernel, A_log,
                       dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)


def zeco_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, group=None, *,
             scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
             use_qk_l2norm_in_kernel: bool = False, method: str = "zeco", use_gate_in_kernel: bool = False,
             A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
             use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
             lower_bound: Optional[float] = None):
    """Sequence-parallel KDA (fla's ``chunk_kda`` conventions): :func:`zeco_gated_delta_rule` with one
    decay per key dimension, g ``[B, T_local, HV, K]``. With ``use_gate_in_kernel`` g is the raw gate
    input: ``-exp(A_log) * softplus(g + dt_bias)`` (``A_log`` ``[HV]``, ``dt_bias`` ``[HV * K]``), or with
    ``lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` optional there).
    ``safe_gate`` is a kernel hint in fla (gates within ``[lower_bound, 0)``); here it only checks
    ``lower_bound``, as fla does."""
    return _delta_rule("zeco_kda", True, q, k, v, g, beta, group, scale, initial_state, output_final_state,
                       cu_seqlens, use_qk_l2norm_in_kernel, method, use_gate_in_kernel, A_log, dt_bias,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound)
