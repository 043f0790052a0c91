"""Rotary position embeddings at given positions: fla's ``RotaryEmbedding`` (0.6.x; the GPT-NeoX halves,
fp32 positions) in torch ops. A shard's rotary needs its tokens' positions in the whole sequence, which
fla's module (positions from 0, or a cache offset) cannot be told; the arithmetic is fla's: the angles in
fp32, cos and sin rounded to the inputs' dtype, the rotation in fp32, the result in the inputs' dtype
(fp64 inputs: all of it in fp64, as allscan's other layers keep fp64)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """``forward(q, k, positions)``: q ``[B, T, H, D]`` and k ``[B, T, H_k, D]`` rotated at ``positions``
    (``[T]``, integers); the buffer ``inv_freq`` is fla's (non-persistent)."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", torch.empty(dim // 2, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def _compute_inv_freq(self, device=None, dtype=torch.float32) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=dtype) / self.dim))

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(self._compute_inv_freq(self.inv_freq.device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``(cos, sin)`` ``[T, D / 2]`` in the arithmetic's dtype (fp32, or fp64 for fp64 inputs), rounded
        through ``dtype`` as fla's cached tables are."""
        acc = torch.promote_types(dtype, torch.float32)
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32 or acc != torch.float32:
            # a model cast to another dtype casts this buffer too: fla recomputes it in fp32 (fp64 here)
            inv_freq = self._compute_inv_freq(inv_freq.device, acc)
        angles = torch.outer(positions.to(device=inv_freq.device, dtype=acc), inv_freq)
        return torch.cos(angles).to(dtype).to(acc), torch.sin(angles).to(dtype).to(acc)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]  # over the heads
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half].to(cos.dtype), x[..., half:].to(cos.dtype)
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).to(x.dtype)
