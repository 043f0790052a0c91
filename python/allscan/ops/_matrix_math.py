"""The matrix All-Scan's arithmetic and its sequential reference (one process holds every rank).

``combine`` is the one operation of the contract, ``M @ y + x`` in the arithmetic dtype (fp32, fp64
for fp64 states) rounded once to the storage dtype; the torch.distributed path and the reference
use it, the C++ core computes the same with FFMA (a GEMM's summation order is its own, so paths
agree to fp32 accuracy, not bitwise, except on exactly representable data).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..reference import acc_dtype, fold_chain

__all__ = ["combine", "matrix_scan_reference"]


def combine(m: torch.Tensor, y: torch.Tensor, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """``M @ y + x`` (``M^T @ y + x`` with ``transpose``) over the leading batch dims, in the
    arithmetic dtype of ``x``, rounded once to ``x.dtype``. m: [..., K, K]; y, x: [..., K, V]. A row of
    the transition that is all zeros takes nothing from y: that row is x's even where y is inf or NaN
    (a zero decay's rule, :func:`allscan.reference.combine`; its gradient there is zero)."""
    acc = acc_dtype(x.dtype)
    ma = m.to(acc)
    if transpose:
        ma = ma.transpose(-1, -2)
    xa = x.to(acc)
    unread = (ma == 0).all(-1, keepdim=True)
    # the unread rows' gradient is zero, not the matmul's 0 * inf (the gradient where passes is 0 there)
    ma = torch.where(unread, ma.detach(), ma)
    return torch.where(unread, xa, torch.matmul(ma, y.to(acc)) + xa).to(x.dtype)


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
    return fold_chain(xs, lambda p, y, x: combine(ms[p], y, x, transpose), init, reverse=reverse,
                      inclusive=inclusive, exact=exact)
