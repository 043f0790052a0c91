"""Fused Triton kernels for the two incoming-state terms of sequence-parallel GLA (CUDA only).

With ``gc`` fla's chunk-local cumulative log2 decay (``chunk_local_cumsum(g, BT, scale=1/ln2)``) and
``off`` the exclusive prefix of the chunk totals, ``G_t * log2(e) = gc_t + off_chunk(t)``. Over the
first ``L1`` tokens of the shard (the first local segment):

- forward:  ``o_t += scale * (q_t * 2^(gc_t + off)) @ S_in``            (:func:`correct_output_`)
- backward: ``X = scale * sum_t (q_t * 2^(gc_t + off))^T do_t``           (:func:`state_grad`)

One pass over q, gc (and o or do), instead of the half-dozen passes of the same thing in torch ops.
The dots take fp32 operands whatever the input dtype (Triton's default fp32 precision: tf32, or IEEE
fp32 with TRITON_F32_DEFAULT=ieee): the incoming state is the sum of everything before the shard and
``q * 2^G * scale`` is not representable in bf16, so rounding both to bf16 (as a bf16 dot would)
added two bf16 roundings to the output. Measured on 2 H200s (plain linear attention, bf16, T = 2048,
RMS error ratio against fla's chunk_gla on the whole sequence): 3.6e-3 with bf16 operands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def chunk_offsets(gc: torch.Tensor, L1: int, BT: int):
    """``(off [B, NT, H, K], total [B, H, K])`` in log2 units over the first L1 tokens (fp32)."""
    NT = triton.cdiv(L1, BT)
    ends = (torch.arange(NT, device=gc.device) * BT + BT).clamp_(max=L1) - 1
    tot = gc.index_select(1, ends).float()  # chunk totals (gc is chunk-local)
    incl = tot.cumsum(1)
    return (incl - tot).contiguous(), incl[:, -1].contiguous()


@triton.jit
def _corr_fwd_kernel(q, gc, off, S, o, T, L1, NT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    o_t = i_c * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L1
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    base_k = (i_b * T * H + i_h) * K
    b_q = tl.load(q + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_g = tl.load(gc + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_off = tl.load(off + ((i_b * NT + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_qe = tl.where(m_tk, b_q * tl.exp2(b_g + b_off[None, :]) * scale, 0.)
    b_S = tl.load(S + (i_bh * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
    b_c = tl.dot(b_qe, b_S)
    m_tv = m_t[:, None] & m_v[None, :]
    p_o = o + (i_b * T * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
    b_o = tl.load(p_o, mask=m_tv, other=0.).to(tl.float32)
    tl.store(p_o, (b_o + b_c).to(p_o.dtype.element_ty), mask=m_tv)


@triton.jit
def _corr_bwd_kernel(q, gc, off, do, Xp, T, L1, NT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CPS: tl.constexpr):
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    base_k = (i_b * T * H + i_h) * K
    base_v = (i_b * T * H + i_h) * V
    b_X = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(CPS):
        i_c = i_s * CPS + j
        o_t = i_c * BT + tl.arange(0, BT)
        m_t = o_t < L1
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_g = tl.load(gc + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_off = tl.load(off + ((i_b * NT + i_c) * H + i_h) * K + o_k, mask=m_k & (i_c < NT), other=0.)
        b_qe = tl.where(m_tk, b_q * tl.exp2(b_g + b_off[None, :]) * scale, 0.)
        b_do = tl.load(do + base_v + o_t[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                       other=0.)
        b_X += tl.dot(tl.trans(b_qe), b_do.to(tl.float32))
    p_X = Xp + ((i_s * (tl.num_programs(1)) + i_bh) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p_X, b_X, mask=m_k[:, None] & m_v[None, :])


def _blocks(K, V):
    BK = max(16, triton.next_power_of_2(K))
    # One program covers the whole V = 128 of a head: every V block re-reads q and the fp32 decays
    # (measured on an H200 at T = 16K, H = 16: the forward correction took 235 us with BV = 64; one
    # V block reads about 320 MiB instead of 512)
    BV = max(16, min(128, triton.next_power_of_2(V)))
    if BK > 256:
        raise ValueError(f"zeco_gla: the fused correction supports head dim K <= 256, got {K}")
    return BK, BV


def correct_output_(o, q, gc, S_in, scale: float, L1: int, BT: int):
    """In place: ``o[:, :L1] += scale * (q * 2^G) @ S_in``. Returns the first segment's total decay
    ``exp(sum g)`` as ``[B, H, K]`` fp32."""
    B, T, H, K = q.shape
    V = o.shape[-1]
    assert o.is_contiguous() and q.is_contiguous() and gc.is_contiguous()
    off, total = chunk_offsets(gc, L1, BT)
    NT = off.shape[1]
    BK, BV = _blocks(K, V)
    S = S_in.float().contiguous()
    grid = (NT, B * H, triton.cdiv(V, BV))
    _corr_fwd_kernel[grid](q, gc, off, S, o, T, L1, NT, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                           num_warps=8 if BK * BV >= 128 * 128 else 4)
    return torch.exp2(total)


def state_grad(q, gc, do, scale: float, L1: int, BT: int, chunks_per_split: int = 16):
    """``(X [B, H, K, V] fp32, exp(total decay) [B, H, K])`` over the first L1 tokens."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    assert do.is_contiguous() and q.is_contiguous() and gc.is_contiguous()
    off, total = chunk_offsets(gc, L1, BT)
    NT = off.shape[1]
    BK, BV = _blocks(K, V)
    NS = triton.cdiv(NT, chunks_per_split)
    Xp = torch.empty(NS, B * H, K, V, dtype=torch.float32, device=q.device)
    grid = (NS, B * H, triton.cdiv(V, BV))
    _corr_bwd_kernel[grid](q, gc, off, do, Xp, T, L1, NT, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                           CPS=chunks_per_split, num_warps=8 if BK * BV >= 128 * 128 else 4)
    X = Xp.sum(0) if NS > 1 else Xp[0]
    return X.view(B, H, K, V), torch.exp2(total)
