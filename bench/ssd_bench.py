#!/usr/bin/env python3
"""Mamba2's SSD sequence-parallel (``zeco_ssd``) on one GPU standing in for a rank, against the ideal and
against the head-parallel all-to-all scheme (Megatron-Core's Mamba context parallelism).

    torchrun --nproc-per-node 1 bench/ssd_bench.py --out DIR            # one GPU (the stand-in)

Forward + backward of the SSD (the gradients of x, dt, A, B, C, D), batch 1, ``--heads`` heads of
``--head-dim``, state ``--state``, ``--groups`` groups of B and C, bf16 x, B, C (dt, A, D fp32), T_local
tokens a rank. Rows, interleaved in one process (each repeat runs every row once, odd repeats reversed),
CUDA events around ``--inner`` back-to-back calls after warm-up, median of the repeats:

    ideal   fla's ``chunk_gla`` on the shard alone, the per-head decay broadcast over the state's K (q = C,
            k = B, v = dt x, g = dt A, the skip D x and the groups' broadcast as zeco_ssd does them): the
            kernel zeco_ssd runs (through zeco_gla), no communication: the floor
    zeco    ``zeco_ssd``: the rank ``--stand-in`` names (rank 1 of 3 by default: the incoming state's
            fold-in and its gradient issued, the scans over the one-rank group, so no transfer)
    a2a     the head-parallel scheme over ``--a2a-ranks`` ranks: all-to-all heads (x, dt, B, C: this rank
            keeps H/P heads and G/P groups of the whole sequence), the ideal's kernel on the whole
            sequence for those heads, all-to-all back (y), the same in the backward. On one GPU the
            all-to-alls are their pack and unpack copies (the data that stays on the rank); their transfer
            is not timed, as zeco's is not: both rows are a rank's own work.
    simple  fla's ``chunk_simple_gla`` (one decay per head, no broadcast) on the shard alone, where fla runs
            its gated backward: fla-core 0.6 refuses it on Hopper with Triton 3.4 to 3.7.0 (its issue #640)
            unless tilelang takes it, which it does for fp32 only; the row says so instead of a time.

Beside the times: the bytes one rank sends per fwd+bwd in each scheme (by the algorithm, not measured). The
agreement of ``zeco`` with ``ideal`` (max relative error of output and gradients) is printed: the stand-in's
scans run over the one-rank group, so its incoming state and the gradient from its right are zeros and it
computes the shard's own answer (``a2a`` on one GPU computes other data: its sequence is the rank's own
heads' pieces one after another). Writes DIR/ssd_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from gla_common import add_fla_autotune_option, add_stand_in_option, middle_rank_stand_in, progress

ROWS = ["ideal", "zeco", "a2a", "simple"]  # "simple" last: left out where fla refuses it
_say = progress("ssd_bench")


def _inputs(args, T, dev):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=dev).manual_seed(1)
    H, P, G, N = args.heads, args.head_dim, args.groups, args.state
    bf = getattr(torch, args.dtype)
    x = torch.randn(1, T, H, P, device=dev, generator=gen).to(bf)
    dt = F.softplus(torch.randn(1, T, H, device=dev, generator=gen) - 3)
    A = -torch.exp(torch.randn(H, device=dev, generator=gen))
    B, C = ((torch.randn(1, T, G, N, device=dev, generator=gen) / N ** 0.5).to(bf) for _ in range(2))
    D = torch.randn(H, device=dev, generator=gen)
    dy = torch.randn(1, T, H, P, device=dev, generator=gen).to(bf)
    return [t.requires_grad_(True) for t in (x, dt, A, B, C, D)], dy


def fla_ssd(x, dt, A, B, C, D, kernel="chunk_gla"):
    """The SSD by fla's ``kernel`` on what this rank holds: ``chunk_gla`` with the per-head decay broadcast
    over K (the ideal's), or ``chunk_simple_gla``."""
    H, G = x.shape[2], B.shape[2]
    q, k = (t.repeat_interleave(H // G, dim=2) for t in (C, B))
    v = (dt.unsqueeze(-1) * x.float()).to(x.dtype)
    g = dt * A
    if kernel == "chunk_gla":
        from fla.ops.gla import chunk_gla

        y, _ = chunk_gla(q, k, v, g.unsqueeze(-1).expand(*g.shape, q.shape[-1]), scale=1.0)
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        y, _ = chunk_simple_gla(q, k, v, g=g, scale=1.0)
    return (y.float() + D[:, None] * x.float()).to(x.dtype)


def simple_gla_refusal(ins, dy):
    """None where fla runs ``chunk_simple_gla``'s gated backward on these inputs, else why it does not."""
    import torch

    try:
        torch.autograd.grad(fla_ssd(*ins, kernel="chunk_simple_gla"), ins, dy)
    except RuntimeError as e:
        if "#640" not in str(e):  # fla's refusal names its issue; anything else (out of memory) is a failure
            raise
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def _to_heads(t, ranks):
    """The all-to-all that gives a rank ``1/ranks`` of the heads (dim 2) of the whole sequence, on one GPU:
    ``[b, T, H, ...] -> [b, ranks * T, H / ranks, ...]``, its pack and unpack copies (the stand-in's other
    ranks' tokens are its own)."""
    b, T, H = t.shape[:3]
    parts = t.reshape(b, T, ranks, H // ranks, *t.shape[3:]).movedim(2, 0)  # [ranks, b, T, H/r, ...]
    return parts.contiguous().movedim(0, 1).reshape(b, ranks * T, H // ranks, *t.shape[3:])


def _to_sequence(t, ranks):
    """The inverse all-to-all: ``[b, ranks * T, H / ranks, ...] -> [b, T, H, ...]``."""
    b, TT, h = t.shape[:3]
    T = TT // ranks
    parts = t.reshape(b, ranks, T, h, *t.shape[3:]).movedim(1, 0).contiguous()  # [ranks, b, T, h, ...]
    return parts.movedim(0, 2).reshape(b, T, ranks * h, *t.shape[3:]).contiguous()


def a2a_ssd(x, dt, A, B, C, D, ranks):
    """The head-parallel scheme on one rank: this rank's heads of the whole sequence, then back."""
    heads = x.shape[2] // ranks
    xs, dts, Bs, Cs = (_to_heads(t, ranks) for t in (x, dt, B, C))
    # the whole sequence (``ranks`` shards) for this rank's heads: A and D of the first heads stand in
    return _to_sequence(fla_ssd(xs, dts, A[:heads], Bs, Cs, D[:heads]), ranks)


def _bytes(args, T):
    """Bytes one rank sends per fwd+bwd (by the algorithm): zeco one fp32 state each way per pass; a2a the
    (P-1)/P of x, dt, B, C out and y back in the forward, dy out and dx, ddt, dB, dC back in the backward."""
    H, P, G, N, R = args.heads, args.head_dim, args.groups, args.state, args.a2a_ranks
    el = 2 if args.dtype != "float32" else 4
    state = H * P * N * 4
    per_token = H * P * el * 2 + H * 4 + 2 * G * N * el  # x and y, dt, B and C
    return {"zeco": 2 * state, "a2a": 2 * T * per_token * (R - 1) / R}


def _measure(args, dev):
    import torch

    from allscan.ops.ssd import zeco_ssd

    results, checks, refused = [], {}, {}
    for T in args.tlocal:
        ins, dy = _inputs(args, T, dev)
        why = simple_gla_refusal(ins, dy)
        rows = ROWS if why is None else ROWS[:-1]
        if why is not None:
            refused[f"{T}/simple"] = why
            _say(f"T_local={T}: fla refuses chunk_simple_gla's backward here ({why}): no 'simple' row")

        def fwd_bwd(name):
            if name == "ideal":
                y = fla_ssd(*ins)
            elif name == "simple":
                y = fla_ssd(*ins, kernel="chunk_simple_gla")
            elif name == "zeco":
                y = zeco_ssd(*ins, torch.distributed.group.WORLD)[0]
            else:
                y = a2a_ssd(*ins, args.a2a_ranks)
            return (y,) + torch.autograd.grad(y, ins, dy)

        _say(f"T_local={T}: first fwd+bwd of every row (compiles kernels the first time)")
        outs = {n: fwd_bwd(n) for n in rows}
        # the stand-in's scans run over the one-rank group: its incoming state and the gradient from its
        # right are zeros, so it computes the ideal's answer (through the same chunk_gla kernels)
        checks[f"{T}/zeco"] = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                                  for a, b in zip(outs["zeco"], outs["ideal"]))
        del outs
        for _ in range(args.warmup):
            for n in rows:
                fwd_bwd(n)
        torch.cuda.synchronize()
        times = {n: [] for n in rows}
        for r in range(args.repeats):
            for n in (rows if r % 2 == 0 else rows[::-1]):
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.inner):
                    fwd_bwd(n)
                e1.record()
                torch.cuda.synchronize()
                times[n].append(e0.elapsed_time(e1) / args.inner)
        sent = _bytes(args, T)
        for n in rows:
            results.append(dict(T_local=T, row=n, ms=statistics.median(times[n]), ms_all=times[n],
                                sent_bytes=sent.get(n, 0)))
        _say(f"T_local={T}: " + ", ".join(f"{n} {statistics.median(times[n]):.2f} ms" for n in rows))
        torch.cuda.empty_cache()
    return results, checks, refused


def report(out):
    print(f"\nssd_bench: one GPU standing in for {out['stand_in']} rank, H={out['H']}, P={out['P']}, "
          f"N={out['N']}, G={out['G']}, {out['dtype']}, a2a over {out['a2a_ranks']} ranks, fwd+bwd, median of "
          f"{out['repeats']} (ms; x = ratio to ideal; MiB one rank sends per fwd+bwd, by the algorithm)")
    by = {(r["T_local"], r["row"]): r for r in out["results"]}
    print(f"{'T_local':>7s} " + " ".join(f"{n:>24s}" for n in ROWS))
    for T in sorted({r["T_local"] for r in out["results"]}):
        ideal = by[(T, "ideal")]["ms"]
        cells = [f"{by[(T, n)]['ms']:7.2f} {by[(T, n)]['ms'] / ideal:5.2f}x {by[(T, n)]['sent_bytes'] / 2 ** 20:7.1f}"
                 if (T, n) in by else "refused by fla" for n in ROWS]
        print(f"{T:7d} " + " ".join(f"{c:>24s}" for c in cells))
    for key, err in sorted(out["agreement_rel_err_vs_ideal"].items()):
        print(f"  agreement {key}: max relative error against ideal {err:.2e}")
    for key, why in sorted(out["refused"].items()):
        print(f"  {key}: {why}")


def run(args):
    import torch
    import torch.distributed as dist

    from allscan.ops.gla import limit_fla_autotune

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    if dist.get_world_size() != 1:
        raise SystemExit("ssd_bench.py: one rank (torchrun --nproc-per-node 1): the stand-in")
    if args.heads % args.a2a_ranks or args.groups % args.a2a_ranks:
        raise SystemExit(f"--a2a-ranks {args.a2a_ranks} must divide --heads {args.heads} and --groups {args.groups}")
    nk = limit_fla_autotune(args.fla_autotune)
    _say(f"T_local {args.tlocal}, fla autotune {args.fla_autotune!r} ({nk} kernels)")
    with middle_rank_stand_in(1, "allscan.ops.gla.zeco", args.stand_in):
        results, checks, refused = _measure(args, dev)
    out = dict(bench="ssd_bench", H=args.heads, P=args.head_dim, N=args.state, G=args.groups, dtype=args.dtype,
               a2a_ranks=args.a2a_ranks, stand_in={"middle": "a middle", "last": "the last", "first": "the first"}[
                   args.stand_in], repeats=args.repeats, inner=args.inner, fla_autotune=args.fla_autotune,
               host=socket.gethostname(), device=torch.cuda.get_device_name(dev), torch=torch.__version__,
               time=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="torchrun --nproc-per-node 1 bench/ssd_bench.py " + " ".join(sys.argv[1:]),
               agreement_rel_err_vs_ideal=checks, refused=refused, results=results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "ssd_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    report(out)
    print(f"wrote {path}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="ssd_bench_out")
    ap.add_argument("--tlocal", type=int, nargs="+", default=[16384])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--a2a-ranks", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    add_fla_autotune_option(ap, default="full")
    add_stand_in_option(ap)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
