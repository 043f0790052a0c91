#!/usr/bin/env python3
"""Sequence-parallel GLA operator benchmark (the ZeCO paper's Tables 3-4, on our GPUs).

    torchrun --nproc-per-node 2 bench/gla_bench.py --out DIR            # on the GPU machine
    torchrun --nproc-per-node 2 bench/gla_bench.py --host --out DIR     # host time, eager and captured (gla_host.py)
    python3 bench/gla_bench.py --plot DIR/gla_bench.json --out DIR      # redraw the plot on CPU

Forward + backward time of one GLA operator (B = 1, H = 16, K = V = 128, bf16 by default) with the
sequence cut over the ranks, T_local tokens per rank, for every T_local in --tlocal. Rows, measured
side by side in one process, interleaved (each repeat runs every row once), CUDA events around
--inner back-to-back fwd+bwd calls after warm-up, the slowest rank's time per call, median of the
repeats:

    ideal        fla ``chunk_gla`` on the local shard alone, no communication (the floor)
    zeco         ``zeco_gla(method="zeco")``: pipelined All-Scan overlapped with the local work
    zeco_corr    the same with the incoming state applied by the separate correction kernel after
                 fla's output kernel (``set_fused_output(False)``), instead of folded into the output
    lasp2        ``zeco_gla(method="lasp2")``: all-gather of every rank's state (LASP-2 pattern)
    lasp1        ``zeco_gla(method="lasp1")``: serial chain of the states, waited for (LASP-1's
                 communication pattern; the local work is still parallel)
    lasp1_strict LASP-1 as its paper runs it: rank p receives the state, then runs its whole local
                 ``chunk_gla`` from it, then sends its final state on (and the reverse in backward):
                 the ranks' computations are serialised

Peak memory (max_memory_allocated above the inputs, one fwd+bwd) per row. Writes DIR/gla_bench.json
and DIR/gla_bench.png and prints a table with the ratios and the goals (zeco <= 1.03x ideal,
>= 1.8x faster than LASP-1, never slower than LASP-2).

Runtime on 2 H200s with the defaults: about 2-3 minutes, nearly all of it process start-up and the
first-time Triton compilation of fla's and our kernels (about 1-2 min); the timed part is short
(15 repeats x 5 rows x 4 calls of a few ms at each T_local). ``--fla-autotune one`` (default) gives
every fla kernel one fixed config (``limit_fla_autotune``), the same for every row, so the ratios
compare the same kernels; ``--fla-autotune full`` is fla's own autotuning (every config of every
kernel compiled and benchmarked for each new argument signature: 10+ minutes on a fresh machine).
Progress lines go to stderr, flushed (rank 0; every rank at the stage boundaries that communicate).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from gla_common import add_fla_autotune_option, add_stand_in_option, progress, pyplot, redraw

ROWS = ["ideal", "zeco", "zeco_corr", "lasp2", "lasp1", "lasp1_strict"]


def _lasp1_strict_fn():
    import torch
    import torch.distributed as dist
    from fla.ops.gla import chunk_gla

    class Lasp1Strict(torch.autograd.Function):
        """recv S_in from rank p-1 -> chunk_gla(initial_state=S_in) -> send S_out to rank p+1."""

        @staticmethod
        def forward(ctx, q, k, v, g, group):
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            B, T, H, K = q.shape
            V = v.shape[-1]
            S_in = None
            if rank > 0:
                S_in = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
                dist.recv(S_in, group=group, group_src=rank - 1)
            with torch.enable_grad():
                qq, kk, vv, gg = (x.detach().requires_grad_(True) for x in (q, k, v, g))
                h0 = None if S_in is None else S_in.requires_grad_(True)
                o, ht = chunk_gla(qq, kk, vv, gg, initial_state=h0, output_final_state=True)
            if rank < world - 1:
                dist.send(ht.detach().contiguous(), group=group, group_dst=rank + 1)
            ctx.save = (qq, kk, vv, gg, h0, o, ht, group)
            return o.detach()

        @staticmethod
        def backward(ctx, do):
            qq, kk, vv, gg, h0, o, ht, group = ctx.save
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            dht = torch.zeros_like(ht)
            if rank < world - 1:
                dist.recv(dht, group=group, group_src=rank + 1)
            wrt = [qq, kk, vv, gg] + ([h0] if h0 is not None else [])
            grads = torch.autograd.grad([o, ht], wrt, [do, dht])
            if h0 is not None:
                dist.send(grads[4].contiguous(), group=group, group_dst=rank - 1)
            return grads[0], grads[1], grads[2], grads[3], None

    return Lasp1Strict.apply


_say = progress("gla_bench")


def run(args):
    import torch
    import torch.distributed as dist
    from fla.ops.gla import chunk_gla

    from allscan.ops.gla import limit_fla_autotune, set_fused_output, zeco_gla

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    nk = limit_fla_autotune(args.fla_autotune)
    _say(f"P={world}, T_local={args.tlocal}, fla autotune {args.fla_autotune!r} ({nk} kernels)", rank)
    dtype = getattr(torch, args.dtype)
    H, K, V, B = args.heads, args.head_dim, args.head_dim, 1
    lasp1_strict = _lasp1_strict_fn()
    results = []
    checks = {}
    for T in args.tlocal:
        gen = torch.Generator(device=dev).manual_seed(1000 + rank)
        q = torch.randn(B, T, H, K, device=dev, generator=gen, dtype=dtype).requires_grad_(True)
        k = torch.randn(B, T, H, K, device=dev, generator=gen, dtype=dtype).requires_grad_(True)
        v = torch.randn(B, T, H, V, device=dev, generator=gen, dtype=dtype).requires_grad_(True)
        g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16).to(dtype)
        g.requires_grad_(True)
        do = torch.randn(B, T, H, V, device=dev, generator=gen, dtype=dtype)
        ins = [q, k, v, g]

        def fwd_bwd(name):
            if name == "ideal":
                o, _ = chunk_gla(q, k, v, g)
            elif name == "lasp1_strict":
                o = lasp1_strict(q, k, v, g, group)
            elif name == "zeco_corr":
                set_fused_output(False)
                try:
                    o, _ = zeco_gla(q, k, v, g, group, method="zeco")
                finally:
                    set_fused_output(True)
            else:
                o, _ = zeco_gla(q, k, v, g, group, method=name)
            grads = torch.autograd.grad(o, ins, do)
            return o, grads

        # agreement of the SP rows (same math, different communication); the first T compiles
        _say(f"T_local={T}: first fwd+bwd of every row (compiles kernels the first time)", rank, True)
        outs = {}
        for n in ROWS:
            if n != "ideal":
                outs[n] = fwd_bwd(n)
                torch.cuda.synchronize()
                _say(f"T_local={T}: {n} ran", rank)
        ref_o, ref_g = outs["lasp2"]
        for n, (o, gr) in outs.items():
            err = max([((o.float() - ref_o.float()).norm() / ref_o.float().norm()).item()] +
                      [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                       for a, b in zip(gr, ref_g)])
            checks[f"{T}/{n}"] = err
        del outs, ref_o, ref_g
        _say(f"T_local={T}: warm-up ({args.warmup} x every row)", rank)
        for _ in range(args.warmup):
            for n in ROWS:
                fwd_bwd(n)
        torch.cuda.synchronize()
        _say(f"T_local={T}: timing {args.repeats} repeats x {len(ROWS)} rows x {args.inner} calls", rank, True)

        times = {n: [] for n in ROWS}
        for r in range(args.repeats):
            order = ROWS if r % 2 == 0 else ROWS[::-1]
            for n in order:
                dist.barrier()
                torch.cuda.synchronize()
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.inner):
                    fwd_bwd(n)
                e1.record()
                torch.cuda.synchronize()
                t = torch.tensor([e0.elapsed_time(e1) / args.inner], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[n].append(t.item())
            if r == 0 or r + 1 == args.repeats:
                _say(f"T_local={T}: repeat {r + 1}/{args.repeats}: " +
                     ", ".join(f"{n} {times[n][-1]:.2f} ms" for n in ROWS), rank)
        if T in args.profile:
            _profile(fwd_bwd, T, rank, world, args.out)
        _say(f"T_local={T}: peak memory", rank)
        peaks = {}
        for n in ROWS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd(n)
            torch.cuda.synchronize()
            p = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 2 ** 20], device=dev)
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
            peaks[n] = p.item()
        for n in ROWS:
            results.append(dict(T_local=T, row=n, ms=statistics.median(times[n]), ms_all=times[n],
                                peak_mib=peaks[n]))
        del q, k, v, g, do, ins
        torch.cuda.empty_cache()
    out = dict(
        bench="gla_bench", world=world, B=B, H=H, K=K, V=V, dtype=args.dtype, repeats=args.repeats,
        inner=args.inner, warmup=args.warmup, fla_autotune=args.fla_autotune, host=socket.gethostname(),
        device=torch.cuda.get_device_name(dev), torch=torch.__version__,
        fla=_version("fla-core"), time=time.strftime("%Y-%m-%d %H:%M:%S"),
        command="torchrun --nproc-per-node %d bench/gla_bench.py %s" % (world, " ".join(sys.argv[1:])),
        agreement_rel_err_vs_lasp2=checks, fused_correction=_fused(), results=results)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "gla_bench.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        report(out)
        plot(out, args.out)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def _stage_host_times(fwd_bwd, calls: int = 8):
    """Host time per stage of a zeco fwd+bwd (microseconds per call, no synchronisation inside), from
    the op's hook ``allscan.ops.gla.host_stage_times`` over ``calls`` calls. ``glue`` is what the
    forward/backward bodies spend outside the stages, ``outside`` what the call spends outside them
    (argument checks, autograd)."""
    import torch

    from allscan.ops.gla import STAGES, host_stage_times

    fwd_bwd("zeco")
    torch.cuda.synchronize()
    with host_stage_times() as acc:
        t0 = time.perf_counter()
        for _ in range(calls):
            fwd_bwd("zeco")
        total = time.perf_counter() - t0
    torch.cuda.synchronize()
    us = {k: v / calls * 1e6 for k, v in acc.items()}
    scans = us.get("scan issue", 0.0) + us.get("scan wait", 0.0)
    body = us.get("forward body", 0.0) + us.get("backward body", 0.0)
    rows = [(k, us.get(k, 0.0)) for k in STAGES + ("scan issue", "scan wait")]
    rows.append(("glue (bodies minus stages and scans)", body - sum(us.get(k, 0.0) for k in STAGES) - scans))
    rows.append(("outside the bodies (checks, autograd)", total / calls * 1e6 - body))
    out = [f"--- zeco: host time per stage, us per fwd+bwd call ({calls} calls, total "
           f"{total / calls * 1e6:.0f} us)"]
    out += [f"  {k:40s} {v:9.1f}" for k, v in rows]
    return out


def _profile(fwd_bwd, T, rank, world, outdir):
    """Where a row's time goes, for ``ideal`` and ``zeco``: the host's issue time per call (no
    synchronisation inside; a row whose issue time exceeds its GPU time is host-bound) and
    torch.profiler's kernel table on the last rank (the one that applies an incoming state)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    lines = [f"profile at T_local={T}, rank {rank}"]
    for n in ("ideal", "zeco"):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(4):
            fwd_bwd(n)
        t_host = (time.perf_counter() - t0) / 4
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / 4
        lines.append(f"{n}: host issue {t_host * 1e3:.3f} ms/call, issue+drain {t_all * 1e3:.3f} ms/call")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                fwd_bwd(n)
            torch.cuda.synchronize()
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(4):
            fwd_bwd(n)
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        if rank == world - 1:
            lines.append(f"--- {n}: host (cProfile), 4 calls, by own time")
            lines.append(buf.getvalue())
            lines.append(f"--- {n}: 2 calls, sorted by self CUDA time")
            lines.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
    lines += _stage_host_times(fwd_bwd)
    text = "\n".join(lines)
    print(text, file=sys.stderr, flush=True)
    if rank == world - 1:
        os.makedirs(outdir, exist_ok=True)
        with open(os.path.join(outdir, f"gla_profile_T{T}.txt"), "w") as f:
            f.write(text + "\n")


