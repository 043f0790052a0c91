"""``method="fla_cp"``: fla's own context parallelism for the delta-rule ops, the baseline the benchmarks
and tests compare allscan's All-Scan with, called as fla documents it."""
from __future__ import annotations

import torch

from ..fla_autotune import apply_autotune_setting
from .chunk import DeltaInputs


def fla_kernel(opts):
    """fla's chunk function for these options and the keyword arguments that carry them."""
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


def fla_context_parallel(x: DeltaInputs, opts, scale: float, group, cu_seqlens, T_global: int):
    """fla's chunk function for ``opts`` with fla's own context parallelism, called as fla documents it
    (one ``build_cp_context`` over the global ``cu_seqlens``, then the chunk function with
    ``cp_context``); ``group`` None: one rank, nothing to parallelise. Returns the outputs."""
    fn, kw = fla_kernel(opts)
    if group is None:
        o, _ = fn(*x, scale=scale, cu_seqlens=cu_seqlens, **kw)
        return o
    from fla.ops.cp import build_cp_context

    if cu_seqlens is None:
        cu_cpu = torch.tensor([0, T_global], dtype=torch.long)
    else:
        cu_cpu = cu_seqlens.detach().to("cpu", torch.long)
    ctx = build_cp_context(cu_cpu.to(x.q.device), group, cu_seqlens_cpu=cu_cpu)
    o, _ = fn(*x, scale=scale, cp_context=ctx, **kw)
    return o
