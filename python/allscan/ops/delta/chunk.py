"""Chunked delta rule in torch ops: the local kernels on CPU (and on CUDA without fla-core, or in fp64).

The math of one sequence of C-token chunks (flash-linear-attention's WY / UT-transform form). With
``G_i`` the within-chunk cumulative log decay (a vector over K; Gated DeltaNet's scalar broadcasts),
``A_t = (I - beta_t k_t k_t^T) diag(exp(g_t))`` the per-token transition and S the state entering
the chunk, the delta ``d_i = beta_i (v_i - (diag(exp(g_i)) S_{i-1})^T k_i)`` of every token solves
the unit lower-triangular system ``(I + diag(beta) A_kk) d = diag(beta) (V - (exp(G) * K) S)`` with
``A_kk[i, j] = k_i^T diag(exp(G_i - G_j)) k_j`` (j < i). Hence ``d = U - W S`` and, per chunk::

    o      = scale * A_qk U + Q~ S          Q~ = scale * (exp(G) * Q - A_qk W)
    S_next = M_c S + K_d^T U                M_c = diag(exp(G_C)) - K_d^T W,  K_d = K * exp(G_C - G)

with ``A_qk[i, j] = q_i^T diag(exp(G_i - G_j)) k_j`` (j <= i). Everything but the chunk-to-chunk
recurrence is computed for all chunks at once; the recurrence is itself a matrix scan over chunks.
A state S_in added to the state entering the sequence changes the state entering chunk c by
``P_c S_in`` (``P_c = M_{c-1} ... M_0``), the outputs by ``Q~_c P_c S_in`` and the final state by
``M S_in`` (``M = P_N``, the sequence's transition): that is how the incoming state of a shard is
folded in after the All-Scan (:func:`incoming_map` is ``Q' = Q~_c P_c``), without recomputing the
local recurrence.

:class:`TorchDelta` is the local backend in torch ops (:mod:`allscan.ops.delta.shard` drives it; its
backward recomputes under ``torch.func.vjp``, which also runs inside a custom op). Arithmetic in fp32
(fp64 for fp64 inputs); a T that is not a multiple of the chunk size is padded with tokens of
k = v = q = 0, beta = 0, g = 0, which leave the outputs, the final state and the transition unchanged.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, NamedTuple, Optional

import torch

from . import gates

CHUNK = 64


class DeltaInputs(NamedTuple):
    """One shard's tensors as a local backend takes them: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g and beta raw (the backend's ``opts`` say what fla's kernels apply to them first)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def compute_dtype(v: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs, fp32 otherwise (the states' dtype too)."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _blocks(x: torch.Tensor, C: int, dt: torch.dtype) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, H, N, C, D]`` in ``dt``, zero-padded to whole chunks."""
    B, T, H, D = x.shape
    pad = (-T) % C
    x = x.to(dt)
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, H, D)], 1)
    return x.view(B, (T + pad) // C, C, H, D).permute(0, 3, 1, 2, 4)


def _pair_scores(a, b, G, mask):
    """``[.., i, j] = a_i^T diag(exp(G_i - G_j)) b_j`` where ``mask`` (0 elsewhere); G ``[.., C, 1 or K]``."""
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [.., C(i), C(j), 1 or K]: G_i - G_j
    decay = torch.where(mask.unsqueeze(-1), diff, torch.full_like(diff, -math.inf)).exp()
    if G.shape[-1] == 1:  # one decay per head (Gated DeltaNet): a plain score matrix times the decays
        return (a @ b.transpose(-1, -2)) * decay.squeeze(-1)
    return torch.einsum("...ik,...jk,...ijk->...ij", a, b, decay)


class ChunkPass(NamedTuple):
    """The chunk quantities of one sequence (:func:`chunk_delta_rule`). NamedTuples, not namespaces:
    torch.compile traces them without a graph break."""

    T: int
    o_intra: torch.Tensor
    q_eff: torch.Tensor
    states: torch.Tensor
    final: torch.Tensor
    transition: Optional[torch.Tensor]
    prefix: Optional[torch.Tensor]


def chunk_delta_rule(q, k, v, g, beta, scale: float, h0: Optional[torch.Tensor] = None, chunk: int = CHUNK,
                     with_transition: bool = True):
    """The chunked delta rule of one sequence (per batch row), up to the states entering the chunks.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: log decays ``[B, T, H, 1]`` (one per head) or
    ``[B, T, H, K]``; beta: ``[B, T, H]``; h0: ``[B, H, K, V]`` or None (zeros). Returns a :class:`ChunkPass` with
    the chunk quantities (``o_intra``, ``q_eff`` = Q~), ``states`` (the state entering every chunk,
    ``[B, H, N, K, V]``), ``final`` (``[B, H, K, V]``) and, ``with_transition``, ``transition`` (M,
    ``[B, H, K, K]``) and ``prefix`` (P_c, ``[B, H, N, K, K]``; None without).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk
    dt = compute_dtype(v)
    q, k, v, g = (_blocks(x, C, dt) for x in (q, k, v, g))
    b = _blocks(beta.unsqueeze(-1), C, dt)  # [B, H, N, C, 1]
    N = q.shape[2]
    G = g.cumsum(3)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A_kk = _pair_scores(k, k, G, causal.tril(-1))
    A_qk = _pair_scores(q, k, G, causal)
    L = torch.eye(C, dtype=dt, device=q.device) + b * A_kk
    eG = G.exp()
    UW = torch.linalg.solve_triangular(L, torch.cat([b * v, b * (eG * k)], -1), upper=False, unitriangular=True)
    U, W = UW.split([V, K], -1)
    G_last = G[..., -1:, :]  # [B, H, N, 1, 1 or K]
    k_d = k * (G_last - G).exp()
    M_c = torch.diag_embed(G_last.squeeze(-2).exp().expand(B, H, N, K)) - k_d.transpose(-1, -2) @ W
    h_add = k_d.transpose(-1, -2) @ U  # [B, H, N, K, V]

    S = q.new_zeros(B, H, K, V) if h0 is None else h0.to(dt)
    P = torch.eye(K, dtype=dt, device=q.device).expand(B, H, K, K) if with_transition else None
    states, prefix = [], []
    for n in range(N):
        states.append(S)
        S = M_c[:, :, n] @ S + h_add[:, :, n]
        if with_transition:
            prefix.append(P)
            P = M_c[:, :, n] @ P
    return ChunkPass(T=T, o_intra=scale * (A_qk @ U), q_eff=scale * (eG * q - A_qk @ W),
                     states=torch.stack(states, 2), final=S, transition=P,
                     prefix=torch.stack(prefix, 2) if with_transition else None)


def chunk_outputs(cp) -> torch.Tensor:
    """The outputs ``[B, T, H, V]`` from the states entering the chunks."""
    return _unblocks(cp.o_intra + cp.q_eff @ cp.states, cp.T)


def incoming_map(cp) -> torch.Tensor:
    """``Q' [B, T, H, K]`` (``Q~_c P_c`` per chunk): a state ``S_in`` added to the state entering the
    sequence adds ``Q' S_in`` to the outputs (and ``M S_in`` to the final state)."""
    return _unblocks(cp.q_eff @ cp.prefix, cp.T)


def _unblocks(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, D]`` -> ``[B, T, H, D]`` (the padding dropped)."""
    B, H, N, C, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, D)[:, :T]


class TorchDelta:
    """The local work of one shard in torch ops: what :mod:`allscan.ops.delta.shard` asks of a backend;
    :class:`allscan.ops.delta.fla.FlaDelta` does the same with fla-core's kernels. q, k, g, beta raw (``opts``, a
    :class:`~allscan.ops.delta.gates.DeltaOptions`, says what fla would apply to them first)."""

    name = "torch"

    @staticmethod
    def states(x: DeltaInputs, run, h0s: List[Optional[torch.Tensor]]):
        """The independent sequences ``run.bounds`` (local boundaries ``[0, ..., T]``) of a shard, each from
        its own initial state (``h0s``, None = zeros), without autograd, first half: ``(finals, M,
        staged)``: the final state of every segment, the transition ``M [B, HV, K, K]`` of the first
        (``run.wide``; else None): what the All-Scan needs; :meth:`outputs` finishes from ``staged``.
        ``run`` (a :class:`~allscan.ops.delta.shard.ShardRun`) gives ``opts``, ``scale``, ``bounds``, ``wide``."""
        bounds, wide = run.bounds, run.wide
        with torch.no_grad():
            qa, ka, ga, ba = gates.activate(run.opts, x.q, x.k, x.g, x.beta, x.v.shape[2], compute_dtype(x.v))
            cps = [chunk_delta_rule(qa[:, a:e], ka[:, a:e], x.v[:, a:e], ga[:, a:e], ba[:, a:e], run.scale, h0s[j],
                                    with_transition=wide and j == 0)
                   for j, (a, e) in enumerate(zip(bounds, bounds[1:]))]
        return [cp.final for cp in cps], (cps[0].transition if wide else None), (cps, wide)

    @staticmethod
    def outputs(staged, incoming=None):
        """Second half: ``(o_head, Q', o_tail, saved)``: with ``wide``, the first segment's outputs with the
        state ``incoming()`` (the All-Scan's result, asked for once the other segments' outputs are
        issued) added to its initial state, and the map ``Q' [B, T0, HV, K]`` from that state to its
        outputs (else None, None); the outputs of the other segments (None if none); what
        :meth:`backward` needs (nothing here: it recomputes)."""
        cps, wide = staged
        with torch.no_grad():
            tail = [chunk_outputs(cp) for cp in cps[int(wide):]]
            o_head = q_eff = None
            if wide:
                q_eff = incoming_map(cps[0])
                S_in = incoming()
                o_head = chunk_outputs(cps[0]) + torch.einsum("bthk,bhkv->bthv", q_eff, S_in.to(q_eff.dtype))
        o_tail = (torch.cat(tail, 1) if len(tail) > 1 else tail[0]) if tail else None
        return o_head, q_eff, o_tail, ()

    @staticmethod
    def saved_like(x: DeltaInputs, opts):
        return ()

    @staticmethod
    def activated_qk(saved):
        """None: the backward recomputes from the raw q and k."""
        return None

    @staticmethod
    def q_eff_dtype(v: torch.Tensor) -> torch.dtype:
        return compute_dtype(v)

    @staticmethod
    def fold_state_grad(q_eff: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bthk,bthv->bhkv", q_eff, do.to(q_eff.dtype))

    @staticmethod
    def backward(saved, x: DeltaInputs, run, h0s: List[Optional[torch.Tensor]], do: torch.Tensor, finals):
        """The gradients of the segments ``run.bounds`` run from ``h0s``, given ``do`` and their final
        states' gradients ``finals.get()`` (:class:`allscan.ops.delta.shard.FinalGrads`; None: zero):
        ``(dq, dk, dv, dg, dbeta, [dh0 per segment], dA_log, ddt_bias)`` (None where not an input)."""
        q, k, v, g, beta = x
        opts, scale, bounds = run.opts, run.scale, run.bounds
        dhts = finals.get()  # nothing to run the reverse scan beside: the vjp below is one step
        # torch.func.vjp, not torch.autograd.grad: it also works inside a custom op's implementation
        # (below autograd: the layers under torch.compile)
        given = [j for j, h in enumerate(h0s) if h is not None]
        ends = [j for j, d in enumerate(dhts) if d is not None]
        params = [t for t in (opts.A_log, opts.dt_bias) if t is not None]
        dt = compute_dtype(v)

        def local(qq, kk, vv, gg, bb, *rest):
            starts = dict(zip(given, rest[:len(given)]))
            it = iter(rest[len(given):])
            A_log, dt_bias = (None if t is None else next(it) for t in (opts.A_log, opts.dt_bias))
            qa, ka, ga, ba = gates.activate(dataclasses.replace(opts, A_log=A_log, dt_bias=dt_bias), qq, kk, gg, bb,
                                            v.shape[2], dt)
            outs, finals = [], []
            for j, (a, e) in enumerate(zip(bounds, bounds[1:])):
                cp = chunk_delta_rule(qa[:, a:e], ka[:, a:e], vv[:, a:e], ga[:, a:e], ba[:, a:e], scale, starts.get(j),
                                      with_transition=False)
                outs.append(chunk_outputs(cp))
                if j in ends:
                    finals.append(cp.final)
            return (torch.cat(outs, 1) if len(outs) > 1 else outs[0], *finals)

        outputs, vjp = torch.func.vjp(local, q, k, v, g, beta, *[h0s[j] for j in given], *params)
        cotangents = [do] + [dhts[j] for j in ends]
        res = list(vjp(tuple(c.to(o.dtype) for c, o in zip(cotangents, outputs))))
        dq, dk, dv, dg, dbeta = (r.to(t.dtype) for r, t in zip(res[:5], x))
        dh0s = [None] * len(h0s)
        for j, r in zip(given, res[5:]):
            dh0s[j] = r
        rest = iter(res[5 + len(given):])
        dA_log, ddt_bias = (None if t is None else next(rest) for t in (opts.A_log, opts.dt_bias))
        return dq, dk, dv, dg, dbeta, dh0s, dA_log, ddt_bias
