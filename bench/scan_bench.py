#!/usr/bin/env python3
"""allscan.scan as users call it, against the floor measured in the same process.

    torchrun --nproc-per-node 2 bench/scan_bench.py --out DIR            # on the GPU machine
    python3 bench/scan_bench.py --plot DIR/scan_bench.json --out DIR     # redraw the plot on CPU

For every state size (4 KiB .. 256 MiB by default) it times, interleaved (repeat r runs every row
once), with CUDA events around many back-to-back calls after warm-up, the median over repeats of
the slowest rank's time per call:

    p2p-chain          the floor: allscan.core.neighbor_exchange(chain=True), exactly the transfers of one
                       scan (a bare NCCL send/recv of the same bytes, one group call)
    torch-p2p-chain    the same transfers through torch: dist.batch_isend_irecv + wait
    c-scan-pipelined   allscan.core.scan with preallocated output and workspace (no Python layer)
    scan-pipelined     allscan.scan(x, gamma) (automatic K), and num_blocks=K for every --blocks K
    scan-serial        allscan.scan(x, gamma, method="serial")     (LASP-1 pattern)
    scan-allgather     allscan.scan(x, gamma, method="allgather")  (LASP-2 pattern)

``scan-pipelined / c-scan-pipelined`` is the cost of the Python layer; ``x / p2p-chain`` the
distance to the floor. Every scan row's result is checked once per size against a sequential
reference with the same rounding (``allscan.reference.combine``), bitwise (#wrong = elements that
differ, summed over ranks).

The state of ``count`` elements is viewed as [H, Dk, Dv] with Dv = gcd(count, 128),
Dk = gcd(count/Dv, 128) (as in allscan_perf); ``--decay`` picks gamma's shape ([], [H], [H, Dk] or
the full state, fp32). Writes DIR/scan_bench.json (rows in allscan_perf's format, so
bench/fit_model.py reads them too) and DIR/scan_bench.png, and prints a table of ratios to the floor.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
METHOD_INDEX = {"pipelined": 0, "serial": 1, "allgather": 2}
DECAYS = ("none", "head", "key", "full")


def parse_size(s: str) -> int:
    """4096, 4K, 4KB, 4KiB, 256M, 1G (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(I?B)?\s*", s.upper())
    if not m or (m.group(3) == "IB" and not m.group(2)):
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 4K, 256M or 1G, got {s!r}")
    v = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {s!r}")
    return v


def int_list(s: str) -> List[int]:
    out = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or not (1 <= int(part) <= 64):
            raise argparse.ArgumentTypeError(f"expected comma-separated block counts 1..64, got {part!r}")
        out.append(int(part))
    return out


def method_list(s: str) -> List[str]:
    out = []
    for part in s.split(","):
        if part == "all":
            out.extend(METHOD_INDEX)
        elif part in METHOD_INDEX:
            out.append(part)
        else:
            raise argparse.ArgumentTypeError(f"expected comma-separated methods from pipelined, serial, allgather (or all), got {part!r}")
    return list(dict.fromkeys(out))


def layout(count: int, dv: int = 128) -> Tuple[int, int, int]:
    Dv = math.gcd(count, dv)
    Dk = math.gcd(count // Dv, dv)
    return count // (Dv * Dk), Dk, Dv


def sizes_between(lo: int, hi: int, factor: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def default_iters(nbytes: int) -> int:
    if nbytes <= (1 << 20):
        return 100
    if nbytes <= (16 << 20):
        return 40
    return 10


# ------------------------------------------------------------------------------------------------
# Plot and table (CPU only, from the JSON)
# ------------------------------------------------------------------------------------------------
def human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:g}{unit if unit != 'B' else ''}"
        n /= 1024
    return str(n)


def row_label(r: dict) -> str:
    if r["op"] == "scan-pipelined":
        return f"scan-pipelined K={'auto' if r.get('K_auto') else r['K']}"
    return r["op"]


def print_table(doc: dict, file=sys.stdout) -> None:
    rows = [r for r in doc["rows"] if r.get("time_us") is not None]
    sizes = sorted({r["size"] for r in rows})
    labels = list(dict.fromkeys(row_label(r) for r in rows))
    cols = [l for l in labels if l != "p2p-chain"]
    print(f"# scan_bench: {doc['nranks']} ranks, {doc.get('dtype')}, decay {doc.get('decay')}; time of p2p-chain "
          f"(the floor) in us, every other row as a ratio to it; py_us = scan-pipelined(auto) - c-scan-pipelined", file=file)
    short = {l: l.replace("scan-pipelined ", "pipe ").replace("scan-", "").replace("torch-p2p-chain", "torch-p2p")
             .replace("c-pipelined", "c-pipe") for l in cols}
    head = f"# {'size':>6} {'floor_us':>9} " + " ".join(f"{short[l]:>13}" for l in cols) + f" {'py_us':>7} {'#wrong':>6}"
    print(head, file=file)
    for n in sizes:
        at = {row_label(r): r for r in rows if r["size"] == n}
        fl = at.get("p2p-chain")
        fl_us = fl["time_us"] if fl else float("nan")
        cells = []
        for l in cols:
            r = at.get(l)
            cells.append(f"{r['time_us'] / fl_us:>13.3f}" if r and fl else f"{'-':>13}")
        py = float("nan")
        if "scan-pipelined K=auto" in at and "c-scan-pipelined" in at:
            py = at["scan-pipelined K=auto"]["time_us"] - at["c-scan-pipelined"]["time_us"]
        wrong = sum(int(r.get("wrong") or 0) for r in at.values())
        print(f"  {human(n):>6} {fl_us:>9.2f} " + " ".join(cells) + f" {py:>7.2f} {wrong:>6}", file=file)


def plot(doc: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("scan_bench.py: matplotlib is not available: no plot (redraw later with --plot)", file=sys.stderr)
        return False
    rows = [r for r in doc["rows"] if r.get("time_us") is not None]
    labels = list(dict.fromkeys(row_label(r) for r in rows))
    floor = {r["size"]: r["time_us"] for r in rows if r["op"] == "p2p-chain"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    for i, l in enumerate(labels):
        pts = sorted((r["size"], r["time_us"]) for r in rows if row_label(r) == l)
        xs = [p[0] for p in pts]
        style = "-" if l in ("p2p-chain", "scan-pipelined K=auto") else "--"
        lw = 2.5 if l in ("p2p-chain", "scan-pipelined K=auto") else 1.2
        ax1.plot(xs, [p[1] for p in pts], style, marker="o", ms=3, lw=lw, label=l, color=f"C{i % 10}")
        if l != "p2p-chain":
            rp = [(x, t / floor[x]) for x, t in pts if x in floor]
            ax2.plot([p[0] for p in rp], [p[1] for p in rp], style, marker="o", ms=3, lw=lw, label=l, color=f"C{i % 10}")
    ax2.axhline(1.0, color="k", lw=1)
    ax2.axhline(1.05, color="r", lw=1, ls=":", label="1.05 x floor (goal)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state bytes per rank")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("time per call (us), slowest rank, median of repeats")
    ax2.set_ylabel("time / floor (p2p-chain)")
    ax2.set_yscale("log")
    dev = (doc.get("devices") or [""])[0]
    fig.suptitle(f"allscan.scan vs the floor, {doc['nranks']} x {dev}, {doc.get('dtype')}, decay {doc.get('decay')} "
                 f"(measured side by side, interleaved)", fontsize=10)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# The GPU run
# ------------------------------------------------------------------------------------------------
def run(args) -> int:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("scan_bench.py: needs CUDA GPUs (run it under torchrun on the GPU machine)", file=sys.stderr)
        return 2
    if "LOCAL_RANK" not in os.environ:
        print("scan_bench.py: run it under torchrun, e.g. torchrun --nproc-per-node 2 bench/scan_bench.py --out DIR",
              file=sys.stderr)
        return 2
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, P = dist.get_rank(), dist.get_world_size()

    import allscan
    from allscan import core
    from allscan.reference import combine

    comm = core.communicator(None, dev)
    dtype = getattr(torch, args.dtype)
    es = torch.empty((), dtype=dtype).element_size()
    stream = torch.cuda.current_stream(dev)
    s_ptr = stream.cuda_stream
    a_us, b_upb, model_set = core.link_model(comm.handle)
    prev, nxt = rank - 1, rank + 1

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    say(f"# scan_bench: {P} ranks on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
        f"allscan {allscan.__version__}, dtype {args.dtype}, decay {args.decay}, repeats {args.repeats}")
    say(f"# link model: " + (f"latency {a_us:.3f} us, {b_upb:.4g} us/B" if model_set else "none (auto K = 1)"))

    rows: List[dict] = []
    t_start = time.time()
    for nbytes in sizes_between(args.min, args.max, args.factor):
        count = nbytes // es
        if count == 0:
            continue
        nbytes = count * es
        H, Dk, Dv = layout(count)
        gen = torch.Generator(device=dev)

        def make(q: int):
            gen.manual_seed(1000 + q)
            x = torch.randn(H, Dk, Dv, device=dev, generator=gen, dtype=torch.float32).to(dtype)
            gshape = {"none": None, "head": (H,), "key": (H, Dk), "full": (H, Dk, Dv)}[args.decay]
            g = None if gshape is None else torch.rand(*gshape, device=dev, generator=gen, dtype=torch.float32) * 0.1 + 0.9
            return x, g

        x, g = make(rank)
        recv = torch.empty_like(x)
        y_c = torch.empty_like(x)
        g_ptr = 0 if g is None else g.data_ptr()
        g_cnt = 0 if g is None else g.numel()
        g_dt = DTYPES["float32"] if g is not None else DTYPES[args.dtype]
        ws_bytes = core.workspace_size(comm.handle, count, DTYPES[args.dtype], g_ptr, g_cnt, g_dt, 0, False, False,
                                       0, 0)
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
        k_auto = core.choose_num_blocks(comm.handle, nbytes)

        ops: List[Tuple[dict, Callable[[], Optional[object]]]] = []

        def add(op, fn, method=None, K=None, K_auto=False):
            ops.append(({"op": op, "method": method, "K": K, "K_auto": K_auto}, fn))

        if P > 1:
            add("p2p-chain", lambda: core.neighbor_exchange(comm.handle, x.data_ptr(), recv.data_ptr(), nbytes, False,
                                                            True, s_ptr))

            def torch_p2p():
                p2p = []
                if nxt < P:
                    p2p.append(dist.P2POp(dist.isend, x, nxt))
                if prev >= 0:
                    p2p.append(dist.P2POp(dist.irecv, recv, prev))
                for req in dist.batch_isend_irecv(p2p):
                    req.wait()

            add("torch-p2p-chain", torch_p2p)
        if "pipelined" in args.methods:
            add("c-scan-pipelined",
                lambda: core.scan(comm.handle, x.data_ptr(), y_c.data_ptr(), count, DTYPES[args.dtype], g_ptr, g_cnt,
                                  g_dt, 0, False, False, 0, 0, ws.data_ptr(), ws_bytes, s_ptr, 0),  # 0: no signature
                "pipelined", k_auto, True)
        for m in args.methods:
            add(f"scan-{m}", (lambda m=m: allscan.scan(x, g, method=m)), m, k_auto if m == "pipelined" else 1, True)
            if m == "pipelined":
                for K in args.blocks:
                    add("scan-pipelined", (lambda K=K: allscan.scan(x, g, num_blocks=K)), "pipelined", K, False)

        iters = args.iters or default_iters(nbytes)
        for _, fn in ops:  # warm-up (creates communicators, caches, torch's p2p comm)
            for _ in range(args.warmup):
                fn()
        torch.cuda.synchronize(dev)
        dist.barrier()
        times = torch.zeros(args.repeats, len(ops), dtype=torch.float64)
        ev0 = torch.cuda.Event(enable_timing=True)
        ev1 = torch.cuda.Event(enable_timing=True)
        for rep in range(args.repeats):
            for j, (_, fn) in enumerate(ops):
                dist.barrier()
                torch.cuda.synchronize(dev)
                ev0.record(stream)
                for _ in range(iters):
                    fn()
                ev1.record(stream)
                ev1.synchronize()
                times[rep, j] = ev0.elapsed_time(ev1) * 1000.0 / iters
        tmax = times.to(dev)
        dist.all_reduce(tmax, op=dist.ReduceOp.MAX)
        tmax = tmax.cpu()

        # Correctness: every scan row once against the sequential reference (same rounding), bitwise.
        ref = None
        wrong = [None] * len(ops)
        if count * es <= args.check_max:
            y = None
            for q in range(rank):
                xq, gq = make(q)
                y = xq.clone() if y is None else combine(gq, y, xq)
            ref = torch.zeros_like(x) if y is None else y
            for j, (meta, fn) in enumerate(ops):
                if meta["method"] is None:
                    continue
                if meta["op"] == "c-scan-pipelined":
                    y_c.fill_(float("nan"))
                    fn()
                    out = y_c
                else:
                    out = fn()
                bad = torch.tensor([int((out.view(-1) != ref.view(-1)).sum().item()) if not torch.equal(out, ref) else 0],
                                   device=dev, dtype=torch.int64)
                dist.all_reduce(bad)
                wrong[j] = int(bad.item())

        floor_us = None
        for j, (meta, _) in enumerate(ops):
            if meta["op"] == "p2p-chain":
                floor_us = statistics.median(tmax[:, j].tolist())
        for j, (meta, _) in enumerate(ops):
            reps = tmax[:, j].tolist()
            med = statistics.median(reps)
            rows.append({
                "size": nbytes, "count": count, "type": args.dtype, **meta,
                "time_us": med, "time_us_min": min(reps), "time_us_repeats": reps, "iters": iters,
                "algbw_GBps": nbytes / med / 1e3, "vs_floor": (med / floor_us) if floor_us else None,
                "wrong": wrong[j], "layout": [H, Dk, Dv],
            })
        del x, g, recv, y_c, ws, ref
        say(f"#   {human(nbytes):>6}: {len(ops)} rows x {args.repeats} repeats x {iters} iters done "
            f"({time.time() - t_start:.1f} s)")

    doc = {
        "tool": "scan_bench",
        "nranks": P,
        "devices": [torch.cuda.get_device_name(dev)],
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "allscan": allscan.__version__,
        "dtype": args.dtype,
        "decay": args.decay,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "link_model": {"set": bool(model_set), "latency_us": a_us, "us_per_byte": b_upb},
        "rows": rows,
    }
    rc = 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "scan_bench.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print_table(doc)
        plot(doc, os.path.join(args.out, "scan_bench.png"))
        total_wrong = sum(int(r["wrong"] or 0) for r in rows)
        print(f"# wrong elements: {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}; wrote {path}")
        rc = 1 if total_wrong else 0
    flag = torch.tensor([rc], device=dev)
    dist.broadcast(flag, 0)
    dist.barrier()
    dist.destroy_process_group()
    return int(flag.item())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " See the module docstring.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (scan_bench.json, scan_bench.png)")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plot and table from a scan_bench.json (CPU)")
    ap.add_argument("--min", type=parse_size, default=4 << 10, help="smallest state size in bytes (default 4K)")
    ap.add_argument("--max", type=parse_size, default=256 << 20, help="largest state size in bytes (default 256M)")
    ap.add_argument("--factor", type=int, default=2, help="size step factor (default 2)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--decay", choices=DECAYS, default="key", help="gamma's shape in the [H, Dk, Dv] view (default key)")
    ap.add_argument("--methods", type=method_list, default=list(METHOD_INDEX), help="pipelined,serial,allgather (default all)")
    ap.add_argument("--blocks", type=int_list, default=[2, 4, 8], help="fixed K rows for the pipelined method (default 2,4,8)")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing (default: 100 up to 1 MiB, 40 up to 16 MiB, 10 above)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per row and size (default 5)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats, median reported (default 5)")
    ap.add_argument("--check-max", type=parse_size, default=256 << 20, help="check results up to this size (default 256M)")
    args = ap.parse_args(argv)
    if args.factor < 2:
        ap.error(f"--factor must be >= 2, got {args.factor}")
    if args.max < args.min:
        ap.error(f"--max ({args.max}) is smaller than --min ({args.min})")
    if args.iters < 0 or args.warmup < 0 or args.repeats < 1:
        ap.error("--iters and --warmup must be >= 0 and --repeats >= 1")
    if not args.methods:
        ap.error("--methods: no method selected")
    if args.plot:
        with open(args.plot) as f:
            doc = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        print_table(doc)
        plot(doc, os.path.join(args.out, "scan_bench.png"))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
