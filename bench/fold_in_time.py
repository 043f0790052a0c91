#!/usr/bin/env python3
"""The delta-rule layers' fold-in of the incoming state, ``o + Q' S_in`` fwd+bwd on one GPU: torch's fp32
einsum (what the layers did before) against allscan's Triton kernel (:mod:`allscan.ops.delta.fold_in`),
side by side, CUDA events around 20 calls, twice. ``o`` and ``Q'`` are slices of one widened tensor, as
fla's widened call returns them.

    python3 bench/fold_in_time.py [--tokens 32768] [--heads 16] [--dim 128]
"""
import argparse

import torch

from allscan.ops.delta.fold_in import fold_incoming


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    T, H, K = args.tokens, args.heads, args.dim
    V = K
    wide = torch.randn(1, T, H, V + K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    S = torch.randn(1, H, K, V, device="cuda", requires_grad=True)
    dout = torch.randn(1, T, H, V, device="cuda", dtype=torch.bfloat16)

    def einsum_fp32():
        o, qe = wide[..., :V], wide[..., V:]
        r = (o.float() + torch.einsum("bthk,bhkv->bthv", qe.float(), S)).to(o.dtype)
        torch.autograd.grad(r, (wide, S), dout)

    def kernel():
        torch.autograd.grad(fold_incoming(wide[..., :V], wide[..., V:], S), (wide, S), dout)

    def kernel_forward():
        with torch.no_grad():
            fold_incoming(wide[..., :V], wide[..., V:], S)

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

    for _ in range(2):
        print(f"fold-in fwd+bwd {T} tokens x {H} heads: torch fp32 {ms(einsum_fp32):.3f} ms, "
              f"triton {ms(kernel):.3f} ms, triton fwd only {ms(kernel_forward):.3f} ms")


if __name__ == "__main__":
    main()