def _fused():
    from allscan.ops.gla import fused_kernels_enabled
    return fused_kernels_enabled()


def _version(pkg):
    try:
        from importlib.metadata import version
        return version(pkg)
    except Exception:  # noqa: BLE001
        return None


def _table(out):
    by = {}
    for r in out["results"]:
        by.setdefault(r["T_local"], {})[r["row"]] = r
    return by


def _names(by):
    """The rows every T_local has (older result files lack the newer rows)."""
    return [n for n in ROWS if all(n in rows for rows in by.values())]


def report(out):
    by = _table(out)
    print(f"\nGLA fwd+bwd, P={out['world']}, B={out['B']}, H={out['H']}, K=V={out['K']}, {out['dtype']} "
          f"(slowest rank, median of {out['repeats']} repeats x {out['inner']} calls; fla autotune "
          f"{out.get('fla_autotune', 'full')!r}), ms:")
    names = _names(by)
    hdr = f"{'T_local':>8} " + " ".join(f"{n:>12}" for n in names) + \
        f" {'zeco/ideal':>10} {'lasp1/zeco':>10} {'l1strict/z':>10} {'lasp2/zeco':>10}"
    print(hdr)
    goals = []
    for T, rows in sorted(by.items()):
        ms = {n: rows[n]["ms"] for n in names}
        z = ms["zeco"]
        print(f"{T:>8} " + " ".join(f"{ms[n]:>12.3f}" for n in names) +
              f" {z / ms['ideal']:>10.3f} {ms['lasp1'] / z:>10.2f} {ms['lasp1_strict'] / z:>10.2f}"
              f" {ms['lasp2'] / z:>10.3f}")
        goals.append((T, z / ms["ideal"], ms["lasp1"] / z, ms["lasp1_strict"] / z, ms["lasp2"] / z))
    print("peak memory above inputs (MiB): " + "; ".join(
        f"T={T}: " + ", ".join(f"{n} {rows[n]['peak_mib']:.0f}" for n in names) for T, rows in sorted(by.items())))
    print("goals:")
    for T, zi, l1, l1s, l2 in goals:
        print(f"  T_local={T}: zeco/ideal {zi:.3f} ({'met' if zi <= 1.03 else 'MISSED'} <= 1.03); "
              f"lasp1_strict/zeco {l1s:.2f} ({'met' if l1s >= 1.8 else 'MISSED'} >= 1.8; "
              f"lasp1 comm-pattern-only row: {l1:.2f});"
              f" lasp2/zeco {l2:.3f} ({'met' if l2 >= 1.0 else 'MISSED'} >= 1)")
    worst = max(out.get("agreement_rel_err_vs_lasp2", {}).values() or [0.0])
    print(f"  rows agree with lasp2: max relative error {worst:.2e}; fused Triton correction used: "
          f"{out.get('fused_correction')}")


