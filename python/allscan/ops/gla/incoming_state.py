"""Fused Triton kernels for the two incoming-state terms of sequence-parallel GLA (CUDA only).

With ``gc`` fla's chunk-local cumulative log2 decay (``chunk_local_cumsum(g, BT, scale=1/ln2)``) and
``off`` the exclusive prefix of the chunk totals, ``G_t * log2(e) = gc_t + off_chunk(t)``. Over the
first ``L1`` tokens of the shard (the first local segment):

- forward:  ``o_t += scale * (q_t * 2^(gc_t + off)) @ S_in``            (:func:`correct_output_`)
- backward: ``X = scale * sum_t (q_t * 2^(gc_t + off))^T do_t``           (:func:`state_grad`)

One pass over q, gc (and o or do), instead of the half-dozen passes of the same thing in torch ops.
In the forward the first term is normally not a separate pass at all: :func:`output_with_state`
computes the chunk output (what fla's ``chunk_gla_fwd_o_gk`` computes, from the same h and A) with the
incoming state folded in, while the intra-chunk part runs as the state is in flight;
:func:`correct_output_` is the fallback and the benchmark's comparison.
The dots take fp32 operands whatever the input dtype (Triton's default fp32 precision: tf32, or IEEE
fp32 with TRITON_F32_DEFAULT=ieee), or fp32 split into bf16 hi/lo halves: the incoming state is the
sum of everything before the shard and ``q * 2^G * scale`` is not representable in bf16, so rounding
both to bf16 (as a bf16 dot would) adds two bf16 roundings to the output (bench/README.md, gla_kernels.py).
Tile sizes and their timings: bench/gla_kernels.py and bench/README.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..delta.fold_in import sm_count  # the GPU's SM count, asked once per device


def chunk_offsets_torch(gc: torch.Tensor, L1: int, BT: int):
    """``(off [B, NT, H, K], exp2(total) [B, H, K])`` over the first L1 tokens (fp32), in torch ops:
    the reference for :func:`chunk_offsets` (which does it in one launch instead of about ten)."""
    NT = triton.cdiv(L1, BT)
    ends = (torch.arange(NT, device=gc.device) * BT + BT).clamp_(max=L1) - 1
    tot = gc.index_select(1, ends).float()  # chunk totals (gc is chunk-local)
    incl = tot.cumsum(1)
    return (incl - tot).contiguous(), torch.exp2(incl[:, -1])


@triton.jit
def _offsets_kernel(gc, off, etot, T, L1, NT, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, BK: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    carry = tl.zeros([BK], dtype=tl.float32)
    for i0 in range(0, NT, BC):
        o_c = i0 + tl.arange(0, BC)
        m_c = o_c < NT
        rows = tl.minimum(o_c * BT + BT, L1) - 1  # the last token of each chunk (gc is chunk-local)
        m = m_c[:, None] & m_k[None, :]
        b = tl.load(gc + ((i_b * T + rows[:, None]) * H + i_h) * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
        incl = tl.cumsum(b, axis=0) + carry[None, :]
        tl.store(off + ((i_b * NT + o_c[:, None]) * H + i_h) * K + o_k[None, :], incl - b, mask=m)
        carry += tl.sum(b, axis=0)
    tl.store(etot + i_bh * K + o_k, tl.exp2(carry), mask=m_k)


def chunk_offsets(gc: torch.Tensor, L1: int, BT: int):
    """``(off [B, NT, H, K], exp2(total) [B, H, K])`` over the first L1 tokens (fp32): ``off`` the
    exclusive prefix (log2 units) of the chunk totals, ``exp2(total)`` the segment's whole decay."""
    B, T, H, K = gc.shape
    assert gc.is_contiguous() and 0 < L1 <= T
    NT = triton.cdiv(L1, BT)
    off = torch.empty(B, NT, H, K, dtype=torch.float32, device=gc.device)
    etot = torch.empty(B, H, K, dtype=torch.float32, device=gc.device)
    BK = min(16, triton.next_power_of_2(K))
    _offsets_kernel[(B * H, triton.cdiv(K, BK))](gc, off, etot, T, L1, NT, H=H, K=K, BT=BT, BC=128, BK=BK,
                                                 num_warps=4)
    return off, etot


