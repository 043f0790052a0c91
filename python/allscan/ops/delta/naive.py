"""Token-by-token delta rule in float64: the reference the chunked kernels and the sequence-parallel
ops are tested against (flash-linear-attention's ``naive_recurrent_gated_delta_rule`` and
``naive_recurrent_kda`` conventions)."""
from __future__ import annotations

import torch


def recurrent_delta_rule_reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """The gated delta rule one token at a time, in float64::

        S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

    (the decay first, then the delta update, as fla). q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``
    (HV a multiple of H: grouped values, q and k shared by HV / H value heads); beta: ``[B, T, HV]``;
    g: natural-log decays, ``[B, T, HV]`` (Gated DeltaNet, one per head) or ``[B, T, HV, K]`` (KDA, one
    per key dimension); q, k, g, beta already activated (no l2norm or gate inside). With
    ``cu_seqlens`` (B = 1) every sequence restarts from ``initial_state[i]`` (or zeros) and the final
    states are ``[N, HV, K, V]``. Returns ``(o float64 [B, T, HV, V], final_states float64)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.double().repeat_interleave(HV // H, dim=2) for x in (q, k))
    v, beta = v.double(), beta.double()
    g = g.double()
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(B, T, HV, K)
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    finals = []
    for i in range(len(bounds) - 1):
        rows = B if cu_seqlens is None else 1
        if initial_state is None:
            S = torch.zeros(rows, HV, K, V, dtype=torch.float64, device=q.device)
        else:
            S = initial_state[i:i + 1].double() if cu_seqlens is not None else initial_state.double()
        for t in range(bounds[i], bounds[i + 1]):
            kt = k[:, t]
            S = S * g[:, t].exp().unsqueeze(-1)
            delta = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
            S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
        finals.append(S)
    return o, torch.cat(finals, 0)
