#!/usr/bin/env python3
"""Soak: many allscan calls in one process, memory and time per call recorded, growth after warm-up.

    torchrun --nproc-per-node 2 bench/soak.py --out DIR                    # gloo on CPU
    torchrun --nproc-per-node 2 bench/soak.py --device cuda --out DIR      # NCCL on GPUs

Phases, each on every rank: ``scan`` (--scans calls of ``allscan.scan``, a new value every call, every
result checked against the exact chain: any wrong value is counted), ``gla`` and ``gdn`` (--steps
fwd+bwd of ``zeco_gla`` / ``zeco_gated_delta_rule`` on a small shard). For each phase: the resident
set size (RSS, from /proc) and on CUDA the allocated memory at 10% of the calls (after warm-up) and at
the end, and the time per call in the first and last tenth. Writes DIR/soak.json; prints a table.
``--check`` exits with 1 if a result was wrong or RSS grew by more than --max-growth-mib after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _phase(name, calls, step, sync, cuda):
    """Runs ``step(i)`` ``calls`` times; returns RSS / memory at 10% and at the end, time per call
    in the first and last tenth, and the count of wrong results ``step`` reports."""
    import torch

    tenth = max(1, calls // 10)
    wrong = 0
    marks = {}
    t_first = t_last = 0.0
    loud = os.environ.get("RANK", "0") == "0"  # progress from one rank: a long soak is not a silent one
    t0 = time.perf_counter()
    for i in range(calls):
        wrong += step(i)
        if loud and (i + 1) % tenth == 0:
            print(f"soak.py: {name}: {i + 1}/{calls} calls, {time.perf_counter() - t0:.0f} s, {wrong} wrong",
                  file=sys.stderr, flush=True)
        if i + 1 == tenth:
            sync()
            t_first = (time.perf_counter() - t0) / tenth
            marks["warm"] = (_rss_mib(), torch.cuda.memory_allocated() / 2 ** 20 if cuda else 0.0)
        if i + 1 == calls - tenth:
            sync()
            t_tail = time.perf_counter()
    sync()
    t_last = (time.perf_counter() - t_tail) / tenth
    end = (_rss_mib(), torch.cuda.memory_allocated() / 2 ** 20 if cuda else 0.0)
    return dict(phase=name, calls=calls, wrong=wrong, rss_warm_mib=marks["warm"][0], rss_end_mib=end[0],
                cuda_warm_mib=marks["warm"][1], cuda_end_mib=end[1], us_per_call_first=t_first * 1e6,
                us_per_call_last=t_last * 1e6)


def run(args):
    unknown = set(args.phases.split(",")) - {"scan", "gla", "gdn"}
    if unknown:
        raise SystemExit(f"soak.py: --phases takes scan, gla, gdn; got {sorted(unknown)}")
    import torch
    import torch.distributed as dist

    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla

    cuda = args.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = args.elements
    gamma = torch.full((n,), 0.5, device=dev)
    # the exact inclusive chain at rank p of x_q = (i + q + 1) * ones: sum_q 0.5^(p - q) (i + q + 1)
    weights = [0.5 ** (rank - q) for q in range(rank + 1)]

    def scan_step(i):
        x = torch.full((n,), float(i % 1024 + rank + 1), device=dev)
        y = allscan.scan(x, gamma, inclusive=True)
        want = sum(w * (i % 1024 + q + 1) for q, w in zip(range(rank + 1), weights))
        return int(not torch.allclose(y, torch.full_like(y, want)))

    B, T, H, D = 1, args.tokens, 2, 16
    gen = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(B, T, H, D, device=dev, generator=gen).requires_grad_(True) for _ in range(3))
    g = torch.full((B, T, H, D), -0.05, device=dev)
    beta = torch.full((B, T, H), 0.5, device=dev)
    g3 = torch.full((B, T, H), -0.05, device=dev)

    def gla_step(i):
        o, _ = zeco_gla(q, k, v, g)
        o.sum().backward()
        return 0

    def gdn_step(i):
        o, _ = zeco_gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, g3, beta)
        o.sum().backward()
        return 0

    steps = {"scan": (args.scans, scan_step), "gla": (args.steps, gla_step), "gdn": (args.steps, gdn_step)}
    phases = [_phase(name, *steps[name], sync, cuda) for name in args.phases.split(",")]
    per_rank = [None] * world
    dist.all_gather_object(per_rank, phases)
    out = dict(bench="soak", world=world, device=args.device, elements=n, tokens=T, host=socket.gethostname(),
               torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="torchrun --nproc-per-node %d bench/soak.py %s" % (world, " ".join(sys.argv[1:])),
               ranks=per_rank)
    bad = False
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(f"soak: P={world}, {args.device}, scan of {n} fp32 elements, layers at T_local={T} (max over ranks)")
        print(f"{'phase':6s} {'calls':>7s} {'wrong':>5s} {'RSS warm':>9s} {'RSS end':>8s} {'growth':>7s} "
              f"{'us/call first':>13s} {'us/call last':>12s}")
        for j, ph in enumerate(phases):
            rows = [r[j] for r in per_rank]
            growth = max(r["rss_end_mib"] - r["rss_warm_mib"] for r in rows)
            wrong = sum(r["wrong"] for r in rows)
            print(f"{ph['phase']:6s} {ph['calls']:7d} {wrong:5d} {max(r['rss_warm_mib'] for r in rows):7.1f}M "
                  f"{max(r['rss_end_mib'] for r in rows):6.1f}M {growth:6.1f}M "
                  f"{max(r['us_per_call_first'] for r in rows):13.1f} {max(r['us_per_call_last'] for r in rows):12.1f}")
            bad |= wrong > 0 or growth > args.max_growth_mib
    flag = torch.tensor([int(bad)], device=dev)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if args.check and flag.item():
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="soak_out")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--scans", type=int, default=100000)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--elements", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-growth-mib", type=float, default=8.0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--phases", default="scan,gla,gdn",
                    help="comma-separated, from scan, gla, gdn (gdn's backward on Hopper GPUs needs tilelang)")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