@triton.jit
def _corr_fwd_kernel(q, gc, off, S, o, T, L1, NT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # one chunk of BT tokens x BV value columns of one head; the K dimension in BK-wide slices, so
    # the fp32 state slice, the decayed queries and the accumulator fit in registers together
    i_c = tl.program_id(0).to(tl.int64)  # token offsets in int64: T * H * K may pass 2^31
    i_bh = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    o_t = i_c * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L1
    m_v = o_v < V
    base_k = (i_b * T * H + i_h) * K
    b_c = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_g = tl.load(gc + base_k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_off = tl.load(off + ((i_b * NT + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_qe = tl.where(m_tk, b_q * tl.exp2(b_g + b_off[None, :]) * scale, 0.)
        b_S = tl.load(S + (i_bh * K + o_k[:, None]) * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_c += tl.dot(b_qe, b_S)
    m_tv = m_t[:, None] & m_v[None, :]
    p_o = o + (i_b * T * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
    b_o = tl.load(p_o, mask=m_tv, other=0.).to(tl.float32)
    tl.store(p_o, (b_o + b_c).to(p_o.dtype.element_ty), mask=m_tv)


@triton.jit
def _corr_bwd_kernel(q, gc, off, do, Xp, T, L1, NT, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CPS: tl.constexpr,
                     SPLIT: tl.constexpr):
    # a [BK, BV] tile of one head's X, summed over CPS consecutive chunks (one partial per split).
    # SPLIT (bf16 do, exact in bf16): the fp32 decayed queries as hi + lo bf16 halves, two bf16
    # products on the tensor cores instead of one with fp32 operands (tf32)
    i_s = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_kv = tl.program_id(2)
    NV = tl.cdiv(V, BV)
    i_k = i_kv // NV
    i_v = i_kv % NV
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = i_k * BK + tl.arange(0, BK)
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
        if SPLIT:
            q_hi = b_qe.to(tl.bfloat16)
            q_lo = (b_qe - q_hi.to(tl.float32)).to(tl.bfloat16)
            b_X = tl.dot(tl.trans(q_hi), b_do, b_X)
            b_X = tl.dot(tl.trans(q_lo), b_do, b_X)
        else:
            b_X += tl.dot(tl.trans(b_qe), b_do.to(tl.float32))
    p_X = Xp + ((i_s * (tl.num_programs(1)) + i_bh) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p_X, b_X, mask=m_k[:, None] & m_v[None, :])


# Tiles: the fastest of bench/gla_kernels.py's sweep on an H200 (bench/README.md): the separate
# forward correction (the fallback) with the whole K = 128 in one tile; the state gradient with its
# bf16 hi/lo products and the whole K x V tile, over at most 16 chunks per partial sum (``cps``; None:
# :func:`chunks_per_split`).
FWD_TILES = dict(BK=128, BV=128, num_warps=8)
BWD_TILES = dict(BK=128, BV=128, num_warps=8, cps=None)
MAX_CHUNKS_PER_SPLIT = 16


def chunks_per_split(NT: int, tiles_per_split: int, sms: int) -> int:
    """Chunks per partial sum of :func:`state_grad`: :data:`MAX_CHUNKS_PER_SPLIT`, halved while the
    grid (splits x ``tiles_per_split``) would leave more than a tenth of the ``sms`` SMs idle: each CTA
    streams its chunks, so a short shard needs more, shorter splits to keep the memory busy (fewer
    partials where the grid is full already: each one is another K x V sum)."""
    cps = MAX_CHUNKS_PER_SPLIT
    while cps > 1 and triton.cdiv(NT, cps) * tiles_per_split * 10 < sms * 9:
        cps //= 2
    return cps


def _tiles(K, V, BK, BV):
    BK = max(16, min(BK, triton.next_power_of_2(K)))
    BV = max(16, min(BV, triton.next_power_of_2(V)))
    return BK, BV


def correct_output_(o, q, gc, S_in, scale: float, L1: int, BT: int, offsets=None, tiles=None):
    """In place: ``o[:, :L1] += scale * (q * 2^G) @ S_in``. Returns the first segment's total decay
    ``exp(sum g)`` as ``[B, H, K]`` fp32. ``offsets``: :func:`chunk_offsets` of (gc, L1, BT) if the
    caller has it already; ``tiles``: overrides of :data:`FWD_TILES` (benchmarks)."""
    B, T, H, K = q.shape
    V = o.shape[-1]
    assert o.is_contiguous() and q.is_contiguous() and gc.is_contiguous()
    off, etot = offsets if offsets is not None else chunk_offsets(gc, L1, BT)
    NT = off.shape[1]
    t = dict(FWD_TILES, **(tiles or {}))
    BK, BV = _tiles(K, V, t["BK"], t["BV"])
    S = S_in.float().contiguous()
    grid = (NT, B * H, triton.cdiv(V, BV))
    _corr_fwd_kernel[grid](q, gc, off, S, o, T, L1, NT, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                           num_warps=t["num_warps"])
    return etot


def state_grad(q, gc, do, scale: float, L1: int, BT: int, offsets=None, tiles=None):
    """``(X [B, H, K, V] fp32, exp(total decay) [B, H, K])`` over the first L1 tokens. ``offsets``:
    :func:`chunk_offsets` of (gc, L1, BT) if the caller has it already (the forward's); ``tiles``:
    overrides of :data:`BWD_TILES` (benchmarks)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    assert do.is_contiguous() and q.is_contiguous() and gc.is_contiguous()
    off, etot = offsets if offsets is not None else chunk_offsets(gc, L1, BT)
    NT = off.shape[1]
    t = dict(BWD_TILES, **(tiles or {}))
    BK, BV = _tiles(K, V, t["BK"], t["BV"])
    tiles_per_split = B * H * triton.cdiv(K, BK) * triton.cdiv(V, BV)
    cps = t["cps"] or chunks_per_split(NT, tiles_per_split, sm_count(q.device.index))
    NS = triton.cdiv(NT, cps)
    Xp = torch.empty(NS, B * H, K, V, dtype=torch.float32, device=q.device)
    grid = (NS, B * H, triton.cdiv(K, BK) * triton.cdiv(V, BV))
    _corr_bwd_kernel[grid](q, gc, off, do, Xp, T, L1, NT, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                           CPS=cps, SPLIT=do.dtype == torch.bfloat16, num_warps=t["num_warps"])
    X = Xp.sum(0) if NS > 1 else Xp[0]
    return X.view(B, H, K, V), etot


@triton.jit(do_not_specialize=["T"])
def _fwd_o_state_kernel(q, v, gc, h, A, off, S, o, cu_seqlens, chunk_indices, scale, T, NT1,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr):
    # The output of one chunk x BV value columns of one head, with the incoming state folded in:
    #   o = scale * (q * 2^gc) @ (h_c + diag(2^off_c) S_in) + A @ v
    # h_c: the chunk's state from a zero start (fla's chunk_fwd_h), A: the intra-chunk attention
    # (fla's chunk_gla_fwd_intra_gk, scale included), S_in: the state entering the shard, applied to
    # the first local sequence only (the whole shard without packing). The inter-chunk product is
    # formed in fp32 and, for 16-bit inputs (SPLIT), multiplied as three bf16 products of hi/lo halves
    # (hi*hi + hi*lo + lo*hi: about 16 mantissa bits) on the bf16 tensor cores: fp32 operands (tf32)
    # made this kernel far slower than fla's output kernel, and plain bf16 operands round the incoming
    # state (see the module docstring).
    NV = tl.cdiv(V, BV)
    i_t = (tl.program_id(0) // NV).to(tl.int64)  # token offsets in int64, as fla
    i_v = tl.program_id(0) % NV
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = (eos - bos).to(tl.int32)
        first = i_n == 0
    else:
        i_tg = i_b * tl.cdiv(T, BT) + i_t
        bos = i_b * T
        first = True
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, BT)
    m_t = o_t < T
    m_v = o_v < V
    p_qk = (bos * H + i_h) * K + o_t[:, None] * (H * K)
    p_h = h + (i_tg * H + i_h) * K * V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_q = tl.load(q + p_qk + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_g = tl.load(gc + p_qk + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_qg = b_q * tl.exp2(b_g)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.).to(tl.float32)
        if first:
            b_off = tl.load(off + ((i_b * NT1 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.)
            b_S = tl.load(S + (i_bh * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.)
            b_h += tl.exp2(b_off)[:, None] * b_S
        if SPLIT:
            q_hi = b_qg.to(tl.bfloat16)
            q_lo = (b_qg - q_hi.to(tl.float32)).to(tl.bfloat16)
            h_hi = b_h.to(tl.bfloat16)
            h_lo = (b_h - h_hi.to(tl.float32)).to(tl.bfloat16)
            b_o = tl.dot(q_hi, h_hi, b_o)
            b_o = tl.dot(q_hi, h_lo, b_o)
            b_o = tl.dot(q_lo, h_hi, b_o)
        else:
            b_o = tl.dot(b_qg, b_h, b_o)
    b_o = b_o * scale
    m_tv = m_t[:, None] & m_v[None, :]
    p_vo = (bos * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
    b_v = tl.load(v + p_vo, mask=m_tv, other=0.)
    b_A = tl.load(A + (bos * H + i_h) * BT + o_t[:, None] * (H * BT) + o_i[None, :], mask=m_t[:, None], other=0.)
    b_A = tl.where(o_i[None, :] <= tl.arange(0, BT)[:, None], b_A, 0.).to(b_v.dtype)
    b_o = tl.dot(b_A, b_v, b_o)
    tl.store(o + p_vo, b_o.to(o.dtype.element_ty), mask=m_tv)


# The output kernel with the state folded in: the fastest of bench/gla_kernels.py's sweep on an H200
# at T_local 4K-16K (bench/README.md, gla_kernels.py).
FWD_O_TILES = dict(BK=64, BV=128, num_warps=4, num_stages=2)


def output_with_state(q, v, gc, A, h, S_in, scale: float, BT: int, offsets, *, cu_seqlens=None, chunk_indices=None,
                      tiles=None):
    """fla's chunk output (``chunk_gla_fwd_o_gk``) with the incoming state ``S_in`` [B, H, K, V] of the
    first local sequence folded in: one pass over q, gc, h, A and v, instead of fla's output kernel
    and then :func:`correct_output_` reading q and gc again and o twice. ``offsets``: :func:`chunk_offsets`
    of (gc, L1, BT), L1 the first sequence's length (T without packing)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert q.is_contiguous() and v.is_contiguous() and gc.is_contiguous() and A.is_contiguous() and h.is_contiguous()
    off, _ = offsets
    NT1 = off.shape[1]
    t = dict(FWD_O_TILES, **(tiles or {}))
    BK, BV = _tiles(K, V, t["BK"], t["BV"])
    NT = triton.cdiv(T, BT) if cu_seqlens is None else chunk_indices.shape[0]
    S = S_in.float().contiguous()
    o = torch.empty_like(v)
    grid = (NT * triton.cdiv(V, BV), B * H)
    _fwd_o_state_kernel[grid](q, v, gc, h, A, off, S, o, cu_seqlens, chunk_indices, scale, T, NT1, H=H, K=K, V=V,
                              BT=BT, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
                              SPLIT=q.dtype != torch.float32, num_warps=t["num_warps"],
                              num_stages=t["num_stages"])
    return o
