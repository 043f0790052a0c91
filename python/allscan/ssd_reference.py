"""Mamba2's SSD one token at a time: the reference :func:`allscan.ops.ssd.zeco_ssd` is tested against."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["ssd_recurrence"]


def ssd_recurrence(x, dt, A, B, C, D=None, *, initial_state: Optional[torch.Tensor] = None,
                   cu_seqlens=None, dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t`` per head, in ``dtype``
    (float64: exact up to rounding; differentiable by autograd).

    x: ``[b, T, H, P]``; dt: ``[b, T, H]`` (the scan's time steps); A, D: ``[H]``; B, C: ``[b, T, G, N]``,
    head h reading group ``h // (H // G)``; initial_state: ``[b, H, P, N]``, or with ``cu_seqlens``
    (offsets of the packed sequences, b = 1) ``[num_seqs, H, P, N]``, every sequence starting from its row
    (zeros without). Returns ``(y [b, T, H, P], final states [b or num_seqs, H, P, N])`` in ``dtype``.
    """
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    x, dt, A = x.to(dtype), dt.to(dtype), A.to(dtype)
    B, C = (t.to(dtype).repeat_interleave(H // G, dim=2) for t in (B, C))
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    ys, finals = [], []
    for i in range(len(bounds) - 1):
        if initial_state is None:
            h = x.new_zeros(b if cu_seqlens is None else 1, H, P, N)
        else:
            h = (initial_state if cu_seqlens is None else initial_state[i:i + 1]).to(dtype)
        for t in range(bounds[i], bounds[i + 1]):
            decay = torch.exp(dt[:, t] * A)[:, :, None, None]  # [b, H, 1, 1]
            h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]))
        finals.append(h)
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    return y, torch.cat(finals, 0)
