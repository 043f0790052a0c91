"""The delta-rule layers' local work on GPU with flash-linear-attention's kernels (fla-core 0.6.0), and
fla's own context parallelism as the ``method="fla_cp"`` baseline.

:class:`FlaDelta` does what :class:`allscan.ops.delta.chunk.TorchDelta` does with fla's kernels: fla's
forward and backward steps (the functions fla's own autograd functions call), so that the shard's
forward and backward (:mod:`allscan.ops.delta.shard`) can put the All-Scan between them. The shard's
first segment, the one the All-Scan's state enters, runs:

- forward on the widened problem. The state dynamics act on the state's columns independently
  (``S_t = A_t S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``), so fla's forward on
  ``v' = [v | 0]`` (``[.., V + K]``) from ``S_0' = [h0 | I]`` returns, column block by column block::

      o'     = [o_local | Q']        o_local: the outputs from h0;  Q'_t = scale q_t^T A_t ... A_1
      final' = [h_local | M]         h_local: the final state from h0;  M = A_T ... A_1 (the transition)

  all the matrix All-Scan needs (``h_local``, ``M``) and all folding the incoming state in needs
  (``o = o_local + Q' S_in``; ``final = h_local + M S_in``), without a second pass over the shard after
  the scan. The WY factors (fla's ``A``, which do not depend on v) are kept for the backward. It runs in
  two halves (:meth:`FlaDelta.states`, :meth:`FlaDelta.outputs`): the final state and the transition
  come out of fla's state kernel and go to the All-Scan; the outputs come from the chunk states by
  allscan's kernel (:func:`.fold_in.head_outputs`: fla's output arithmetic over the V + K columns with
  ``S_in`` folded in, so ``o'`` is never written), which waits for the scan; the other packed segments'
  outputs are issued before that wait. The WY values ``u`` are computed on the V columns, not on ``[v |
  0]``, and widened with zeros (``u`` is linear in v): Gated DeltaNet's written widened by allscan's WY
  kernel after fla's solve kernel, KDA's widened after fla's intra-chunk function (:mod:`.widen`).
- backward on the V value columns only: fla's backward from the whole incoming state, given the final
  state's gradient, exactly what fla runs for a sequence that starts from that state. Its steps are
  called one by one (:func:`_backward_steps`, in fla's order), so that the final state's gradient, to
  which the reverse All-Scan adds, is needed only where fla's backward state kernel starts: the scan
  runs beside the recomputation of the chunk states before it.

Packed sequences after it (no incoming state reaches them) run in one varlen call of the same steps on
the V columns; the backward is one varlen call over the whole shard, with fla's per-token factors of the
two forward calls joined (fla's chunks start at each sequence's start, so they are the factors one
varlen call over the shard would have made).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .._shards import on_device
from .chunk import CHUNK, DeltaInputs, compute_dtype
from .fla_imports import fla_functions

_WHOLE = (None, None)  # fla's (cu_seqlens, chunk_indices) of a batch of whole sequences


def _activate(x: DeltaInputs, opts):
    """What fla's autograd functions apply before their forward steps: ``(x activated, q_rstd, k_rstd)``."""
    q, k, beta = x.q, x.k, x.beta
    q_rstd = k_rstd = None
    if opts.use_qk_l2norm_in_kernel:
        q, q_rstd = fla_functions().l2norm_fwd(q)
        k, k_rstd = fla_functions().l2norm_fwd(k)
    if opts.use_beta_sigmoid_in_kernel:
        beta = fla_functions().fused_beta_sigmoid_fwd(beta, 2.0 if opts.allow_neg_eigval else 1.0)
    return x._replace(q=q, k=k, beta=beta), q_rstd, k_rstd


def _beside_identity(h0: Optional[torch.Tensor], B: int, HV: int, K: int, V: int, dt, device) -> torch.Tensor:
    """``[h0 | I]`` ``[B, HV, K, V + K]`` (h0 None: zeros), built in place: fewer launches than eye,
    zeros and cat."""
    wide = torch.zeros(B, HV, K, V + K, dtype=dt, device=device)
    wide[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1)
    if h0 is not None:
        wide[..., :V].copy_(h0)
    return wide


