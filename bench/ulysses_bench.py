#!/usr/bin/env python3
"""Ulysses attention with head-chunked overlap (HCMS) against serial Ulysses, yunchang and the floors.

    torchrun --nproc-per-node 2 bench/ulysses_bench.py --out DIR                          # NVLink
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=0 torchrun --nproc-per-node 2 bench/ulysses_bench.py \\
        --out DIR --tag host-staged                                                        # host-staged
    python3 bench/ulysses_bench.py --plot DIR/ulysses_bench.json --out DIR                 # redraw on CPU

At P ranks, bf16, for every head count (--heads, default 40,24), head_dim D (128) and total sequence
length (--seqs, default 32K,64K,128K; 256K works too, it just takes longer), forward ("fwd") and
forward + backward ("fwdbwd"), timed interleaved (every row once per repeat, ranks aligned by a
barrier before each timing), with CUDA events, after warm-up; the slowest rank's time, median over
repeats:

    attention        the floor: SDPA alone on the per-rank problem [B, H/P, S, D]
    a2a              the all-to-alls alone (allscan's C++ chunked all-to-all, C = 1): scatter q,k,v +
                     gather o (fwd); plus scatter do + gather dq,dk,dv (fwdbwd)
    a2a-torch        the same bytes through dist.all_to_all_single, no layout copies (NCCL floor)
    serial           UlyssesAttention(num_chunks=1): allscan's all-to-all, no overlap
    hcms-auto        UlyssesAttention(num_chunks="auto")
    hcms-C           UlyssesAttention(num_chunks=C) for every C of --chunks (at most H/P)
    yunchang         yunchang.UlyssesAttention with its attention function replaced by the same SDPA
                     call (skipped when yunchang is not importable)

Derived per (H, S, mode): rho = a2a / (a2a + attention) (communication share), exposed = serial -
attention, hidden = (serial - hcms) / exposed, speedups serial/hcms and yunchang/hcms. Writes
DIR/ulysses_bench[-TAG].json and .png and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def int_list(s: str) -> List[int]:
    out = []
    for part in s.split(","):
        part = part.strip().upper()
        if not part:
            continue
        mult = 1
        if part.endswith("K"):
            mult, part = 1024, part[:-1]
        try:
            v = int(part) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers (32K allowed), got {s!r}")
        if v <= 0:
            raise argparse.ArgumentTypeError(f"values must be > 0, got {s!r}")
        out.append(v)
    return out


# ------------------------------------------------------------------------------------------------
# Plot and table (CPU is enough)
# ------------------------------------------------------------------------------------------------

def derive(rows: List[dict]) -> List[dict]:
    """One summary per (heads, seq, mode)."""
    by: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        by.setdefault((r["heads"], r["seq"], r["mode"]), {})[r["variant"]] = r["ms"]
    out = []
    for (H, S, mode), v in sorted(by.items()):
        att, a2a, serial = v.get("attention"), v.get("a2a"), v.get("serial")
        auto = v.get("hcms-auto")
        sweep = {k: t for k, t in v.items() if k.startswith("hcms-") and k != "hcms-auto"}
        best_k = min(sweep, key=sweep.get) if sweep else None
        s = {"heads": H, "seq": S, "mode": mode, "attention_ms": att, "a2a_ms": a2a, "serial_ms": serial,
             "hcms_auto_ms": auto, "best_sweep": best_k, "best_sweep_ms": sweep.get(best_k) if best_k else None,
             "yunchang_ms": v.get("yunchang"), "auto_C": None}
        if att and a2a:
            s["rho"] = a2a / (a2a + att)
        if serial and att:
            s["exposed_ms"] = serial - att
            if auto:
                s["hidden_auto"] = (serial - auto) / (serial - att) if serial > att else None
                s["speedup_auto_vs_serial"] = serial / auto
            if best_k:
                s["hidden_best"] = (serial - sweep[best_k]) / (serial - att) if serial > att else None
        if auto and v.get("yunchang"):
            s["speedup_auto_vs_yunchang"] = v["yunchang"] / auto
        out.append(s)
    return out


def table(doc: dict) -> str:
    lines = [f"# ulysses_bench {doc.get('tag', '')}  P={doc['world']}  {doc['dtype']}  D={doc['head_dim']}  "
             f"causal={doc['causal']}  ({doc.get('host', '')})",
             f"{'H':>3} {'S':>7} {'mode':>6} {'attn':>8} {'a2a':>7} {'rho':>6} {'serial':>8} {'auto(C)':>12} "
             f"{'best C':>14} {'yunchang':>9} {'hidden':>7} {'x serial':>8} {'x yunch':>8}"]
    autoC = {(r["heads"], r["seq"], r["mode"]): r.get("C") for r in doc["rows"] if r["variant"] == "hcms-auto"}
    for s in doc["summary"]:
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        C = autoC.get((s["heads"], s["seq"], s["mode"]))
        best = "-" if not s.get("best_sweep") else f"{s['best_sweep_ms']:.2f}({s['best_sweep'][5:]})"
        lines.append(
            f"{s['heads']:>3} {s['seq'] // 1024:>6}K {s['mode']:>6} {f(s['attention_ms']):>8} {f(s['a2a_ms']):>7} "
            f"{f(s.get('rho'), 3):>6} {f(s['serial_ms']):>8} {f(s['hcms_auto_ms']) + '(' + str(C) + ')':>12} "
            f"{best:>14} {f(s['yunchang_ms']):>9} {f(s.get('hidden_auto'), 2):>7} "
            f"{f(s.get('speedup_auto_vs_serial'), 3):>8} {f(s.get('speedup_auto_vs_yunchang'), 3):>8}")
    lines.append("times in ms (slowest rank, median); rho = a2a/(a2a+attn); hidden = (serial-auto)/(serial-attn); "
                 "x = speedup of hcms-auto")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ulysses_bench.py: matplotlib is not available: no plot (redraw later with --plot)", file=sys.stderr)
        return False
    summ = doc["summary"]
    heads = sorted({s["heads"] for s in summ}, reverse=True)
    modes = [m for m in ("fwd", "fwdbwd") if any(s["mode"] == m for s in summ)]
    fig, axes = plt.subplots(len(heads), len(modes), figsize=(6.5 * len(modes), 4.2 * len(heads)), squeeze=False)
    variants = [("serial_ms", "serial Ulysses (C=1)"), ("hcms_auto_ms", "HCMS auto C"),
                ("best_sweep_ms", "HCMS best swept C"), ("yunchang_ms", "yunchang (same SDPA)")]
    for i, H in enumerate(heads):
        for j, m in enumerate(modes):
            ax = axes[i][j]
            rows = sorted((s for s in summ if s["heads"] == H and s["mode"] == m), key=lambda s: s["seq"])
            xs = list(range(len(rows)))
            width = 0.8 / len(variants)
            for k, (key, label) in enumerate(variants):
                ys = [(s[key] / s["attention_ms"]) if s.get(key) and s.get("attention_ms") else 0 for s in rows]
                ax.bar([x + (k - len(variants) / 2 + 0.5) * width for x in xs], ys, width, label=label)
            ax.axhline(1.0, color="k", lw=1, ls="--", label="attention alone (floor)")
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{s['seq'] // 1024}K\nrho={s.get('rho', 0):.2f}" for s in rows])
            ax.set_ylabel("time / attention alone")
            ax.set_title(f"H={H}, {m}, P={doc['world']} {doc.get('tag', '')}")
            lo = min([0.9] + [s[k] / s["attention_ms"] for s in rows for k, _ in variants[:4]
                              if s.get(k) and s.get("attention_ms")])
            ax.set_ylim(max(0.0, lo - 0.05), None)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ------------------------------------------------------------------------------------------------
# Measurement (GPU)
# ------------------------------------------------------------------------------------------------

def main_gpu(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import allscan
    from allscan import a2a
    from allscan.layers import UlyssesAttention

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    P, me = dist.get_world_size(), dist.get_rank()
    dtype = torch.bfloat16
    D, B = args.head_dim, args.batch

    yc_cls = None
    try:
        from yunchang import UlyssesAttention as YCUlysses  # noqa: N813
        yc_cls = YCUlysses
    except Exception as e:  # noqa: BLE001
        if me == 0:
            print(f"ulysses_bench: yunchang not importable ({type(e).__name__}: {e}); its rows are skipped",
                  file=sys.stderr)

    def sdpa_bshd(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *a, **kw):
        """yunchang's attention function replaced by the same SDPA call as ours ([B, S, H, D])."""
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal, scale=softmax_scale).transpose(1, 2)

    def make_yc():
        try:
            from yunchang.kernels import AttnType
            m = yc_cls(group, attn_type=AttnType.TORCH_FLASH)
        except Exception:  # noqa: BLE001
            m = yc_cls(group)
        m.attn_fn = sdpa_bshd
        return m

    def barrier():
        t = torch.zeros(1, device=dev)
        dist.all_reduce(t)
        torch.cuda.synchronize()

    def time_once(fn: Callable[[], None]) -> float:
        barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    rows: List[dict] = []
    t_start = time.time()
    for H in args.heads:
        n_me = len(range(*a2a.split_heads(0, H, P)[me]))
        n_min = H // P
        for S in args.seqs:
            if S % P:
                raise SystemExit(f"sequence length {S} is not a multiple of {P}")
            Sl = S // P
            g = torch.Generator(device=dev).manual_seed(100 + me)
            mk = lambda h, s=Sl: torch.randn(B, s, h, D, generator=g, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
            q, k, v, do = mk(H), mk(H), mk(H), mk(H)
            qa, ka, va, doa = (torch.randn(B, n_me, S, D, device=dev, dtype=dtype) for _ in range(4))
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            qag, kag, vag = (t.clone().requires_grad_(True) for t in (qa, ka, va))
            whole = a2a.split_heads(0, H, P)
            outs_s = [q.new_empty(B, S, n_me, D) for _ in range(3)]
            out_g = q.new_empty(B, Sl, H, D)
            outs_g3 = [q.new_empty(B, Sl, H, D) for _ in range(3)]
            flat_in = q.new_empty(B * Sl * H * D)
            flat_out = q.new_empty(B * Sl * H * D)

            def a2a_fwd():
                a2a.a2a_multi(a2a.SCATTER, [q, k, v], [whole] * 3, [H] * 3, group, outs=outs_s, check=False)
                a2a.a2a_multi(a2a.GATHER, [outs_s[0]], [whole], [H], group, outs=[out_g], check=False)

            def a2a_bwd():
                a2a.a2a_multi(a2a.SCATTER, [do], [whole], [H], group, outs=outs_s[:1], check=False)
                a2a.a2a_multi(a2a.GATHER, outs_s, [whole] * 3, [H] * 3, group, outs=outs_g3, check=False)

            def torch_a2a(n):
                for _ in range(n):
                    dist.all_to_all_single(flat_out, flat_in, group=group)

            variants: Dict[str, Dict[str, Callable[[], None]]] = {"fwd": {}, "fwdbwd": {}}
            variants["fwd"]["attention"] = lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=args.causal)

            def att_fb():
                qag.grad = kag.grad = vag.grad = None
                o = F.scaled_dot_product_attention(qag, kag, vag, is_causal=args.causal)
                o.backward(doa)

            variants["fwdbwd"]["attention"] = att_fb
            variants["fwd"]["a2a"] = a2a_fwd
            variants["fwdbwd"]["a2a"] = lambda: (a2a_fwd(), a2a_bwd())
            variants["fwd"]["a2a-torch"] = lambda: torch_a2a(4)
            variants["fwdbwd"]["a2a-torch"] = lambda: torch_a2a(8)

            def layer_fns(name, module):
                def fwd():
                    with torch.no_grad():
                        module(q, k, v, causal=args.causal)

                def fb():
                    qg.grad = kg.grad = vg.grad = None
                    o = module(qg, kg, vg, causal=args.causal)
                    o.backward(do)

                variants["fwd"][name] = fwd
                variants["fwdbwd"][name] = fb

            layers = {"serial": UlyssesAttention(group, num_chunks=1)}
            auto = UlyssesAttention(group, num_chunks="auto")
            layers["hcms-auto"] = auto
            for C in args.chunks:
                if 1 < C <= n_min:
                    layers[f"hcms-{C}"] = UlyssesAttention(group, num_chunks=C)
            if yc_cls is not None:
                layers["yunchang"] = make_yc()
            for name, mod in layers.items():
                layer_fns(name, mod)
            for mode in args.modes:
                fns = variants[mode]
                fns["hcms-auto"]()  # measures and caches the auto choice of this mode (forward / training)
                auto_C = auto.last_info["num_chunks"]
                auto_info = auto.last_info.get("auto")
                for name, fn in fns.items():  # warm-up
                    for _ in range(args.warmup):
                        fn()
                times: Dict[str, List[float]] = {name: [] for name in fns}
                names = list(fns)
                for rep in range(args.repeats):
                    # every other repeat in reverse order, so that drift (clocks, heat) does not
                    # favour the variants measured first
                    for name in (names if rep % 2 == 0 else names[::-1]):
                        times[name].append(time_once(fns[name]))
                for name, ts in times.items():
                    t = torch.tensor([statistics.median(ts), min(ts)], dtype=torch.float64, device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    row = {"heads": H, "seq": S, "mode": mode, "variant": name, "ms": t[0].item(),
                           "min_ms": t[1].item(), "repeats": len(ts)}
                    if name == "hcms-auto":
                        row["C"] = auto_C
                        if auto_info is not None:
                            row["auto"] = {k2: v2 for k2, v2 in auto_info.items() if k2 != "predicted_ms"}
                            row["auto"]["predicted_ms"] = {str(c): t2 for c, t2 in auto_info["predicted_ms"].items()}
                    elif name.startswith("hcms-"):
                        row["C"] = int(name[5:])
                    elif name == "serial":
                        row["C"] = 1
                    rows.append(row)
                if me == 0:
                    print(f"[{time.time() - t_start:6.1f}s] H={H} S={S} {mode}: " +
                          ", ".join(f"{n}={statistics.median(ts):.2f}" for n, ts in times.items()), flush=True)
            del q, k, v, do, qa, ka, va, doa, qg, kg, vg, qag, kag, vag, outs_s, out_g, outs_g3, flat_in, flat_out
            torch.cuda.empty_cache()
    if me == 0:
        doc = {
            "benchmark": "ulysses_bench", "tag": args.tag, "world": P, "dtype": "bfloat16", "head_dim": D,
            "batch": B, "causal": args.causal, "host": socket.gethostname(),
            "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE")},
            "torch": torch.__version__, "cpp_a2a": allscan.settings.a2a_impl != "torch", "yunchang": yc_cls is not None,
            "command": " ".join(sys.argv), "rows": rows,
        }
        doc["summary"] = derive(rows)
        write(doc, args.out)
    dist.barrier()
    dist.destroy_process_group()


