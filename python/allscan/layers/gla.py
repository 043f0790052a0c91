"""Gated linear attention with ZeCO sequence parallelism (All-Scan).

A long sequence is cut into contiguous shards, one per rank of ``group`` (rank order = sequence
order). :func:`zeco_gla` returns on each rank exactly what single-GPU ``chunk_gla`` (fla) returns on
the whole sequence, restricted to the rank's shard.

The algorithm (rank p, shard of T tokens, log decays g, G_t = sum_{s<=t} g_s inside the shard)::

    local:      (o_loc, S_loc) = chunk_gla(q, k, v, g, initial_state=0)     # zero incoming state
    All-Scan:   S_in_p = scan(S_loc, gamma=exp(G_T))                       # y_{p+1} = exp(G_T,p) y_p + S_loc_p
    correction: o = o_loc + scale * (q * exp(G)) @ S_in                    # no recomputation
                S_out = S_loc + exp(G_T) * S_in

The scan runs asynchronously while the local intra-chunk attention and output are computed.

Backward, with Z_p the gradient of the state leaving rank p (from the next rank and, on the rank that
returns it, from the caller's ``final_state``): the gradient of the state entering rank p is
``dS_in_p = X_p + exp(G_T) * Z_p`` with ``X_p = scale * sum_t (q_t * exp(G_t)) do_t^T``, and
``Z_{p-1} = dS_in_p``, i.e. ``Z`` is the REVERSE All-Scan of ``X_p + exp(G_T) * dfinal_p`` with the
same decays. ``X_p`` needs only q, g and do, so the reverse scan starts first and runs while the local
backward prepares everything that does not need ``Z``; then the local backward of
``chunk_gla(q, k, v, g, initial_state=S_in)`` with final-state gradient ``Z`` gives exactly dq, dk, dv,
dg (including the decay of the incoming state) and the initial state's gradient.

Variable-length packing (``cu_seqlens`` over the GLOBAL packed sequence, B = 1, equal shard lengths):
the shard is cut into local segments at the sequence boundaries that fall inside it. Only the first
segment can continue a sequence from the previous rank (the incoming state applies to its tokens
only); the state passed on is the last segment's. A rank whose shard contains a sequence start passes
decay 0 to the scan, so no state crosses a sequence start.

Methods (same code, different scan): ``"zeco"`` (pipelined All-Scan, overlapped), ``"lasp1"`` (serial
point-to-point chain, waited for before the local output: LASP-1), ``"lasp2"`` (all-gather of every
state: LASP-2, overlapped).

Collectives (what keeps P ranks from deadlocking): with ``world > 1`` every rank, in every branch
(first, last or inner rank, varlen or not, any method), issues exactly one ``allscan.scan`` in forward
and one reverse ``allscan.scan`` in backward, with the same signature (state ``[B, H, K, V]`` fp32;
gamma of the same shape and dtype on every rank, or None on every rank), and nothing else. Each scan
is launched before the local work that may synchronise the device (Triton compiling or autotuning,
``.item()``), so a rank blocked in such a synchronise on its own pending scan never waits for a peer
that is itself waiting for it; every async handle is waited on before the function returns. A rank
that raises after launching its scan leaves its peers able to finish that scan; a mismatch of
arguments across ranks raises on every rank in the scan's signature check instead of hanging.
"""
from __future__ import annotations

import bisect
import os
import warnings
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ._gla_local import FlaGLA, TorchGLA, fla_available, recurrent_gla_reference  # noqa: F401

__all__ = ["zeco_gla", "GatedLinearAttention", "recurrent_gla_reference"]

_SCAN_METHOD = {"zeco": "pipelined", "lasp1": "serial", "lasp2": "allgather"}


def _scan(*args, **kwargs):
    from allscan import scan
    return scan(*args, **kwargs)


