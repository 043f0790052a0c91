"""The norms of fla's layers in torch ops (``RMSNorm``, ``FusedRMSNormGated``), shared by the layers that
load fla's state_dicts: 16-bit inputs are normalised in fp32, fp64 stays fp64. ``reset_parameters`` sets the
weight to ones, as fla's modules do (fla's models call it when they initialise their weights)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RMSNorm", "RMSNormGated", "gate_activation"]


def gate_activation(name):
    if name in ("swish", "silu"):
        return F.silu
    if name == "sigmoid":
        return torch.sigmoid
    raise NotImplementedError(f"gate activation {name!r} is not supported (swish, silu, sigmoid)")


class RMSNormGated(nn.Module):
    """fla's ``FusedRMSNormGated``: ``rmsnorm(x) * weight * act(g)`` (parameter ``weight`` only)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, activation="swish"):
        super().__init__()
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None
        self._act = gate_activation(activation)

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x, g):
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit inputs, fp64 stays fp64
        y = F.rms_norm(x.to(acc), (self.hidden_size,), None if self.weight is None else self.weight.to(acc), self.eps)
        return (y * self._act(g.to(acc))).to(x.dtype)


class RMSNorm(nn.Module):
    """fla's ``RMSNorm`` (``weight``; ``bias`` only if asked)."""

    def __init__(self, hidden_size, elementwise_affine=True, eps=1e-5, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if elementwise_affine else None

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x):
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit inputs, fp64 stays fp64
        w = None if self.weight is None else self.weight.to(acc)
        return F.rms_norm(x.to(acc), (self.hidden_size,), w, self.eps).to(x.dtype)
