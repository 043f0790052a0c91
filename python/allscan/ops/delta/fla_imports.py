"""fla-core's functions that :mod:`allscan.ops.delta.fla`'s steps call, and allscan's Triton kernels beside
them, imported once per process; and whether they all import (else the delta layers take the torch backend)."""
from __future__ import annotations

import functools
from types import SimpleNamespace

from ..fla_autotune import apply_autotune_setting
from ..fla_dispatch import direct


@functools.lru_cache(maxsize=None)
def fla_delta_available() -> bool:
    """Whether every fla-core function the delta layers call imports (fla-core and Triton with a GPU):
    a version lacking one falls back to the torch backend at selection, not in the middle of a call."""
    try:
        fla_functions()
    except Exception:  # noqa: BLE001 - any failure to import means: not usable here
        return False
    return True


@functools.lru_cache(maxsize=None)
def fla_functions() -> SimpleNamespace:
    """fla-core's functions the steps below call, and allscan's kernels around them, imported once per
    process (import statements on every call are host time on the critical path, issue 14). What it
    found is kept: to replace one of them (tests, benchmarks), replace ``fla_functions`` or clear its cache."""
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.common.gate import fused_beta_sigmoid_bwd, fused_beta_sigmoid_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import (chunk_gated_delta_rule_fwd_intra,
                                                    chunk_gated_delta_rule_fwd_kkt_solve_kernel)
    from fla.ops.gated_delta_rule.gate import gdn_gate_bwd, gdn_gate_chunk_cumsum
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd as gdn_recompute_w_u_fwd
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv, chunk_kda_bwd_wy_dqkg_fused
    from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra, chunk_kda_fwd_intra
    from fla.ops.kda.gate import kda_gate_bwd, kda_gate_chunk_cumsum
    from fla.ops.kda.wy_fast import recompute_w_u_fwd as kda_recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    from .fold_in import fold_state_grad, head_outputs  # Triton: imported with fla
    from .widen import gdn_wy_widened, widened

    apply_autotune_setting()
    fla = dict(
        l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, fused_beta_sigmoid_fwd=fused_beta_sigmoid_fwd,
        fused_beta_sigmoid_bwd=fused_beta_sigmoid_bwd, chunk_local_cumsum=chunk_local_cumsum,
        gdn_gate_chunk_cumsum=gdn_gate_chunk_cumsum, chunk_gated_delta_rule_fwd_intra=chunk_gated_delta_rule_fwd_intra,
        kda_gate_chunk_cumsum=kda_gate_chunk_cumsum, chunk_kda_fwd_intra=chunk_kda_fwd_intra,
        chunk_gated_delta_rule_fwd_h=chunk_gated_delta_rule_fwd_h, chunk_fwd_o=chunk_fwd_o,
        chunk_gla_fwd_o_gk=chunk_gla_fwd_o_gk,
        # the backward's steps (fla's chunk_gated_delta_rule_bwd / chunk_kda_bwd)
        gdn_recompute_w_u_fwd=gdn_recompute_w_u_fwd, kda_recompute_w_u_fwd=kda_recompute_w_u_fwd,
        chunk_bwd_dv_local=chunk_bwd_dv_local, chunk_kda_bwd_dAv=chunk_kda_bwd_dAv,
        chunk_gated_delta_rule_bwd_dhu=chunk_gated_delta_rule_bwd_dhu, chunk_bwd_dqkwg=chunk_bwd_dqkwg,
        prepare_wy_repr_bwd=prepare_wy_repr_bwd, chunk_kda_bwd_wy_dqkg_fused=chunk_kda_bwd_wy_dqkg_fused,
        chunk_kda_bwd_intra=chunk_kda_bwd_intra, gdn_gate_bwd=gdn_gate_bwd, kda_gate_bwd=kda_gate_bwd)
    return SimpleNamespace(
        **{name: direct(fn) for name, fn in fla.items()},  # past fla's dispatcher where it falls back anyway
        RCP_LN2=RCP_LN2, prepare_chunk_indices=prepare_chunk_indices,
        gdn_kkt_solve_kernel=chunk_gated_delta_rule_fwd_kkt_solve_kernel, gdn_wy_widened=gdn_wy_widened,
        widened=widened, head_outputs=head_outputs, fold_state_grad=fold_state_grad)
