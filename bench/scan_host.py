"""Host (CPU) time of one allscan.scan call, piece by piece, on the NCCL path.

    torchrun --nproc-per-node 2 bench/scan_host.py [--out DIR]   (1 process: an NCCL group of one)

The time the calling thread spends issuing one scan of a [1, 16, 128, 128] fp32 state (a GLA state)
with a [1, 16, 128] decay, median over 200 calls, at four depths of the API, through the hooks
documented in ``allscan.ops.scan``: the C++ core alone (``launch`` through the cached plan from
``plan_for``), ``run`` (plan lookup + core), ``scan()`` and
``scan(async_op=True)`` with ``wait()``; the same for a [1, 16, 128, 128] fp32 transition (the delta
layers' matrix scan), and the full path of each (``full_path``: every check and lookup, what a call
costs when the eager fast path cannot serve it); each with the GPU idle and with the GPU busy (a long
matmul queued first, so the host runs ahead of the device, as inside a model). Baselines: ``torch.empty_like``
and an elementwise op on this host. Then what each API adds over the core, paired: the core and the
call alternated in one loop, the median of the per-pair differences (the host's speed drifts between
rows measured one after another by more than the difference itself). Then cProfile of 100 async calls.
Prints a table; JSON to --out.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def scan_module():
    """allscan.ops.scan, the module (``from allscan.ops import scan`` is the function of that name)."""
    return importlib.import_module("allscan.ops.scan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    import allscan
    S = scan_module()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    rank = dist.get_rank()
    x = torch.randn(1, 16, 128, 128, device=dev)
    g = torch.rand(1, 16, 128, device=dev)
    name = group.group_name
    allscan.scan(x, g, group)  # prepares the plan, checks the signature
    allscan.scan(x, g, group, async_op=True).wait()
    plan = S.plan_for(x, g, None, group, False, False, 0, "pipelined")
    MS = importlib.import_module("allscan.ops.matrix_scan")
    m = torch.randn(1, 16, 128, 128, device=dev) / 16
    allscan.scan(x, group=group, transition=m)
    allscan.scan(x, group=group, transition=m, async_op=True).wait()
    mplan = MS.plan_for(x, m, None, group, False, False, False, 0, "pipelined")
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    pieces = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "elementwise x * 2": lambda: x * 2,
        "core (_C.scan via the plan)": lambda: S.launch(plan, x, g, None, False, False, 0),
        "run (plan lookup + core)": lambda: S.run(x, g, None, name, False, False, 0, "pipelined", group),
        "scan()": lambda: allscan.scan(x, g, group),
        "scan(async_op=True).wait()": lambda: allscan.scan(x, g, group, async_op=True).wait(),
        "full path: full_path()": lambda: S.full_path(x, g, group, None, False, False, None, None, "pipelined", False),
        "matrix core (launch via the plan)": lambda: MS.launch(mplan, x, m, None, False, False, False, 0),
        "scan(transition=)": lambda: allscan.scan(x, group=group, transition=m),
        "scan(transition=, async_op=True).wait()": lambda: allscan.scan(x, group=group, transition=m,
                                                                         async_op=True).wait(),
        "full path: full_path(transition=)":
            lambda: S.full_path(x, None, group, m, False, False, None, None, "pipelined", False),
        "full path: full_path(transition=, async_op=True).wait()":
            lambda: S.full_path(x, None, group, m, False, False, None, None, "pipelined", True).wait(),
    }
    res = {}
    for busy in (False, True):
        for label, fn in pieces.items():
            dist.barrier()
            torch.cuda.synchronize()
            if busy:
                for _ in range(6):
                    big @ big  # ~ several ms of queued work: the host runs ahead
            ts = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            res[f"{label} [{'busy' if busy else 'idle'} GPU]"] = statistics.median(ts) * 1e6
    core, mcore = pieces["core (_C.scan via the plan)"], pieces["matrix core (launch via the plan)"]
    pairs = {
        "scan() - core": (pieces["scan()"], core),
        "scan(async_op=True).wait() - core": (pieces["scan(async_op=True).wait()"], core),
        "scan(transition=) - matrix core": (pieces["scan(transition=)"], mcore),
        "scan(transition=, async_op=True).wait() - matrix core": (pieces["scan(transition=, async_op=True).wait()"],
                                                                   mcore),
    }
    paired = {}
    for busy in (False, True):
        for label, (fn, base) in pairs.items():
            dist.barrier()
            torch.cuda.synchronize()
            if busy:
                for _ in range(6):
                    big @ big
            diffs = []
            for i in range(args.calls):
                first, second = (base, fn) if i % 2 == 0 else (fn, base)  # either order, half the pairs each
                t0 = time.perf_counter()
                first()
                t1 = time.perf_counter()
                second()
                t2 = time.perf_counter()
                diffs.append((t2 - t1) - (t1 - t0) if i % 2 == 0 else (t1 - t0) - (t2 - t1))
            torch.cuda.synchronize()
            q1, q2, q3 = statistics.quantiles(diffs, n=4)
            paired[f"{label} [{'busy' if busy else 'idle'} GPU]"] = [q2 * 1e6, q1 * 1e6, q3 * 1e6]
    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        allscan.scan(x, g, group, async_op=True).wait()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
    if rank == 0:
        print("host time per call, median of %d calls (us):" % args.calls)
        for k, v in res.items():
            print(f"  {k:52s} {v:8.1f}")
        print("added over the core, paired (calls alternated; median and quartiles of the differences, us):")
        for k, (med, lo, hi) in paired.items():
            print(f"  {k:64s} {med:6.1f}  [{lo:5.1f}, {hi:5.1f}]")
        print(buf.getvalue())
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "scan_host.json"), "w") as f:
                json.dump(dict(bench="scan_host", device=torch.cuda.get_device_name(dev), calls=args.calls,
                               host_us=res, paired_over_core_us=paired, allscan_timeout=str(allscan.settings.timeout),
                               command="torchrun --nproc-per-node %d bench/scan_host.py" % dist.get_world_size()),
                          f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
