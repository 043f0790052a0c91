"""The fla glue: flash-linear-attention's (fla-core) ``chunk_gla`` Triton kernels, called stage by stage.

:class:`FlaGLA` is the CUDA local backend of :mod:`allscan.ops.gla.zeco` (the other is
:class:`allscan.ops.gla.chunk.TorchGLA`, same staged interface): local cumulative gates and chunk
states first (so the final state can be sent as early as possible), then the intra-chunk attention
and output; in backward, the recomputed states and the intra-chunk gradients first, the
state-gradient recurrence (which needs the gradient arriving from the next rank) last. The
incoming-state terms use allscan's own Triton kernels (:mod:`allscan.ops.gla.incoming_state`), with
the torch ops of :mod:`allscan.ops.gla.chunk` as the fallback should one fail.

:func:`limit_fla_autotune` (``ALLSCAN_FLA_AUTOTUNE``), which the delta-rule ops share, is
:mod:`allscan.ops.fla_autotune`'s, named here too.
"""
from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import torch

from allscan._settings import settings

from ..fla_autotune import FLA_AUTOTUNE_MODES, apply_autotune_setting, limit_fla_autotune  # noqa: F401
from ..fla_dispatch import direct, falls_back
from .chunk import torch_correct_, torch_state_grad

# ---------------------------------------------------------------------------------------------------
# allscan's fused Triton kernels: on unless ALLSCAN_GLA_FUSED(_OUTPUT)=0, a caller, or a failure says off
# ---------------------------------------------------------------------------------------------------
_FUSED_OVERRIDE: dict = {}  # "correction" / "output" -> bool, set by set_fused_output or a failure


def fused_kernels_enabled() -> bool:
    """Whether the incoming-state terms use allscan's fused Triton kernels (``ALLSCAN_GLA_FUSED``, on by
    default); False once one of them failed and the op fell back to torch ops (with a warning)."""
    return _FUSED_OVERRIDE.get("correction", settings.gla_fused)


def _fused_output_enabled() -> bool:
    return _FUSED_OVERRIDE.get("output", settings.gla_fused_output)


def set_fused_output(enabled: bool) -> None:
    """Fold the incoming state into the output kernel (default) or apply it afterwards with the
    separate correction kernel (benchmarks compare both; ``ALLSCAN_GLA_FUSED_OUTPUT=0`` sets it off)."""
    _FUSED_OVERRIDE["output"] = bool(enabled)


def _fused_failed(e, which="correction"):
    _FUSED_OVERRIDE[which] = False
    what = "output kernel (with the incoming state folded in)" if which == "output" else "correction"
    instead = "fla's output kernel and the separate correction" if which == "output" else "torch ops"
    warnings.warn(f"allscan.ops.gla: the fused Triton {what} failed ({type(e).__name__}: {e}); "
                  f"using {instead} from now on")


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    """Whether fla-core's GLA kernels can be imported (and Triton initialises)."""
    try:
        import fla.ops.gla.chunk  # noqa: F401
        return True
    except Exception:  # ImportError, or triton failing to initialise
        return False


