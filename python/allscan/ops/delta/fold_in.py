"""Folding the incoming state into a shard's outputs, ``o + Q' S_in``, in Triton kernels that read each operand once.

``Q' [B, T, H, K]`` maps the state entering the shard to every token's output (from fla's forward on
the widened values, :meth:`allscan.ops.delta.fla.FlaDelta.outputs`), ``S_in [B, H, K, V]`` fp32 is
the state the All-Scan delivered, ``o [B, T, H, V]`` the local outputs. Done with torch ops this was an
fp32 GEMM with casts of ``o`` and ``Q'`` around it; here each direction reads its operands once:

    forward:   out = round(o + Q' S_in)                  one pass over o, Q'       fold_forward
    backward:  dS_in = sum_t Q'_t^T dout_t  (fp32)       the sum over T split      fold_state_grad
                                                         over CTAs, then summed

(``Q'`` needs no gradient: the layer's backward differentiates fla's forward from the whole incoming
state, :mod:`allscan.ops.delta.shard`.)

Precision: ``Q'`` and ``dout`` are exact in their (16-bit) dtype; ``S_in`` is split into two bf16
parts (hi + lo carry 16 significant bits), so the product is fp32-accurate on bf16 tensor cores and
the result is rounded once, as the fp32 einsum did. fp16 and fp32 inputs take IEEE fp32 dots.
The partial sums of ``dS_in`` are written per split and added in a fixed order: deterministic.
Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CI's tests) computes bf16 dots wrongly, so
there every dot takes the IEEE fp32 form.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["fold_forward", "fold_state_grad"]

_BLOCK_T = 64
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
def _tile(base, rows, cols, n_rows, n_cols, s_row, s_col):
    """Load ``base[rows, cols]`` (zeros outside ``[n_rows, n_cols]``), 64-bit offsets."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * s_row + cols.to(tl.int64)[None, :] * s_col
    return tl.load(base + offs, mask=mask, other=0.0)


@triton.jit
def _fold_forward(o, qe, s, out, q_out, T, H,
                  so_b, so_t, so_h, sq_b, sq_t, sq_h, sout_b, sout_t, sout_h,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  SPLIT: tl.constexpr, STORE_Q: tl.constexpr):
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)  # offsets past 2^31 elements
    t = i_t * BT + tl.arange(0, BT)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    acc = _tile(o + b * so_b + h * so_h, t, vv, T, V, so_t, 1).to(tl.float32)
    q = _tile(qe + b * sq_b + h * sq_h, t, kk, T, K, sq_t, 1)
    if STORE_Q:  # a contiguous copy of Q' [B, T, H, K], written by the first column block
        if i_v == 0:
            mask_q = (t[:, None] < T) & (kk[None, :] < K)
            tl.store(q_out + ((b * T + t.to(tl.int64)[:, None]) * H + h) * K + kk[None, :], q, mask=mask_q)
    acc += _dot_state(q, _tile(s + i_bh.to(tl.int64) * K * V, kk, vv, K, V, V, 1), SPLIT)
    mask = (t[:, None] < T) & (vv[None, :] < V)
    dst = out + b * sout_b + h * sout_h + t.to(tl.int64)[:, None] * sout_t + vv[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mask)


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


def _check_inner_stride(name: str, t: torch.Tensor):
    if t.stride(-1) != 1:
        raise ValueError(f"fold_forward: {name} must have a unit stride in its last dimension, got {t.stride()}")


def fold_forward(o: torch.Tensor, q_eff: torch.Tensor, S_in: torch.Tensor, copy_q: bool = False):
    """``o + einsum("bthk,bhkv->bthv", q_eff, S_in)`` in ``o``'s dtype (no autograd); with ``copy_q``
    also a contiguous copy of ``q_eff``, read once for both: ``(out, q_copy)``.

    ``o [B, T, H, V]`` and ``q_eff [B, T, H, K]`` (any strides with a unit last one: slices of fla's
    widened output are taken as they are), ``S_in [B, H, K, V]`` (fp32)."""
    B, T, H, V = o.shape
    K = q_eff.shape[-1]
    _check_inner_stride("o", o)
    _check_inner_stride("q_eff", q_eff)
    S = S_in.to(torch.float32).contiguous()
    out = torch.empty(B, T, H, V, dtype=o.dtype, device=o.device)
    q_copy = torch.empty(B, T, H, K, dtype=q_eff.dtype, device=o.device) if copy_q else None
    BK, BV = _pow2(K), min(_pow2(V), 64)
    split = q_eff.dtype == torch.bfloat16 and not _INTERPRETED
    grid = (triton.cdiv(T, _BLOCK_T), triton.cdiv(V, BV), B * H)
    _fold_forward[grid](o, q_eff, S, out, q_copy if copy_q else out, T, H, *[o.stride(i) for i in range(3)],
                        *[q_eff.stride(i) for i in range(3)], *[out.stride(i) for i in range(3)],
                        K=K, V=V, BT=_BLOCK_T, BK=BK, BV=BV, SPLIT=split, STORE_Q=copy_q)
    return (out, q_copy) if copy_q else out


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
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
    sms = 8 if cuda_index is None else _sm_count(cuda_index)
    blocks = triton.cdiv(T, _BLOCK_T)
    splits = max(1, min(blocks, triton.cdiv(2 * sms, B * H * nv)))
    t_split = triton.cdiv(blocks, splits) * _BLOCK_T
    return BK, BV, nv, triton.cdiv(T, t_split), t_split


def fold_state_grad(q_eff: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``einsum("bthk,bthv->bhkv", q_eff, dout)`` in fp32 (no autograd): the gradient of ``S_in`` in
    :func:`fold_forward`, deterministic."""
    B, T, H, K = q_eff.shape
    V = dout.shape[-1]
    _check_inner_stride("q_eff", q_eff)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    BK, BV, nv, splits, t_split = _state_grad_launch(B, T, H, K, V, q_eff.device.index if q_eff.is_cuda else None)
    part = torch.empty(splits, B * H, K, V, dtype=torch.float32, device=q_eff.device)
    ieee = _INTERPRETED or q_eff.dtype == torch.float32 or q_eff.dtype != dout.dtype
    _fold_grad_state[(nv, splits, B * H)](
        q_eff, dout, part, T, H, t_split, *[q_eff.stride(i) for i in range(3)],
        *[dout.stride(i) for i in range(3)], K=K, V=V, BT=_BLOCK_T, BK=BK, BV=BV, IEEE=ieee)
    return part.sum(0).view(B, H, K, V)
