"""Chunked gated linear attention in torch ops: the local kernels on CPU (and on CUDA without fla-core).

:class:`TorchGLA` is one of the two staged local backends :mod:`allscan.ops.gla.zeco` drives (the
other is :class:`allscan.ops.gla.fla.FlaGLA`); both take the local shard cut into segments
(``bounds``: local sequence boundaries ``[0, ..., T]``), every segment an independent sequence with
its own initial state (``None`` = zeros). Here the forward is chunked GLA in fp32 (float64 for float64
inputs: :func:`state_dtype`; chunk size 64) and
the backward autograd through a recomputation; the float64 token-by-token reference beside it
(:mod:`allscan.ops.gla.naive`) is what it is tested against.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, NamedTuple, Optional, Sequence

import torch

CHUNK = 64


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of GLA states and accumulations for inputs of ``dtype``: float32, float64 for float64
    inputs (so that a float64 computation on the CPU is exact to float64, as the references are)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_chunk_gla(q, k, v, g, scale: float, h0: Optional[torch.Tensor] = None, chunk: int = CHUNK):
    """Chunked GLA of one sequence in torch ops (differentiable by autograd), in :func:`state_dtype`.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: log decays (<= 0); h0: ``[B, H, K, V]`` or None.
    Returns ``(o [B, T, H, V], h_T [B, H, K, V])``, both in ``state_dtype(q.dtype)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = state_dtype(q.dtype)
    q, k, v, g = (x.to(acc) for x in (q, k, v, g))
    pad = (-T) % chunk
    if pad:
        # padding after the sequence (g = 0, k = v = q = 0) changes neither outputs nor final state
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    N = (T + pad) // chunk
    C = chunk
    q = q.view(B, N, C, H, K)
    k = k.view(B, N, C, H, K)
    v = v.view(B, N, C, H, V)
    b = g.view(B, N, C, H, K).cumsum(2)  # within-chunk cumulative log decay (<= 0, decreasing)

    # intra-chunk: A[i, j] = sum_k q_i k_j exp(b_i - b_j), j <= i (exponent <= 0: no overflow)
    diff = b.unsqueeze(3) - b.unsqueeze(2)  # [B, N, C(i), C(j), H, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().view(1, 1, C, C, 1, 1)
    decay = torch.where(causal, diff, torch.full_like(diff, -math.inf)).exp()
    A = torch.einsum("bnihk,bnjhk,bnijhk->bnhij", q, k, decay)
    o = torch.einsum("bnhij,bnjhv->bnihv", A, v)

    # inter-chunk: the state entering each chunk
    h = q.new_zeros(B, H, K, V) if h0 is None else h0.to(acc)
    outs = []
    for n in range(N):
        bn = b[:, n]  # [B, C, H, K]
        outs.append(torch.einsum("bihk,bhkv->bihv", q[:, n] * bn.exp(), h))
        last = bn[:, -1]  # [B, H, K]
        kd = k[:, n] * (last.unsqueeze(1) - bn).exp()
        h = last.exp().unsqueeze(-1) * h + torch.einsum("bjhk,bjhv->bhkv", kd, v[:, n])
    o = (o + torch.stack(outs, 1)) * scale
    return o.reshape(B, N * C, H, V)[:, :T], h


# ---------------------------------------------------------------------------------------------------
# the incoming-state terms over the first L1 tokens (also the fallback of the fused Triton kernels)
# ---------------------------------------------------------------------------------------------------
def _decayed_queries(q, g, scale, L1):
    """``(scale * q_t * exp(G_t)`` over the first L1 tokens, ``exp(G_L1)`` as a multiplier of a
    ``[B, H, K, V]`` state, None when there is no decay)."""
    acc = state_dtype(q.dtype)
    qe = q[:, :L1].to(acc) * scale
    if g is None:
        return qe, None
    e = torch.cumsum(g[:, :L1].to(acc), dim=1).exp()
    e = e.unsqueeze(-1) if e.dim() == 3 else e  # simple GLA: one decay per head
    return qe * e, e[:, -1].unsqueeze(-1)  # [B, H, K, 1] or [B, H, 1, 1]


def torch_correct_(q, g, o, S_in, scale, L1):
    """In place ``o[:, :L1] += scale * (q * exp(G)) @ S_in``; returns the state multiplier exp(G_L1)."""
    qe, total = _decayed_queries(q, g, scale, L1)
    o[:, :L1] = (o[:, :L1].to(qe.dtype) + torch.einsum("bthk,bhkv->bthv", qe, S_in.to(qe.dtype))).to(o.dtype)
    return total


