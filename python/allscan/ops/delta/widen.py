"""``[u | 0]``: the WY values ``u [B, T, HV, V]`` widened with zero columns to ``[B, T, HV, W]``, for the
widened forward of :class:`allscan.ops.delta.fla.FlaDelta` (``u`` is linear in the values, so the WY
values of ``[v | 0]`` are ``[u | 0]``). Two ways, each writing the widened rows once:

- :func:`gdn_wy_widened` (Gated DeltaNet): fla's ``recompute_w_u_fwd`` arithmetic (``w = A (k beta
  exp2(g))``, ``u = A (v beta)`` per chunk of 64, from fla's solved factors ``A``; the same tiles and
  roundings, bitwise equal to fla's where ``tests/test_widen.py`` compares them on the GPU), storing
  ``u`` straight into the widened rows, so ``u`` is never written and read back;
- :func:`widened` (KDA, whose WY values come out of fla's intra-chunk function): ``u`` read once, each
  row written whole (torch would copy into the left columns, then fill the right ones).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["widened", "gdn_wy_widened"]

_ELEMENTS_PER_PROGRAM = 8192
_BLOCK_T = 64  # fla's chunk
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _widen(src, dst, n_rows, V: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BW)[None, :]
    r = rows.to(tl.int64)[:, None]  # offsets past 2^31 elements
    inside = rows[:, None] < n_rows
    x = tl.load(src + r * V + cols, mask=inside & (cols < V), other=0.0)
    tl.store(dst + r * W + cols, x, mask=inside & (cols < W))


def widened(u: torch.Tensor, width: int) -> torch.Tensor:
    """``torch.cat([u, zeros(..., width - V)], -1)``, contiguous (no autograd)."""
    V = u.shape[-1]
    if width < V:
        raise ValueError(f"widened: width must be at least u's last dimension {V}, got {width}")
    u = u.contiguous()
    out = torch.empty(*u.shape[:-1], width, dtype=u.dtype, device=u.device)
    rows = u.numel() // V if V else 0
    if rows == 0:
        return out.zero_()
    BW = triton.next_power_of_2(width)
    BR = max(1, _ELEMENTS_PER_PROGRAM // BW)
    _widen[(triton.cdiv(rows, BR),)](u, out, rows, V=V, W=width, BR=BR, BW=BW)
    return out


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, ALLOW_TF32: tl.constexpr):
    """``a @ b`` as fla's ``recompute_w_u_fwd_kernel`` computes it (``u``'s without TF32, ``w``'s with
    Triton's default), or in IEEE fp32 (the interpreter, whose 16-bit dots are wrong)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if ALLOW_TF32:
        return tl.dot(a, b)
    return tl.dot(a, b, allow_tf32=False)


@triton.jit
def _product(x, b):
    """``x * b[:, None]`` as fla's kernel has it: in x's dtype when b has it too (the product of two 16-bit
    floats is exact in fp32, so rounding it once gives that product), else in fp32. Computed in fp32:
    the interpreter multiplies 16-bit floats wrongly."""
    p = x.to(tl.float32) * b.to(tl.float32)[:, None]
    if b.dtype == x.dtype:
        p = p.to(x.dtype)
    return p


@triton.jit
def _gdn_wy_widened(k, v, beta, A, g, w, u, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    IEEE: tl.constexpr):
    """One chunk of one value head: ``u``'s V columns and the zero columns after them, then ``w``."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = (i_bh // HV).to(tl.int64), (i_bh % HV).to(tl.int64)  # offsets past 2^31 elements
    i_h = i_hv // (HV // H)
    t = i_t * BT + tl.arange(0, BT)
    m_t = t < T
    rows = i_b * T + t.to(tl.int64)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0)
    b_A = tl.load(A + (rows * HV + i_hv)[:, None] * BT + tl.arange(0, BT)[None, :], mask=m_t[:, None], other=0.0)
    u_rows = u + (rows * HV + i_hv)[:, None] * W
    for i_v in range(tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (vv[None, :] < V)
        b_v = tl.load(v + (rows * HV + i_hv)[:, None] * V + vv[None, :], mask=m, other=0.0)
        b_u = _dot(b_A, _product(b_v, b_b).to(b_v.dtype), IEEE, False)
        tl.store(u_rows + vv[None, :], b_u.to(u.dtype.element_ty), mask=m)
    for i_z in range(tl.cdiv(W - V, BV)):
        zz = V + i_z * BV + tl.arange(0, BV)
        tl.store(u_rows + zz[None, :], tl.zeros([BT, BV], dtype=u.dtype.element_ty),
                 mask=m_t[:, None] & (zz[None, :] < W))
    b_g = tl.math.exp2(tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0))
    for i_k in range(tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (kk[None, :] < K)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + kk[None, :], mask=m, other=0.0)
        b_w = _dot(b_A, (_product(b_k, b_b) * b_g[:, None]).to(b_k.dtype), IEEE, True)
        tl.store(w + (rows * HV + i_hv)[:, None] * K + kk[None, :], b_w.to(w.dtype.element_ty), mask=m)


def gdn_wy_widened(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor, g_cum: torch.Tensor,
                   width: int):
    """``(w, [u | 0])`` of Gated DeltaNet (no autograd, one sequence batch, no packing): what fla's
    ``recompute_w_u_fwd(k, v, beta, A, g_cum)`` returns, with ``u`` widened to ``width`` columns.
    ``k [B, T, H, K]``, ``v [B, T, HV, V]``, ``beta`` and ``g_cum`` (the cumulative log2 decay) ``[B, T,
    HV]``, ``A [B, T, HV, 64]`` (fla's solved factors)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if width < V:
        raise ValueError(f"gdn_wy_widened: width must be at least v's last dimension {V}, got {width}")
    if HV % H or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"gdn_wy_widened: v must be [B, T, HV, V] with k's [B, T] and HV a multiple of k's heads, "
                         f"got k {list(k.shape)}, v {list(v.shape)}")
    for name, t, shape in (("beta", beta, (B, T, HV)), ("g_cum", g_cum, (B, T, HV)), ("A", A, (B, T, HV, _BLOCK_T))):
        if tuple(t.shape) != shape:
            raise ValueError(f"gdn_wy_widened: {name} must be {list(shape)}, got {list(t.shape)}")
    k, v, beta, A, g_cum = (t.contiguous() for t in (k, v, beta, A, g_cum))
    w = k.new_empty(B, T, HV, K)
    u = v.new_empty(B, T, HV, width)
    if w.numel() == 0 and u.numel() == 0:
        return w, u
    _gdn_wy_widened[(triton.cdiv(T, _BLOCK_T), B * HV)](
        k, v, beta, A, g_cum, w, u, T, H=H, HV=HV, K=K, V=V, W=width, BT=_BLOCK_T, BK=64, BV=64, IEEE=_INTERPRETED,
        num_warps=4, num_stages=3)
    return w, u
