"""The attention of one rank after Ulysses' all-to-all when it is more than plain causal SDPA: a sliding
window, a logit soft-cap, attention sinks. Ulysses holds the whole sequence for a subset of heads there, so
these per-head operations are exact:

- sliding window ``w`` (causal): token i sees keys j with ``i - w < j <= i`` (transformers'
  ``sliding_window_overlay``; ``w`` tokens, itself included), never across a packed sequence's start;
- soft-cap ``c``: the scaled scores become ``c * tanh(scores / c)`` before the mask (Gemma 2);
- sinks: one learned logit per head in the softmax denominator and no value (GPT-OSS), so
  ``o = softmax([scores, sink])[:-1] @ v``; on the kernel path ``o * sigmoid(lse - sink)``.

Two paths, the same function: the math path (scores materialised, ``[B, n, S, S]``: exact, any device and
dtype; what runs on CPU) and, on CUDA in fp16 / bf16 / fp32 with a head dim FlexAttention tiles (a power of
two, at least 16), torch's compiled FlexAttention (window and packing as a ``mask_mod``, the soft-cap as a
``score_mod``, the log-sum-exp for the sinks), whose block masks are cached per call options.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

__all__ = ["MaskSpec", "masked_attention", "flex_ok"]


@dataclass(frozen=True)
class MaskSpec:
    """What the local attention of a call needs besides q, k, v and the sinks: ``scale`` (None: ``D ** -0.5``),
    ``causal``, ``window`` (tokens, or None), ``softcap`` (or None), ``bounds`` (packed sequences' offsets in
    the whole sequence, or None: one sequence)."""
    scale: Optional[float]
    causal: bool = True
    window: Optional[int] = None
    softcap: Optional[float] = None
    bounds: Optional[Tuple[int, ...]] = None


_FLEX = None  # the compiled flex_attention (compiled on first use)
_BLOCK_MASKS: Dict[tuple, object] = {}  # (spec's mask fields, S, device) -> BlockMask
_MAX_BLOCK_MASKS = 64


def flex_ok(q: torch.Tensor) -> bool:
    """Whether the FlexAttention path runs for q ``[B, S, n, D]``: CUDA, fp16/bf16/fp32, D a power of two >= 16."""
    D = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and D >= 16
            and D & (D - 1) == 0)


def _allowed(spec: MaskSpec, S: int, device) -> Optional[torch.Tensor]:
    """``[S, S]`` bool, True where query i may see key j (None: everywhere)."""
    i = torch.arange(S, device=device)
    ok = None

    def both(a, b):
        return b if a is None else a & b

    if spec.causal:
        ok = both(ok, i[None, :] <= i[:, None])
    if spec.window is not None:
        ok = both(ok, i[None, :] > i[:, None] - spec.window)
    if spec.bounds is not None:
        seg = _segments(spec.bounds, S, device)
        ok = both(ok, seg[None, :] == seg[:, None])
    return ok


def _segments(bounds, S: int, device) -> torch.Tensor:
    """The packed sequence each of the S tokens belongs to."""
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=S)


def _math(spec: MaskSpec, q, k, v, sinks):
    dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k.to(dtype)) * scale
    if spec.softcap is not None:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    ok = _allowed(spec, q.shape[1], q.device)
    if ok is not None:  # the diagonal is always allowed: no row is empty
        s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        B, n, S, _ = s.shape
        s = torch.cat([s, sinks.to(dtype).view(1, n, 1, 1).expand(B, n, S, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v.to(dtype)).to(q.dtype)


def _block_mask(spec: MaskSpec, S: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (spec.causal, spec.window, spec.bounds, S, str(device))
    bm = _BLOCK_MASKS.get(key)
    if bm is not None:
        return bm
    causal, window = spec.causal, spec.window
    seg = None if spec.bounds is None else _segments(spec.bounds, S, device)

    def mask_mod(b, h, qi, kj):
        ok = qi >= 0
        if causal:
            ok = ok & (kj <= qi)
        if window is not None:
            ok = ok & (kj > qi - window)
        if seg is not None:
            ok = ok & (seg[qi] == seg[kj])
        return ok

    bm = create_block_mask(mask_mod, None, None, S, S, device=device)
    if len(_BLOCK_MASKS) >= _MAX_BLOCK_MASKS:
        _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
    _BLOCK_MASKS[key] = bm
    return bm


def _flex(spec: MaskSpec, q, k, v, sinks):
    global _FLEX
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    cap = spec.softcap
    score_mod = None
    if cap is not None:
        def score_mod(score, b, h, qi, kj):
            return torch.tanh(score / cap) * cap
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, n, S, D]
    bm = _block_mask(spec, q.shape[2], q.device)
    if sinks is None:
        o = _FLEX(q, k, v, score_mod=score_mod, block_mask=bm, scale=spec.scale)
    else:
        o, aux = _FLEX(q, k, v, score_mod=score_mod, block_mask=bm, scale=spec.scale,
                       return_aux=AuxRequest(lse=True))
        # the sink's share of the denominator: o * Z / (Z + e^sink) = o * sigmoid(lse - sink)
        keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
        o = (o.float() * keep.unsqueeze(-1)).to(q.dtype)
    return o.transpose(1, 2)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                     sinks: Optional[torch.Tensor] = None, *, kernel: str = "auto") -> torch.Tensor:
    """Attention of ``[B, S, n, D]`` q, k, v (k, v with as many heads as q) under ``spec`` (a window, a
    soft-cap, packed bounds), with ``sinks`` (``[n]``, one logit per head, or None) -> ``[B, S, n, D]``.
    ``kernel``: "auto" (FlexAttention where :func:`flex_ok`, else the math path), "math" or "flex"."""
    if kernel not in ("auto", "math", "flex"):
        raise ValueError(f"masked_attention: kernel must be 'auto', 'math' or 'flex', got {kernel!r}")
    if kernel == "flex" or (kernel == "auto" and flex_ok(q)):
        return _flex(spec, q, k, v, sinks)
    return _math(spec, q, k, v, sinks)
