"""Session scratch (issue 17): what the widened forward's extra steps could cost.

1. fla's WY values then [u | 0] (today) against fla's kkt+solve kernel and one kernel writing w and [u | 0].
2. head_outputs variants: today; the fold with S_in's bf16 part only; no fold (a floor); 8 warps.

    python3 scratch/forward_pieces.py [T ...]     (GDN, bf16, H = 16, K = V = 128)
"""
import importlib.util
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "python")
from allscan.ops.gla.fla import limit_fla_autotune  # noqa: E402

limit_fla_autotune("one")
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h  # noqa: E402
from fla.ops.common.chunk_o import chunk_fwd_o  # noqa: E402
from fla.ops.gated_delta_rule import chunk_fwd as CF  # noqa: E402
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402
from fla.ops.utils.constant import RCP_LN2  # noqa: E402

from allscan.ops.delta import fold_in  # noqa: E402
from allscan.ops.delta.widen import widened  # noqa: E402

dev = torch.device("cuda", 0)


def timed(fn, reps=25):
    fn(); fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


@triton.jit
def _wy_wide(k, v, beta, A, g, w, u, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             W: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = (i_bh // HV).to(tl.int64), (i_bh % HV).to(tl.int64)
    i_h = i_hv // (HV // H)
    bos = i_b * T
    t = i_t * BT + tl.arange(0, BT)
    m_t = t < T
    rows = (bos + t).to(tl.int64)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0.0)
    cols = tl.arange(0, BT)
    b_A = tl.load(A + (rows * HV + i_hv)[:, None] * BT + cols[None, :], mask=m_t[:, None], other=0.0)
    for i_v in range(tl.cdiv(V, BV)):
        vv = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (vv[None, :] < V)
        b_v = tl.load(v + (rows * HV + i_hv)[:, None] * V + vv[None, :], mask=m, other=0.0)
        b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
        b_u = tl.dot(b_A, b_vb, allow_tf32=False)
        tl.store(u + (rows * HV + i_hv)[:, None] * W + vv[None, :], b_u.to(u.dtype.element_ty), mask=m)
    for i_z in range(tl.cdiv(W - V, BV)):
        zz = V + i_z * BV + tl.arange(0, BV)
        m = m_t[:, None] & (zz[None, :] < W)
        tl.store(u + (rows * HV + i_hv)[:, None] * W + zz[None, :], tl.zeros([BT, BV], dtype=u.dtype.element_ty), mask=m)
    b_g = tl.math.exp2(tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0))
    for i_k in range(tl.cdiv(K, BK)):
        kk = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (kk[None, :] < K)
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + kk[None, :], mask=m, other=0.0)
        b_kb = b_k * b_b[:, None]
        b_kb *= b_g[:, None]
        b_w = tl.dot(b_A, b_kb.to(b_k.dtype))
        tl.store(w + (rows * HV + i_hv)[:, None] * K + kk[None, :], b_w.to(w.dtype.element_ty), mask=m)


def wy_wide(k, v, beta, A, g_cum, warps, stages):
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = k.new_empty(B, T, HV, K)
    u = v.new_empty(B, T, HV, V + K)
    _wy_wide[(triton.cdiv(T, 64), B * HV)](k, v, beta, A, g_cum, w, u, T, H=H, HV=HV, K=K, V=V, W=V + K, BT=64,
                                           BK=64, BV=64, num_warps=warps, num_stages=stages)
    return w, u


def kkt_solve(k, g_cum, beta):
    B, T, H, K = k.shape
    HV = beta.shape[2]
    A = torch.zeros(B, T, HV, 64, device=k.device, dtype=k.dtype)
    CF.chunk_gated_delta_rule_fwd_kkt_solve_kernel[(triton.cdiv(T, 64), B * HV)](
        k=k, g=g_cum, beta=beta, A=A, cu_seqlens=None, chunk_indices=None, T=T, H=H, HV=HV, K=K, BT=64, BC=16)
    return A


