"""The matrix All-Scan's arithmetic and its sequential reference (one process holds every rank).

``combine`` is the one operation of the contract, ``M @ y + x`` in the arithmetic dtype (fp32, fp64
for fp64 states) rounded once to the storage dtype; the torch.distributed path and the reference
use it, the C++ core computes the same with FFMA (a GEMM's summation order is its own, so paths
agree to fp32 accuracy, not bitwise, except on exactly representable data).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..reference import acc_dtype

__all__ = ["combine", "matrix_scan_reference"]


def combine(m: torch.Tensor, y: torch.Tensor, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``M @ y + x`` (``M^T @ y + x`` with ``transpose``) over the leading batch dims, in the
    arithmetic dtype of ``x``, rounded once to ``x.dtype``. m: [..., K, K]; y, x: [..., K, V]."""
    acc = acc_dtype(x.dtype)
    ma = m.to(acc)
    if transpose:
        ma = ma.transpose(-1, -2)
    return (torch.matmul(ma, y.to(acc)) + x.to(acc)).to(x.dtype)


def matrix_scan_reference(
    xs: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor],
    init: Optional[torch.Tensor] = None,
    *,
    reverse: bool = False,
    inclusive: bool = False,
    transpose: bool = False,
    exact: bool = False,
) -> List[torch.Tensor]:
    """Every rank's result of the matrix All-Scan of states ``xs[p]`` and transitions ``ms[p]``.

    ``exact=False`` rounds to the storage dtype at every rank boundary, as the library does (the
    head without ``init`` passes its x on unchanged); ``exact=True`` runs the recurrence in float64
    without intermediate rounding (the ground truth for error bounds)."""
    P = len(xs)
    if len(ms) != P:
        raise ValueError(f"ms: expected {P} transitions (one per rank), got {len(ms)}")
    order = range(P - 1, -1, -1) if reverse else range(P)
    out: List[Optional[torch.Tensor]] = [None] * P
    if exact:
        f64 = torch.float64
        y = torch.zeros_like(xs[0], dtype=f64) if init is None else init.to(f64)
        for p in order:
            nxt = combine(ms[p].to(f64), y, xs[p].to(f64), transpose)
            out[p] = nxt if inclusive else y
            y = nxt
        return out  # type: ignore[return-value]
    y = None if init is None else init.clone()  # None: the chain head's zero state
    for p in order:
        nxt = xs[p].clone() if y is None else combine(ms[p], y, xs[p], transpose)
        out[p] = nxt if inclusive else (torch.zeros_like(xs[p]) if y is None else y)
        y = nxt
    return out  # type: ignore[return-value]
