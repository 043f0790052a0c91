"""The matrix All-Scan on plain torch.distributed (any backend: gloo on CPU).

The path for users without GPUs and the oracle of the NCCL path: the same three methods, the same
block partition (:func:`matrix_blocks`, equal to the core's ``allscanMatrixBlocks``) and the same
arithmetic (:func:`allscan.ops._matrix_math.combine`) as the C++ core.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._matrix_math import combine
from ._scan_dist import effective_blocks, global_rank

__all__ = ["matrix_blocks", "scan"]


def matrix_blocks(batch: int, k: int, v: int, num_blocks: int) -> List[Tuple[int, int, int, int]]:
    """The pipeline's blocks as (first batch entry, entries, first column, columns): whole batch
    entries while there are at least as many as blocks wanted, else every entry's v columns split
    into ceil(num_blocks / batch) ranges (as the core's allscanMatrixBlocks)."""
    want = max(1, num_blocks)
    if batch == 0 or v == 0 or k == 0:
        return []
    if want <= batch:
        bb = -(-batch // want)
        return [(b0, min(bb, batch - b0), 0, v) for b0 in range(0, batch, bb)]
    splits = min(-(-want // batch), v)
    vcw = -(-v // splits)
    return [(b, 1, c0, min(vcw, v - c0)) for b in range(batch) for c0 in range(0, v, vcw)]


def scan(x: torch.Tensor, m: torch.Tensor, init: Optional[torch.Tensor], group, reverse: bool, inclusive: bool,
         transpose: bool, num_blocks: int, method: str) -> torch.Tensor:
    """The matrix All-Scan of contiguous ``x`` [batch, K, V] with transitions ``m`` [batch, K, K]."""
    staged = x.is_cuda  # e.g. a gloo group with CUDA tensors: go through the host
    if staged:
        dev = x.device
        x, m = x.cpu(), m.cpu()
        init = None if init is None else init.cpu()
    y = _scan_host(x, m, init, group, reverse, inclusive, transpose, num_blocks, method)
    return y.to(dev) if staged else y


def _scan_host(x, m, init, group, reverse, inclusive, transpose, num_blocks, method):
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    head = P - 1 if reverse else 0
    if P == 1:
        if inclusive:
            return x.clone() if init is None else combine(m, init, x, transpose)
        return torch.zeros_like(x) if init is None else init.clone()

    if method == "allgather":
        return _allgather(x, m, init, group, P, r, head, reverse, inclusive, transpose)

    has_next = r > 0 if reverse else r < P - 1
    nxt = global_rank(group, r - 1 if reverse else r + 1) if has_next else None
    batch, k, v = x.shape
    K = effective_blocks(group, x.numel(), x.element_size(), num_blocks, method)
    blocks = matrix_blocks(batch, k, v, K)
    sends = []

    if r == head:
        s = x if init is None else combine(m, init, x, transpose)
        for b0, nb, c0, vc in blocks:
            sends.append(dist.isend(s[b0:b0 + nb, :, c0:c0 + vc].contiguous(), nxt, group=group))
        for req in sends:
            req.wait()
        if inclusive:
            return s.clone() if s is x else s
        return torch.zeros_like(x) if init is None else init.clone()

    prev = global_rank(group, r + 1 if reverse else r - 1)
    y = torch.empty_like(x)
    for b0, nb, c0, vc in blocks:
        recv = torch.empty((nb, k, vc), dtype=x.dtype)
        dist.recv(recv, prev, group=group)
        if not inclusive:
            y[b0:b0 + nb, :, c0:c0 + vc] = recv
        if has_next or inclusive:
            out = combine(m[b0:b0 + nb], recv, x[b0:b0 + nb, :, c0:c0 + vc], transpose)
            if inclusive:
                y[b0:b0 + nb, :, c0:c0 + vc] = out
            if has_next:
                sends.append(dist.isend(out.contiguous(), nxt, group=group))
    for req in sends:
        req.wait()
    return y


def _allgather(x, m, init, group, P, r, head, reverse, inclusive, transpose):
    """fla's context-parallel pattern: all-gather every rank's x and M, fold the predecessors."""
    if init is not None:
        init = init.clone()  # read on the chain head only, as in the other methods: take the head's
        dist.broadcast(init, src=global_rank(group, head), group=group)
    xs = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(xs, x, group=group)
    ms = [torch.empty_like(m) for _ in range(P)]
    dist.all_gather(ms, m, group=group)
    order = range(P - 1, r - (1 if inclusive else 0), -1) if reverse else range(0, r + (1 if inclusive else 0))
    y = init
    for q in order:
        y = xs[q].clone() if y is None else combine(ms[q], y, xs[q], transpose)
    if y is None:
        return torch.zeros_like(x)
    return y.clone() if y is init else y