def _backend(q):
    want = os.environ.get("ALLSCAN_GLA_BACKEND", "auto")
    if want not in ("auto", "torch", "fla"):
        raise ValueError(f"ALLSCAN_GLA_BACKEND must be auto, torch or fla, got {want!r}")
    if want == "torch":
        return TorchGLA
    if q.is_cuda and (want == "fla" or fla_available()):
        return FlaGLA
    if want == "fla":
        raise RuntimeError("ALLSCAN_GLA_BACKEND=fla needs CUDA tensors and fla-core (flash-linear-attention)")
    if q.is_cuda and not _WARNED:
        _WARNED.append(True)
        warnings.warn("allscan.layers.gla: fla-core (flash-linear-attention) is not importable; using the torch "
                      "chunked GLA on CUDA (correct, but slow and memory-hungry: install fla-core)")
    return TorchGLA


_WARNED: list = []


# ---------------------------------------------------------------------------------------------------
# the plan: how this rank's shard is cut into local segments
# ---------------------------------------------------------------------------------------------------
class _Plan:
    def __init__(self, group, T: int, B: int, cu_seqlens):
        if group is None:
            self.world, self.rank = 1, 0
        else:
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.T = T
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.bounds = [0, T]
            self.seq_ids = [None]
            self.ends_here = [True]
            self.continued = self.rank > 0
            self.starts_inside = False
            self.num_seqs = B
            return
        if B != 1:
            raise ValueError(f"zeco_gla: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("zeco_gla: cu_seqlens must be a 1-D tensor [N+1] of cumulative sequence lengths "
                             "over the GLOBAL packed sequence")
        if cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"zeco_gla: cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        total = self.world * T
        if cu[0] != 0 or cu[-1] != total:
            raise ValueError(f"zeco_gla: cu_seqlens must start at 0 and end at world_size * T_local = "
                             f"{self.world} * {T} = {total} (the global packed length), got {cu[0]} .. {cu[-1]}")
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError("zeco_gla: cu_seqlens must be strictly increasing (empty sequences are not supported)")
        off = self.rank * T
        cuset = set(cu)
        cut = sorted(set([0, T] + [c - off for c in cu if off < c < off + T]))
        self.bounds = cut
        self.seq_ids = [bisect.bisect_right(cu, off + s) - 1 for s in cut[:-1]]
        self.ends_here = [(off + e) in cuset for e in cut[1:]]
        self.continued = off not in cuset
        self.starts_inside = (not self.continued) or len(cut) > 2
        self.num_seqs = len(cu) - 1

    @property
    def nseg(self):
        return len(self.bounds) - 1


def _full_decay(g, q):
    """g of GLA ``[B,T,H,K]``, simple GLA ``[B,T,H]`` or None -> ``[B,T,H,K]`` for the local kernels."""
    B, T, H, K = q.shape
    if g is None:
        return q.new_zeros(B, T, H, K, dtype=torch.float32)
    if g.dim() == 3:
        return g.unsqueeze(-1).expand(B, T, H, K).contiguous()
    return g.contiguous()


def _scale_state(S, evec):
    return S if evec is None else S * evec


def _gamma_fixed(plan, g, B, device):
    """The decay this rank passes to the All-Scan (a prefix shape of the state [B, H, K, V])."""
    if g is None:
        shape = (B,)
    else:
        shape = tuple(g.shape[:1]) + tuple(g.shape[2:])  # [B, H, K] or [B, H]
    if plan.starts_inside:  # a sequence starts in this shard: no state crosses it
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if g is None:  # plain linear attention: decay 1 (a tensor when varlen, so every rank passes one)
        return torch.ones(shape, dtype=torch.float32, device=device) if plan.varlen else None
    return None  # computed by the backend from the shard's decays


