"""allscan demo: the All-Scan of a linear-attention state across P ranks, in every mode, checked
against the sequential reference.

    python3 -m allscan.demo [--nproc P] [--state 1,16,128,128] [--iters N]

Starts P ranks: NCCL on GPUs when at least P GPUs are visible (P defaults to the GPU count, or 4
on CPU), else gloo on CPU. Prints one row per mode: median time per call and the check (bitwise equal
to the reference with the same arithmetic, and the relative error against float64).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time


def _rank_main(rank, world, backend, init_file, state, iters, q):
    import torch
    import torch.distributed as dist

    import allscan
    from allscan.reference import scan_reference

    try:
        torch.set_num_threads(1)
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        gen = torch.Generator().manual_seed(0)
        B, H = state[0], state[1]
        # Every rank makes every rank's inputs from one seed, so each can check its own result.
        xs = [torch.randn(state, generator=gen) * 0.1 for _ in range(world)]
        gs = [torch.rand((B, H, state[2]), generator=gen) * 0.1 + 0.9 for _ in range(world)]  # per key dim
        init = torch.randn(state, generator=gen) * 0.1
        rows = []
        modes = list(itertools.product(("pipelined", "serial", "allgather"), (False, True), (False, True), (False, True)))
        for method, reverse, inclusive, use_init in modes:
            i0 = init if use_init else None
            ref = scan_reference(xs, gs, i0, reverse=reverse, inclusive=inclusive)[rank]
            exact = scan_reference(xs, gs, i0, reverse=reverse, inclusive=inclusive, exact=True)[rank]
            x, g = xs[rank].to(dev), gs[rank].to(dev)
            i0d = None if i0 is None else i0.to(dev)
            y = allscan.scan(x, g, reverse=reverse, inclusive=inclusive, init=i0d, method=method)
            times = []
            for _ in range(iters):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                allscan.scan(x, g, reverse=reverse, inclusive=inclusive, init=i0d, method=method)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            y = y.cpu()
            bitwise = torch.equal(y, ref)
            rel = float((y.double() - exact).norm() / exact.norm().clamp_min(1e-30))
            rows.append((method, reverse, inclusive, use_init, statistics.median(times) * 1e6, bitwise, rel))
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, rows, None))
    except BaseException:  # noqa: BLE001
        import traceback

        q.put((rank, None, traceback.format_exc()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: GPU count, or 4 on CPU)")
    ap.add_argument("--state", default="1,16,128,128", help="state shape B,H,K,V (default 1,16,128,128)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per mode (median reported)")
    ap.add_argument("--cpu", action="store_true", help="use gloo on CPU even when GPUs are present")
    args = ap.parse_args(argv)
    try:
        state = tuple(int(s) for s in args.state.split(","))
    except ValueError:
        ap.error(f"--state: expected comma-separated integers B,H,K,V, got {args.state!r}")
    if len(state) != 4 or min(state) < 1:
        ap.error(f"--state: expected four positive integers B,H,K,V, got {args.state!r}")
    if args.iters < 1:
        ap.error("--iters: expected a positive integer")

    import torch
    import torch.multiprocessing as mp

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 0
    nproc = args.nproc or (ngpu if ngpu > 0 else 4)
    if nproc < 1:
        ap.error("--nproc: expected a positive integer")
    backend = "nccl" if ngpu >= nproc else "gloo"
    if ngpu and backend == "gloo":
        print(f"# {nproc} ranks but {ngpu} GPUs: running on CPU with gloo", file=sys.stderr)
    fd, init_file = tempfile.mkstemp(prefix="allscan_demo_")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, backend, init_file, state, args.iters, q))
             for r in range(nproc)]
    for p in procs:
        p.start()
    results = {}
    ok = True
    for _ in range(nproc):
        rank, rows, err = q.get(timeout=600)
        if err:
            print(f"rank {rank} failed:\n{err}", file=sys.stderr)
            ok = False
        results[rank] = rows
    for p in procs:
        p.join(timeout=30)
    if not ok:
        return 1
    nbytes = 4
    for d in state:
        nbytes *= d
    dev = f"NCCL on {nproc} GPUs" if backend == "nccl" else f"gloo on CPU, {nproc} ranks"
    print(f"allscan demo: state {list(state)} float32 ({nbytes / 2**20:.1f} MiB per rank), decay per key dim, {dev}")
    print(f"{'method':<10} {'reverse':<8} {'inclusive':<10} {'init':<5} {'time_us(max over ranks)':>24} {'bitwise':>8} {'rel_err_vs_fp64':>16}")
    all_ok = True
    for i, row in enumerate(results[0]):
        method, reverse, inclusive, use_init = row[:4]
        t = max(results[r][i][4] for r in range(nproc))
        bit = all(results[r][i][5] for r in range(nproc))
        rel = max(results[r][i][6] for r in range(nproc))
        good = bit and rel <= 1e-5
        all_ok &= good
        print(f"{method:<10} {str(reverse):<8} {str(inclusive):<10} {str(use_init):<5} {t:>24.1f} "
              f"{'yes' if bit else 'NO':>8} {rel:>16.2e}")
    print("check: " + ("every rank equals the sequential reference (bitwise) in every mode" if all_ok else "FAILED"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
