"""head_outputs' tiles and the S_in split at 16K tokens (GDN, KDA): time (CUDA events) and the error of o
and Q' against float64 (the fold test's reference), side by side with fla's output kernel on V columns."""
import sys, os
import torch
import triton
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_fold_in import head_outputs_reference
from allscan.ops.delta import fold_in as F
from allscan.ops.delta.fla import _fns

T = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
H, K, V, C, dev, bf = 16, 128, 128, 64, "cuda", torch.bfloat16
NT = T // C
torch.manual_seed(0)
q = (torch.randn(1, T, H, K, device=dev) * K ** -0.5).to(bf)
k = (torch.randn(1, T, H, K, device=dev) * K ** -0.5).to(bf)
vw = torch.randn(1, T, H, V + K, device=dev).to(bf)
hw = torch.randn(1, NT, H, K, V + K, device=dev).to(bf)
S = 3 * torch.randn(1, H, K, V, device=dev)
g = (-0.1 * torch.rand(1, NT, C, H, device=dev)).cumsum(2).view(1, T, H).contiguous()
gk = (-0.1 * torch.rand(1, NT, C, H, K, device=dev)).cumsum(2).view(1, T, H, K).contiguous()
A = torch.randn(1, T, H, C, device=dev).to(bf)
fla = _fns()
v, h = vw[..., :V].contiguous(), hw[..., :V].contiguous()


def launch(per_key, BK, BV, BC, warps, stages, split):
    o = torch.empty(1, T, H, V, dtype=bf, device=dev)
    qe = torch.empty(1, T, H, K, dtype=bf, device=dev)
    grid = (triton.cdiv(V, BV) * NT, H)
    F._head_outputs[grid](q, q if per_key else k, vw, hw, gk if per_key else g, A if per_key else g, S, o, qe, T,
                          K ** -0.5, H=H, HV=H, K=K, V=V, BT=C, BK=BK, BV=BV, BC=BC, ONE_PASS=BC >= K,
                          PER_KEY=per_key, SPLIT=split, IEEE=False, num_warps=warps, num_stages=stages)
    return o, qe


def ms(f, n=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


# the reference on the first 1024 tokens (float64 on the GPU)
Tr = 1024
refs = {}
for per_key in (sys.argv[2] == "kda",):
    sl = lambda x: x[:, :Tr].cpu()
    refs[per_key] = head_outputs_reference(sl(q), sl(k), sl(vw), hw[:, :Tr // C].cpu(), sl(gk if per_key else g),
                                           sl(A) if per_key else None, S.cpu(), K ** -0.5, bf)
for per_key in (sys.argv[2] == "kda",):
    name = "kda" if per_key else "gdn"
    ideal = (lambda: fla.chunk_gla_fwd_o_gk(q=q, v=v, g=gk, A=A, h=h, scale=K ** -0.5, chunk_size=C)) if per_key \
        else (lambda: fla.chunk_fwd_o(q=q, k=k, v=v, h=h, g=g, scale=K ** -0.5, chunk_size=C))
    print(f"{name} T={T}: fla output kernel on V columns {ms(ideal):.3f} ms", flush=True)
    for cfg in [(64, 128, 64, 4, 2, True), (64, 128, 64, 4, 2, 2), (64, 128, 128, 4, 2, True),
                (64, 128, 128, 8, 2, True), (64, 128, 128, 8, 2, 2), (64, 128, 128, 4, 2, 2),
                (64, 128, 64, 8, 2, True), (64, 128, 128, 8, 3, True),
                (64, 64, 128, 4, 2, True), (64, 128, 64, 4, 3, True), (64, 128, 64, 4, 1, True),
                (128, 128, 128, 8, 2, True)]:
        try:
            o, qe = launch(per_key, *cfg)
            ro, rq = refs[per_key]
            eo, eq = rms(o[:, :Tr].cpu(), ro), rms(qe[:, :Tr].cpu(), rq)
            t1 = ms(lambda: launch(per_key, *cfg))
            t2 = ms(lambda: launch(per_key, *cfg))
            print(f"{name} BK,BV,BC,warps,stages,split={cfg}: {t1:.3f} {t2:.3f} ms; rms err o {eo:.3e} Q' {eq:.3e}",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} {cfg}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            break
