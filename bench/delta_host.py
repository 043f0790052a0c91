"""Host time of sequence-parallel Gated DeltaNet on ONE GPU, a middle rank stood in (issue 14).

    torchrun --nproc-per-node 1 bench/delta_host.py [T_local]      # fla-core and tilelang (Hopper) needed

``zeco_gated_delta_rule`` runs what a middle rank of a longer chain runs (its shard continues the
sequence: the widened fla call, the matrix All-Scan issued async with gradients, the fold-in), with
the scan over the one-rank group (no transfer). Beside it ``ideal`` (fla's chunk_gated_delta_rule on the
shard) and ``wide`` (the widened fla call alone: zeco's local part). Prints the host's issue time of
the forward and the backward (us, no synchronisation inside) and the eager time per fwd+bwd (CUDA
events, 10 calls, best of 4), then cProfile tables (us per fwd+bwd) of wide and zeco.
B = 1, H = 16, K = V = 128, bf16, T_local 8192 by default.
"""
import cProfile
import pstats
import sys
import time

import torch
import torch.distributed as dist
torch.cuda.set_device(0); dev = torch.device("cuda", 0)
dist.init_process_group("nccl", device_id=dev)
from allscan.layers import zeco_gated_delta_rule
from allscan.ops.delta.fla import widened_call, fla_kernel
from allscan.ops.delta.gates import DeltaOptions
from allscan.ops.gla import limit_fla_autotune
import allscan.ops.delta.zeco as dz
limit_fla_autotune("one")
Base = dz.ShardSegments
class Mid(Base):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw); self.world, self.rank, self.continued = 2, 1, True
dz.ShardSegments = Mid
T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
H, K, V, B = 16, 128, 128, 1
dtype = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(1)
q = torch.randn(B, T, H, K, device=dev, generator=gen, dtype=dtype)
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1).to(dtype)
v = torch.randn(B, T, H, V, device=dev, generator=gen, dtype=dtype)
g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen)).float()
beta = torch.rand(B, T, H, device=dev, generator=gen).to(dtype)
ins = [t.requires_grad_(True) for t in (q, k, v, g, beta)]
do = torch.randn(B, T, H, V, device=dev, generator=gen, dtype=dtype)
fn, kw = fla_kernel(DeltaOptions(per_key=False))
def fwd(name):
    if name == "ideal":
        o, _ = fn(q, k, v, g, beta, **kw); return (o,), (do,)
    if name == "wide":
        o, qe, h, M = widened_call(fn, kw, q, k, v, g, beta, K ** -0.5, None)
        return (o, qe, h, M), (do, torch.ones_like(qe), torch.ones_like(h), torch.ones_like(M))
    o, _ = zeco_gated_delta_rule(q, k, v, g, beta); return (o,), (do,)
def fb(name):
    outs, gs = fwd(name); torch.autograd.grad(outs, ins, gs)
t0 = time.time()
for n in ("ideal", "wide", "zeco"):
    for _ in range(2):
        fb(n)
    torch.cuda.synchronize(); print(f"{n} warm {time.time()-t0:.0f}s", flush=True)
N = 10
for n in ("ideal", "wide", "zeco"):
    best = None
    for rep in range(4):
        tf = tb = 0.0
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); e0.record()
        for _ in range(N):
            a = time.perf_counter(); outs, gs = fwd(n); b = time.perf_counter()
            torch.autograd.grad(outs, ins, gs); c = time.perf_counter()
            tf += b - a; tb += c - b
        e1.record(); torch.cuda.synchronize()
        cand = (tf / N * 1e6, tb / N * 1e6, e0.elapsed_time(e1) / N)
        best = cand if best is None or cand[2] < best[2] else best
    print(f"{n}: host fwd {best[0]:.0f} us bwd {best[1]:.0f} us total {best[0]+best[1]:.0f} us; eager {best[2]:.3f} ms", flush=True)
for n in ("wide", "zeco"):
    pr = cProfile.Profile(); torch.cuda.synchronize(); pr.enable()
    for _ in range(N):
        fb(n)
    pr.disable(); torch.cuda.synchronize()
    rows = []
    for (f, l, fnm), (cc, nc, tt, ct, callers) in pstats.Stats(pr).stats.items():
        rows.append((ct / N * 1e6, tt / N * 1e6, nc / N, f"{f.split('site-packages/')[-1].split('python/')[-1]}:{l}({fnm})"))
    rows.sort(reverse=True)
    print(f"--- {n}: cProfile us per fwd+bwd: cumulative, own, calls, function", flush=True)
    for r in rows[:90]:
        print(f"{r[0]:9.1f} {r[1]:8.1f} {r[2]:6.1f}  {r[3]}")
dist.destroy_process_group()
