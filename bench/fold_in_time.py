#!/usr/bin/env python3
"""The delta-rule layers' fold-in of the incoming state on one GPU: ``o + Q' S_in`` and the gradient of
``S_in``, ``Q'^T dout`` (what the layers compute with it, forward and backward), as torch fp32 einsums
(what the layers did before) against allscan's Triton kernels (:mod:`allscan.ops.delta.fold_in`), side
by side, CUDA events around 20 calls, twice. ``o`` and ``Q'`` are slices of one widened tensor, as
fla's forward on the widened values returns them. Then the host's issue time of each kernel's call
(median over 5 rounds of 200 calls, nothing synchronised inside a round) beside a query of the device's
properties (what ``fold_state_grad`` asked every call before it cached the SM count).

    python3 bench/fold_in_time.py [--tokens 32768] [--heads 16] [--dim 128]
"""
import argparse
import statistics
import time

import torch

from allscan.ops.delta.fold_in import fold_forward, fold_state_grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    T, H, K = args.tokens, args.heads, args.dim
    V = K
    wide = torch.randn(1, T, H, V + K, device="cuda", dtype=torch.bfloat16)
    S = torch.randn(1, H, K, V, device="cuda")
    dout = torch.randn(1, T, H, V, device="cuda", dtype=torch.bfloat16)
    o, qe = wide[..., :V], wide[..., V:]

    def einsum_fp32():
        (o.float() + torch.einsum("bthk,bhkv->bthv", qe.float(), S)).to(o.dtype)
        torch.einsum("bthk,bthv->bhkv", qe.float(), dout.float())

    def kernels():
        fold_forward(o, qe, S)
        fold_state_grad(qe, dout)

    def kernel_forward():
        fold_forward(o, qe, S)

    def kernel_forward_copy():  # what the layers run: the fold and the contiguous copy of Q' they keep
        fold_forward(o, qe, S, copy_q=True)

    def torch_copy():  # the copy alone, as torch makes it
        qe.contiguous()

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

    def state_grad():
        fold_state_grad(qe, dout)

    def properties():
        torch.cuda.get_device_properties(qe.device).multi_processor_count

    for _ in range(2):
        print(f"fold-in and its state gradient, {T} tokens x {H} heads: torch fp32 {ms(einsum_fp32):.3f} ms, "
              f"triton {ms(kernels):.3f} ms, triton fold only {ms(kernel_forward):.3f} ms, fold with the copy of Q' "
              f"{ms(kernel_forward_copy):.3f} ms (torch's copy alone {ms(torch_copy):.3f} ms)")
    print(f"host us per call: fold {host_us(kernel_forward):.1f}, fold with the copy {host_us(kernel_forward_copy):.1f}, "
          f"state gradient {host_us(state_grad):.1f}; a device-properties query {host_us(properties):.1f}")


if __name__ == "__main__":
    main()