class _ZecoGLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, plan: _Plan, method: str, want_final: bool):
        with torch.autocast(device_type=q.device.type, enabled=False):  # our own precision choices
            return _ZecoGLA._forward(ctx, q, k, v, g, h0, scale, plan, method, want_final)

    @staticmethod
    def _forward(ctx, q, k, v, g, h0, scale, plan: _Plan, method: str, want_final: bool):
        be = _backend(q)
        B, T, H, K = q.shape
        V = v.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gf = _full_decay(g, q)
        sp = plan.world > 1
        smethod = _SCAN_METHOD[method]

        # initial state of every local segment (None = zeros); a continued first segment starts from 0
        h0s: List[Optional[torch.Tensor]] = []
        for j in range(plan.nseg):
            if j == 0 and plan.continued:
                h0s.append(None)
            elif h0 is None:
                h0s.append(None)
            elif plan.varlen:
                h0s.append(h0[plan.seq_ids[j]:plan.seq_ids[j] + 1])
            else:
                h0s.append(h0)

        st = be.fwd_states(q, k, v, gf, scale, plan.bounds, h0s)
        gamma = None
        if sp:
            gamma = _gamma_fixed(plan, g, B, q.device)
            if gamma is None and g is not None:
                gamma = be.shard_gamma(st, g)
        handle = None
        S_in = None
        if sp:
            x = st.finals[-1].float().contiguous()
            if method == "lasp1":
                S_in = _scan(x, gamma, plan.group, method=smethod)
            else:
                handle = _scan(x, gamma, plan.group, method=smethod, async_op=True)
        finals = list(st.finals)
        fused = None
        if plan.continued and getattr(be, "fused_output_ok", lambda: False)():
            # The intra-chunk part runs while the state is in flight; then one output kernel with
            # the incoming state folded in (no second pass over q, the decays and o).
            be.fwd_intra(st, q, k, scale)
            if handle is not None:
                S_in = handle.wait()
            fused = be.fwd_output_with_state(st, q, v, S_in, scale, plan.bounds[1])
            if fused is not None:
                o, evec = fused
            else:
                o = be.fwd_output(st, q, k, v, gf, scale, plan.bounds)
        else:
            o = be.fwd_output(st, q, k, v, gf, scale, plan.bounds)
            if handle is not None:
                S_in = handle.wait()
        if plan.continued:  # the incoming state's contribution to the first segment, no recomputation
            if fused is None:
                evec = be.correct(st, q, g, o, S_in, scale, plan.bounds[1])
            finals[0] = finals[0] + _scale_state(S_in, evec)

        final = None
        if want_final:
            if plan.varlen:
                final = q.new_zeros(plan.num_seqs, H, K, V, dtype=torch.float32)
                for j in range(plan.nseg):
                    if plan.ends_here[j]:
                        final[plan.seq_ids[j]] = finals[j][0]
            else:
                final = finals[0]

        ctx.save_for_backward(q, k, v, g, h0, S_in, be.saved(st))
        ctx.be, ctx.scale, ctx.plan, ctx.method, ctx.gamma = be, scale, plan, method, gamma
        ctx.h0s_none = [h is None for h in h0s]
        if final is not None:
            return o, final
        return o, None

    @staticmethod
    def backward(ctx, do, dfinal):
        with torch.autocast(device_type=do.device.type, enabled=False):
            return _ZecoGLA._backward(ctx, do, dfinal)

    @staticmethod
    def _backward(ctx, do, dfinal):
        q, k, v, g, h0, S_in, saved = ctx.saved_tensors
        be, scale, plan, method = ctx.be, ctx.scale, ctx.plan, ctx.method
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = do.contiguous()
        gf = _full_decay(g, q)
        sp = plan.world > 1

        # final-state gradients per local segment
        dfin: List[Optional[torch.Tensor]] = []
        for j in range(plan.nseg):
            if dfinal is None or not plan.ends_here[j]:
                dfin.append(None)
            elif plan.varlen:
                dfin.append(dfinal[plan.seq_ids[j]:plan.seq_ids[j] + 1].float())
            else:
                dfin.append(dfinal.float())

        # the part of dS_in this rank contributes (needs only q, g, do): start the reverse scan on it
        y = None
        prep = be.bwd_begin(q, k, v, gf, plan.bounds)
        if sp:
            x = q.new_zeros(B, H, K, V, dtype=torch.float32)
            if plan.continued:
                x, evec = be.xgrad(prep, q, g, do, scale, plan.bounds[1])
                if dfin[0] is not None:
                    x = x + _scale_state(dfin[0], evec)
            smethod = _SCAN_METHOD[method]
            if method == "lasp1":
                y = _scan(x.contiguous(), ctx.gamma, plan.group, reverse=True, method=smethod)
                handle = None
            else:
                handle = _scan(x.contiguous(), ctx.gamma, plan.group, reverse=True, method=smethod, async_op=True)

        # incoming state of every local segment, as the local forward saw it (with the true S_in)
        h0s: List[Optional[torch.Tensor]] = []
        for j in range(plan.nseg):
            if j == 0 and plan.continued:
                h0s.append(S_in)
            elif ctx.h0s_none[j]:
                h0s.append(None)
            elif plan.varlen:
                h0s.append(h0[plan.seq_ids[j]:plan.seq_ids[j] + 1])
            else:
                h0s.append(h0)

        prep = be.bwd_prepare(prep, saved, q, k, v, gf, scale, plan.bounds, h0s, do)
        if sp and y is None:
            y = handle.wait()
        dhts = list(dfin)
        if y is not None:
            dhts[-1] = y if dhts[-1] is None else dhts[-1] + y
        if dhts[-1] is None:
            dhts[-1] = q.new_zeros(B, H, K, V, dtype=torch.float32) if not plan.varlen else q.new_zeros(
                1, H, K, V, dtype=torch.float32)
        dq, dk, dv, dgf, dh0s = be.bwd_finish(prep, q, k, v, gf, scale, plan.bounds, h0s, do, dhts)

        dg = None
        if g is not None:
            dg = (dgf.float().sum(-1) if g.dim() == 3 else dgf).to(g.dtype)
        dh0 = None
        if h0 is not None:
            dh0 = torch.zeros_like(h0)
            for j in range(plan.nseg):
                if (j == 0 and plan.continued) or dh0s[j] is None:
                    continue
                if plan.varlen:
                    dh0[plan.seq_ids[j]] += dh0s[j][0].to(h0.dtype)
                else:
                    dh0 += dh0s[j].to(h0.dtype)
        return dq, dk, dv, dg, dh0, None, None, None, None


