"""The delta-rule layers' local work on GPU with flash-linear-attention's kernels (fla-core 0.6.0), and
fla's own context parallelism as the ``method="fla_cp"`` baseline.

:class:`FlaDelta` implements :class:`allscan.ops.delta.chunk.TorchDelta`'s three stages with fla's
public ``chunk_gated_delta_rule`` / ``chunk_kda`` and nothing else. The state dynamics act on the
state's columns independently (``S_t = A_t S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``),
so one call on the widened problem ``v' = [v | 0]`` (``[.., V + K]``) from ``S_0' = [h0 | I]`` returns,
column block by column block::

    o'     = [o_local | Q']        o_local: the outputs from h0;  Q'_t = scale q_t^T A_t ... A_1
    final' = [h_local | M]         h_local: the final state from h0;  M = A_T ... A_1 (the transition)

which is all the matrix All-Scan needs (``h_local``, ``M``) and all that folding the incoming state in
needs (``o += Q' S_in``, Triton kernels: :mod:`.fold_in`; ``final = h_local + M S_in``):
fla's kernels, fla's autograd, one call, no second pass over the shard after the scan. The price is K more value columns in that call for the
first segment of a shard (the only one an incoming state reaches); ``bench/README.md`` has the
measured cost. Packed sequences after the first run in one more call with local ``cu_seqlens``.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch


@functools.lru_cache(maxsize=None)
def fla_delta_available() -> bool:
    """Whether fla-core's delta-rule kernels import (fla-core and Triton with a GPU)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.kda  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means: not usable here
        return False
    return True


def fla_kernel(opts):
    """fla's chunk function for these options and the keyword arguments that carry them."""
    from allscan.ops.gla.fla import apply_autotune_setting

    apply_autotune_setting()
    kw = dict(use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel, allow_neg_eigval=opts.allow_neg_eigval)
    if opts.use_gate_in_kernel:
        kw.update(use_gate_in_kernel=True, A_log=opts.A_log, dt_bias=opts.dt_bias)
    if opts.per_key:
        from fla.ops.kda import chunk_kda

        kw.update(safe_gate=opts.safe_gate, lower_bound=opts.lower_bound)
        return chunk_kda, kw
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule, kw


def widened_call(fn, kw, q, k, v, g, beta, scale, h0):
    """One fla call on ``[v | 0]`` from ``[h0 | I]``: ``(o_local, Q', h_local, M)``. The local part of
    ``method="zeco"`` (``bench/delta_bench.py`` times it alone as the ``wide`` row)."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    v_wide = torch.cat([v, v.new_zeros(B, T, HV, K)], -1)
    eye = torch.eye(K, dtype=torch.float32, device=v.device).expand(B, HV, K, K)
    h0 = v.new_zeros(B, HV, K, V, dtype=torch.float32) if h0 is None else h0
    o, fin = fn(q, k, v_wide, g, beta, scale=scale, initial_state=torch.cat([h0, eye], -1),
                output_final_state=True, **kw)
    return o[..., :V], o[..., V:], fin[..., :V], fin[..., V:]


class FlaDelta:
    """The local work of one shard with fla-core's kernels (CUDA, bf16 / fp16 / fp32), in the three
    stages of :class:`allscan.ops.delta.chunk.TorchDelta`."""

    name = "fla"

    @staticmethod
    def summarize(q, k, v, g, beta, opts, scale: float, bounds: Sequence[int], h0s: List[Optional[torch.Tensor]],
                  need_transition: bool):
        fn, kw = fla_kernel(opts)
        T0 = bounds[1]
        seg = lambda t: t[:, :T0]  # noqa: E731 - the first segment
        if need_transition:
            o0, q_eff, h0_local, M = widened_call(fn, kw, seg(q), seg(k), seg(v), seg(g), seg(beta), scale, h0s[0])
        else:
            o0, h0_local = fn(seg(q), seg(k), seg(v), seg(g), seg(beta), scale=scale, initial_state=h0s[0],
                              output_final_state=True, **kw)
            q_eff = M = None
        outs, finals = [o0], [h0_local]
        if len(bounds) > 2:  # the packed sequences that start inside the shard: one varlen call
            rest = [b - T0 for b in bounds[1:]]
            cu_cpu = torch.tensor(rest, dtype=torch.long)
            inits = torch.cat([h if h is not None else v.new_zeros(1, *h0_local.shape[1:], dtype=torch.float32)
                               for h in h0s[1:]])
            o_rest, fin_rest = fn(q[:, T0:], k[:, T0:], v[:, T0:], g[:, T0:], beta[:, T0:], scale=scale,
                                  initial_state=inits, output_final_state=True,
                                  cu_seqlens=cu_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_cpu, **kw)
            outs.append(o_rest)
            finals.extend(fin_rest.split(1))
        return SimpleNamespace(outputs=outs, T0=T0, q_eff=q_eff, finals=finals, transition=M)

    @staticmethod
    def local_outputs(sp) -> torch.Tensor:
        return torch.cat(sp.outputs, 1) if len(sp.outputs) > 1 else sp.outputs[0]

    @staticmethod
    def add_incoming(sp, o: torch.Tensor, S_in: Optional[torch.Tensor], need_final: bool = True):
        """Stage 3 (:meth:`TorchDelta.add_incoming`); the first segment's final state is updated only
        when the caller returns it (``need_final``)."""
        finals = list(sp.finals)
        if S_in is None:
            return o, finals
        dt = sp.finals[0].dtype  # fp32: the states' dtype (fp64 in the CPU tests of this algebra)
        S_in = S_in.to(dt)
        if o.is_cuda and dt == torch.float32:
            from .fold_in import fold_incoming

            first = fold_incoming(o[:, :sp.T0], sp.q_eff, S_in)
        else:  # what the kernel computes, in torch ops (CPU, float64)
            first = (o[:, :sp.T0].to(dt) + torch.einsum("bthk,bhkv->bthv", sp.q_eff.to(dt), S_in)).to(o.dtype)
        if need_final:
            finals[0] = finals[0] + sp.transition @ S_in
        if sp.T0 == o.shape[1]:  # one segment (the common case): no concatenation copy
            return first, finals
        return torch.cat([first, o[:, sp.T0:]], 1), finals


def fla_context_parallel(fn, kw, q, k, v, g, beta, scale, group, cu_seqlens, T_global):
    """``method="fla_cp"``: fla's own context parallelism, called as fla documents it (one
    ``build_cp_context`` over the global ``cu_seqlens``, then the chunk function with ``cp_context``)."""
    if group is None:  # one rank: nothing to parallelise
        o, _ = fn(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, **kw)
        return o
    from fla.ops.cp import build_cp_context

    if cu_seqlens is None:
        cu_cpu = torch.tensor([0, T_global], dtype=torch.long)
    else:
        cu_cpu = cu_seqlens.detach().to("cpu", torch.long)
    ctx = build_cp_context(cu_cpu.to(q.device), group, cu_seqlens_cpu=cu_cpu)
    o, _ = fn(q, k, v, g, beta, scale=scale, cp_context=ctx, **kw)
    return o
