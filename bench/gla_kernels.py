"""Tile sweep of the incoming-state kernels of sequence-parallel GLA on one GPU.

    python3 bench/gla_kernels.py --out DIR [--fla-autotune full] [--kernels out,fwd,bwd]

For T in --tlocal (B = 1, H = 16, K = V = 128, bf16 inputs, Triton's default fp32 dot precision),
times ``output_with_state`` (the chunk output with the incoming state folded in) next to fla's
output kernel alone (one fixed config, or fla's own autotuning), ``correct_output_`` (the separate
forward correction: o += scale * (q * 2^G) @ S_in) and ``state_grad`` (backward: X = scale * sum_t
(q_t * 2^G_t)^T do_t) at each tile configuration: GPU time per call, ``--inner`` calls captured in one
CUDA graph and replayed, median of ``--repeats`` (launched one by one, this host's Triton launches
took longer than the kernels at T = 4K). Each configuration's relative error: the output kernels'
against their formula in float64 on the operands as stored (so the kernel's own rounding, fla's too),
the others against the torch-op reference. Writes gla_kernels.json and prints the fastest configuration
per kernel (summed over T); the library's defaults (FWD_O_TILES, FWD_TILES, BWD_TILES in
allscan/ops/gla/incoming_state.py) come from this table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from combine_bench import graph_time_us  # noqa: E402
from gla_common import add_fla_autotune_option  # noqa: E402

FWD = [dict(BK=128, BV=128, num_warps=8), dict(BK=32, BV=64, num_warps=4)]
# the first of each list is the library's default
# cps None: chunks per partial sum from the grid's occupancy (the library's rule); fixed counts beside it
BWD = [dict(BK=128, BV=128, num_warps=8, cps=None)] + [
    dict(BK=bk, BV=128, num_warps=w, cps=cps) for bk in (64, 128) for w in (4, 8) for cps in (4, 8, 16)]
OUT = [dict(BK=64, BV=128, num_warps=4, num_stages=2)] + [
    dict(BK=bk, BV=bv, num_warps=w, num_stages=st)
    for bk in (32, 64) for bv in (64, 128) for w in (4, 8) for st in (2, 3) if (bk, bv, w, st) != (64, 128, 4, 2)]


def exact_output(q, v, gc, A, h, S, off, scale, BT):
    """The output kernels' formula in float64 on the operands as stored: ``scale * (q * 2^gc) @ (h_c +
    diag(2^off_c) S) + tril(A) @ v`` per chunk (``S = None``: fla's output kernel, no incoming state), so
    an error against it is the kernel's own rounding."""
    import torch
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // BT
    qg = (q.double() * torch.exp2(gc.double())).view(B, NT, BT, H, K)
    hs = h.double().view(B, NT, H, K, V)
    if S is not None:
        hs = hs + torch.exp2(off.double())[..., None] * S.double()[:, None]
    o = scale * torch.einsum("bntok,bnokv->bntov", qg, hs)
    mask = torch.ones(BT, BT, device=q.device, dtype=torch.float64).tril()
    Am = A.double().view(B, NT, BT, H, BT) * mask[None, None, :, None, :]
    o = o + torch.einsum("bntoj,bnjov->bntov", Am, v.double().view(B, NT, BT, H, V))
    return o.reshape(B, T, H, V)


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _time(fn, repeats, inner):
    """GPU time per call (us): ``inner`` calls captured in one CUDA graph, replayed ``repeats`` times, the
    median (launched one by one, this host's Triton launches take longer than these kernels at small T)."""
    import torch
    return graph_time_us(torch, fn, inner, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tlocal", default="8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--kernels", default="out,fwd,bwd", help="which of out, fwd, bwd to sweep")
    add_fla_autotune_option(ap)
    args = ap.parse_args()
    tlocal = [int(x) for x in args.tlocal.split(",")]
    if any(T <= 0 or T % 64 for T in tlocal):  # the exact output is formed chunk by chunk
        ap.error(f"--tlocal: positive multiples of the 64-token chunk, got {args.tlocal}")
    kinds = args.kernels.split(",")
    if not kinds or set(kinds) - {"out", "fwd", "bwd"}:
        ap.error(f"--kernels: a comma-separated subset of out, fwd, bwd, got {args.kernels}")
    import torch

    from allscan.ops.gla import incoming_state as GT
    from allscan.ops.gla import limit_fla_autotune
    from allscan.ops.gla.chunk import torch_correct_, torch_state_grad

    limit_fla_autotune(args.fla_autotune)  # fla's output kernel: one fixed config, or fla's own tuning

    dev = torch.device("cuda", 0)
    H, K = args.heads, args.head_dim
    V, B, BT = K, 1, 64
    rows = []
    for T in tlocal:
        gen = torch.Generator(device=dev).manual_seed(T)
        q = torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16)
        do = torch.randn(B, T, H, V, device=dev, generator=gen).to(torch.bfloat16)
        o0 = torch.randn(B, T, H, V, device=dev, generator=gen).to(torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16
        NT = (T + BT - 1) // BT
        gc = (g.view(B, NT, BT, H, K).cumsum(2) / 0.6931471805599453).view(B, T, H, K).contiguous()
        S = torch.randn(B, H, K, V, device=dev, generator=gen) / K
        scale = K ** -0.5
        offs = GT.chunk_offsets(gc, T, BT)
        o_ref = o0.clone()
        torch_correct_(q, g, o_ref, S, scale, T)
        X_ref, _ = torch_state_grad(q, g, do, scale, T)
        # the output kernel with the state folded in, against fla's output kernel (+ the correction)
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.gla import chunk as fgc
        k_ = torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16)
        h, _ = chunk_fwd_h(k=k_, v=do, g=None, gk=gc, gv=None, h0=None, output_final_state=False, chunk_size=BT,
                           states_in_fp32=False)
        A = fgc.chunk_gla_fwd_intra_gk(q=q, k=k_, g=gc, scale=scale, chunk_size=BT)
        o_fla = fgc.chunk_gla_fwd_o_gk(q=q, v=do, g=gc, A=A, h=h, scale=scale, chunk_size=BT)
        o_exact = exact_output(q, do, gc, A, h, S, offs[0], scale, BT)
        err_fla = rel_err(o_fla, exact_output(q, do, gc, A, h, None, None, scale, BT))
        us_fla = _time(lambda: fgc.chunk_gla_fwd_o_gk(q=q, v=do, g=gc, A=A, h=h, scale=scale, chunk_size=BT),
                       args.repeats, args.inner)
        rows.append(dict(kernel="out_fla", T=T, us=us_fla, rel_err=err_fla))
        print(f"T={T:6d} fla output kernel alone: {us_fla:8.1f} us  rel err {err_fla:.2e} (its own formula)",
              flush=True)
        for kind, configs in (("out", OUT), ("fwd", FWD), ("bwd", BWD)):
            if kind not in kinds:
                continue
            for cfg in configs:
                if kind == "out":
                    o = GT.output_with_state(q, do, gc, A, h, S, scale, BT, offs, tiles=cfg)
                    err = rel_err(o, o_exact)
                    us = _time(lambda: GT.output_with_state(q, do, gc, A, h, S, scale, BT, offs, tiles=cfg),
                               args.repeats, args.inner)
                elif kind == "fwd":
                    o = o0.clone()
                    GT.correct_output_(o, q, gc, S, scale, T, BT, offsets=offs, tiles=cfg)
                    err = ((o.float() - o_ref.float()).norm() / (o_ref.float() - o0.float()).norm()).item()
                    ob = o0.clone()
                    us = _time(lambda: GT.correct_output_(ob, q, gc, S, scale, T, BT, offsets=offs, tiles=cfg),
                               args.repeats, args.inner)
                else:
                    X, _ = GT.state_grad(q, gc, do, scale, T, BT, tiles=cfg)
                    err = ((X - X_ref).norm() / X_ref.norm()).item()
                    us = _time(lambda: GT.state_grad(q, gc, do, scale, T, BT, tiles=cfg), args.repeats, args.inner)
                rows.append(dict(kernel=kind, T=T, tiles=cfg, us=us, rel_err=err))
                print(f"T={T:6d} {kind} {cfg}: {us:8.1f} us  rel err {err:.2e}", flush=True)
        us = _time(lambda: GT.chunk_offsets(gc, T, BT), args.repeats, args.inner)
        us_t = _time(lambda: GT.chunk_offsets_torch(gc, T, BT), args.repeats, args.inner)
        rows.append(dict(kernel="offsets", T=T, us=us, us_torch_ops=us_t))
        print(f"T={T:6d} offsets: one kernel {us:.1f} us, torch ops {us_t:.1f} us", flush=True)
    best = {}
    firsts = {"fwd": FWD[0], "bwd": BWD[0], "out": OUT[0]}
    for kind in kinds:
        tot = {}
        for r in rows:
            if r["kernel"] == kind:
                tot.setdefault(json.dumps(r["tiles"], sort_keys=True), []).append(r["us"])
        key = min(tot, key=lambda k: sum(tot[k]))
        best[kind] = dict(tiles=json.loads(key), us=tot[key], first_config_us=tot[json.dumps(firsts[kind], sort_keys=True)])
    doc = dict(bench="gla_kernels", device=torch.cuda.get_device_name(dev), torch=torch.__version__,
               H=H, K=K, V=V, B=B, BT=BT, time=time.strftime("%Y-%m-%d %H:%M:%S"),
               command="python3 bench/gla_kernels.py " + " ".join(sys.argv[1:]), rows=rows, best=best)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gla_kernels.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for kind, b in best.items():
        print(f"best {kind}: {b['tiles']} {['%.1f' % u for u in b['us']]} us (first config, the default: "
              f"{['%.1f' % u for u in b['first_config_us']]} us) at T = {args.tlocal}")
    fla = [r["us"] for r in rows if r["kernel"] == "out_fla"]
    print(f"fla's output kernel alone: {['%.1f' % u for u in fla]} us")


if __name__ == "__main__":
    main()
