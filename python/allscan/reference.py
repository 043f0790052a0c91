"""Sequential references of the All-Scan contract (one process holds every rank's tensors).

``scan_reference(..., exact=False)`` mirrors the library's arithmetic: fp32 (fp64 for fp64 states),
``g*y + x`` as a separate multiply and add, rounded to the storage dtype at every rank boundary; every
allscan method (NCCL or torch.distributed) is bitwise equal to it. ``exact=True`` computes the same
recurrence in float64 without intermediate rounding (the ground truth for error bounds).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

__all__ = ["scan_reference", "combine", "acc_dtype", "expand_decay"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype of a storage dtype: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_decay(g: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a prefix-shaped decay so that it broadcasts over the state's trailing dimensions."""
    return g.reshape(tuple(g.shape) + (1,) * (ndim - g.dim()))


def combine(g: Optional[torch.Tensor], y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g*y + x`` in the arithmetic dtype, rounded once to ``x.dtype`` (the library's one operation). A decay
    of exactly zero stops the state: y is read as 0 where it is inf or NaN (IEEE's ``0 * inf`` is NaN, which
    would carry a non-finite state past a reset such as a packed sequence's start), as the kernels do
    (``csrc/allscan/decay_combine.cuh``): the result there is ``g*0 + x``, the kernels' bits (a -0 x gives +0).
    Differentiable; where the decay is 0 and y is not finite, the gradients are zero."""
    acc = acc_dtype(x.dtype)
    ya, xa = y.to(acc), x.to(acc)
    if g is None:
        return (ya + xa).to(x.dtype)
    ga = expand_decay(g, x.dim()).to(acc)
    if ya.device.type != "cpu" or torch.compiler.is_compiling():  # no host synchronisation, no data-dependent branch
        ya = torch.where((ga == 0) & ~torch.isfinite(ya), 0.0, ya)
        return (ga * ya + xa).to(x.dtype)
    out = ga * ya + xa
    if bool(torch.isfinite(out.detach().sum())):  # every element finite (a sum over inf or NaN is not): usual
        return out.to(x.dtype)
    return torch.where(~torch.isfinite(out) & (ga == 0), ga * 0.0 + xa, out).to(x.dtype)


def scan_reference(
    xs: Sequence[torch.Tensor],
    gs: Optional[Sequence[Optional[torch.Tensor]]] = None,
    init: Optional[torch.Tensor] = None,
    *,
    reverse: bool = False,
    inclusive: bool = False,
    exact: bool = False,
) -> List[torch.Tensor]:
    """Every rank's result of ``allscan.scan`` for states ``xs[p]`` and decays ``gs[p]``."""
    P = len(xs)
    if P == 0:
        return []
    if gs is None:
        gs = [None] * P
    if len(gs) != P:
        raise ValueError(f"gs: expected {P} decays (one per rank), got {len(gs)}")
    return fold_chain(xs, lambda p, y, x: combine(gs[p], y, x), init, reverse=reverse, inclusive=inclusive,
                      exact=exact)


def fold_chain(
    xs: Sequence[torch.Tensor],
    step: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
    init: Optional[torch.Tensor] = None,
    *,
    reverse: bool = False,
    inclusive: bool = False,
    exact: bool = False,
) -> List[torch.Tensor]:
    """Every rank's result of the chain ``y_next = step(p, y, x_p)`` started from ``init`` (None:
    zeros), as every scan flavour's reference walks it: y entering rank p, or leaving it with
    ``inclusive``. ``exact=False`` stays in the storage dtype (``step`` rounds to it; the head without
    ``init`` passes its x on unchanged); ``exact=True`` gives ``step`` x_p and y in float64 and
    rounds nothing."""
    P = len(xs)
    order = range(P - 1, -1, -1) if reverse else range(P)
    out: List[Optional[torch.Tensor]] = [None] * P
    if exact:
        f64 = torch.float64
        y = torch.zeros_like(xs[0], dtype=f64) if init is None else init.to(f64)
        for p in order:
            nxt = step(p, y, xs[p].to(f64))
            out[p] = nxt if inclusive else y
            y = nxt
        return out  # type: ignore[return-value]
    y = None if init is None else init.clone()  # None: the chain head's zero state
    for p in order:
        x = xs[p]
        nxt = x.clone() if y is None else step(p, y, x)
        out[p] = nxt if inclusive else (torch.zeros_like(x) if y is None else y)
        y = nxt
    return out  # type: ignore[return-value]
