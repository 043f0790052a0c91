"""Host time of sequence-parallel GLA, eager and CUDA-graph captured: ``gla_bench.py --host`` (issue 14).

    torchrun --nproc-per-node 2 bench/gla_bench.py --host --tlocal 2048,4096,8192,16384 --out DIR
    torchrun --nproc-per-node 1 bench/gla_bench.py --host ...    # one GPU: a middle rank's work (below)

For ``ideal`` (fla's ``chunk_gla`` on the shard alone) and ``zeco`` (``zeco_gla``), fwd+bwd at each
T_local (B = 1, H heads, K = V, bf16 by default), every number the slowest rank's:

- ``host_ms``: the host's issue time per fwd+bwd (``--inner`` calls back to back, nothing synchronised
  inside, wall time / calls; median of ``--repeats``). Above the GPU's time the row is host-bound.
- ``eager_ms``: the same calls timed by CUDA events: what a training loop sees (the larger of the two).
- ``graph_ms``: one fwd+bwd captured in a CUDA graph and replayed (CUDA events): the GPU's time without
  the host. ``graph_equal``: the replay's output and gradients are bitwise those of an eager call.
- zeco's host time by part (``allscan.ops.gla.host_stage_times``): fla's stages, allscan's
  incoming-state kernels, the scans (issue and wait), and the layer's own Python (argument checks,
  glue between stages, autograd).

With one rank the ``zeco`` rows run what a middle rank (``--stand-in middle``, rank 1 of 3), the last
of two ranks (``last``) or the first of two (``first``) runs: both scans are issued, over the one-rank
group, and for the first two the incoming-state kernels (their shard continues the sequence); the
host's work is that rank's, the GPU's lacks only the transfer. Writes DIR/gla_host.json, prints a table.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

from gla_common import captured_time, middle_rank_stand_in

ROWS = ("ideal", "zeco")
FLA_STAGES = ("fwd_states", "fwd_intra", "fwd_output", "bwd_begin", "bwd_prepare", "bwd_dh", "bwd_finish")
ALLSCAN_KERNELS = ("shard_gamma", "fwd_output_with_state", "correct", "xgrad")


def _slowest(value: float, dev) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _parts(fwd_bwd, calls):
    """zeco's host microseconds per fwd+bwd by part (no synchronisation inside)."""
    import torch

    from allscan.ops.gla import host_stage_times

    with host_stage_times() as acc:
        t0 = time.perf_counter()
        for _ in range(calls):
            fwd_bwd("zeco")
        total = time.perf_counter() - t0
    torch.cuda.synchronize()
    us = {k: v / calls * 1e6 for k, v in acc.items()}
    body = us.get("forward body", 0.0) + us.get("backward body", 0.0)
    scans = us.get("scan issue", 0.0) + us.get("scan wait", 0.0)
    fla = sum(us.get(k, 0.0) for k in FLA_STAGES)
    kernels = sum(us.get(k, 0.0) for k in ALLSCAN_KERNELS)
    return dict(total=total / calls * 1e6, fla_stages=fla, allscan_kernels=kernels, scans=scans,
                layer_python=total / calls * 1e6 - fla - kernels - scans, inside_bodies=body)


