"""The checks of one Ulysses call: its arguments (eager and traced alike), the fields every rank's
call must agree on, and packed sequences' bounds (``cu_seqlens``)."""
from __future__ import annotations

import operator
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..._contract import DTYPE_CODES, dtype_code

OP = "UlyssesAttention"  # the name errors and cross-rank checks give the op


def check_inputs(q, k, v, world):
    """``(B, S_local, Hq, Hkv, D)`` of q, k, v ``[B, S_local, H, D]`` (k, v: grouped-query heads) for a
    group of ``world`` ranks; TypeError or ValueError naming the argument otherwise."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"UlyssesAttention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"UlyssesAttention: {name} must be 4-D [B, S_local, H, D], got shape {tuple(t.shape)}")
        dtype_code(t.dtype, f"UlyssesAttention: {name}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"UlyssesAttention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"UlyssesAttention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"UlyssesAttention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Sl, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != Sl or k.shape[3] != D:
        raise ValueError(
            f"UlyssesAttention: k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch, local sequence and head_dim"
        )
    Hkv = k.shape[2]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"UlyssesAttention: the query heads ({Hq}) must be a multiple of the k/v heads ({Hkv}) (grouped-query attention)"
        )
    if Hq < world:
        raise ValueError(
            f"UlyssesAttention: needs at least one query head per rank: {Hq} query heads for a group of {world} ranks"
        )
    return B, Sl, Hq, Hkv, D


def signature(q, k, causal: bool, scale: Optional[float], num_chunks: int, needs_grad: bool,
              bounds: Optional[Tuple[int, ...]] = None, options: Optional["AttentionOptions"] = None):
    """The fields every rank's call must agree on (``num_chunks`` 0: "auto"), for ``check_across_ranks``;
    ``options``: the call's window, soft-cap and sinks (None: none of them)."""
    B, Sl, Hq, D = q.shape
    window, cap, sinks = (0, 0.0, 0) if options is None else (options.window or 0, options.softcap or 0.0,
                                                              int(options.sinks is not None))
    return [("batch B", B), ("local sequence length S_local", Sl), ("query heads", Hq), ("k/v heads", k.shape[2]),
            ("head_dim D", D), ("dtype", DTYPE_CODES[q.dtype]), ("causal", int(bool(causal))),
            ("scale (x1e9)", int(round((scale or 0.0) * 1e9))), ("num_chunks (0 auto)", int(num_chunks)),
            ("needs grad", int(needs_grad)),
            ("packed sequences (0: cu_seqlens None)", 0 if bounds is None else len(bounds) - 1),
            ("cu_seqlens checksum", 0 if bounds is None else zlib.crc32(repr(tuple(bounds)).encode())),
            ("sliding window (0: none)", window), ("soft-cap (x1e6, 0: none)", int(round(cap * 1e6))),
            ("sinks (1: given)", sinks)]


@dataclass(frozen=True)
class AttentionOptions:
    """A call's attention beyond plain causal SDPA, as checked (:func:`check_options`): ``window`` (a causal
    sliding window, tokens, shorter than the whole sequence; longer ones are None: they change nothing),
    ``softcap`` (a float > 0), ``sinks`` (a ``[Hq]`` tensor of sink logits)."""
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None

    @property
    def any(self) -> bool:
        return self.window is not None or self.softcap is not None or self.sinks is not None

    def as_kwargs(self) -> dict:
        """As :func:`allscan.ops.ulysses.ulysses_attention`'s keyword arguments."""
        return {"window": self.window, "softcap": self.softcap, "sinks": self.sinks}


def check_options(window, softcap, sinks, q: torch.Tensor, causal: bool, S: int) -> AttentionOptions:
    """``window``, ``softcap`` and ``sinks`` of a call on q ``[B, S_local, Hq, D]`` over a whole sequence of
    ``S`` tokens, checked: TypeError or ValueError naming the argument otherwise."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{OP}: window must be a positive int (tokens each query sees, itself included) or "
                             f"None, got {window!r}")
        if not causal:
            raise ValueError(f"{OP}: a sliding window needs causal=True (token i sees keys i - window < j <= i)")
        if window >= S:
            window = None  # the whole causal sequence: no window
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
            raise ValueError(f"{OP}: softcap must be a positive finite number or None, got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"{OP}: sinks must be a torch.Tensor of one logit per query head, got "
                            f"{type(sinks).__name__}")
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[2] or not sinks.dtype.is_floating_point:
            raise ValueError(f"{OP}: sinks must be a 1-D floating tensor of {q.shape[2]} logits (one per query "
                             f"head), got {sinks.dtype} of shape {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"{OP}: sinks must be on q's device {q.device}, got {sinks.device}")
    return AttentionOptions(window=window, softcap=softcap, sinks=sinks)


def refuse_packed_while_tracing(op: str) -> None:
    """Packed sequences while torch.compile traces: the bounds are read on the host and would specialise
    the graph, so such a call is left to eager (a graph break; ``fullgraph=True`` raises this)."""
    raise NotImplementedError(f"{op}: packed sequences (cu_seqlens) under torch.compile are not traced (the bounds "
                              "are read on the host); without fullgraph=True the call runs eagerly")


def packed_bounds(cu_seqlens, B: int, S: int, op: str = OP) -> Optional[Tuple[int, ...]]:
    """``cu_seqlens`` (a 1-D integer tensor or sequence, the packed sequences' offsets in the whole
    sequence of ``S`` tokens, the same on every rank) as a tuple of ints, checked (a tensor on a GPU is
    read once: a device synchronisation); None stays None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        bounds = tuple(int(b) for b in cu_seqlens.tolist())
    else:
        try:
            if any(isinstance(b, bool) for b in cu_seqlens):
                raise TypeError
            bounds = tuple(operator.index(b) for b in cu_seqlens)  # ints, NumPy's included
        except TypeError:
            raise ValueError(f"{op}: cu_seqlens must hold integers, got {cu_seqlens!r}") from None
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch size must be 1 (the sequences packed in one row), got {B}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != S or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to the whole sequence's length {S} (the local length "
                         f"times the group size), got {list(bounds)}")
    return bounds
