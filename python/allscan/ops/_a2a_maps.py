"""Head maps of the chunked all-to-all (:mod:`allscan.ops.a2a`): which heads each rank holds on the
head-sharded side. A head map is the list of the ``P`` ranges ``(lo_r, hi_r)``, one per rank."""
from __future__ import annotations

from typing import List, Optional, Sequence

from ._a2a_dist import HeadMap, Range

__all__ = ["split_heads", "kv_head_ranges", "chunk_head_ranges"]


def split_heads(h0: int, h1: int, world_size: int) -> HeadMap:
    """The uneven split of heads ``[h0, h1)``: rank r gets ``n // P`` heads, the first ``n % P`` ranks one more."""
    if world_size < 1:
        raise ValueError(f"split_heads: world_size must be >= 1, got {world_size}")
    if h0 < 0 or h1 < h0:
        raise ValueError(f"split_heads: need 0 <= h0 <= h1, got [{h0}, {h1})")
    n = h1 - h0
    q, rem = divmod(n, world_size)
    out = []
    for r in range(world_size):
        lo = h0 + r * q + min(r, rem)
        out.append((lo, lo + q + (1 if r < rem else 0)))
    return out


def kv_head_ranges(q_ranges: Sequence[Range], q_per_kv: int) -> HeadMap:
    """The k/v heads each rank needs for its query heads (query head h uses k/v head ``h // q_per_kv``).

    Ranks whose query heads use the same k/v head both get it (replication when there are fewer
    k/v heads than ranks); an empty query range gives an empty k/v range.
    """
    if q_per_kv < 1:
        raise ValueError(f"kv_head_ranges: q_per_kv must be >= 1, got {q_per_kv}")
    out = []
    for lo, hi in q_ranges:
        if hi <= lo:
            out.append((lo // q_per_kv, lo // q_per_kv))
        else:
            out.append((lo // q_per_kv, (hi - 1) // q_per_kv + 1))
    return out


def _split_counts(n: int, weights: Sequence[float]) -> List[int]:
    """n items into len(weights) parts proportional to weights (largest remainder, stable)."""
    total = float(sum(weights))
    raw = [n * w / total for w in weights]
    base = [int(x) for x in raw]
    rest = n - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    return base


def chunk_head_ranges(num_heads: int, world_size: int, num_chunks: int,
                      weights: Optional[Sequence[float]] = None) -> List[HeadMap]:
    """Head maps of ``num_chunks`` chunks, rank-major: rank r's heads of the whole split
    (``split_heads(0, num_heads, P)[r]``) are cut into ``num_chunks`` consecutive pieces (equal, or
    proportional to ``weights``), so each chunk keeps every rank's share balanced and the union over
    chunks is the unchunked head map. Returns ``maps[c][r] = (lo, hi)``."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    whole = split_heads(0, num_heads, world_size)
    w = list(weights) if weights is not None else [1.0] * num_chunks
    if len(w) != num_chunks:
        raise ValueError(f"weights must have num_chunks ({num_chunks}) entries, got {len(w)}")
    maps: List[HeadMap] = [[] for _ in range(num_chunks)]
    for lo, hi in whole:
        counts = _split_counts(hi - lo, w)
        start = lo
        for c in range(num_chunks):
            maps[c].append((start, start + counts[c]))
            start += counts[c]
    return maps