def plot(out, outdir):
    plt = pyplot()
    if plt is None:
        return
    by = _table(out)
    Ts = sorted(by)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(Ts))
    names = _names(by)
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        axes[0].bar([j + i * w for j in x], [by[T][n]["ms"] for T in Ts], w, label=n)
        axes[1].bar([j + i * w for j in x], [by[T][n]["ms"] / by[T]["ideal"]["ms"] for T in Ts], w, label=n)
    for ax in axes:
        ax.set_xticks([j + 0.4 - w / 2 for j in x])
        ax.set_xticklabels([f"{T // 1024}K" for T in Ts])
        ax.set_xlabel("tokens per GPU (T_local)")
    axes[0].set_ylabel("fwd+bwd time (ms)")
    axes[1].set_ylabel("time / ideal (single-GPU chunk_gla on the shard)")
    axes[1].axhline(1.03, color="k", ls="--", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Sequence-parallel GLA, P={out['world']}, H={out['H']}, K=V={out['K']}, {out['dtype']} "
                 f"({out.get('device', '')})")
    fig.tight_layout()
    path = os.path.join(outdir, "gla_bench.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="output directory")
    ap.add_argument("--tlocal", default="8192,16384,32768", help="tokens per GPU, comma-separated")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=4, help="back-to-back fwd+bwd calls per timing")
    ap.add_argument("--warmup", type=int, default=3)
    add_fla_autotune_option(ap)
    add_stand_in_option(ap)
    ap.add_argument("--plot", default=None, help="redraw the table and plot from this JSON (no GPU)")
    ap.add_argument("--profile", default="", help="T_local values (comma-separated) at which to print where "
                    "the time goes: host issue time and torch.profiler's kernel table for ideal and zeco")
    ap.add_argument("--host", action="store_true", help="host issue time, eager and CUDA-graph time of ideal and "
                    "zeco, and zeco's host time by part (bench/gla_host.py); one rank stands in for another (--stand-in)")
    args = ap.parse_args()
    if args.plot:
        redraw(args.plot, args.out, report, plot)
        return
    args.tlocal = [int(x) for x in args.tlocal.split(",")]
    args.profile = [int(x) for x in args.profile.split(",") if x]
    if args.host:
        from gla_host import run_host
        run_host(args, _say)
        return
    run(args)


if __name__ == "__main__":
    main()
