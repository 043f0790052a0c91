"""Folding the incoming state into a shard's outputs, in Triton kernels that read each operand once.

The first segment of a shard runs fla's state kernel on the widened values ``[u | 0]`` from ``[h0 | I]``
(:class:`allscan.ops.delta.fla.FlaDelta`): its chunk states ``h [B, NT, HV, K, V + K]`` carry the local
states in their first V columns and the chunks' transitions ``P_c`` in the last K, and so do the new
values ``v' [B, T, HV, V + K]``. fla's output kernel would turn them into ``[o_local | Q']``; here one
kernel does that and adds the incoming state ``S_in [B, HV, K, V]`` (fp32, the All-Scan's result)::

    forward:   o = round(o_local + round(Q') S_in),  Q' kept      head_outputs (fla's output kernel's
                                                                  math, then the fold, per chunk tile)
    backward:  dS_in = sum_t Q'_t^T dout_t  (fp32)                fold_state_grad (the sum over T split
                                                                  over CTAs, then summed)

so neither ``o_local`` nor ``Q'`` makes a round trip through memory before the fold (fla's widened output
kernel, then a pass over its result, wrote and read both once more). The kernel waits for the All-Scan.
``Q'`` needs no gradient: the layer's backward differentiates fla's forward from the whole incoming state
(:mod:`allscan.ops.delta.shard`).

Precision: the local outputs and ``Q'`` are fla's arithmetic (16-bit dots, fp32 sums; Triton's default
for fp32 inputs, as fla's kernels); ``Q'`` is rounded to the values' dtype (what the backward keeps);
``S_in`` is split into two bf16 parts (hi + lo carry 16 significant bits), so ``Q' S_in`` is fp32-accurate
on bf16 tensor cores, and the output is rounded once. fp16 and fp32 take IEEE fp32 dots for ``Q' S_in``.
The partial sums of ``dS_in`` are written per split and added in a fixed order: deterministic. Triton's
CPU interpreter (``TRITON_INTERPRET=1``, the CI's tests) computes bf16 dots wrongly, so there every dot
takes the IEEE fp32 form.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["head_outputs", "fold_state_grad", "sm_count"]

_BLOCK_T = 64  # fla's chunk
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot_state(a, s, SPLIT: tl.constexpr):
    """``a @ s`` with fp32 accuracy: ``a`` bf16 (SPLIT) or any float (IEEE), ``s`` fp32."""
    if SPLIT:
        hi = s.to(tl.bfloat16)
        lo = (s - hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a, hi) + tl.dot(a, lo)
    return tl.dot(a.to(tl.float32), s, input_precision="ieee")


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` as fla's kernels compute it, or in IEEE fp32 (the interpreter)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile(base, rows, cols, n_rows, n_cols, s_row, s_col):
    """Load ``base[rows, cols]`` (zeros outside ``[n_rows, n_cols]``), 64-bit offsets."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * s_row + cols.to(tl.int64)[None, :] * s_col
    return tl.load(base + offs, mask=mask, other=0.0)


@triton.jit
def _queries(q, g, t, kk, T, K, s_q, s_g, PER_KEY: tl.constexpr):
    """The chunk's queries ``[BT, BK]``: KDA's gated by their per-key decay (fla's ``q * exp2(g)``)."""
    b_q = _tile(q, t, kk, T, K, s_q, 1)
    if PER_KEY:
        b_q = (b_q * tl.math.exp2(_tile(g, t, kk, T, K, s_g, 1).to(tl.float32))).to(b_q.dtype)
    return b_q