def variant(name, edits):
    src = open(fold_in.__file__).read()
    for a, b in edits:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = f"/tmp/fold_in_{name}.py"
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"fold_in_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HI_ONLY = ("        return tl.dot(a, hi) + tl.dot(a, lo)", "        return tl.dot(a, hi)")
NO_FOLD = ("        b_o += _dot_state(b_qe, _tile(s, cc, vv, K, V, V, 1), SPLIT)", "        pass")
WARPS8 = ("num_warps=4, num_stages=3", "num_warps=8, num_stages=3")


def run(T, H=16, K=128, V=128):
    torch.manual_seed(0)
    bf = torch.bfloat16
    q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf)
    k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, H, V, device=dev).to(bf)
    beta = torch.rand(1, T, H, device=dev).to(bf)
    g = F.logsigmoid(torch.randn(1, T, H, device=dev)) / 16
    g_cum = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
    w, u, A = CF.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=64)
    A2 = kkt_solve(k, g_cum, beta)
    print(f"\nGDN T={T}: |A(kkt_solve by hand) - A(fla)| = {(A2.float() - A.float()).abs().max().item():.2e}")
    for warps, stages in ((4, 2), (4, 3), (8, 2), (2, 2)):
        w2, u2 = wy_wide(k, v, beta, A, g_cum, warps, stages)
        torch.cuda.synchronize()
        eq_u = torch.equal(u2, widened(u, V + K))
        print(f"  wy_wide w{warps}s{stages}: w equal {torch.equal(w2, w)} (max {(w2.float() - w.float()).abs().max().item():.2e}),"
              f" [u|0] equal {eq_u} (max {(u2.float() - widened(u, V + K).float()).abs().max().item():.2e});"
              f" {timed(lambda: wy_wide(k, v, beta, A, g_cum, warps, stages)):8.1f} us", flush=True)
    rows = [("fla intra (kkt_solve + w, u)", lambda: CF.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta,
                                                                                         chunk_size=64)),
            ("fla recompute_w_u", lambda: recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g_cum)),
            ("widen [u | 0]", lambda: widened(u, V + K)),
            ("kkt_solve by hand", lambda: kkt_solve(k, g_cum, beta))]
    for name, fn in rows:
        print(f"  {name:44s} {timed(fn):8.1f} us", flush=True)

    eye = torch.zeros(1, H, K, V + K, device=dev)
    eye[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1)
    h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=widened(u, V + K), g=g_cum, initial_state=eye,
                                               output_final_state=True, chunk_size=64)
    S = torch.randn(1, H, K, V, device=dev) / 4
    scale = K ** -0.5
    o_ref, qe_ref = fold_in.head_outputs(q, k, v_new, h, g_cum, None, S, scale)
    hv = h[..., :V].contiguous()
    vn = v_new[..., :V].contiguous()
    print(f"  {'fla chunk_fwd_o, V columns (ideal)':44s} "
          f"{timed(lambda: chunk_fwd_o(q=q, k=k, v=vn, h=hv, g=g_cum, scale=scale, chunk_size=64)):8.1f} us")
    print(f"  {'fla chunk_fwd_o, V + K columns':44s} "
          f"{timed(lambda: chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, chunk_size=64)):8.1f} us")
    for name, edits in (("today", []), ("hi_only", [HI_ONLY]), ("no_fold", [NO_FOLD]), ("warps8", [WARPS8])):
        mod = variant(name, edits)
        o, qe = mod.head_outputs(q, k, v_new, h, g_cum, None, S, scale)
        torch.cuda.synchronize()
        d = (o.float() - o_ref.float()).abs().max().item()
        print(f"  head_outputs {name:31s} {timed(lambda: mod.head_outputs(q, k, v_new, h, g_cum, None, S, scale)):8.1f} us"
              f"  (max |o - today's| {d:.2e}, Q' equal {torch.equal(qe, qe_ref)})", flush=True)


if __name__ == "__main__":
    for T in [int(a) for a in sys.argv[1:]] or [16384, 8192]:
        run(T)
