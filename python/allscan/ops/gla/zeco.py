"""Gated linear attention with ZeCO sequence parallelism (All-Scan): :func:`zeco_gla`.

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
the shard is cut into local segments at the sequence boundaries that fall inside it
(:class:`ShardSegments`). Only the first segment can continue a sequence from the previous rank (the
incoming state applies to its tokens only); the state passed on is the last segment's. A rank whose
shard contains a sequence start passes decay 0 to the scan, so no state crosses a sequence start.

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

The local work runs on one of two staged backends (:class:`~allscan.ops.gla.fla.FlaGLA` on CUDA with
fla-core, :class:`~allscan.ops.gla.chunk.TorchGLA` otherwise; ``ALLSCAN_GLA_BACKEND`` forces one).
"""
from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from allscan._contract import settings

from .._shards import LOCAL, ShardSegments, sequence_parallel_group
from .chunk import TorchGLA
from .fla import FlaGLA, fla_available
from .stage_times import timed_body, timed_scan

__all__ = ["zeco_gla", "LOCAL", "METHODS"]

_SCAN_METHOD = {"zeco": "pipelined", "lasp1": "serial", "lasp2": "allgather"}
METHODS = tuple(_SCAN_METHOD)  # the ``method=`` values of zeco_gla


_WARNED: list = []


def select_backend(q):
    """The local backend for ``q``: fla-core's kernels on CUDA when importable, the torch chunked
    implementation otherwise (``ALLSCAN_GLA_BACKEND=fla|torch`` forces one)."""
    want = settings.gla_backend
    if want == "torch":
        return TorchGLA
    if q.is_cuda and (want == "fla" or fla_available()):
        return FlaGLA
    if want == "fla":
        raise RuntimeError("ALLSCAN_GLA_BACKEND=fla needs CUDA tensors and fla-core (pip install allscan[gla])")
    if q.is_cuda and not _WARNED:
        _WARNED.append(True)
        warnings.warn("allscan.ops.gla: fla-core (flash-linear-attention) is not importable; using the torch "
                      "chunked GLA on CUDA (correct, but slow and memory-hungry: pip install allscan[gla])")
    return TorchGLA


def _scan(x, gamma, group, **kwargs):
    from allscan import scan
    return timed_scan(scan, x, gamma, group, **kwargs)


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


def _gamma_fixed(segs, g, B, device):
    """The decay this rank passes to the All-Scan (a prefix shape of the state [B, H, K, V])."""
    if g is None:
        shape = (B,)
    else:
        shape = tuple(g.shape[:1]) + tuple(g.shape[2:])  # [B, H, K] or [B, H]
    if segs.starts_inside:  # a sequence starts in this shard: no state crosses it
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if g is None:  # plain linear attention: decay 1 (a tensor when varlen, so every rank passes one)
        return torch.ones(shape, dtype=torch.float32, device=device) if segs.varlen else None
    return None  # computed by the backend from the shard's decays