def local_varlen(bounds: Sequence[int], device):
    """fla's ``(cu_seqlens, chunk_indices)`` for local segment ``bounds``, ``(None, None)`` for one."""
    if len(bounds) == 2:
        return _WHOLE
    cu_cpu = torch.tensor(list(bounds), dtype=torch.long)
    cu = cu_cpu.to(device, non_blocking=True)
    return cu, fla_functions().prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cu_cpu)


def _state_steps(x: DeltaInputs, opts, scale, h0, width, varlen=_WHOLE):
    """fla's forward of one sequence batch (q, k, beta activated; packed sequences with ``varlen``, fla's
    ``(cu_seqlens, chunk_indices)``) up to the final states, on the values ``[v | 0]`` with ``width``
    columns (``h0``, None = zeros, as wide): ``(final, staged)``; :func:`_output_step` (V columns) or
    :func:`_head_output_step` (widened, after the All-Scan) finishes from ``staged``. The calls and their
    order are those of fla's ``chunk_gated_delta_rule_fwd`` / ``chunk_kda_fwd`` (chunk 64)."""
    fla = fla_functions()
    q, k, v, g, beta = x
    vl = dict(cu_seqlens=varlen[0], chunk_indices=varlen[1])
    if opts.per_key:
        if opts.use_gate_in_kernel:
            g_cum = fla.kda_gate_chunk_cumsum(g=g, A_log=opts.A_log, dt_bias=opts.dt_bias, scale=fla.RCP_LN2,
                                              chunk_size=CHUNK, lower_bound=opts.lower_bound, **vl)
        else:
            g_cum = fla.chunk_local_cumsum(g=g, scale=fla.RCP_LN2, chunk_size=CHUNK, **vl)
        w, u, _, kg, Aqk, Akk = fla.chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=scale,
                                                        chunk_size=CHUNK, safe_gate=opts.safe_gate, **vl)
        if width > v.shape[-1]:
            u = fla.widened(u, width)
        h, v_new, final = fla.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g_cum, initial_state=h0,
                                                           output_final_state=True, chunk_size=CHUNK, **vl)
        # fla recomputes the cumulative gate in the backward when it applies the gate itself
        factors = (None if opts.use_gate_in_kernel else g_cum, Aqk, Akk)
        return final, ("kda", q, v_new, g_cum, Aqk, h, scale, vl, factors)
    if opts.use_gate_in_kernel:
        g_cum = fla.gdn_gate_chunk_cumsum(g=g, A_log=opts.A_log, chunk_size=CHUNK, scale=fla.RCP_LN2,
                                          dt_bias=opts.dt_bias, **vl)
    else:
        g_cum = fla.chunk_local_cumsum(g, chunk_size=CHUNK, scale=fla.RCP_LN2, **vl)
    if width == v.shape[-1]:
        w, u, A = fla.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=CHUNK, **vl)
    else:  # the first segment (one sequence batch): w and [u | 0] in one pass after fla's factors
        assert varlen[0] is None, "the widened segment is one sequence batch (FlaDelta.states)"
        A = _gdn_solved_factors(k, g_cum, beta)
        w, u = fla.gdn_wy_widened(k, v, beta, A, g_cum, width)
    h, v_new, final = fla.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_cum, initial_state=h0,
                                                       output_final_state=True, chunk_size=CHUNK, **vl)
    return final, ("gdn", q, k, v_new, h, g_cum, scale, vl, (g_cum, A))