def zeco_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None, group=None, *,
             scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
             output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None, method: str = "zeco"):
    """Sequence-parallel gated linear attention (fla's ``chunk_gla`` conventions).

    Args:
        q, k: ``[B, T_local, H, K]``; v: ``[B, T_local, H, V]``: this rank's contiguous shard.
        g: natural-log decays (<= 0): ``[B, T_local, H, K]`` (GLA), ``[B, T_local, H]`` (simple GLA, one
            decay per head) or None (plain linear attention).
        group: the sequence-parallel process group (rank order = sequence order); None = no sequence
            parallelism (the shard is the whole sequence).
        scale: default ``K ** -0.5``.
        initial_state: fp32 ``[B, H, K, V]``, the state before the global first token (used by group
            rank 0 only; its gradient is returned there, zeros elsewhere). With ``cu_seqlens``:
            ``[N, H, K, V]``, one per global sequence, used by the rank where that sequence starts (the
            gradient of row i is returned there only: sum over ranks for the full gradient).
        output_final_state: return the final state. Without ``cu_seqlens``: ``[B, H, K, V]``, the state
            after this rank's last token (on the last rank: after the global last token). With
            ``cu_seqlens``: ``[N, H, K, V]`` with the rows of the sequences that END on this rank
            filled, zeros elsewhere.
        cu_seqlens: ``[N+1]`` cumulative lengths over the GLOBAL packed sequence (B = 1, every rank
            holds T_local tokens, ``cu_seqlens[-1] == world_size * T_local``); boundaries may fall
            anywhere, inside a rank or on a rank boundary. Same tensor on every rank.
        method: ``"zeco"`` (pipelined All-Scan overlapped with the local work), ``"lasp1"`` (serial
            chain, waited for: the LASP-1 baseline), ``"lasp2"`` (all-gather: the LASP-2 baseline).

    Returns:
        ``(o [B, T_local, H, V] in v's dtype, final_state or None)``.
    """
    if method not in _SCAN_METHOD:
        raise ValueError(f"zeco_gla: method must be one of {sorted(_SCAN_METHOD)}, got {method!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"zeco_gla: {name} must be a 4-D tensor [B, T_local, H, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"zeco_gla: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"zeco_gla: v must be [B, T_local, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if T == 0:
        raise ValueError("zeco_gla: every rank needs at least one token (T_local = 0)")
    V = v.shape[-1]
    if g is not None and tuple(g.shape) not in ((B, T, H, K), (B, T, H)):
        raise ValueError(f"zeco_gla: g must be [B, T, H, K] = {(B, T, H, K)} (GLA), [B, T, H] = {(B, T, H)} "
                         f"(simple GLA) or None, got {tuple(g.shape)}")
    if g is not None and not g.is_floating_point():
        raise ValueError(f"zeco_gla: g must be a floating-point tensor, got {g.dtype}")
    if initial_state is not None:
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if tuple(initial_state.shape) != (n, H, K, V):
            raise ValueError(f"zeco_gla: initial_state must be [{'B' if cu_seqlens is None else 'N'}, H, K, V] = "
                             f"{(n, H, K, V)}, got {tuple(initial_state.shape)}")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"zeco_gla: initial_state must be float32, got {initial_state.dtype}")
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("zeco_gla: group given but torch.distributed is not initialised")
    scale = K ** -0.5 if scale is None else float(scale)
    plan = _Plan(group, T, B, cu_seqlens)
    o, final = _ZecoGLA.apply(q, k, v, g, initial_state, scale, plan, method, bool(output_final_state))
    return o, (final if output_final_state else None)


# ---------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------
def _gate_act(name):
    if name in ("swish", "silu"):
        return F.silu
    if name == "sigmoid":
        return torch.sigmoid
    raise NotImplementedError(f"GatedLinearAttention: gate_fn {name!r} is not supported (swish, silu, sigmoid)")


class _RMSNormGated(nn.Module):
    """fla's ``FusedRMSNormGated``: ``rmsnorm(x) * weight * act(g)`` (parameter ``weight`` only)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, activation="swish"):
        super().__init__()
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self._act = _gate_act(activation)

    def forward(self, x, g):
        y = F.rms_norm(x.float(), (self.hidden_size,), None if self.weight is None else self.weight.float(), self.eps)
        return (y * self._act(g.float())).to(x.dtype)


class _RMSNorm(nn.Module):
    """fla's ``RMSNorm`` (``weight``; ``bias`` only if asked)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if elementwise_affine else None

    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.hidden_size,), w, self.eps).to(x.dtype)


