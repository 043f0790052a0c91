#!/usr/bin/env python3
"""Sequence-parallel Gated DeltaNet and KDA operator benchmark: allscan against fla's own CP.

    torchrun --nproc-per-node 2 bench/delta_bench.py --out DIR          # on the GPU machine
    torchrun --nproc-per-node 1 bench/delta_bench.py --graph ...        # one GPU: another rank's work (below)
    python3 bench/delta_bench.py --model                                # the per-rank cost model only (CPU)

Forward + backward time of one operator (B = 1, H = 16, K = V = 128, bf16 by default), the sequence
cut over the ranks, T_local tokens per rank, for each layer in --layers and each T_local in --tlocal.
Rows, side by side in one process, interleaved (each repeat runs every row once; odd repeats in
reverse order), CUDA events around --inner back-to-back fwd+bwd calls after warm-up, the slowest
rank's time per call, median of the repeats:

    ideal       fla's chunk function on the local shard alone, no communication (the floor)
    zeco        ``zeco_*(method="zeco")``: the pipelined matrix All-Scan
    allgather   ``zeco_*(method="allgather")``: every rank's state and transition all-gathered
    fla_cp      ``zeco_*(method="fla_cp")``: fla's own context parallelism (``build_cp_context``)

Beside each row's time (CUDA events: what a training loop sees) the host's issue time of the same
calls (nothing synchronised inside; a row whose issue time reaches its time is host-bound), and with
``--graph`` the time of one fwd+bwd captured in a CUDA graph and replayed (the GPU's time without the
host; ``fla_cp`` is not captured), with whether the replay is bitwise the eager call. Peak memory above
the inputs for one fwd+bwd, per row (max over ranks). The agreement of the sequence-parallel rows is
checked first (relative error of output and gradients against ``fla_cp``). With one rank the ``zeco``
and ``allgather`` rows run what rank 1 of 3 (``--stand-in middle``, the default), the last of 2
(``last``) or the first of 2 (``first``) runs: the scans are issued over the one-rank group (no
transfer), and where the shard continues the sequence (middle, last) the fold-in too; ``fla_cp`` is
left out and the agreement is ``allgather`` against ``zeco``.
Writes DIR/delta_bench.json and prints a table with the ratios to ``ideal``; ``--model`` prints the
model of bytes received and combine FLOPs per rank for ``zeco`` and ``fla_cp`` at P = 2..256 (a model,
not a measurement). fla's kernels autotune as fla does by default (``--fla-autotune full``: each row,
the ideal and the widened shapes alike, gets its best configs; fla keeps them on disk, so a later run
on the same machine does not tune again); ``--fla-autotune one`` gives every kernel one fixed config instead (minutes
less tuning, a slower floor). fla's delta-rule backward needs tilelang on Hopper with Triton 3.6
(``../shared/tools/device_tilelang.sh``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from gla_common import add_fla_autotune_option, add_stand_in_option, captured_time, middle_rank_stand_in, progress

ROWS = ["ideal", "zeco", "allgather", "fla_cp"]
_say = progress("delta_bench")


def _inputs(layer, T, H, K, V, dtype, dev, seed):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(1, T, H, K, device=dev, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, device=dev, generator=gen, dtype=dtype)
    gshape = (1, T, H, K) if layer == "kda" else (1, T, H)
    g = (F.logsigmoid(torch.randn(*gshape, device=dev, generator=gen) + 3.0) / 4).to(torch.float32)
    beta = torch.rand(1, T, H, device=dev, generator=gen).to(dtype)
    do = torch.randn(1, T, H, V, device=dev, generator=gen, dtype=dtype)
    ins = [t.requires_grad_(True) for t in (q, k, v, g, beta)]
    return ins, do


def _measure(args, rows, dev):
    """``(results, agreement)``: every row's times and peak memory at every (layer, T_local)."""
    import torch
    import torch.distributed as dist

    from allscan.layers import zeco_gated_delta_rule, zeco_kda
    from allscan.ops.delta.fla_cp import fla_kernel
    from allscan.ops.delta.gates import DeltaOptions

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    H, K, V = args.heads, args.head_dim, args.head_dim
    results, checks = [], {}
    for layer in args.layers:
        op = zeco_kda if layer == "kda" else zeco_gated_delta_rule
        fn, kw = fla_kernel(DeltaOptions(per_key=layer == "kda"))
        for T in args.tlocal:
            ins, do = _inputs(layer, T, H, K, V, dtype, dev, 1000 + rank)
            q, k, v, g, beta = ins

            def fwd_bwd(name):
                if name == "ideal":
                    o, _ = fn(q, k, v, g, beta, **kw)
                    return (o,) + torch.autograd.grad(o, ins, do)
                o, _ = op(q, k, v, g, beta, group, method=name)
                return (o,) + torch.autograd.grad(o, ins, do)

            tag = f"{layer} T_local={T}"
            _say(f"{tag}: first fwd+bwd of every row (compiles kernels the first time)", rank, True)
            outs = {}
            for n in rows:
                outs[n] = fwd_bwd(n)
                torch.cuda.synchronize()
                _say(f"{tag}: {n} ran", rank)
            ref = outs["fla_cp" if world > 1 else "zeco"]
            for n in ("zeco", "allgather") if world > 1 else ("allgather",):
                checks[f"{layer}/{T}/{n}"] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                                                 .item() for a, b in zip(outs[n], ref))
            del outs, ref
            for _ in range(args.warmup):
                for n in rows:
                    fwd_bwd(n)
            torch.cuda.synchronize()
            _say(f"{tag}: timing {args.repeats} repeats x {len(rows)} rows x {args.inner} calls", rank, True)
            times = {n: [] for n in rows}
            hosts = {n: [] for n in rows}
            for r in range(args.repeats):
                for n in (rows if r % 2 == 0 else rows[::-1]):
                    dist.barrier()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        fwd_bwd(n)
                    t_host = (time.perf_counter() - t0) / args.inner * 1e3
                    e1.record()
                    torch.cuda.synchronize()
                    t = torch.tensor([e0.elapsed_time(e1) / args.inner, t_host], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[n].append(t[0].item())
                    hosts[n].append(t[1].item())
            graphs = {}
            if args.graph:
                _say(f"{tag}: captured", rank, True)
                for n in rows:
                    if n == "fla_cp":  # fla's CP reads cu_seqlens on the host: not capturable
                        continue
                    dist.barrier()
                    ms, equal = captured_time(fwd_bwd, n, args.inner, dev)
                    t = torch.tensor([ms, 0.0 if equal else 1.0], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    graphs[n] = dict(graph_ms=t[0].item(), graph_equal=t[1].item() == 0.0)
            if args.compiled:
                _say(f"{tag}: zeco under torch.compile(mode='reduce-overhead')", rank, True)
                dist.barrier()
                ms, equal = compiled_time(op, ins, do, group, args.inner, dev)
                t = torch.tensor([ms, 0.0 if equal else 1.0], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                graphs.setdefault("zeco", {}).update(compiled_ms=t[0].item(), compiled_equal=t[1].item() == 0.0)
            peaks = {}
            for n in rows:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd(n)
                torch.cuda.synchronize()
                p = torch.tensor([(torch.cuda.max_memory_allocated() - base) / 2 ** 20], device=dev)
                dist.all_reduce(p, op=dist.ReduceOp.MAX)
                peaks[n] = p.item()
            if args.profile:
                _profile(fwd_bwd, f"{layer}_{T}", rank, args.out)
            if args.host_profile:
                _host_profile(fwd_bwd, f"{layer}_{T}", rank, args.out)
                _host_split(fwd_bwd, f"{layer}_{T}", rank, args.out)
            for n in rows:
                results.append(dict(layer=layer, T_local=T, row=n, ms=statistics.median(times[n]), ms_all=times[n],
                                    host_ms=statistics.median(hosts[n]), peak_mib=peaks[n], **graphs.get(n, {})))
            _say(f"{tag}: " + ", ".join(f"{n} {statistics.median(times[n]):.2f} ms" for n in rows), rank)
            torch.cuda.empty_cache()
    return results, checks


def run(args):
    import torch
    import torch.distributed as dist

    from allscan.ops.gla import limit_fla_autotune

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS if world > 1 else [n for n in ROWS if n != "fla_cp"]
    nk = limit_fla_autotune(args.fla_autotune)
    _say(f"P={world}, layers {args.layers}, T_local {args.tlocal}, fla autotune {args.fla_autotune!r} ({nk} kernels)",
         rank)
    with middle_rank_stand_in(world, "allscan.ops.delta.prepare", args.stand_in):
        results, checks = _measure(args, rows, dev)
    H, K, V = args.heads, args.head_dim, args.head_dim
    out = dict(bench="delta_bench", world=world, B=1, H=H, K=K, V=V, dtype=args.dtype, repeats=args.repeats,
               inner=args.inner, warmup=args.warmup, fla_autotune=args.fla_autotune, host=socket.gethostname(),
               device=torch.cuda.get_device_name(dev), torch=torch.__version__, fla=_version("fla-core"),
               time=time.strftime("%Y-%m-%d %H:%M:%S"), middle_rank_stand_in=world == 1,
               stand_in=args.stand_in if world == 1 else None,
               command="torchrun --nproc-per-node %d bench/delta_bench.py %s" % (world, " ".join(sys.argv[1:])),
               agreement_rel_err=checks, agreement_reference="fla_cp" if world > 1 else "zeco", results=results)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "delta_bench.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        report(out)
        print(model_table(H, K, V, [2, 8, 32, 128, 256]))
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def _profile(fwd_bwd, tag, rank, outdir, calls=3):
    """``--profile``: torch.profiler tables (GPU kernels by total time, host ops by their own CPU time,
    and host time per call) of
    ``ideal`` and ``zeco``, per rank, into DIR/delta_profile_<layer>_<T>_rank<r>.txt."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"delta_profile_{tag}_rank{rank}.txt"), "w") as f:
        for name in ("ideal", "zeco"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fwd_bwd(name)
                host = (time.perf_counter() - t0) / calls
                torch.cuda.synchronize()
            f.write(f"== {name}: {calls} calls, host issue time {host * 1e3:.2f} ms per call (profiler on)\n")
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n")
            f.write(f"== {name}: the host's side, by CPU time of the op itself\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45) + "\n")


def compiled_time(op, ins, do, group, calls, dev):
    """(ms per fwd+bwd, bitwise equal to eager) of ``op`` under torch.compile(fullgraph=True,
    mode="reduce-overhead"): its custom ops inside inductor's CUDA-graph trees, after the calls that
    warm up and record them; best of 3 runs of ``calls`` calls."""
    import torch

    def step(q, k, v, g, beta):
        return op(q, k, v, g, beta, group)[0]

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")

    def fwd_bwd(fn):
        o = fn(*ins)
        return (o.detach().clone(),) + torch.autograd.grad(o, ins, do)

    for _ in range(3):
        got = fwd_bwd(compiled)
    equal = all(torch.equal(a, b) for a, b in zip(got, fwd_bwd(step)))
    times = []
    for _ in range(3):
        torch.cuda.synchronize(dev)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fwd_bwd(compiled)
        e1.record()
        torch.cuda.synchronize(dev)
        times.append(e0.elapsed_time(e1) / calls)
    return min(times), equal


def _host_profile(fwd_bwd, tag, rank, outdir, calls=5):
    """``--host-profile``: where the host's issue time goes (cProfile of eager fwd+bwd calls of ``ideal``
    and ``zeco``, by own time and by cumulative time), per rank, into DIR/delta_host_<layer>_<T>_rank<r>.txt."""
    import cProfile
    import io
    import pstats

    import torch

    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"delta_host_{tag}_rank{rank}.txt"), "w") as f:
        for name in ("ideal", "zeco"):
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(calls):
                fwd_bwd(name)
            prof.disable()
            host = (time.perf_counter() - t0) / calls
            torch.cuda.synchronize()
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(45)
                f.write(f"== {name}: {calls} calls, host issue time {host * 1e3:.2f} ms per call (cProfile on), "
                        f"by {order}\n{text.getvalue()}\n")


class _StageClock:
    """Host time spent in named functions (perf_counter around each call, no profiler): wraps the
    delta backend's steps, the op's scans (its documented hook ``allscan.ops.hooks.op_hooks.delta_scan``)
    and the scan handle's ``wait`` while active."""

    def __init__(self):
        self.ms = {}
        self._undo = []

    def wrap(self, owner, attr, label, static=False):
        real = getattr(owner, attr)
        original = owner.__dict__[attr] if static else real  # the staticmethod object itself

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + (time.perf_counter() - t0) * 1e3

        setattr(owner, attr, staticmethod(timed) if static else timed)
        self._undo.append((owner, attr, original))

    def restore(self):
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)
        self._undo.clear()


def _host_split(fwd_bwd, tag, rank, outdir, calls=10, rounds=5):
    """``--host-profile``, second part: the host's issue time of ``ideal`` and ``zeco`` without a
    profiler: ``total``, ``backward (autograd.grad)`` and ``forward (all but backward)``, and for zeco
    the stages inside them (nested: the backend's steps as allscan calls them, the outputs' step with
    the folding kernel and the scan's wait inside it, ``Q'^T do``, the scans' issue forward and reverse
    together, the handle's wait). ms per fwd+bwd, the mean of
    ``calls`` per round, the median of ``rounds`` rounds that alternate the two rows (this host's
    issue time drifts), into DIR/delta_host_split_*.json."""
    import torch

    from allscan.ops.delta.fla import FlaDelta
    from allscan.ops.hooks import op_hooks
    from allscan.ops.scan import ScanHandle

    clock = _StageClock()
    per_round = {"ideal": [], "zeco": []}
    for r in range(rounds):
        for name in ("ideal", "zeco") if r % 2 == 0 else ("zeco", "ideal"):
            clock.ms = {}
            if name == "zeco":
                for attr in ("states", "outputs", "fold_state_grad", "backward"):
                    clock.wrap(FlaDelta, attr, f"step {attr}", static=True)
                clock.wrap(op_hooks, "delta_scan", "allscan.scan (issue, forward and reverse)")
                clock.wrap(ScanHandle, "wait", "scan handle wait")
            clock.wrap(torch.autograd, "grad", "backward (autograd.grad)")
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fwd_bwd(name)
                total = (time.perf_counter() - t0) * 1e3 / calls
                torch.cuda.synchronize()
            finally:
                clock.restore()
            stages = {k: v / calls for k, v in sorted(clock.ms.items())}
            stages["forward (all but backward)"] = total - stages["backward (autograd.grad)"]
            stages["total"] = total
            per_round[name].append(stages)
    out = {name: {k: statistics.median(st[k] for st in rs) for k in rs[0]} for name, rs in per_round.items()}
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"delta_host_split_{tag}_rank{rank}.json"), "w") as f:
        json.dump(dict(median_ms=out, rounds=per_round, calls_per_round=calls), f, indent=1)
    if rank == 0:
        for name, st in out.items():
            print(f"host split {tag} {name} (ms per fwd+bwd, median of {rounds} rounds): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in st.items()), flush=True)


def _version(pkg):
    try:
        from importlib.metadata import version
        return version(pkg)
    except Exception:  # noqa: BLE001
        return None


def report(out):
    # runs before --stand-in stood in for a middle rank (rank 1 of 2: a middle rank's code then)
    place = {"middle": "rank 1 of 3", "last": "the last of 2 ranks", "first": "the first of 2 ranks",
             None: "a middle rank"}[out.get("stand_in")]
    stand_in = f" (one GPU stands in for {place})" if out.get("middle_rank_stand_in") else ""
    print(f"\n{out['bench']}: P={out['world']}{stand_in}, H={out['H']}, K={out['K']}, V={out['V']}, {out['dtype']}, "
          f"fwd+bwd, slowest rank, median of {out['repeats']} (ms; x = ratio to ideal; peak MiB above the inputs)")
    by = {(r["layer"], r["T_local"], r["row"]): r for r in out["results"]}
    keys = sorted({(r["layer"], r["T_local"]) for r in out["results"]})
    print(f"{'layer':6s} {'T_local':>7s} " + " ".join(f"{n:>17s}" for n in ROWS))
    for layer, T in keys:
        ideal = by[(layer, T, "ideal")]["ms"]
        cells = []
        for n in ROWS:
            r = by.get((layer, T, n))
            cells.append(f"{r['ms']:6.2f} {r['ms'] / ideal:4.2f}x {r['peak_mib']:4.0f}" if r else f"{'-':>17s}")
        print(f"{layer:6s} {T:7d} " + " ".join(cells))
    print("host issue ms (x = issue / time: 1 is host-bound); captured ms (x = ratio to ideal captured, "
          "= : replay bitwise equal to eager)")
    print(f"{'layer':6s} {'T_local':>7s} " + " ".join(f"{n:>24s}" for n in ROWS))
    for layer, T in keys:
        ideal = by[(layer, T, "ideal")]
        cells = []
        for n in ROWS:
            r = by.get((layer, T, n))
            if r is None or "host_ms" not in r:
                cells.append(f"{'-':>24s}")
                continue
            cell = f"{r['host_ms']:5.2f} {r['host_ms'] / r['ms']:4.2f}x"
            if "graph_ms" in r:
                cell += f" {r['graph_ms']:5.2f} {r['graph_ms'] / ideal['graph_ms']:4.2f}x{'=' if r['graph_equal'] else '!'}"
            cells.append(f"{cell:>24s}")
        print(f"{layer:6s} {T:7d} " + " ".join(cells))
    compiled = [r for r in out["results"] if "compiled_ms" in r]
    if compiled:
        print("zeco under torch.compile(fullgraph=True, mode='reduce-overhead'): ms (x = ratio to ideal captured "
              "in a CUDA graph, = : bitwise equal to eager)")
        for r in compiled:
            ideal = by[(r["layer"], r["T_local"], "ideal")]
            base = f" {r['compiled_ms'] / ideal['graph_ms']:4.2f}x" if "graph_ms" in ideal else ""
            print(f"{r['layer']:6s} {r['T_local']:7d} {r['compiled_ms']:6.2f}{base}{'=' if r['compiled_equal'] else '!'}")
    ref = out.get("agreement_reference", "fla_cp")
    for key, err in sorted(out.get("agreement_rel_err", out.get("agreement_rel_err_vs_fla_cp", {})).items()):
        print(f"  agreement {key}: max relative error against {ref} {err:.2e}")


def model_table(H, K, V, worlds):
    """Per rank, per fwd (the bwd is the same with transposed transitions), all heads: what crosses
    into a rank and the combine work, by the algorithms' structure (not measured)."""
    lines = [f"\nmodel (not measured), per rank per forward, H={H}, K={K}, V={V}, fp32 states:",
             f"{'P':>5s} {'zeco recv':>12s} {'zeco combine':>14s} {'fla_cp recv':>13s} {'fla_cp merge':>14s}"]
    state = H * K * V * 4
    pair = H * K * (V + K) * 4
    combine = 2 * H * K * K * V
    for P in worlds:
        lines.append(f"{P:5d} {state / 2 ** 20:9.2f} MiB {combine / 1e9:10.3f} GF {(P - 1) * pair / 2 ** 20:10.2f} MiB "
                     f"{(P - 1) * combine / 1e9:10.3f} GF")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="delta_bench_out")
    ap.add_argument("--layers", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    ap.add_argument("--tlocal", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also write torch.profiler tables of ideal and zeco")
    ap.add_argument("--compiled", action="store_true",
                    help="also time zeco under torch.compile(fullgraph=True, mode='reduce-overhead')")
    ap.add_argument("--host-profile", action="store_true",
                    help="also write cProfile tables of the host's issue time of ideal and zeco, and its "
                         "split by stage without a profiler")
    ap.add_argument("--graph", action="store_true", help="also time each row captured in a CUDA graph (not fla_cp)")
    ap.add_argument("--model", action="store_true", help="print the per-rank cost model and exit (no GPU)")
    # fla's own autotuning by default: the floor is fla as its users run it (bench/README.md, delta_bench.py)
    add_fla_autotune_option(ap, default="full")
    add_stand_in_option(ap)
    args = ap.parse_args()
    if args.model:
        print(model_table(args.heads, args.head_dim, args.head_dim, [2, 8, 32, 128, 256]))
        return
    run(args)


if __name__ == "__main__":
    main()