class ZecoGLAFunction(torch.autograd.Function):
    """The autograd function of :func:`zeco_gla` (arguments already checked)."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, segs: ShardSegments, method: str, want_final: bool):
        ctx.be = select_backend(q)
        with torch.autocast(device_type=q.device.type, enabled=False):  # our own precision choices
            return timed_body("forward body", ZecoGLAFunction._forward, ctx, ctx.be, q, k, v, g, h0, scale,
                               segs, method, want_final)

    @staticmethod
    def _forward(ctx, be, q, k, v, g, h0, scale, segs: ShardSegments, method: str, want_final: bool):
        B, T, H, K = q.shape
        V = v.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gf = _full_decay(g, q)
        sp = segs.world > 1
        smethod = _SCAN_METHOD[method]

        # initial state of every local segment (None = zeros); a continued first segment starts from 0
        h0s: List[Optional[torch.Tensor]] = []
        for j in range(segs.nseg):
            if j == 0 and segs.continued:
                h0s.append(None)
            elif h0 is None:
                h0s.append(None)
            elif segs.varlen:
                h0s.append(h0[segs.seq_ids[j]:segs.seq_ids[j] + 1])
            else:
                h0s.append(h0)

        st = be.fwd_states(q, k, v, gf, scale, segs.bounds, h0s)
        gamma = None
        if sp:
            gamma = _gamma_fixed(segs, g, B, q.device)
            if gamma is None and g is not None:
                gamma = be.shard_gamma(st, g)
        handle = None
        S_in = None
        if sp:
            x = st.finals[-1].float().contiguous()
            if method == "lasp1":
                S_in = _scan(x, gamma, segs.group, method=smethod)
            else:
                handle = _scan(x, gamma, segs.group, method=smethod, async_op=True)
        finals = list(st.finals)
        fused = None
        if segs.continued and getattr(be, "fused_output_ok", lambda: False)():
            # The intra-chunk part runs while the state is in flight; then one output kernel with
            # the incoming state folded in (no second pass over q, the decays and o).
            be.fwd_intra(st, q, k, scale)
            if handle is not None:
                S_in = handle.wait()
            fused = be.fwd_output_with_state(st, q, v, S_in, scale, segs.bounds[1])
            if fused is not None:
                o, evec = fused
            else:
                o = be.fwd_output(st, q, k, v, gf, scale, segs.bounds)
        else:
            o = be.fwd_output(st, q, k, v, gf, scale, segs.bounds)
            if handle is not None:
                S_in = handle.wait()
        if segs.continued:  # the incoming state's contribution to the first segment, no recomputation
            if fused is None:
                evec = be.correct(st, q, g, o, S_in, scale, segs.bounds[1])
            if want_final and segs.ends_here[0]:  # the first segment's final state is returned
                finals[0] = finals[0] + _scale_state(S_in, evec)

        final = None
        if want_final:
            if segs.varlen:
                final = q.new_zeros(segs.num_seqs, H, K, V, dtype=torch.float32)
                for j in range(segs.nseg):
                    if segs.ends_here[j]:
                        final[segs.seq_ids[j]] = finals[j][0]
            else:
                final = finals[0]

        ctx.save_for_backward(q, k, v, g, h0, S_in, *be.saved(st, segs.bounds[1]))
        ctx.scale, ctx.segs, ctx.method, ctx.gamma = scale, segs, method, gamma
        ctx.h0s_none = [h is None for h in h0s]
        if final is not None:
            return o, final
        return o, None

    @staticmethod
    def backward(ctx, do, dfinal):
        with torch.autocast(device_type=do.device.type, enabled=False):
            return timed_body("backward body", ZecoGLAFunction._backward, ctx, ctx.be, do, dfinal)

    @staticmethod
    def _backward(ctx, be, do, dfinal):
        q, k, v, g, h0, S_in, *saved = ctx.saved_tensors
        scale, segs, method = ctx.scale, ctx.segs, ctx.method
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = do.contiguous()
        gf = _full_decay(g, q)
        sp = segs.world > 1

        # final-state gradients per local segment
        dfin: List[Optional[torch.Tensor]] = []
        for j in range(segs.nseg):
            if dfinal is None or not segs.ends_here[j]:
                dfin.append(None)
            elif segs.varlen:
                dfin.append(dfinal[segs.seq_ids[j]:segs.seq_ids[j] + 1].float())
            else:
                dfin.append(dfinal.float())

        # the part of dS_in this rank contributes (needs only q, g, do): start the reverse scan on it
        y = None
        prep = be.bwd_begin(q, k, v, gf, segs.bounds)
        if sp:
            if segs.continued:
                x, evec = be.xgrad(prep, saved, q, g, do, scale, segs.bounds[1])
                if dfin[0] is not None:
                    x = x + _scale_state(dfin[0], evec)
            else:  # nothing of this rank's output depends on the incoming state
                x = q.new_zeros(B, H, K, V, dtype=torch.float32)
            smethod = _SCAN_METHOD[method]
            if method == "lasp1":
                y = _scan(x.contiguous(), ctx.gamma, segs.group, reverse=True, method=smethod)
                handle = None
            else:
                handle = _scan(x.contiguous(), ctx.gamma, segs.group, reverse=True, method=smethod, async_op=True)

        # incoming state of every local segment, as the local forward saw it (with the true S_in)
        h0s: List[Optional[torch.Tensor]] = []
        for j in range(segs.nseg):
            if j == 0 and segs.continued:
                h0s.append(S_in)
            elif ctx.h0s_none[j]:
                h0s.append(None)
            elif segs.varlen:
                h0s.append(h0[segs.seq_ids[j]:segs.seq_ids[j] + 1])
            else:
                h0s.append(h0)

        prep = be.bwd_prepare(prep, saved, q, k, v, gf, scale, segs.bounds, h0s, do)
        if sp and y is None:
            y = handle.wait()
        dhts = list(dfin)
        if y is not None:
            dhts[-1] = y if dhts[-1] is None else dhts[-1] + y
        if dhts[-1] is None:
            dhts[-1] = q.new_zeros(B, H, K, V, dtype=torch.float32) if not segs.varlen else q.new_zeros(
                1, H, K, V, dtype=torch.float32)
        dq, dk, dv, dgf, dh0s = be.bwd_finish(prep, q, k, v, gf, scale, segs.bounds, h0s, do, dhts)

        dg = None
        if g is not None:
            dg = (dgf.float().sum(-1) if g.dim() == 3 else dgf).to(g.dtype)
        dh0 = None
        if h0 is not None:
            dh0 = torch.zeros_like(h0)
            for j in range(segs.nseg):
                if (j == 0 and segs.continued) or dh0s[j] is None:
                    continue
                if segs.varlen:
                    dh0[segs.seq_ids[j]] += dh0s[j][0].to(h0.dtype)
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
        group: the sequence-parallel process group (rank order = sequence order). None: the default
            group, as everywhere in torch.distributed (one process, holding the whole sequence, when
            torch.distributed is not initialised). :data:`LOCAL`: no sequence parallelism even in an
            initialised group (this process holds the whole sequence).
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
    scale = K ** -0.5 if scale is None else float(scale)
    segs = ShardSegments(sequence_parallel_group(group, "zeco_gla"), T, B, cu_seqlens, "zeco_gla")
    o, final = ZecoGLAFunction.apply(q, k, v, g, initial_state, scale, segs, method, bool(output_final_state))
    return o, (final if output_final_state else None)