class GatedLinearAttention(nn.Module):
    """GLA layer with the parameters (names, shapes) of ``fla.layers.gla.GatedLinearAttention``.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (output gate), ``gk_proj`` (two linears:
    hidden -> gate_low_rank_dim -> key_dim, with bias), ``o_proj``, and ``g_norm_swish_gate.weight``
    (fused norm + swish gate, fla's default) or ``g_norm.weight``. A state_dict of fla's layer loads.

    ``group``: the sequence-parallel group (None = no sequence parallelism); the input
    ``hidden_states [B, T_local, hidden]`` is this rank's shard. ``method`` as in :func:`zeco_gla`.
    ``forward`` returns ``(o, None, None)`` like fla's layer (no caching).
    Not supported: short convolutions (they need a halo exchange across ranks), feature maps.
    """

    def __init__(self, mode: str = "chunk", hidden_size: int = 1024, expand_k: float = 0.5, expand_v: float = 1.0,
                 num_heads: int = 4, num_kv_heads: Optional[int] = None, feature_map: Optional[str] = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, gate_fn: str = "swish", elementwise_affine: Optional[bool] = True,
                 norm_eps: float = 1e-5, gate_logit_normalizer: int = 16, gate_low_rank_dim: int = 16,
                 clamp_min: Optional[float] = None, fuse_norm: bool = True, layer_idx: Optional[int] = None,
                 group=None, method: str = "zeco"):
        super().__init__()
        if mode not in ("chunk", "fused_recurrent", "fused_chunk"):
            raise ValueError(f"GatedLinearAttention: mode must be chunk, fused_recurrent or fused_chunk, got {mode!r}")
        if use_short_conv:
            raise NotImplementedError("GatedLinearAttention: use_short_conv=True is not supported with sequence "
                                      "parallelism here (the convolution needs the previous rank's last tokens)")
        if feature_map is not None:
            raise NotImplementedError(f"GatedLinearAttention: feature_map={feature_map!r} is not supported")
        if method not in _SCAN_METHOD:
            raise ValueError(f"GatedLinearAttention: method must be one of {sorted(_SCAN_METHOD)}, got {method!r}")
        self.mode = mode
        self.hidden_size = hidden_size
        self.expand_k, self.expand_v = expand_k, expand_v
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(f"GatedLinearAttention: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.use_output_gate = use_output_gate
        self.key_dim = int(hidden_size * expand_k)
        self.value_dim = int(hidden_size * expand_v)
        self.key_dim_per_group = self.key_dim // self.num_kv_groups
        self.value_dim_per_group = self.value_dim // self.num_kv_groups
        self.clamp_min = clamp_min
        self.layer_idx = layer_idx
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"GatedLinearAttention: key_dim ({self.key_dim}) and value_dim ({self.value_dim}) must be "
                             f"divisible by num_heads ({num_heads})")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim_per_group, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim_per_group, bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, self.key_dim_per_group, bias=True))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        if gate_fn == "swish" and fuse_norm and use_output_gate:
            self.g_norm_swish_gate = _RMSNormGated(self.head_v_dim, elementwise_affine=bool(elementwise_affine),
                                                   eps=norm_eps)
            self.fuse_norm_and_gate = True
        else:
            self.fuse_norm_and_gate = False
            self.g_norm = _RMSNorm(self.head_v_dim, elementwise_affine=bool(elementwise_affine), eps=norm_eps,
                                   dtype=torch.float32)
            self.gate_fn = _gate_act(gate_fn)
        self.gate_logit_normalizer = gate_logit_normalizer
        self.group = group
        self.method = method

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None, use_cache=False,
                output_attentions=False, cu_seqlens=None, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("GatedLinearAttention: attention_mask is not supported; pack sequences "
                                      "and pass cu_seqlens (over the global sequence)")
        if past_key_values is not None or use_cache:
            raise NotImplementedError("GatedLinearAttention: caching (past_key_values/use_cache) is not supported")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedLinearAttention: hidden_states must be [B, T_local, {self.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_k_dim)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        gk = self.gk_proj(hidden_states)
        if self.num_kv_groups > 1:
            hk = self.num_kv_heads
            k, gk = (x.view(B, T, hk, 1, self.head_k_dim).expand(B, T, hk, self.num_kv_groups, self.head_k_dim)
                     .reshape(B, T, self.num_heads, self.head_k_dim) for x in (k, gk))
            v = v.view(B, T, hk, 1, self.head_v_dim).expand(B, T, hk, self.num_kv_groups, self.head_v_dim) \
                .reshape(B, T, self.num_heads, self.head_v_dim)
        else:
            k = k.view(B, T, self.num_heads, self.head_k_dim)
            gk = gk.view(B, T, self.num_heads, self.head_k_dim)
            v = v.view(B, T, self.num_heads, self.head_v_dim)
        gk = F.logsigmoid(gk) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = torch.clamp_min(gk, self.clamp_min)
        o, _ = zeco_gla(q, k, v, gk, self.group, cu_seqlens=cu_seqlens, method=self.method)
        if self.use_output_gate:
            gate = self.g_proj(hidden_states)
            if self.fuse_norm_and_gate:
                o = self.g_norm_swish_gate(o, gate.view(B, T, self.num_heads, self.head_v_dim))
                o = o.reshape(B, T, self.value_dim)
            else:
                o = self.g_norm(o).reshape(B, T, self.value_dim) * self.gate_fn(gate)
        else:
            o = self.g_norm(o).reshape(B, T, self.value_dim)
        return self.o_proj(o), None, None
