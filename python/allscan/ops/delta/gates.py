"""What fla's delta-rule kernels apply to their inputs before the recurrence, in torch ops (so autograd
differentiates them, ``A_log`` and ``dt_bias`` included): the q/k l2 normalisation and the gate
activations of ``chunk_gated_delta_rule`` / ``chunk_kda`` (fla-core 0.6.0's formulas)."""
from __future__ import annotations

import struct
from dataclasses import dataclass
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


@dataclass(frozen=True)
class DeltaOptions:
    """The input options of fla's ``chunk_gated_delta_rule`` (``per_key=False``) and ``chunk_kda``
    (``per_key=True``), as the user gave them: fla's kernels apply them inside, the torch backend with
    :func:`activate`."""

    per_key: bool
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    A_log: Optional[torch.Tensor] = None
    dt_bias: Optional[torch.Tensor] = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    safe_gate: bool = False
    lower_bound: Optional[float] = None

    def flags(self) -> int:
        """The boolean options as one integer (for the cross-rank signature)."""
        return (int(bool(self.use_qk_l2norm_in_kernel)) | int(bool(self.use_gate_in_kernel)) << 1
                | int(bool(self.use_beta_sigmoid_in_kernel)) << 2 | int(bool(self.allow_neg_eigval)) << 3
                | int(bool(self.safe_gate)) << 4)

    def lower_bound_bits(self) -> int:
        """``lower_bound`` as the bits of its float64 (-1, a NaN's, for None): ranks gating with different
        bounds would compute another sequence's states, so the signature compares it exactly."""
        if self.lower_bound is None:
            return -1
        return struct.unpack("<q", struct.pack("<d", float(self.lower_bound)))[0]


def activate(opts: DeltaOptions, q, k, g, beta, HV: int, dt: torch.dtype):
    """What fla's kernels apply before the recurrence, in torch ops in the compute dtype ``dt``; q and k
    repeated over grouped value heads, g ``[B, T, HV, 1 or K]``."""
    q, k, g, beta = (t.to(dt) for t in (q, k, g, beta))
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if opts.use_beta_sigmoid_in_kernel:
        beta = beta_gate(beta, opts.allow_neg_eigval)
    if opts.use_gate_in_kernel:
        g = (kda_gate(g, opts.A_log, opts.dt_bias, opts.lower_bound) if opts.per_key
             else gdn_gate(g, opts.A_log, opts.dt_bias))
    H = q.shape[2]
    if HV != H:  # grouped values: HV / H value heads share each q/k head
        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    return q, k, (g if opts.per_key else g.unsqueeze(-1)), beta
