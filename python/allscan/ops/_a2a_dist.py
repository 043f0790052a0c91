"""The chunked all-to-all on plain torch.distributed (any backend: gloo on CPU).

The path without NCCL and the correctness oracle of the C++ path: for disjoint head maps both give
bitwise the same result, and with summation both add in fp32 (fp64 for fp64) in rank order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

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


def all_to_all(direction: int, xs: Sequence[torch.Tensor], maps: Sequence[HeadMap], num_heads: Sequence[int],
               group, outs: Optional[Sequence[torch.Tensor]], accumulate: Sequence[bool]) -> List[torch.Tensor]:
    """Scatter-heads (SCATTER) or gather-heads (GATHER) of checked arguments with one
    all_to_all_single for all tensors of the call (any backend)."""
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
    out_flat = x0.new_empty(sum(recv_sizes))
    if P > 1:
        dist.all_to_all_single(out_flat, inp, recv_sizes, send_sizes, group=group)
    else:
        out_flat.copy_(inp)
    pieces = list(out_flat.split(recv_sizes))
    results = []
    if direction == SCATTER:
        for t, (x, hm) in enumerate(zip(xs, maps)):
            n = hm[me][1] - hm[me][0]
            out = outs[t] if outs is not None else x.new_empty(B, P * Sl, n, D)
            results.append(out)
        offs = [0] * P
        for t, hm in enumerate(maps):
            n = hm[me][1] - hm[me][0]
            size = B * Sl * n * D
            for p in range(P):
                piece = pieces[p][offs[p]:offs[p] + size].view(B, Sl, n, D)
                offs[p] += size
                results[t][:, p * Sl:(p + 1) * Sl].copy_(piece)
        return results
    offs = [0] * P
    for t, (hm, H) in enumerate(zip(maps, num_heads)):
        out = outs[t] if outs is not None else x0.new_zeros(B, Sl, H, D)
        got = []
        for p in range(P):
            n = hm[p][1] - hm[p][0]
            size = B * Sl * n * D
            got.append(pieces[p][offs[p]:offs[p] + size].view(B, Sl, n, D))
            offs[p] += size
        if accumulate[t] or overlaps(hm):
            acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
            lo_all = min((lo for lo, hi in hm if hi > lo), default=0)
            hi_all = max((hi for lo, hi in hm if hi > lo), default=0)
            if hi_all > lo_all:
                acc = torch.zeros(B, Sl, hi_all - lo_all, D, dtype=acc_dtype, device=out.device)
                covered = torch.zeros(hi_all - lo_all, dtype=torch.bool)
                if accumulate[t]:
                    acc += out[:, :, lo_all:hi_all].to(acc_dtype)
                    covered[:] = True
                for p in range(P):
                    lo, hi = hm[p]
                    if hi > lo:
                        acc[:, :, lo - lo_all:hi - lo_all] += got[p].to(acc_dtype)
                        covered[lo - lo_all:hi - lo_all] = True
                idx = covered.nonzero().flatten()
                if idx.numel() == hi_all - lo_all:
                    out[:, :, lo_all:hi_all] = acc.to(out.dtype)
                else:
                    idx_dev = idx.to(out.device)
                    out.index_copy_(2, idx_dev + lo_all, acc.index_select(2, idx_dev).to(out.dtype))
        else:
            for p in range(P):
                lo, hi = hm[p]
                if hi > lo:
                    out[:, :, lo:hi].copy_(got[p])
        results.append(out)
    return results
