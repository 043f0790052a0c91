"""Token-by-token gated linear attention in float64: the reference the chunked kernels are tested against."""
from __future__ import annotations

import torch


def recurrent_gla_reference(q, k, v, g=None, scale=None, initial_state=None, cu_seqlens=None):
    """GLA one token at a time, ``h_t = exp(g_t) * h_{t-1} + k_t v_t^T``, ``o_t = scale * q_t h_t``, in float64.

    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` (GLA), ``[B, T, H]`` (simple GLA)
    or None (linear attention). With ``cu_seqlens`` (B = 1): every sequence starts from
    ``initial_state[i]`` (or zeros), and the final states are ``[N, H, K, V]``.
    Returns ``(o float64, final_states float64)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.double() for x in (q, k, v))
    if g is None:
        g = torch.zeros(B, T, H, K, dtype=torch.float64, device=q.device)
    elif g.dim() == 3:
        g = g.double().unsqueeze(-1).expand(B, T, H, K)
    g = g.double()
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    o = torch.zeros(B, T, H, V, dtype=torch.float64, device=q.device)
    finals = []
    for i in range(len(bounds) - 1):
        if initial_state is None:
            h = torch.zeros(B if cu_seqlens is None else 1, H, K, V, dtype=torch.float64, device=q.device)
        elif cu_seqlens is None:
            h = initial_state.double().clone()
        else:
            h = initial_state[i:i + 1].double().clone()
        for t in range(bounds[i], bounds[i + 1]):
            h = h * g[:, t].exp().unsqueeze(-1) + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, h)
        finals.append(h)
    return o, torch.cat(finals, 0)
