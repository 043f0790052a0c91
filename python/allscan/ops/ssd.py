"""Mamba2's SSD (state space duality) with ZeCO sequence parallelism: :func:`zeco_ssd`.

Mamba2's selective scan per head h, with transformers' state layout ``h_t [P, N]``::

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        y_t = h_t C_t + D x_t

is simple gated linear attention (one scalar decay per head and token) with ``q = C``, ``k = B``,
``v = dt x``, log decay ``g = dt A`` and scale 1, whose state ``S [K=N, V=P]`` is ``h^T``. So
:func:`zeco_ssd` is :func:`allscan.ops.gla.zeco_gla` on those inputs: the same All-Scan of one state
per rank boundary, overlap, packed rows, methods, backends and failure propagation; here only the
arguments are checked, the groups of B and C broadcast to the heads (transformers' ``repeat_interleave``),
the states transposed, and the skip term added. Gradients reach x, dt, A, B, C, D and the initial state by
autograd through these broadcasts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from allscan._agreement import check_across_ranks

from ._launch import own_work, validated_group
from ._shards import LOCAL
from allscan.context import SequenceContext

from .batch_context import context_conflict, context_group
from .gla import METHODS, zeco_gla
from .gla.chunk import state_dtype

__all__ = ["zeco_ssd", "METHODS"]

_OP = "zeco_ssd"


def _shape(t) -> str:
    """What an error says was passed: a tensor's shape and dtype, else the type."""
    return f"{tuple(t.shape)} of {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_arguments(x, dt, A, B, C, D, initial_state, cu_seqlens, method, *, rows: Optional[int] = None) -> None:
    """zeco_ssd's local checks, each error naming the argument (zeco_gla checks the packed cut and the
    agreement across ranks); ``rows``: the packed sequences of a context (the initial states' rows)."""
    if method not in METHODS:
        raise ValueError(f"{_OP}: method must be one of {sorted(METHODS)}, got {method!r}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{_OP}: cu_seqlens must be a 1-D integer tensor [N+1] or None, got "
                        f"{type(cu_seqlens).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{_OP}: x must be a floating-point 4-D tensor [batch, T_local, H, P], got {_shape(x)}")
    b, T, H, P = x.shape
    if not isinstance(dt, torch.Tensor) or tuple(dt.shape) != (b, T, H) or not dt.is_floating_point():
        raise ValueError(f"{_OP}: dt must be a floating-point tensor [batch, T_local, H] = {(b, T, H)}, "
                         f"got {_shape(dt)}")
    if not isinstance(A, torch.Tensor) or tuple(A.shape) != (H,) or not A.is_floating_point():
        raise ValueError(f"{_OP}: A must be a floating-point tensor [H] = [{H}], got {_shape(A)}")
    if not isinstance(B, torch.Tensor) or B.dim() != 4 or tuple(B.shape[:2]) != (b, T):
        raise ValueError(f"{_OP}: B must be a 4-D tensor [batch, T_local, G, N] with batch, T_local = {b}, {T}, "
                         f"got {_shape(B)}")
    G, N = B.shape[2], B.shape[3]
    if G == 0 or H % G != 0:
        raise ValueError(f"{_OP}: the heads H = {H} (x.shape[2]) must be a multiple of the groups G = {G} "
                         f"(B.shape[2])")
    if not isinstance(C, torch.Tensor) or C.shape != B.shape:
        raise ValueError(f"{_OP}: C must have B's shape {tuple(B.shape)}, got {_shape(C)}")
    for name, t in (("B", B), ("C", C)):
        if t.dtype != x.dtype:
            raise ValueError(f"{_OP}: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    if D is not None and (not isinstance(D, torch.Tensor) or tuple(D.shape) != (H,) or not D.is_floating_point()):
        raise ValueError(f"{_OP}: D must be a floating-point tensor [H] = [{H}] or None, got {_shape(D)}")
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("initial_state", initial_state)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{_OP}: {name} must be on x's device {x.device}, got {t.device}")
    if initial_state is not None:
        per_sequence = cu_seqlens is not None or rows is not None
        n = rows if rows is not None else b if cu_seqlens is None else cu_seqlens.numel() - 1
        what = "num_seqs" if per_sequence else "batch"
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (n, H, P, N):
            raise ValueError(f"{_OP}: initial_state must be [{what}, H, P, N] = {(n, H, P, N)}, "
                             f"got {_shape(initial_state)}")
        if initial_state.dtype != state_dtype(x.dtype):
            want = str(state_dtype(x.dtype)).replace("torch.", "")
            raise ValueError(f"{_OP}: initial_state must be {want} for {x.dtype} inputs (float32; float64 for float64 "
                             f"inputs), got {initial_state.dtype}")


def _to_heads(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[b, T, G, N]`` -> ``[b, T, H, N]``, head h reading group h // (H // G) (transformers'
    ``repeat_interleave``); its gradient sums each group's heads."""
    b, T, G, N = t.shape
    if G == H:
        return t
    return t.unsqueeze(3).expand(b, T, G, H // G, N).reshape(b, T, H, N)


def _gla_inputs(x, dt, A, B, C, initial_state):
    """q, k, v, g and the initial state in zeco_gla's conventions."""
    H = x.shape[2]
    acc = state_dtype(x.dtype)
    v = (dt.to(acc).unsqueeze(-1) * x.to(acc)).to(x.dtype)  # dt x, rounded once to x's dtype
    g = dt.to(acc) * A.to(acc)  # the log decay of each head and token (<= 0 for dt > 0, A < 0)
    h0 = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()  # [.., N, P]
    return _to_heads(C, H), _to_heads(B, H), v, g, h0


def zeco_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: Optional[torch.Tensor] = None, group=None, *, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
             method: str = "zeco", context=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sequence-parallel Mamba2 SSD: on each rank, exactly what the chunked scan of one process returns
    on the whole sequence, restricted to the rank's shard.

    Args:
        x: ``[batch, T_local, H, P]``, this rank's contiguous shard.
        dt: ``[batch, T_local, H]``, the time steps as the scan uses them: already biased, softplus'ed and
            clamped by the caller (positive; values are not checked).
        A: ``[H]``, negative (``-exp(A_log)``).
        B, C: ``[batch, T_local, G, N]`` in x's dtype, ``H % G == 0``: head h reads group ``h // (H // G)``.
        D: ``[H]`` or None: the skip term ``D[h] * x``.
        group: the sequence-parallel process group, as :func:`~allscan.ops.gla.zeco_gla`'s (None: the
            default group; :data:`~allscan.ops.LOCAL`: one process holding the whole sequence).
        initial_state: fp32 (fp64 with fp64 inputs) ``[batch, H, P, N]`` (transformers' ``ssm_state``
            layout), the state before the global first token; with ``cu_seqlens`` ``[num_seqs, H, P, N]``,
            used where each sequence starts.
        output_final_state: return the state after the shard (on the last rank the global end); with
            ``cu_seqlens`` the rows of the sequences that end on this rank, zeros elsewhere.
        cu_seqlens: ``[num_seqs + 1]`` offsets over the GLOBAL packed row (batch 1), as zeco_gla's.
        method: ``"zeco"``, ``"lasp1"`` or ``"lasp2"``, as zeco_gla's.
        context: the batch's :class:`allscan.SequenceContext` instead of ``group`` and ``cu_seqlens``
            (as zeco_gla's: the cut agreed once per batch is not compared again).

    Returns:
        ``(y [batch, T_local, H, P] in x's dtype, final_state [.., H, P, N] or None)``, the final state
        fp32 (fp64 with fp64 inputs).
    """
    conflict = context_conflict(context, group, cu_seqlens, _OP)
    spg = context_group(context, group, _OP)
    packed = cu_seqlens is not None and not isinstance(context, SequenceContext)  # (zeco_gla's rule)

    def validate():
        if conflict is not None:
            raise conflict
        # a packed context's sequences are the initial states' rows
        rows = context.cut(x.shape[1], x.shape[0], _OP).num_seqs if context is not None and context.packed else None
        _check_arguments(x, dt, A, B, C, D, initial_state, cu_seqlens, method, rows=rows)

    if spg is None:
        validate()
    else:  # a rank whose own arguments fail tells its peers, which raise in the next exchange
        validated_group(spg, x, _OP, validate, every_call=packed)
        if not torch.compiler.is_compiling():  # (no collective while tracing)
            # what zeco_gla's signature cannot see: B and C broadcast to the heads, the skip term added here
            check_across_ranks(spg, x.device, _OP, [("groups of B and C (G)", int(B.shape[2])),
                                                    ("D given", int(D is not None))], every_call=packed)
    # the reshapes before zeco_gla's first exchange: a failure here (out of memory) reaches the peers too
    q, k, v, g, h0 = own_work(spg, _OP, "its inputs' broadcasts", _gla_inputs, x, dt, A, B, C, initial_state,
                              every_call=packed)
    o, final = zeco_gla(q, k, v, g, None if context is not None else LOCAL if spg is None else spg, scale=1.0,
                        initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                        method=method, context=context)
    if D is not None:
        acc = state_dtype(x.dtype)
        o = (o.to(acc) + D.to(acc)[:, None] * x.to(acc)).to(x.dtype)
    return o, (final.transpose(-1, -2).contiguous() if output_final_state else None)
