"""Session scratch (issue 17): the first segment's states widened in one fla call (today) against fla's
state kernel twice, V columns on the calling stream and the K transition columns beside it.

    python3 scratch/split_states.py [T ...]     (GDN and KDA, bf16, H = 16, K = V = 128)
"""
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "python")
from allscan.ops.gla.fla import limit_fla_autotune  # noqa: E402

limit_fla_autotune("one")
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h  # noqa: E402
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra  # noqa: E402
from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402
from fla.ops.utils.constant import RCP_LN2  # noqa: E402

from allscan.ops.delta.widen import widened  # noqa: E402

dev = torch.device("cuda", 0)
side = torch.cuda.Stream(device=dev)
H = K = V = None


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


def run(T, kind, H=16, K=128, V=128):
    torch.manual_seed(0)
    bf = torch.bfloat16
    q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf)
    k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, H, V, device=dev).to(bf)
    beta = torch.rand(1, T, H, device=dev).to(bf)
    if kind == "gdn":
        g = F.logsigmoid(torch.randn(1, T, H, device=dev)) / 16
        g_cum = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=64)
        kk, gkw = k, dict(g=g_cum)
    else:
        g = F.logsigmoid(torch.randn(1, T, H, K, device=dev)) / 16
        g_cum = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=g_cum, beta=beta, scale=K ** -0.5,
                                                    chunk_size=64)
        kk, gkw = kg, dict(gk=g_cum)
    eye = torch.eye(K, device=dev).expand(1, H, K, K).contiguous()
    wide0 = torch.zeros(1, H, K, V + K, device=dev)
    wide0[..., V:].diagonal(dim1=-2, dim2=-1).fill_(1)
    zeros = torch.zeros(1, T, H, K, device=dev, dtype=bf)

    def fwd_h(uu, h0):
        return chunk_gated_delta_rule_fwd_h(k=kk, w=w, u=uu, initial_state=h0, output_final_state=True,
                                            chunk_size=64, **gkw)

    def widened_today():
        return fwd_h(widened(u, V + K), wide0)

    def v_only():
        return fwd_h(u, None)

    def k_only_prezeroed():
        return fwd_h(zeros, eye)

    def zero_fill():
        return torch.zeros(1, T, H, K, device=dev, dtype=bf)

    def split(prezeroed):
        def f():
            main = torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                z = zeros if prezeroed else torch.zeros(1, T, H, K, device=dev, dtype=bf)
                r = fwd_h(z, eye)
            out = fwd_h(u, None)
            main.wait_stream(side)
            for t in r:
                t.record_stream(main)
            return out, r
        return f

    # check: the split gives what the widened call gives, column block by column block
    hw, vw, fw = widened_today()
    (hv, vv, fv), (hk, vk, fk) = split(False)()
    torch.cuda.synchronize()
    errs = [(hw[..., :V] - hv).abs().max().item(), (hw[..., V:] - hk).abs().max().item(),
            (vw[..., V:] - vk).abs().max().item(), (fw[..., V:] - fk).abs().max().item(),
            (fw[..., :V] - fv).abs().max().item()]
    rows = [("widen [u | 0] alone", lambda: widened(u, V + K)),
            ("fla state, widened (today, without widen)", lambda: fwd_h(widened_u, wide0)),
            ("widen + fla state widened (today)", widened_today),
            ("fla state, V columns (ideal)", v_only),
            ("fla state, K columns, zeros made", k_only_prezeroed),
            ("zero fill [T, H, K]", zero_fill),
            ("split beside, zeros made before", split(True)),
            ("split beside, zeros inside", split(False))]
    widened_u = widened(u, V + K)
    print(f"\n{kind} T={T}: max |split - widened|: h {errs[0]:.2e}, P {errs[1]:.2e}, "
          f"v'_K {errs[2]:.2e}, M {errs[3]:.2e}, final {errs[4]:.2e}", flush=True)
    for name, fn in rows:
        print(f"  {name:44s} {timed(fn):8.1f} us", flush=True)


if __name__ == "__main__":
    Ts = [int(a) for a in sys.argv[1:]] or [16384, 8192]
    for T in Ts:
        for kind in ("gdn", "kda"):
            run(T, kind)