@triton.jit
def _head_outputs(q, k, v, h, g, A, s, o, qe, T, scale,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, ONE_PASS: tl.constexpr,
                  PER_KEY: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """One chunk's ``[BT, BV]`` outputs: fla's output kernel over the V columns (``chunk_fwd_o``, or
    ``chunk_gla_fwd_o_gk`` with PER_KEY), then ``Q'`` over the K columns, BC at a time, each block
    folded in at once (and stored by the first column block's programs). ONE_PASS (BC covers K): ``Q'``'s
    state term in the first loop, which reads each query tile once."""
    # column block and chunk in the grid's first dimension (2^31 - 1 programs: no limit on T that one
    # rank could reach alone), batch row and value head in the second
    i_vt, i_bh = tl.program_id(0), tl.program_id(1)
    i_v, i_t = i_vt % tl.cdiv(V, BV), i_vt // tl.cdiv(V, BV)
    i_b, i_hv = (i_bh // HV).to(tl.int64), (i_bh % HV).to(tl.int64)  # offsets past 2^31 elements
    i_h = i_hv // (HV // H)
    W = V + K
    NT = tl.cdiv(T, BT)
    bos = i_b * T
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    v += (bos * HV + i_hv) * W
    h += ((i_b * NT + i_t) * HV + i_hv) * K * W
    o += (bos * HV + i_hv) * V
    qe += (bos * HV + i_hv) * K
    s += i_bh.to(tl.int64) * K * V
    if PER_KEY:
        g += (bos * HV + i_hv) * K
        A += (bos * HV + i_hv) * BT
    else:
        g += bos * HV + i_hv
    t = i_t * BT + tl.arange(0, BT)
    vv = i_v * BV + tl.arange(0, BV)
    cols = tl.arange(0, BT)

    # the local outputs of this column block (and GDN's q k^T; with ONE_PASS, Q's state term too)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    if ONE_PASS:
        b_e = tl.zeros([BT, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        b_q = _queries(q, g, t, kk, T, K, H * K, HV * K, PER_KEY)
        b_o = _dot(b_q, _tile(h, kk, vv, K, V, W, 1), b_o, IEEE)
        if not PER_KEY:
            b_A = _dot(b_q, _tile(k, kk, t, K, T, 1, H * K), b_A, IEEE)
        if ONE_PASS:
            b_e = _dot(b_q, _tile(h + V, kk, tl.arange(0, BC), K, K, W, 1), b_e, IEEE)
    causal = (t[:, None] >= t[None, :]) & (t[:, None] < T) & (t[None, :] < T)
    # fla's scalings: GDN scales both terms after its dots, KDA only the state term (Aqk holds it)
    if PER_KEY:
        b_A = tl.where(causal, _tile(A, t, cols, T, BT, HV * BT, 1).to(tl.float32), 0.0)
        q_scale = tl.full([BT], 1.0, tl.float32) * scale
        a_scale = 1.0
    else:
        b_g = tl.load(g + t.to(tl.int64) * HV, mask=t < T, other=0.0).to(tl.float32)
        b_A = tl.where(causal, b_A * tl.math.exp2(b_g[:, None] - b_g[None, :]), 0.0)
        q_scale = tl.math.exp2(b_g) * scale
        a_scale = scale
    b_A = b_A.to(v.dtype.element_ty)
    zero = tl.zeros([BT, BV], dtype=tl.float32)
    b_o = b_o * q_scale[:, None] + _dot(b_A, _tile(v, t, vv, T, V, HV * W, 1), zero, IEEE) * a_scale

    # Q' (the K columns: chunk transitions and their new values) and its fold, block by block
    for i_c in range(tl.cdiv(K, BC)):
        cc = i_c * BC + tl.arange(0, BC)
        if not ONE_PASS:
            b_e = tl.zeros([BT, BC], dtype=tl.float32)
            for i_k in range(tl.cdiv(K, BK)):
                kk = i_k * BK + tl.arange(0, BK)
                b_q = _queries(q, g, t, kk, T, K, H * K, HV * K, PER_KEY)
                b_e = _dot(b_q, _tile(h + V, kk, cc, K, K, W, 1), b_e, IEEE)
        b_av = _dot(b_A, _tile(v + V, t, cc, T, K, HV * W, 1), tl.zeros([BT, BC], dtype=tl.float32), IEEE)
        b_qe = (b_e * q_scale[:, None] + b_av * a_scale).to(qe.dtype.element_ty)
        if i_v == 0:
            mask_e = (t[:, None] < T) & (cc[None, :] < K)
            tl.store(qe + t.to(tl.int64)[:, None] * (HV * K) + cc[None, :], b_qe, mask=mask_e)
        b_o += _dot_state(b_qe, _tile(s, cc, vv, K, V, V, 1), SPLIT)
    mask = (t[:, None] < T) & (vv[None, :] < V)
    tl.store(o + t.to(tl.int64)[:, None] * (HV * V) + vv[None, :], b_o.to(o.dtype.element_ty), mask=mask)


@triton.jit
def _fold_grad_state(qe, do, part, T, H, T_SPLIT,
                     sq_b, sq_t, sq_h, sd_b, sd_t, sd_h,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     IEEE: tl.constexpr):
    """One split's ``sum_t Q'_t^T dout_t`` over tokens [i_s * T_SPLIT, (i_s + 1) * T_SPLIT)."""
    i_v, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    acc = tl.zeros((BK, BV), dtype=tl.float32)
    t_end = tl.minimum(T, (i_s + 1) * T_SPLIT)
    for t0 in range(i_s * T_SPLIT, t_end, BT):
        t = t0 + tl.arange(0, BT)
        q_t = _tile(qe + b * sq_b + h * sq_h, kk, t, K, t_end, 1, sq_t)  # Q'^T [BK, BT]
        d = _tile(do + b * sd_b + h * sd_h, t, vv, t_end, V, sd_t, 1)
        if IEEE:
            acc += tl.dot(q_t.to(tl.float32), d.to(tl.float32), input_precision="ieee")
        else:  # 16-bit operands: exact products, fp32 sums
            acc += tl.dot(q_t, d)
    mask = (kk[:, None] < K) & (vv[None, :] < V)
    dst = part + (i_s * tl.num_programs(2) + i_bh).to(tl.int64) * K * V + kk[:, None] * V + vv[None, :]
    tl.store(dst, acc, mask=mask)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def head_outputs(q, k, v_wide, h_wide, g, A, S_in, scale: float):
    """``(o, Q')``: the first segment's outputs with the incoming state ``S_in`` folded in, and ``Q'``
    (both in ``v_wide``'s dtype, contiguous, no autograd), from what fla's widened forward staged.

    ``q, k [B, T, H, K]`` (k unused for KDA), ``v_wide [B, T, HV, V + K]`` (fla's new values),
    ``h_wide [B, NT, HV, K, V + K]`` (its chunk states), ``g``: the cumulative log2 decay
    ``[B, T, HV]`` (Gated DeltaNet) or ``[B, T, HV, K]`` (KDA, with ``A [B, T, HV, 64]``, fla's Aqk; else
    None), ``S_in [B, HV, K, V]``."""
    B, T, H, K = q.shape
    HV, V = v_wide.shape[2], v_wide.shape[3] - K
    per_key = g.dim() == 4
    q, k, v_wide, h_wide, g = (t.contiguous() for t in (q, k, v_wide, h_wide, g))
    A = A.contiguous() if per_key else g  # not read without per_key
    S = S_in.to(torch.float32).contiguous()
    o = torch.empty(B, T, HV, V, dtype=v_wide.dtype, device=v_wide.device)
    q_eff = torch.empty(B, T, HV, K, dtype=v_wide.dtype, device=v_wide.device)
    # Tiles of at least 64 columns: Q' (a dot's result) feeds the fold's dot, which went wrong on the GPU
    # with narrower ones (Triton 3.6). 128 V columns per program for 16-bit inputs: each program computes
    # the whole Q' tile of its chunk, so fewer programs compute it fewer times. In bf16 (the dtype the
    # tiles were swept in, bench/README.md) KDA takes Q' in the first pass up to K = 128 (its gated
    # queries, an fp32 gate, are read once, not once per block of Q') and Gated DeltaNet, whose queries
    # are cheap to read again, pipelines deeper; fp16 and fp32 (folded by IEEE fp32 dots, larger in shared
    # memory) keep the first tiles.
    bits16 = v_wide.element_size() == 2
    swept = v_wide.dtype == torch.bfloat16
    BK = min(_pow2(K), 64)
    BC = max(64, _pow2(K)) if per_key and swept and _pow2(K) <= 128 else 64
    BV = 128 if bits16 and _pow2(V) > 64 else 64
    split = v_wide.dtype == torch.bfloat16 and not _INTERPRETED
    grid = (triton.cdiv(V, BV) * triton.cdiv(T, _BLOCK_T), B * HV)
    if B * HV > _MAX_GRID_Y:  # B and HV are alike on every rank: each raises, none waits for another
        raise ValueError(f"head_outputs: at most {_MAX_GRID_Y} batch rows x value heads, got B * HV = {B * HV}")
    _head_outputs[grid](q, k, v_wide, h_wide, g, A, S, o, q_eff, T, scale, H=H, HV=HV, K=K, V=V, BT=_BLOCK_T,
                        BK=BK, BV=BV, BC=BC, ONE_PASS=BC >= K, PER_KEY=per_key, SPLIT=split, IEEE=_INTERPRETED,
                        num_warps=4, num_stages=3 if swept and not per_key else 2)
    return o, q_eff


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The GPU's SM count, asked once per device."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _state_grad_launch(B: int, T: int, H: int, K: int, V: int, cuda_index):
    """``(BK, BV, column blocks, token splits, tokens per split)`` of :func:`fold_state_grad`, once per
    shape (the backward's host time; packed sequences change T, and only the arithmetic is redone)."""
    BK, BV = _pow2(K), min(_pow2(V), 64)
    nv = triton.cdiv(V, BV)
    # enough CTAs to fill the GPU: split the tokens when heads x column blocks are few (on the CPU
    # interpreter a nominal 8 "SMs", so the splits are exercised there too)
    sms = 8 if cuda_index is None else sm_count(cuda_index)
    blocks = triton.cdiv(T, _BLOCK_T)
    splits = max(1, min(blocks, triton.cdiv(2 * sms, B * H * nv)))
    t_split = triton.cdiv(blocks, splits) * _BLOCK_T
    return BK, BV, nv, triton.cdiv(T, t_split), t_split


def fold_state_grad(q_eff: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``einsum("bthk,bthv->bhkv", q_eff, dout)`` in fp32 (no autograd): the gradient of ``S_in`` in
    :func:`head_outputs`, deterministic."""
    B, T, H, K = q_eff.shape
    V = dout.shape[-1]
    if q_eff.stride(-1) != 1:
        raise ValueError(f"fold_state_grad: q_eff must have a unit stride in its last dimension, got {q_eff.stride()}")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    BK, BV, nv, splits, t_split = _state_grad_launch(B, T, H, K, V, q_eff.device.index if q_eff.is_cuda else None)
    part = torch.empty(splits, B * H, K, V, dtype=torch.float32, device=q_eff.device)
    ieee = _INTERPRETED or q_eff.dtype == torch.float32 or q_eff.dtype != dout.dtype
    _fold_grad_state[(nv, splits, B * H)](
        q_eff, dout, part, T, H, t_split, *[q_eff.stride(i) for i in range(3)],
        *[dout.stride(i) for i in range(3)], K=K, V=V, BT=_BLOCK_T, BK=BK, BV=BV, IEEE=ieee)
    return part.sum(0).view(B, H, K, V)