def write(doc: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = "ulysses_bench" + (f"-{doc['tag']}" if doc.get("tag") else "")
    jpath = os.path.join(out, stem + ".json")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1)
    ok = plot(doc, os.path.join(out, stem + ".png"))
    print(f"wrote {jpath}" + (f" and {stem}.png" if ok else ""))
    print(table(doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " See the module docstring.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plot and table from a ulysses_bench JSON (CPU)")
    ap.add_argument("--tag", default="", help="suffix of the output files, e.g. nvlink or host-staged")
    ap.add_argument("--heads", type=int_list, default=[40, 24], help="head counts (default 40,24)")
    ap.add_argument("--seqs", type=int_list, default=[32768, 65536, 131072],
                    help="total sequence lengths (default 32K,64K,128K; 256K is allowed)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunks", type=int_list, default=[2, 4, 5, 8, 10], help="C sweep (default 2,4,5,8,10; <= H/P)")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="fwd,fwdbwd (default both)")
    ap.add_argument("--causal", action="store_true", help="causal attention (default: full)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("fwd", "fwdbwd"):
            ap.error(f"--modes: expected fwd and/or fwdbwd, got {m!r}")
    if args.plot:
        with open(args.plot) as f:
            doc = json.load(f)
        doc["summary"] = derive(doc["rows"])
        write(doc, args.out)
        return
    main_gpu(args)


if __name__ == "__main__":
    main()
