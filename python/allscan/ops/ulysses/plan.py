"""The plan of one Ulysses call: the head maps of each chunk (rank-major, see
:func:`allscan.ops.chunk_head_ranges`), the local k/v index of grouped-query attention, and the
attention of a chunk (SDPA, one call per packed sequence; with a sliding window, a soft-cap or sinks,
:func:`.masked.masked_attention`)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..a2a import chunk_head_ranges, kv_head_ranges, split_heads
from .masked import MaskSpec, masked_attention


class Chunk:
    """One head chunk of a plan: its query and k/v head maps over the ranks, this rank's heads in it, and
    (grouped-query attention) the local k/v head each local query head uses."""

    __slots__ = ("q_map", "kv_map", "q_lo", "q_hi", "kv_lo", "kv_hi", "kv_index", "new_map", "done_map", "_idx")

    def __init__(self, q_map, kv_map, me, q_per_kv):
        self.q_map = q_map
        self.kv_map = kv_map
        self.q_lo, self.q_hi = q_map[me]
        self.kv_lo, self.kv_hi = kv_map[me]
        self.kv_index = None
        if q_per_kv > 1 and self.q_hi > self.q_lo:
            # local query head i uses local k/v head (q_lo + i) // g - kv_lo
            self.kv_index = [(h // q_per_kv) - self.kv_lo for h in range(self.q_lo, self.q_hi)]
        # k/v heads this chunk brings to each rank (first use) and whose gradients it sends back
        # (last use); with grouped-query attention consecutive chunks of a rank may share a k/v head,
        # which then moves once each way. Filled in by ChunkPlan.
        self.new_map = kv_map
        self.done_map = kv_map
        self._idx = {}

    def index(self, device, offset=0):
        """kv_index (+ offset) as a tensor on device, cached (no host-to-device copy per call)."""
        key = (str(device), offset)
        t = self._idx.get(key)
        if t is None:
            t = torch.tensor([j + offset for j in self.kv_index], dtype=torch.long, device=device)
            self._idx[key] = t
        return t

    @property
    def nq(self):
        return self.q_hi - self.q_lo

    @property
    def nkv(self):
        return self.kv_hi - self.kv_lo


def _first_last_maps(chunks, world):
    """new_map[c][r]: the k/v heads of rank r first used by chunk c; done_map: last used."""
    for r in range(world):
        first: Dict[int, int] = {}
        last: Dict[int, int] = {}
        for c, ch in enumerate(chunks):
            lo, hi = ch.kv_map[r]
            for h in range(lo, hi):
                first.setdefault(h, c)
                last[h] = c
        for c, ch in enumerate(chunks):
            for attr, table in (("new_map", first), ("done_map", last)):
                heads = [h for h, cc in table.items() if cc == c]
                rng = (min(heads), max(heads) + 1) if heads else (ch.kv_map[r][0], ch.kv_map[r][0])
                assert not heads or rng[1] - rng[0] == len(heads)
                m = list(getattr(ch, attr))
                m[r] = rng
                setattr(ch, attr, m)


@dataclass(frozen=True)
class CallSpec:
    """What a plan is made from: the group and this rank's place in it, the shapes of q ``[B, Sl, Hq,
    D]`` and k, v ``[B, Sl, Hkv, D]``, and the attention's options (``bounds``: packed sequences'
    global bounds, a tuple of ints, or None: one sequence; ``window``: a causal sliding window of that
    many tokens, shorter than the whole sequence, or None; ``softcap``: a logit soft-cap or None;
    ``sinks``: whether the call passes one sink logit per query head)."""
    group: Any
    world: int
    me: int
    B: int
    Sl: int
    Hq: int
    Hkv: int
    D: int
    causal: bool
    scale: Optional[float]
    bounds: Optional[Tuple[int, ...]] = None
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False

    @property
    def masked(self) -> bool:
        """Whether the attention is more than plain SDPA (a window, a soft-cap, sinks)."""
        return self.window is not None or self.softcap is not None or self.sinks


class ChunkPlan:
    """The plan of one call: ``spec`` cut into ``num_chunks`` head chunks (sized by ``weights``, or
    equal); the spec's fields are attributes too (read on every call)."""

    def __init__(self, spec: CallSpec, num_chunks: int, weights: Optional[Sequence[float]] = None):
        self.spec = spec
        group, world, me, Hq, Hkv = spec.group, spec.world, spec.me, spec.Hq, spec.Hkv
        causal, scale, bounds = spec.causal, spec.scale, spec.bounds
        self.group, self.world, self.me = group, world, me
        self.B, self.Sl, self.Hq, self.Hkv, self.D = spec.B, spec.Sl, Hq, Hkv, spec.D
        self.q_per_kv = Hq // Hkv
        self.causal, self.scale = causal, scale
        self.bounds = bounds
        # what the all-to-alls' in-band signature carries besides their shapes (a2a_multi)
        options = (bool(causal), scale, bounds, num_chunks, weights)
        if spec.masked:  # the plain call's signature stays what it was
            options += (spec.window, spec.softcap, spec.sinks)
        self.call_signature = zlib.crc32(repr(options).encode()) or 1
        self.mask = MaskSpec(scale=scale, causal=bool(causal), window=spec.window, softcap=spec.softcap,
                             bounds=bounds) if spec.masked else None
        q_maps = chunk_head_ranges(Hq, world, num_chunks, weights)
        chunks = []
        for qm in q_maps:
            if all(hi <= lo for lo, hi in qm):
                continue  # no rank has a head in this chunk
            chunks.append(Chunk(qm, kv_head_ranges(qm, self.q_per_kv), me, self.q_per_kv))
        self.chunks = chunks
        # this rank's k/v heads over all chunks
        self.kv_lo, self.kv_hi = kv_head_ranges(split_heads(0, Hq, world), self.q_per_kv)[me]
        # Grouped-query attention: a k/v head is moved once to each rank that needs it, and its
        # gradient is accumulated on that rank in fp32 over the chunks that use it, then summed over
        # the ranks that hold it (gather-heads with accumulation: ranks may finish it in different chunks).
        self.kv_accumulate = self.q_per_kv > 1
        if self.kv_accumulate:
            _first_last_maps(chunks, world)