def _gdn_solved_factors(k, g_cum, beta):
    """Gated DeltaNet's solved WY factors ``A [B, T, HV, 64]`` of one sequence batch: the first step of
    fla's ``chunk_gated_delta_rule_fwd_intra`` (its fused kkt + solve kernel, launched as it launches
    it for chunk 64), without the WY values it computes next (:func:`.widen.gdn_wy_widened` does,
    widened)."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    A = torch.zeros(B, T, HV, CHUNK, device=k.device, dtype=k.dtype)
    fla_functions().gdn_kkt_solve_kernel[(-(-T // CHUNK), B * HV)](
        k=k, g=g_cum, beta=beta, A=A, cu_seqlens=None, chunk_indices=None, T=T, H=H, HV=HV, K=K, BT=CHUNK, BC=16)
    return A


def _output_step(staged):
    """fla's output kernel from what :func:`_state_steps` staged: ``(o, factors)``, ``factors`` what
    :func:`_backward_steps` needs besides the inputs (per-token tensors, or None)."""
    fla = fla_functions()
    if staged[0] == "kda":
        _, q, v_new, g_cum, Aqk, h, scale, vl, factors = staged
        return fla.chunk_gla_fwd_o_gk(q=q, v=v_new, g=g_cum, A=Aqk, h=h, scale=scale, chunk_size=CHUNK, **vl), factors
    _, q, k, v_new, h, g_cum, scale, vl, factors = staged
    return fla.chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, chunk_size=CHUNK, **vl), factors


def _head_output_step(staged, S_in):
    """The widened segment's outputs with ``S_in`` folded in, from what :func:`_state_steps` staged (one
    sequence batch, no packing): ``((o, Q'), factors)``, in allscan's kernel (:mod:`.fold_in`) instead of
    fla's output kernel over the widened columns and a pass over its result."""
    if staged[0] == "kda":
        _, q, v_new, g_cum, Aqk, h, scale, _, factors = staged
        return fla_functions().head_outputs(q, q, v_new, h, g_cum, Aqk, S_in, scale), factors
    _, q, k, v_new, h, g_cum, scale, _, factors = staged
    return fla_functions().head_outputs(q, k, v_new, h, g_cum, None, S_in, scale), factors


def _backward_steps(x: DeltaInputs, factors, opts, scale, h0, do, finals, varlen=_WHOLE):
    """fla's backward of the forward steps (:func:`_state_steps`, :func:`_output_step`) on ``x.v`` from
    ``h0``: ``(dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias)`` (q, k, beta activated; dg of the raw g).
    The calls and their order are those of fla's ``chunk_gated_delta_rule_bwd`` / ``chunk_kda_bwd``
    (chunk 64), with the final states' gradients asked of ``finals`` (:class:`.shard.FinalGrads`) only
    where fla's backward state kernel needs them: the reverse All-Scan that adds to them runs beside
    the recomputation of the chunk states, a latency-bound kernel on a few dozen SMs. (``zeco_gla``
    does the opposite, recomputing before it issues its scan, which overlaps its intra-chunk backward
    instead: here the recomputation is the only long step before the one that needs the scan's result,
    and it slows down beside the scan's work by less than the work takes; bench/README.md,
    "Measurements behind design choices".)"""
    fla = fla_functions()
    vl = dict(cu_seqlens=varlen[0], chunk_indices=varlen[1])
    if opts.per_key:
        return _kda_backward_steps(fla, x, factors, opts, scale, h0, do, finals, vl)
    q, k, v, g, beta = x
    dt = compute_dtype(v)
    g_cum, A = factors
    w, u = fla.gdn_recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g_cum, **vl)
    finals.mark()
    h, v_new, _ = fla.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g_cum, initial_state=h0, output_final_state=False,
                                                   chunk_size=CHUNK, **vl)
    finals.start()
    del u
    dv = fla.chunk_bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale, chunk_size=CHUNK, **vl)
    dh, dh0, dv = fla.chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g_cum, h0=h0, dht=_stacked(finals.get(), dt),
                                                     do=do, dv=dv, scale=scale, chunk_size=CHUNK, **vl)
    dq, dk, dw, dg = fla.chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                         chunk_size=CHUNK, **vl)
    del h, v_new, dh, w
    dk2, dv, db, dg2 = fla.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_cum, A=A, dw=dw, du=dv, **vl)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = fla.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **vl)
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        dg, dA_log, ddt_bias = fla.gdn_gate_bwd(g=g, A_log=opts.A_log, dt_bias=opts.dt_bias, dyg=dg)
    return dq, dk, dv, db, dg, dh0, dA_log, ddt_bias


