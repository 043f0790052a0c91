"""The chunked all-to-all on plain torch.distributed (any backend: gloo on CPU).

The path without NCCL and the correctness oracle of the C++ path: for disjoint head maps both give
bitwise the same result, and with summation both add in fp32 (fp64 for fp64) in rank order.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

SCATTER = 0
GATHER = 1

Range = Tuple[int, int]
HeadMap = List[Range]


def overlaps(hm: Sequence[Range]) -> bool:
    """Whether two non-empty ranges of a head map overlap (grouped-query attention's replicated heads)."""
    v = sorted((lo, hi) for lo, hi in hm if hi > lo)
    return any(v[i][0] < v[i - 1][1] for i in range(1, len(v)))


def prepare(direction: int, xs: Sequence[torch.Tensor], maps: Sequence[HeadMap], num_heads: Sequence[int],
            group, outs: Optional[Sequence[torch.Tensor]], accumulate: Sequence[bool]) -> Callable[[], List[torch.Tensor]]:
    """Everything of a scatter-heads (SCATTER) or gather-heads (GATHER) of checked arguments that
    allocates (the packed send buffer, the receive buffer, the outputs, the fp32 sums), done before the
    exchange; returns the exchange: one all_to_all_single for all tensors of the call (any backend),
    then only copies and adds into what was allocated here (on the CPU, torch still converts each
    bf16/fp16 piece it adds to the fp32 sums in a temporary). So a rank that runs out of memory in its
    all-to-all does so before it enters the collective, where its caller can still tell the peers."""
    P = dist.get_world_size(group)
    me = dist.get_rank(group)
    x0 = xs[0]
    B, _, _, D = x0.shape
    if direction == SCATTER:
        Sl = x0.shape[1]
        send = [[x[:, :, hm[p][0]:hm[p][1]].reshape(-1) for x, hm in zip(xs, maps)] for p in range(P)]
        recv_sizes = [sum(B * Sl * (hm[me][1] - hm[me][0]) * D for hm in maps) for _ in range(P)]
    else:
        Sl = x0.shape[1] // P
        send = [[y[:, p * Sl:(p + 1) * Sl].reshape(-1) for y in xs] for p in range(P)]
        recv_sizes = [sum(B * Sl * (hm[p][1] - hm[p][0]) * D for hm in maps) for p in range(P)]
    send_flat = [torch.cat(parts) if parts else x0.new_empty(0) for parts in send]
    send_sizes = [s.numel() for s in send_flat]
    inp = torch.cat(send_flat) if send_flat else x0.new_empty(0)
    del send, send_flat
    out_flat = x0.new_empty(sum(recv_sizes))
    if direction == SCATTER:
        results = [outs[t] if outs is not None else x.new_empty(B, P * Sl, hm[me][1] - hm[me][0], D)
                   for t, (x, hm) in enumerate(zip(xs, maps))]
        sums = []
    else:
        results = [outs[t] if outs is not None else x0.new_zeros(B, Sl, H, D) for t, H in enumerate(num_heads)]
        sums = [_sum_buffer(out, hm, acc) for out, hm, acc in zip(results, maps, accumulate)]

    def exchange() -> List[torch.Tensor]:
        if P > 1:
            dist.all_to_all_single(out_flat, inp, recv_sizes, send_sizes, group=group)
        else:
            out_flat.copy_(inp)
        pieces = list(out_flat.split(recv_sizes))
        offs = [0] * P
        if direction == SCATTER:
            for t, hm in enumerate(maps):
                n = hm[me][1] - hm[me][0]
                size = B * Sl * n * D
                for p in range(P):
                    piece = pieces[p][offs[p]:offs[p] + size].view(B, Sl, n, D)
                    offs[p] += size
                    results[t][:, p * Sl:(p + 1) * Sl].copy_(piece)
            return results
        for t, (hm, out) in enumerate(zip(maps, results)):
            got = []
            for p in range(P):
                n = hm[p][1] - hm[p][0]
                size = B * Sl * n * D
                got.append(pieces[p][offs[p]:offs[p] + size].view(B, Sl, n, D))
                offs[p] += size
            if sums[t] is None:
                for p in range(P):
                    lo, hi = hm[p]
                    if hi > lo:
                        out[:, :, lo:hi].copy_(got[p])
            elif sums[t] != ():
                acc, lo_all, runs = sums[t]
                if accumulate[t]:
                    acc.add_(out[:, :, lo_all:lo_all + acc.shape[2]])
                for p in range(P):
                    lo, hi = hm[p]
                    if hi > lo:
                        acc[:, :, lo - lo_all:hi - lo_all].add_(got[p])
                for a, b in runs:  # only the heads some rank sent (or all, when accumulating)
                    out[:, :, lo_all + a:lo_all + b].copy_(acc[:, :, a:b])
        return results

    return exchange


def _sum_buffer(out: torch.Tensor, hm: HeadMap, accumulate: bool):
    """For a gathered tensor whose pieces are summed (``accumulate``, or heads sent by several ranks):
    the fp32 (fp64) buffer over the heads any rank sends, its first head, and the runs of heads to write
    back (every head of the span when accumulating); ``()`` when no rank sends a head; None when the
    pieces are copied, not summed. Sums add in rank order, after ``out``'s own values."""
    if not (accumulate or overlaps(hm)):
        return None
    lo_all = min((lo for lo, hi in hm if hi > lo), default=0)
    hi_all = max((hi for lo, hi in hm if hi > lo), default=0)
    if hi_all <= lo_all:
        return ()
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    B, Sl, _, D = out.shape
    acc = torch.zeros(B, Sl, hi_all - lo_all, D, dtype=acc_dtype, device=out.device)
    covered = [accumulate] * (hi_all - lo_all)
    for lo, hi in hm:
        for h in range(lo, hi):
            covered[h - lo_all] = True
    runs, start = [], None
    for i, c in enumerate(covered + [False]):
        if c and start is None:
            start = i
        elif not c and start is not None:
            runs.append((start, i))
            start = None
    return acc, lo_all, runs

