"""Probe: the state gradient Q'^T do of the delta layers' backward (fold_in.fold_state_grad, a Triton kernel
with a sum of per-split partials) against one cuBLAS batched GEMM with fp32 output (torch.bmm(...,
out_dtype=torch.float32) on strided views, no copy asked). GPU time (CUDA events, 50 calls back to back),
host time per call (median of 5 x 200), error against float64, bitwise repeatability. bf16, B = 1, H = 16,
K = V = 128."""
import statistics
import sys
import time

import torch

from allscan.ops.delta.fold_in import fold_state_grad


def bmm_state_grad(q_eff, do):
    B, T, H, K = q_eff.shape
    assert B == 1
    return torch.bmm(q_eff[0].permute(1, 2, 0), do[0].permute(1, 0, 2), out_dtype=torch.float32).view(1, H, K, -1)


def gpu_ms(f, n=50):
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


def host_us(f, n=200, rounds=5):
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


torch.manual_seed(0)
for T in [int(t) for t in sys.argv[1:]] or [8192, 16384]:
    q = torch.randn(1, T, 16, 128, device="cuda").to(torch.bfloat16)
    d = torch.randn(1, T, 16, 128, device="cuda").to(torch.bfloat16)
    ref = torch.einsum("bthk,bthv->bhkv", q.double(), d.double())
    for name, f in (("triton fold_state_grad", fold_state_grad), ("cuBLAS bmm out_dtype=fp32", bmm_state_grad)):
        y = f(q, d)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        same = torch.equal(y, f(q, d))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f(q, d)
            torch.cuda.synchronize()
        kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        print(f"T={T} {name}: gpu {gpu_ms(lambda: f(q, d)) * 1e3:.1f} us, host {host_us(lambda: f(q, d)):.1f} us, "
              f"rel err {err:.2e}, repeatable {same}, kernels {kernels}", flush=True)