def run_host(args, say):
    import torch
    import torch.distributed as dist
    from fla.ops.gla import chunk_gla

    from allscan.ops.gla import limit_fla_autotune, zeco_gla

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    limit_fla_autotune(args.fla_autotune)
    dtype = getattr(torch, args.dtype)
    H, K, B = args.heads, args.head_dim, 1
    results = []
    with middle_rank_stand_in(world, "allscan.ops.gla.zeco", args.stand_in):
        for T in args.tlocal:
            gen = torch.Generator(device=dev).manual_seed(1000 + rank)
            q, k, v = (torch.randn(B, T, H, K, device=dev, generator=gen, dtype=dtype).requires_grad_(True)
                       for _ in range(3))
            g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16).to(dtype)
            g.requires_grad_(True)
            do = torch.randn(B, T, H, K, device=dev, generator=gen, dtype=dtype)
            ins = [q, k, v, g]

            def fwd_bwd(name):
                o = chunk_gla(q, k, v, g)[0] if name == "ideal" else zeco_gla(q, k, v, g)[0]
                return (o,) + torch.autograd.grad(o, ins, do)

            say(f"T_local={T}: warm-up", rank, True)
            for _ in range(args.warmup):
                for n in ROWS:
                    fwd_bwd(n)
            torch.cuda.synchronize()
            host = {n: [] for n in ROWS}
            eager = {n: [] for n in ROWS}
            for r in range(args.repeats):
                for n in (ROWS if r % 2 == 0 else ROWS[::-1]):
                    dist.barrier()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        fwd_bwd(n)
                    t_host = (time.perf_counter() - t0) / args.inner
                    e1.record()
                    torch.cuda.synchronize()
                    host[n].append(_slowest(t_host * 1e3, dev))
                    eager[n].append(_slowest(e0.elapsed_time(e1) / args.inner, dev))
            say(f"T_local={T}: captured", rank, True)
            for n in ROWS:
                dist.barrier()
                ms, equal = captured_time(fwd_bwd, n, args.inner, dev)
                row = dict(T_local=T, row=n, host_ms=statistics.median(host[n]), eager_ms=statistics.median(eager[n]),
                           graph_ms=_slowest(ms, dev), graph_equal=bool(_slowest(0.0 if equal else 1.0, dev) == 0.0),
                           host_ms_all=host[n], eager_ms_all=eager[n])
                if n == "zeco":
                    row["zeco_host_us_by_part"] = {k: _slowest(v, dev) for k, v in _parts(fwd_bwd, args.inner).items()}
                results.append(row)
            del q, k, v, g, do, ins
            torch.cuda.empty_cache()
    out = dict(bench="gla_host", world=world, B=B, H=H, K=K, V=K, dtype=args.dtype, repeats=args.repeats,
               inner=args.inner, fla_autotune=args.fla_autotune, host=socket.gethostname(),
               device=torch.cuda.get_device_name(dev), torch=torch.__version__,
               middle_rank_stand_in=world == 1, stand_in=args.stand_in if world == 1 else None, time=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="torchrun --nproc-per-node %d bench/gla_bench.py %s" % (world, " ".join(sys.argv[1:])),
               results=results)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "gla_host.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(report_host(out))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def report_host(out) -> str:
    """The table of a ``--host`` run: per T_local, ideal and zeco (ms) and zeco's ratios to ideal."""
    by = {(r["T_local"], r["row"]): r for r in out["results"]}
    # runs before the --stand-in option stood in for rank 1 of 2 (a middle rank's code then)
    place = {"middle": "rank 1 of 3", "last": "the last of 2 ranks", "first": "the first of 2 ranks",
             None: "rank 1 of 2"}[out.get("stand_in")]
    lines = [f"gla_bench --host: P={out['world']}{f' (one GPU stands in for {place})' if out['middle_rank_stand_in'] else ''}, "
             f"{out['dtype']}, H={out['H']}, K=V={out['K']}, ms per fwd+bwd (slowest rank)",
             "| T_local | row | host issue | eager | captured | replay == eager | eager / ideal | captured / ideal |",
             "|---|---|---|---|---|---|---|---|"]
    for T in sorted({t for t, _ in by}):
        ideal = by[(T, "ideal")]
        for n in ROWS:
            r = by[(T, n)]
            lines.append(f"| {T} | {n} | {r['host_ms']:.3f} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} | "
                         f"{r['graph_equal']} | {r['eager_ms'] / ideal['eager_ms']:.3f} | "
                         f"{r['graph_ms'] / ideal['graph_ms']:.3f} |")
    lines.append("zeco host us per fwd+bwd by part: T_local: total = fla stages + allscan kernels + scans + layer Python")
    for T in sorted({t for t, _ in by}):
        p = by[(T, "zeco")]["zeco_host_us_by_part"]
        lines.append(f"  {T}: {p['total']:.0f} = {p['fla_stages']:.0f} + {p['allscan_kernels']:.0f} + "
                     f"{p['scans']:.0f} + {p['layer_python']:.0f}")
    return "\n".join(lines)
