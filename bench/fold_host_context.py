#!/usr/bin/env python3
"""Host time of the delta layers' fold kernels where they run, against a tight loop.

``fold_in_time.py`` times each fold kernel's call alone, back to back. Inside a Gated DeltaNet fwd+bwd
the same calls cost more: this script times them (perf_counter around ``fold_forward`` and
``fold_state_grad``, and around the Triton launch inside each) in four settings, the median per call:

    layer               zeco_gated_delta_rule fwd+bwd as a middle rank (one GPU stands in), 30 calls
    alone               the two calls back to back on tensors of the same shapes
    alone_in_backward   the same inside an autograd.Function (the fold in its forward, the state
                        gradient in its backward, which autograd's device thread runs)
    layer_again         the layer once more (the host's drift)

    torchrun --nproc-per-node 1 bench/fold_host_context.py [--tokens 8192] [--out DIR]

Needs fla-core (and tilelang for the Gated DeltaNet backward on Hopper with Triton 3.6).
"""
import argparse
import json
import os
import statistics
import time

from delta_bench import _inputs
from gla_common import middle_rank_stand_in


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import allscan.ops.delta.fla as delta_fla
    import allscan.ops.delta.fold_in as fold_in
    from allscan.layers import zeco_gated_delta_rule
    from allscan.ops.gla.fla import limit_fla_autotune

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    limit_fla_autotune("one")
    T, H, D = args.tokens, args.heads, 128
    ins, do = _inputs("gdn", T, H, D, D, torch.bfloat16, dev, 1)
    q, k, v, g, beta = ins

    times = {}

    def timed(label, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)
        return wrapper

    fold_in.fold_forward = timed("fold", fold_in.fold_forward)
    fold_in.fold_state_grad = timed("state gradient", fold_in.fold_state_grad)
    fold_in._fold_forward.run = timed("fold: Triton launch", fold_in._fold_forward.run)
    fold_in._fold_grad_state.run = timed("state gradient: Triton launch", fold_in._fold_grad_state.run)
    delta_fla._fns.cache_clear()  # the layer looks its kernels up once: now it finds the timed ones

    def layer():
        o, _ = zeco_gated_delta_rule(q, k, v, g, beta, dist.group.WORLD)
        torch.autograd.grad(o, ins, do)

    wide = torch.randn(1, T, H, 2 * D, device=dev, dtype=torch.bfloat16)
    S = torch.randn(1, H, D, D, device=dev)
    o_loc, q_eff = wide[..., :D], wide[..., D:]
    q_copy = q_eff.contiguous()

    def alone():
        fold_in.fold_forward(o_loc, q_eff, S, True)
        fold_in.fold_state_grad(q_copy, do)

    class FoldFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            fold_in.fold_forward(o_loc, q_eff, S, True)
            return x * 1

        @staticmethod
        def backward(ctx, dx):
            fold_in.fold_state_grad(q_copy, do)
            return dx

    x = torch.randn(4, device=dev, requires_grad=True)

    def alone_in_backward():
        torch.autograd.grad(FoldFunction.apply(x).sum(), x)

    settings = {"layer": layer, "alone": alone, "alone_in_backward": alone_in_backward, "layer_again": layer}
    results = {}
    with middle_rank_stand_in(1, "allscan.ops.delta.zeco"):
        for fn in settings.values():  # compile everything first
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for name, fn in settings.items():
            times.clear()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            results[name] = {label: round(statistics.median(v), 1) for label, v in times.items()}
    print(f"host us per call (median of {args.calls}), {T} tokens x {H} heads:")
    for name, r in results.items():
        print(f"  {name:18s} " + ", ".join(f"{label} {us}" for label, us in r.items()))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"fold_host_context_{T}.json"), "w") as f:
        json.dump(dict(tokens=T, heads=H, calls=args.calls, us=results), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