def _kda_backward_steps(fla, x: DeltaInputs, factors, opts, scale, h0, do, finals, vl):
    """:func:`_backward_steps` for KDA (fla's ``chunk_kda_bwd``, recomputing)."""
    q, k, v, g, beta = x
    dt = compute_dtype(v)
    g_cum, Aqk, Akk = factors
    if opts.use_gate_in_kernel:  # the cumulative gate was not kept: fla recomputes it
        g_cum = fla.kda_gate_chunk_cumsum(g=g, A_log=opts.A_log, dt_bias=opts.dt_bias, scale=fla.RCP_LN2,
                                          chunk_size=CHUNK, lower_bound=opts.lower_bound, **vl)
    w, u, qg, kg = fla.kda_recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=g_cum, **vl)
    finals.mark()
    h, v_new, _ = fla.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g_cum, initial_state=h0, output_final_state=False,
                                                   chunk_size=CHUNK, **vl)
    finals.start()
    del u
    dAqk, dv = fla.chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=CHUNK, **vl)
    dh, dh0, dv = fla.chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g_cum, h0=h0, dht=_stacked(finals.get(), dt),
                                                     do=do, dv=dv, scale=scale, chunk_size=CHUNK, **vl)
    del qg, kg, w
    dq, dk, dv, db, dg, dAkk = fla.chunk_kda_bwd_wy_dqkg_fused(q=q, k=k, v=v, v_new=v_new, g=g_cum, beta=beta, A=Akk,
                                                               h=h, do=do, dh=dh, dv=dv, scale=scale, chunk_size=CHUNK,
                                                               **vl)
    del h, v_new, dh
    dq, dk, db, dg = fla.chunk_kda_bwd_intra(q=q, k=k, g=g_cum, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                             dg=dg, chunk_size=CHUNK, safe_gate=opts.safe_gate, **vl)
    H, HV = q.shape[2], v.shape[2]
    if HV > H:  # grouped value heads: dq and dk summed back over each group
        dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(dim=3)
        dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(dim=3)
    dg = fla.chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **vl)
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        dg, dA_log, ddt_bias = fla.kda_gate_bwd(g=g, A_log=opts.A_log, dt_bias=opts.dt_bias, dyg=dg,
                                                lower_bound=opts.lower_bound)
    return dq, dk, dv, db, dg, dh0, dA_log, ddt_bias


