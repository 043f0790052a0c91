"""Softmax attention with fla's parameters, sequence-parallel by Ulysses: the attention layers of fla's
hybrid models (Gated DeltaNet or KDA layers with some softmax attention layers between them).

:class:`Attention` has the parameter names, shapes and defaults of flash-linear-attention 0.6.x's
``fla.layers.Attention`` (q, k, v and output projections, grouped-query heads, optional q/k norms, rotary
embeddings), so its state_dict loads. On a shard of the sequence it rotates q and k at their global
positions (the shard's offset in the whole sequence, restarting at each packed sequence's start), and
its attention is :func:`allscan.ops.ulysses.ulysses_attention`, causal: what fla's layer computes (with
flash-attn) on the whole sequence, in its arithmetic (fp64 inputs stay fp64 throughout, as in allscan's
other layers, where fla's rotary kernel would compute in fp32).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from allscan.context import SequenceContext
from allscan.ops import own_work
from allscan.ops.batch_context import context_conflict, context_group
from allscan.ops.ulysses import packed_bounds, refuse_packed_while_tracing, ulysses_attention

from ._inputs import check_layer_inputs
from .norms import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention"]


class Attention(nn.Module):
    """fla's ``Attention`` layer (0.6.x), sequence-parallel over ``group`` (None: the default process group;
    ``allscan.ops.LOCAL``: one process), attention by Ulysses with ``num_chunks`` head chunks (as
    :class:`allscan.layers.UlyssesAttention` takes it). ``forward(hidden_states, ...)`` takes this rank's
    contiguous shard ``[B, T_local, hidden_size]`` (the same T_local on every rank) and returns
    ``(o, None, None)`` as fla's layer does; packed sequences (``cu_seqlens``: offsets in the whole sequence,
    the same on every rank, B = 1) as fla's layer takes them, each attended on its own with its rotary
    positions from its start (under torch.compile such a call runs eagerly: a graph break). Not supported:
    ``window_size`` (sliding windows), padding masks, caches."""

    def __init__(self, hidden_size: int = 2048, num_heads: int = 32, num_kv_heads: Optional[int] = None,
                 qkv_bias: bool = False, qk_norm: bool = False, window_size: Optional[int] = None,
                 rope_theta: float = 10000.0, max_position_embeddings: Optional[int] = None,
                 layer_idx: Optional[int] = None, *, group=None, num_chunks: Union[int, str] = "auto"):
        super().__init__()
        name = type(self).__name__
        if window_size is not None:
            raise NotImplementedError(f"{name}: window_size={window_size} (sliding-window attention) is not supported "
                                      "sequence-parallel; only full causal attention (window_size=None)")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{name}: num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if hidden_size % num_heads:
            raise ValueError(f"{name}: hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
        if rope_theta is None:
            raise ValueError(f"{name}: rope_theta must be a positive number (fla's layer always applies rotary "
                             "embeddings), got None")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.kv_dim = num_kv_heads * self.head_dim
        self.qkv_bias, self.qk_norm, self.window_size = qkv_bias, qk_norm, window_size
        self.rope_theta, self.max_position_embeddings = rope_theta, max_position_embeddings
        self.layer_idx = layer_idx
        self.group, self.num_chunks = group, num_chunks

        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, self.kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, self.kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, dtype=torch.float32)
            self.k_norm = RMSNorm(self.head_dim, dtype=torch.float32)
        self.rotary = RotaryEmbedding(self.head_dim, base=rope_theta)

    def _rotated_qkv(self, hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, rank, world):
        """The input checks, then q, k (rotated at their global positions) and v, ``[B, T_local, heads, D]``,
        and the packed sequences' bounds (None: one sequence per row)."""
        name = type(self).__name__
        check_layer_inputs(name, hidden_states, self.hidden_size, attention_mask, past_key_values, use_cache)
        B, T, _ = hidden_states.shape
        bounds = packed_bounds(cu_seqlens, B, T * world, name)
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, _positions(rank * T, T, bounds, hidden_states.device))
        return q, k, v, bounds

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values=None,
                output_attentions: bool = False, use_cache: bool = False, cu_seqlens=None, context=None, **kwargs):
        """``context``: the batch's :class:`allscan.SequenceContext` (its group and packed offsets), instead of
        ``cu_seqlens`` (and of the layer's ``group``, which must then be None or the context's)."""
        name = type(self).__name__
        conflict = context_conflict(context, self.group, cu_seqlens, name)
        if conflict is None and context is not None:
            cu_seqlens = context.offsets(hidden_states.device)
        if cu_seqlens is not None and torch.compiler.is_compiling():
            refuse_packed_while_tracing(name)
        pg = context_group(context, self.group, name)
        rank, world = (0, 1) if pg is None else (torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg))

        def project():
            if conflict is not None:
                raise conflict
            return self._rotated_qkv(hidden_states, attention_mask, past_key_values, use_cache, cu_seqlens, rank,
                                     world)

        # before Ulysses' first collective: if it raises, the peers waiting there are told (packed calls:
        # in the check Ulysses then makes on every call)
        # as Ulysses checks next: every call when packed by the caller's cu_seqlens (a context's were agreed once)
        given = isinstance(context, SequenceContext)
        every_call = cu_seqlens is not None and not given
        q, k, v, bounds = own_work(pg, name, "its projections", project, every_call=every_call)
        if pg is None:
            o = _causal_attention(q, k, v, bounds)
        else:
            packing = dict(context=context) if given else dict(cu_seqlens=bounds)
            o = ulysses_attention(q, k, v, pg, causal=True, num_chunks=self.num_chunks, **packing)
        B, T = hidden_states.shape[:2]
        return self.o_proj(o.reshape(B, T, self.hidden_size)), None, None

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"num_chunks={self.num_chunks!r}")


def _positions(offset: int, T: int, bounds, device) -> torch.Tensor:
    """The rotary positions of global tokens ``offset .. offset + T - 1``: from each packed sequence's start."""
    pos = torch.arange(offset, offset + T, device=device)
    if bounds is None:
        return pos
    cu = torch.tensor(bounds, dtype=torch.long).to(device, non_blocking=True)
    return pos - cu[torch.searchsorted(cu, pos, right=True) - 1]


def _causal_attention(q, k, v, bounds):
    """One process: causal SDPA over ``[B, T, H, D]`` (k, v heads repeated for grouped queries), each
    packed sequence on its own."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    bounds = bounds or (0, q.shape[1])
    parts = [F.scaled_dot_product_attention(q[:, a:b].transpose(1, 2), k[:, a:b].transpose(1, 2),
                                            v[:, a:b].transpose(1, 2), is_causal=True).transpose(1, 2)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts, 1)