class FlaGLA:
    """fla-core's ``chunk_gla`` Triton kernels, called stage by stage (CUDA only)."""

    name = "fla"
    state_backward_first = True  # bwd_dh is one kernel: the last rank runs it before its reverse scan

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _mods():  # once per process: every stage asks for it (host time per call, issue 14)
        apply_autotune_setting()
        from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
        from fla.ops.gla import chunk as gc
        from fla.ops.utils import prepare_chunk_indices
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum, chunk_local_cumsum_scalar, chunk_local_cumsum_vector

        gla = SimpleNamespace(**{name: direct(getattr(gc, name)) for name in (
            "chunk_gla_fwd_intra_gk", "chunk_gla_fwd_o_gk", "chunk_gla_bwd_dA", "chunk_gla_bwd_dqk_intra",
            "chunk_gla_bwd_dv", "chunk_gla_bwd_dqkg")})
        # fla's chunk_local_cumsum is its dispatcher and an input guard (contiguous inputs, the
        # inputs' device) around chunk_local_cumsum_vector for [B, T, H, K] gates: the stages pass
        # contiguous gates, on the current device (the layer makes the inputs' device current)
        cumsum = chunk_local_cumsum_vector if falls_back(chunk_local_cumsum) else chunk_local_cumsum
        return SimpleNamespace(chunk_fwd_h=direct(chunk_fwd_h), chunk_bwd_dh=direct(chunk_bwd_dh), gla=gla,
                               prepare_chunk_indices=prepare_chunk_indices, RCP_LN2=RCP_LN2,
                               chunk_local_cumsum=cumsum, chunk_local_cumsum_scalar=chunk_local_cumsum_scalar)

    @staticmethod
    def _chunk_decays(g, BT, cu, ci):
        """fla's chunk-local cumulative decays ``[B, T, H, K]`` (log2) of the gates ``g`` ``[B, T, H, K]``. A
        decay per head broadcast over K (simple GLA, Mamba2's SSD: a stride-0 view) is summed once per head and
        then broadcast: one write of the result instead of writing the broadcast gates, reading them back and
        writing the sums (at 16K tokens and 64 heads of 128, 1 GiB less memory traffic per call)."""
        m = FlaGLA._mods()
        if g.stride(-1) == 0:
            per_head = m.chunk_local_cumsum_scalar(g[..., 0].contiguous(), BT, scale=m.RCP_LN2, cu_seqlens=cu,
                                                   chunk_indices=ci)
            return per_head.unsqueeze(-1).expand(g.shape).contiguous()
        return m.chunk_local_cumsum(g, BT, scale=m.RCP_LN2, cu_seqlens=cu, chunk_indices=ci)

    @staticmethod
    def _layout(q, bounds):
        BT = FlaGLA._chunk_size(q.shape[1])
        if len(bounds) == 2:
            return BT, None, None
        m = FlaGLA._mods()
        cu = torch.tensor(bounds, dtype=torch.long, device=q.device)
        return BT, cu, m.prepare_chunk_indices(cu, BT)

    @staticmethod
    def _stack(hs, like_shape, device):
        if all(h is None for h in hs):
            return None
        if len(hs) == 1:
            return hs[0].float().contiguous()
        return torch.cat([torch.zeros(like_shape, dtype=torch.float, device=device) if h is None else h.float()
                          for h in hs], 0).contiguous()

    @staticmethod
    def _split(ht, n):
        return [ht] if n == 1 else [ht[j:j + 1] for j in range(n)]

    @staticmethod
    def fwd_states(q, k, v, g, scale, bounds, h0s):
        m = FlaGLA._mods()
        BT, cu, ci = FlaGLA._layout(q, bounds)
        B, T, H, K = k.shape
        V = v.shape[-1]
        h0 = FlaGLA._stack(h0s, (1, H, K, V), q.device)
        gcum = FlaGLA._chunk_decays(g, BT, cu, ci)
        h, ht = m.chunk_fwd_h(k=k, v=v, g=None, gk=gcum, gv=None, h0=h0, output_final_state=True,
                              cu_seqlens=cu, chunk_size=BT, states_in_fp32=False)
        return SimpleNamespace(gcum=gcum, h=h, BT=BT, cu=cu, ci=ci, finals=FlaGLA._split(ht, len(bounds) - 1))

    @staticmethod
    def fwd_output(st, q, k, v, g, scale, bounds):
        m = FlaGLA._mods()
        A = m.gla.chunk_gla_fwd_intra_gk(q=q, k=k, g=st.gcum, scale=scale, cu_seqlens=st.cu,
                                         chunk_size=st.BT, chunk_indices=st.ci)
        o = m.gla.chunk_gla_fwd_o_gk(q=q, v=v, g=st.gcum, A=A, h=st.h, scale=scale, cu_seqlens=st.cu,
                                     chunk_size=st.BT, chunk_indices=st.ci)
        st.A = A
        st.h = None  # recomputed in backward (in fp32, from the true incoming state), as fla does
        return o

    @staticmethod
    def fused_output_ok():
        return fused_kernels_enabled() and _fused_output_enabled()

    @staticmethod
    def fwd_intra(st, q, k, scale):
        """The intra-chunk attention only: what the forward computes while the incoming state is in
        flight, when the output is then made by :meth:`fwd_output_with_state`."""
        m = FlaGLA._mods()
        st.A = m.gla.chunk_gla_fwd_intra_gk(q=q, k=k, g=st.gcum, scale=scale, cu_seqlens=st.cu,
                                            chunk_size=st.BT, chunk_indices=st.ci)

    @staticmethod
    def fwd_output_with_state(st, q, v, S_in, scale, L1):
        """The output with the incoming state of the first local segment folded in (one kernel);
        returns (o, the segment's total decay as a state multiplier). None if the kernel failed (the
        caller then takes fla's output kernel and the separate correction)."""
        try:
            from .incoming_state import output_with_state
            offs = FlaGLA._offsets(st, L1)
            o = output_with_state(q, v, st.gcum, st.A, st.h, S_in, scale, st.BT, offs, cu_seqlens=st.cu,
                                  chunk_indices=st.ci)
        except Exception as e:  # noqa: BLE001 - a Triton failure must not stop training
            _fused_failed(e, "output")
            return None
        st.h = None
        return o, offs[1].unsqueeze(-1)

    @staticmethod
    def saved(st, L1):
        """What the backward keeps of the forward: the intra-chunk attention and, when the forward
        made them (and ``L1`` is not None), the chunk offsets of the first L1 tokens (the backward's
        state gradient reuses them: the same cumulative gates, one launch fewer)."""
        if L1 is not None and getattr(st, "offs_L1", None) == L1:
            return (st.A,) + tuple(st.offs)
        return (st.A,)

    @staticmethod
    def saved_like(q, v):
        """Empty tensors shaped as :meth:`saved` without offsets (torch.compile's fake kernel)."""
        B, T, H, _ = q.shape
        return [q.new_empty(B, T, H, FlaGLA._chunk_size(T), dtype=torch.float32)]

    @staticmethod
    def _chunk_size(T):
        return min(64, max(16, 1 << max(0, (T - 1).bit_length())))  # as fla's ChunkGLAFunction

    @staticmethod
    def _offsets(st, L1):
        """chunk_offsets of the forward's gates over the first L1 tokens, computed once per forward
        (the All-Scan's decay and the output correction use the same ones)."""
        from .incoming_state import chunk_offsets
        if getattr(st, "offs_L1", None) != L1:
            st.offs, st.offs_L1 = chunk_offsets(st.gcum, L1, st.BT), L1
        return st.offs

    @staticmethod
    def correct(st, q, g, o, S_in, scale, L1):
        if fused_kernels_enabled():
            try:
                from .incoming_state import correct_output_
                return correct_output_(o, q, st.gcum, S_in, scale, L1, st.BT,
                                       offsets=FlaGLA._offsets(st, L1)).unsqueeze(-1)
            except Exception as e:  # noqa: BLE001 - a Triton failure must not stop training
                _fused_failed(e)
        return torch_correct_(q, g, o, S_in, scale, L1)

    @staticmethod
    def shard_gamma(st, g):
        # the shard is one segment here; its total decay from fla's chunk-local cumulative gates
        e = FlaGLA._offsets(st, st.gcum.shape[1])[1]  # [B, H, K]
        return e[..., 0].contiguous() if g.dim() == 3 else e  # simple GLA: [B, H], as on every other rank

    @staticmethod
    def bwd_begin(q, k, v, gf, bounds, h0s):
        """The chunk-local decays and the chunk states from the segments' initial states ``h0s``."""
        m = FlaGLA._mods()
        BT, cu, ci = FlaGLA._layout(q, bounds)
        gcum = FlaGLA._chunk_decays(gf, BT, cu, ci)
        B, T, H, K = k.shape
        h0 = FlaGLA._stack(h0s, (1, H, K, v.shape[-1]), q.device)
        h, _ = m.chunk_fwd_h(k=k, v=v, g=None, gk=gcum, gv=None, h0=h0, output_final_state=False,
                             cu_seqlens=cu, chunk_size=BT, states_in_fp32=True)
        return SimpleNamespace(BT=BT, cu=cu, ci=ci, gcum=gcum, h0=h0, h=h)

    @staticmethod
    def xgrad(prep, saved, q, g, do, scale, L1):
        if fused_kernels_enabled():
            try:
                from .incoming_state import state_grad
                offsets = tuple(saved[1:3]) if len(saved) == 3 else None
                X, e = state_grad(q, prep.gcum, do, scale, L1, prep.BT, offsets=offsets)
                return X, e.unsqueeze(-1)
            except Exception as e:  # noqa: BLE001
                _fused_failed(e)
        return torch_state_grad(q, g, do, scale, L1)

    @staticmethod
    def bwd_prepare(prep, saved, q, k, v, g, scale, bounds, h0s, do):
        """The rest of the local backward that does not need the gradient of the final state."""
        m = FlaGLA._mods()
        BT, cu, ci, gcum = prep.BT, prep.cu, prep.ci, prep.gcum
        dA = m.gla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, cu_seqlens=cu, chunk_size=BT, chunk_indices=ci)
        prep.dq, prep.dk = m.gla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=gcum, dA=dA, cu_seqlens=cu, chunk_size=BT,
                                                         chunk_indices=ci)
        prep.A = saved[0]
        return prep

    @staticmethod
    def bwd_dh(p, q, k, v, g, scale, bounds, h0s, do, dhts):
        """The chunk states' gradients from the segments' final-state gradients ``dhts``, and the
        initial states' (``p.dh0s``, None where ``h0s`` is)."""
        m = FlaGLA._mods()
        B, T, H, K = k.shape
        V = v.shape[-1]
        dht = FlaGLA._stack(dhts, (1, H, K, V), q.device)
        p.dh, dh0 = m.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=p.h0, dht=dht, scale=scale, g=None, gk=p.gcum,
                                   gv=None, cu_seqlens=p.cu, chunk_size=p.BT, states_in_fp32=True)
        n = len(bounds) - 1
        if dh0 is None:
            p.dh0s = [None] * n
        else:
            parts = FlaGLA._split(dh0, n)
            p.dh0s = [None if h is None else parts[j] for j, h in enumerate(h0s)]
        return p

    @staticmethod
    def bwd_finish(p, q, k, v, g, scale, bounds, h0s, do):
        m = FlaGLA._mods()
        dv = m.gla.chunk_gla_bwd_dv(k=k, g=p.gcum, A=p.A, do=do, dh=p.dh, cu_seqlens=p.cu, chunk_size=p.BT,
                                    chunk_indices=p.ci)
        dq, dk, dg = m.gla.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=p.h, g=p.gcum, do=do, dh=p.dh, dq=p.dq, dk=p.dk,
                                              scale=scale, cu_seqlens=p.cu, chunk_size=p.BT, chunk_indices=p.ci)
        dh0s = p.dh0s
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dh0s