def torch_state_grad(q, g, do, scale, L1):
    """``X = scale * sum_t (q_t * exp(G_t)) do_t^T`` over the first L1 tokens, and exp(G_L1)."""
    qe, total = _decayed_queries(q, g, scale, L1)
    return torch.einsum("bthk,bthv->bhkv", qe, do[:, :L1].to(qe.dtype)), total


class TorchForward(NamedTuple):
    """What :meth:`TorchGLA.fwd_states` hands on: the shard's outputs from zero states and its
    segments' final states (a NamedTuple: torch.compile traces it without a graph break)."""

    o: torch.Tensor
    finals: List[torch.Tensor]


class TorchGLA:
    """Chunked GLA in torch ops, staged for :mod:`allscan.ops.gla.zeco`; backward by autograd through
    a recomputation."""

    name = "torch"
    # bwd_dh is the whole local backward (one vjp): run before the reverse scan it would hold the
    # other ranks for all of it, so the last rank computes X like the others
    state_backward_first = False

    @staticmethod
    def fwd_states(q, k, v, g, scale, bounds: Sequence[int], h0s: List[Optional[torch.Tensor]]):
        outs, finals = [], []
        with torch.no_grad():
            for j in range(len(bounds) - 1):
                s, e = bounds[j], bounds[j + 1]
                o_j, h_j = torch_chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0s[j])
                outs.append(o_j)
                finals.append(h_j)
        return TorchForward(o=torch.cat(outs, 1), finals=finals)

    @staticmethod
    def fwd_output(st, q, k, v, g, scale, bounds):
        return st.o.to(v.dtype)

    @staticmethod
    def saved(st, L1):
        return ()  # the backward recomputes

    @staticmethod
    def saved_like(q, v):
        return []

    # the incoming-state terms over the first L1 tokens (g: the caller's decay, natural log, or None)
    @staticmethod
    def correct(st, q, g, o, S_in, scale, L1):
        return torch_correct_(q, g, o, S_in, scale, L1)

    @staticmethod
    def shard_gamma(st, g):
        return torch.exp(g.to(st.finals[-1].dtype).sum(1))

    @staticmethod
    def bwd_begin(q, k, v, gf, bounds, h0s):
        return SimpleNamespace()

    @staticmethod
    def xgrad(prep, saved, q, g, do, scale, L1):
        return torch_state_grad(q, g, do, scale, L1)

    @staticmethod
    def bwd_prepare(prep, saved, q, k, v, g, scale, bounds, h0s, do):
        return prep

    @staticmethod
    def bwd_dh(prep, q, k, v, g, scale, bounds, h0s, do, dhts):
        """The whole local backward (one vjp); ``prep.dh0s``: the initial states' gradients."""
        # torch.func.vjp, not torch.autograd.grad: it also works inside a custom op's implementation
        # (below autograd: zeco_gla under torch.compile)
        given = [j for j, h in enumerate(h0s) if h is not None]
        ends = [j for j, d in enumerate(dhts) if d is not None]

        def local(qq, kk, vv, gg, *hs):
            starts = dict(zip(given, hs))
            outs, finals = [], []
            for j in range(len(bounds) - 1):
                s, e = bounds[j], bounds[j + 1]
                o_j, h_j = torch_chunk_gla(qq[:, s:e], kk[:, s:e], vv[:, s:e], gg[:, s:e], scale, starts.get(j))
                outs.append(o_j)
                if j in ends:
                    finals.append(h_j)
            return (torch.cat(outs, 1), *finals)

        outputs, vjp = torch.func.vjp(local, q, k, v, g, *[h0s[j].to(state_dtype(q.dtype)) for j in given])
        cotangents = [do] + [dhts[j] for j in ends]
        res = vjp(tuple(c.to(o.dtype) for c, o in zip(cotangents, outputs)))
        prep.grads = [r.to(x.dtype) for r, x in zip(res[:4], (q, k, v, g))]
        prep.dh0s = [None] * len(h0s)
        for j, r in zip(given, res[4:]):
            prep.dh0s[j] = r
        return prep

    @staticmethod
    def bwd_finish(prep, q, k, v, g, scale, bounds, h0s, do):
        dq, dk, dv, dg = prep.grads
        dh0s = prep.dh0s
        return dq, dk, dv, dg, dh0s
