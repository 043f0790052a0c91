"""The chunked all-to-all's argument checks (:mod:`allscan.ops.a2a`): the tensors, the head maps, one
call's cross-rank signature fields. Each error names the argument and what was expected."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .._dtypes import DTYPE_CODES, dtype_code
from ._a2a_dist import GATHER, SCATTER, HeadMap, Range
from ._a2a_maps import split_heads

__all__ = ["check_tensor", "check_head_map", "signature_fields", "validate_call", "resolve_head_map"]


def check_tensor(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"allscan.a2a: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"allscan.a2a: {name} must be 4-D [B, S, H, D], got shape {tuple(x.shape)}")
    dtype_code(x.dtype, f"allscan.a2a: {name}")


def check_head_map(head_map: Sequence[Range], num_heads: int, world_size: int, name: str) -> HeadMap:
    hm = [(int(lo), int(hi)) for lo, hi in head_map]
    if len(hm) != world_size:
        raise ValueError(f"allscan.a2a: {name} must have one (lo, hi) range per rank ({world_size}), got {len(hm)}")
    for r, (lo, hi) in enumerate(hm):
        if lo < 0 or hi < lo or hi > num_heads:
            raise ValueError(
                f"allscan.a2a: {name}[{r}] = ({lo}, {hi}) is not a head range of [0, {num_heads}) "
                "(need 0 <= lo <= hi <= H)"
            )
    return hm


def signature_fields(direction: int, xs: Sequence[torch.Tensor], maps: Sequence[HeadMap], num_heads: Sequence[int],
               accumulate: Sequence[bool]) -> List[tuple]:
    x0 = xs[0]
    B, S, _, D = x0.shape
    if direction == GATHER:
        S_name = "sequence length (whole) S"
    else:
        S_name = "local sequence length S_local"
    fields = [("direction", direction), ("number of tensors", len(xs)), ("batch B", B), (S_name, S), ("head_dim D", D),
              ("dtype", DTYPE_CODES[x0.dtype])]
    for t, (hm, H, acc) in enumerate(zip(maps, num_heads, accumulate)):
        h = 0
        for lo, hi in hm:
            h = (h * 1000003 + lo * 7919 + hi) % (1 << 61)
        fields += [(f"tensors[{t}] num_heads", H), (f"tensors[{t}] head map (hash)", h),
                   (f"tensors[{t}] accumulate", int(acc))]
    return fields


def validate_call(direction: int, xs: Sequence[torch.Tensor], maps, num_heads, world_size: int, rank: int,
              names: Sequence[str]) -> Tuple[int, int, int, List[HeadMap]]:
    if not 1 <= len(xs) <= 4:
        raise ValueError(f"allscan.a2a: between 1 and 4 tensors per call, got {len(xs)}")
    if len(maps) != len(xs) or len(num_heads) != len(xs):
        raise ValueError("allscan.a2a: one head map and one num_heads per tensor")
    for x, n in zip(xs, names):
        check_tensor(x, n)
    x0 = xs[0]
    for x, n in zip(xs[1:], names[1:]):
        if x.dtype != x0.dtype:
            raise TypeError(f"allscan.a2a: {n} has dtype {x.dtype}, {names[0]} has {x0.dtype}; one dtype per call")
        if x.device != x0.device:
            raise ValueError(f"allscan.a2a: {n} is on {x.device}, {names[0]} on {x0.device}; one device per call")
        if x.shape[0] != x0.shape[0] or x.shape[1] != x0.shape[1] or x.shape[3] != x0.shape[3]:
            raise ValueError(
                f"allscan.a2a: {n} has shape {tuple(x.shape)}, {names[0]} {tuple(x0.shape)}; B, S and D must agree"
            )
    B, S, _, D = x0.shape
    out_maps = []
    for t, (x, hm, H, n) in enumerate(zip(xs, maps, num_heads, names)):
        hm = check_head_map(hm, H, world_size, f"head map of {n}")
        out_maps.append(hm)
        if direction == SCATTER:
            if x.shape[2] != H:
                raise ValueError(f"allscan.a2a: {n} has {x.shape[2]} heads, its head map is over {H}")
        else:
            lo, hi = hm[rank]
            if x.shape[2] != hi - lo:
                raise ValueError(
                    f"allscan.a2a: {n} must hold this rank's {hi - lo} heads [{lo}, {hi}) (dim 2), got {x.shape[2]}"
                )
            if S % world_size != 0:
                raise ValueError(
                    f"allscan.a2a: {n} must hold the whole sequence, a multiple of the group size {world_size}; "
                    f"got S = {S}"
                )
    return B, S, D, out_maps


def resolve_head_map(head_map, head_range, num_heads: int, world_size: int) -> HeadMap:
    if head_map is not None and head_range is not None:
        raise ValueError("allscan.a2a: pass head_map or head_range, not both")
    if head_map is not None:
        return [(int(lo), int(hi)) for lo, hi in head_map]
    h0, h1 = head_range if head_range is not None else (0, num_heads)
    if not 0 <= h0 <= h1 <= num_heads:
        raise ValueError(f"allscan.a2a: head_range must satisfy 0 <= h0 <= h1 <= H ({num_heads}), got ({h0}, {h1})")
    return split_heads(h0, h1, world_size)
