#!/usr/bin/env python3
"""The delta-rule layers' widened output step on one GPU, side by side (CUDA events around 20 calls, twice):

- ``ideal``: fla's output kernel on the V columns (what fla runs for a shard alone: the floor);
- ``widened``: fla's output kernel on the V + K widened columns (``[o_local | Q']``, what the layers ran
  before allscan's kernel; the fold of ``S_in`` and the copy of ``Q'`` came after it, one more pass);
- ``allscan``: :func:`allscan.ops.delta.fold_in.head_outputs`, the same math with ``S_in`` folded in
  and ``Q'`` written apart, one pass.

Gated DeltaNet (``chunk_fwd_o``) and KDA (``chunk_gla_fwd_o_gk``), B = 1, bf16, random operands of the
layers' shapes (the kernels' time does not depend on the values). Then the host's issue time of
``head_outputs`` (median of 5 rounds of 200 calls).

    python3 bench/head_output_time.py [--tokens 16384] [--heads 16] [--dim 128]
"""
import argparse
import statistics
import time

import torch

from allscan.ops.delta.fla_imports import fla_functions
from allscan.ops.delta.fold_in import head_outputs

C = 64


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


def host_us(f, n=200, rounds=5):
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    T, H, K = args.tokens, args.heads, args.dim
    V, NT, dev, bf = K, -(-T // C), "cuda", torch.bfloat16
    fla = fla_functions()
    q = torch.randn(1, T, H, K, device=dev, dtype=bf) * K ** -0.5
    k = torch.randn(1, T, H, K, device=dev, dtype=bf) * K ** -0.5
    v_wide = torch.randn(1, T, H, V + K, device=dev, dtype=bf)
    h_wide = torch.randn(1, NT, H, K, V + K, device=dev, dtype=bf)
    v, h = v_wide[..., :V].contiguous(), h_wide[..., :V].contiguous()
    S = torch.randn(1, H, K, V, device=dev)
    g = (-0.1 * torch.rand(1, NT, C, H, device=dev)).cumsum(2).view(1, NT * C, H)[:, :T].contiguous()
    gk = (-0.1 * torch.rand(1, NT, C, H, K, device=dev)).cumsum(2).view(1, NT * C, H, K)[:, :T].contiguous()
    A = torch.randn(1, T, H, C, device=dev, dtype=bf)
    scale = K ** -0.5
    rows = {
        "gdn": dict(ideal=lambda: fla.chunk_fwd_o(q=q, k=k, v=v, h=h, g=g, scale=scale, chunk_size=C),
                    widened=lambda: fla.chunk_fwd_o(q=q, k=k, v=v_wide, h=h_wide, g=g, scale=scale, chunk_size=C),
                    allscan=lambda: head_outputs(q, k, v_wide, h_wide, g, None, S, scale)),
        "kda": dict(ideal=lambda: fla.chunk_gla_fwd_o_gk(q=q, v=v, g=gk, A=A, h=h, scale=scale, chunk_size=C),
                    widened=lambda: fla.chunk_gla_fwd_o_gk(q=q, v=v_wide, g=gk, A=A, h=h_wide, scale=scale,
                                                           chunk_size=C),
                    allscan=lambda: head_outputs(q, q, v_wide, h_wide, gk, A, S, scale)),
    }
    for _ in range(2):
        for layer, fns in rows.items():
            t = {name: ms(f) for name, f in fns.items()}
            print(f"{layer} T={T} H={H} K=V={K}: ideal {t['ideal']:.3f} ms, widened {t['widened']:.3f} ms "
                  f"({t['widened'] / t['ideal']:.2f}x), allscan {t['allscan']:.3f} ms ({t['allscan'] / t['ideal']:.2f}x)")
    print(f"host us per call: head_outputs (GDN) {host_us(rows['gdn']['allscan']):.1f}, "
          f"fla's output kernel {host_us(rows['gdn']['ideal']):.1f}")


if __name__ == "__main__":
    main()