def kv_for_chunk(ch: "Chunk", pieces):
    """The chunk's k/v heads [kv_lo, kv_hi) from the pieces received so far [(lo, hi, k, v)]."""
    parts_k, parts_v = [], []
    for lo, hi, k, v in pieces:
        a, b = max(lo, ch.kv_lo), min(hi, ch.kv_hi)
        if a < b:
            if a == lo and b == hi and ch.kv_lo == lo and ch.kv_hi == hi:
                return k, v
            parts_k.append(k[:, :, a - lo:b - lo])
            parts_v.append(v[:, :, a - lo:b - lo])
    return torch.cat(parts_k, 2), torch.cat(parts_v, 2)


def expand_kv(ch: Chunk, k: torch.Tensor, v: torch.Tensor):
    """Grouped-query attention: the chunk's k/v heads repeated for each local query head."""
    if ch.kv_index is None:
        return k, v
    idx = ch.index(k.device)
    return k.index_select(2, idx), v.index_select(2, idx)


def sdpa(plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on [B, S, n, D] tensors (k, v already expanded) -> [B, S, n, D] contiguous; with packed
    sequences, one SDPA per sequence (no token attends across a sequence's bounds)."""
    if plan.bounds is None:
        return _sdpa_one(plan, q, k, v).contiguous()
    pairs = [(a, b) for a, b in zip(plan.bounds[:-1], plan.bounds[1:]) if b > a]
    return torch.cat([_sdpa_one(plan, q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in pairs], 1)


def _sdpa_one(plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=plan.causal, scale=plan.scale)
    return o.transpose(1, 2)


def chunk_attention(plan: ChunkPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A chunk's attention on [B, S, n, D] tensors (k, v already expanded; ``sinks``: the chunk's ``[n]`` sink
    logits, where the call has sinks): SDPA, or the masked attention where the plan has a window, a
    soft-cap or sinks."""
    if plan.mask is None:
        return sdpa(plan, q, k, v)
    return masked_attention(q, k, v, plan.mask, sinks).contiguous()


def attend_chunk(plan: ChunkPlan, ch: Chunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    k, v = expand_kv(ch, k, v)
    return chunk_attention(plan, q, k, v, None if sinks is None else sinks[ch.q_lo:ch.q_hi])
