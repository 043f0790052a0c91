"""What fla's delta-rule kernels apply to their inputs before the recurrence, in torch ops (so autograd
differentiates them, ``A_log`` and ``dt_bias`` included): the q/k l2 normalisation and the gate
activations of ``chunk_gated_delta_rule`` / ``chunk_kda`` (fla-core 0.6.0's formulas)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # fla's l2norm_fwd: x / sqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def beta_gate(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """``use_beta_sigmoid_in_kernel``: sigmoid(beta), or 2 sigmoid(beta) (eigenvalues down to -1)."""
    return torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Gated DeltaNet's ``use_gate_in_kernel``: ``-exp(A_log) * softplus(g + dt_bias)``, g ``[B, T, HV]``."""
    if dt_bias is not None:
        g = g + dt_bias
    return -A_log.exp() * F.softplus(g)


def kda_gate(g: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
             lower_bound: Optional[float]) -> torch.Tensor:
    """KDA's ``use_gate_in_kernel`` on g ``[B, T, HV, K]``: ``-exp(A_log) * softplus(g + dt_bias)``, or with
    ``lower_bound``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (A_log optional there)."""
    HV, K = g.shape[-2:]
    if dt_bias is not None:
        g = g + dt_bias.view(HV, K)
    a = None if A_log is None else A_log.view(HV, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(g)
    return lower_bound * torch.sigmoid(g if a is None else a * g)