def _stacked(states: Sequence[Optional[torch.Tensor]], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One state per segment (``[1, ...]``, None = zeros) as fla's ``[N, ...]`` tensor in ``dtype``; None
    when all are None."""
    given = [s for s in states if s is not None]
    if not given:
        return None
    if len(states) == 1:
        return given[0].to(dtype).contiguous()
    return torch.cat([torch.zeros_like(given[0], dtype=dtype) if s is None else s.to(dtype) for s in states])


class FlaDelta:
    """The local work of one shard with fla-core's kernels (CUDA, bf16 / fp16 / fp32): the methods of
    :class:`allscan.ops.delta.chunk.TorchDelta`. ``saved`` is ``(qa, ka, ba, q_rstd, k_rstd, *factors)``:
    the activated q, k, beta and the l2 norms' reciprocals (None where fla applies nothing) and fla's
    WY factors, every one per token over the whole shard."""

    name = "fla"

    @staticmethod
    def states(x: DeltaInputs, run, h0s: List[Optional[torch.Tensor]]):
        opts, scale, bounds, wide = run.opts, run.scale, run.bounds, run.wide
        B, T, HV, V = x.v.shape
        K = x.q.shape[-1]
        x = DeltaInputs(*(t.contiguous() for t in x))
        dt = compute_dtype(x.v)  # fp32: fla's states (fp64 only in the CPU tests of this algebra)
        finals, M, steps = [], None, []
        with on_device(x.q):
            xa, q_rstd, k_rstd = _activate(x, opts)
            T0 = bounds[1] if wide else 0
            if wide:  # the first segment on [v | 0] from [h0 | I]
                final, st = _state_steps(DeltaInputs(*(t[:, :T0] for t in xa)), opts, scale,
                                         _beside_identity(h0s[0], B, HV, K, V, dt, x.v.device), V + K)
                finals.append(final[..., :V].contiguous())
                M = final[..., V:].contiguous()
                steps.append(st)
            if T0 < T:  # the other segments in one (varlen) call, on the V columns
                rest = [b - T0 for b in bounds if b >= T0]
                varlen = local_varlen(rest, x.q.device)
                inits = _stacked(h0s[len(bounds) - len(rest):], dt)
                part = DeltaInputs(*(t[:, T0:] for t in xa)) if T0 else xa
                final, st = _state_steps(part, opts, scale, inits, V, varlen)
                finals.extend(final.split(1) if varlen[0] is not None else [final])
                steps.append(st)
        l2, sig = opts.use_qk_l2norm_in_kernel, opts.use_beta_sigmoid_in_kernel
        activated = (xa.q if l2 else None, xa.k if l2 else None, xa.beta if sig else None, q_rstd, k_rstd)
        return finals, M, (steps, wide, V, activated)

    @staticmethod
    def outputs(staged, incoming=None):
        steps, wide, V, activated = staged
        with on_device(steps[0][1]):
            outs = [_output_step(st) for st in steps[int(wide):]]  # beside the All-Scan
            if wide:
                outs.insert(0, _head_output_step(steps[0], incoming()))
        o_head = q_eff = o_tail = None
        if wide:
            o_head, q_eff = outs[0][0]
        if len(outs) > int(wide):
            o_tail = outs[-1][0]
        # the factors of both calls, per token over the whole shard (the backward is one call)
        factors = tuple(None if fs[0] is None else (fs[0] if len(fs) == 1 else torch.cat(fs, 1))
                        for fs in zip(*(f for _, f in outs)))
        return o_head, q_eff, o_tail, activated + factors

    @staticmethod
    def saved_like(x: DeltaInputs, opts):
        """Empty tensors shaped like :meth:`outputs`' ``saved`` (None where absent): the fake kernels'."""
        q, k, v, g, beta = x
        l2, sig = opts.use_qk_l2norm_in_kernel, opts.use_beta_sigmoid_in_kernel
        B, T, H, K = q.shape
        HV = v.shape[2]
        rstd = q.new_empty(B, T, H, dtype=torch.float32) if l2 else None
        factor = k.new_empty(B, T, HV, CHUNK)
        g_cum = None if (opts.per_key and opts.use_gate_in_kernel) else g.new_empty(g.shape, dtype=torch.float32)
        factors = (g_cum, factor, k.new_empty(B, T, HV, CHUNK)) if opts.per_key else (g_cum, factor)
        return (q.new_empty(q.shape) if l2 else None, k.new_empty(k.shape) if l2 else None,
                beta.new_empty(beta.shape, dtype=torch.float32) if sig else None, rstd,
                None if rstd is None else q.new_empty(B, T, H, dtype=torch.float32)) + factors

    @staticmethod
    def activated_qk(saved):
        """``(q, k)`` l2-normalised as :meth:`outputs` kept them, or None (no in-kernel l2norm): the
        backward needs nothing else of q and k (fla keeps the same)."""
        return None if saved[0] is None else (saved[0], saved[1])

    @staticmethod
    def q_eff_dtype(v: torch.Tensor) -> torch.dtype:
        """The dtype of Q' (:func:`.fold_in.head_outputs` writes it in the values' dtype)."""
        return v.dtype

    @staticmethod
    def fold_state_grad(q_eff: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
        return fla_functions().fold_state_grad(q_eff, do)

    @staticmethod
    def backward(saved, x: DeltaInputs, run, h0s: List[Optional[torch.Tensor]], do: torch.Tensor, finals):
        opts = run.opts
        qa, ka, ba, q_rstd, k_rstd, *factors = saved
        q, k, v, g, beta = x
        xa = DeltaInputs(q.contiguous() if qa is None else qa, k.contiguous() if ka is None else ka, v.contiguous(),
                         g.contiguous(), beta.contiguous() if ba is None else ba)
        with on_device(q):
            varlen = local_varlen(run.bounds, q.device)
            dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = _backward_steps(
                xa, factors, opts, run.scale, _stacked(h0s, compute_dtype(v)), do.contiguous(), finals, varlen)
            if opts.use_qk_l2norm_in_kernel:
                dq, dk = fla_functions().l2norm_bwd(xa.q, q_rstd, dq), fla_functions().l2norm_bwd(xa.k, k_rstd, dk)
            if opts.use_beta_sigmoid_in_kernel:
                dbeta = fla_functions().fused_beta_sigmoid_bwd(beta.contiguous(), dbeta,
                                                               2.0 if opts.allow_neg_eigval else 1.0)
        if dh0 is None:
            dh0s = [None] * len(h0s)
        else:
            dh0s = list(dh0.split(1)) if varlen[0] is not None else [dh0]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0s,
                dA_log, ddt_bias)
