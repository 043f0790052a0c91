"""``[u | 0]``: fla's WY values ``u [B, T, H, V]`` widened with zero columns to ``[B, T, H, W]`` in one
pass, for the widened forward of :class:`allscan.ops.delta.fla.FlaDelta` (``u`` is linear in the values,
so the WY values of ``[v | 0]`` are ``[u | 0]``).

torch does this as two strided passes (a copy into the left columns, a fill of the right ones) over
rows of W elements; here each program writes whole rows once, reading ``u`` once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["widened"]

_ELEMENTS_PER_PROGRAM = 8192


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
