#!/usr/bin/env python3
"""Fit the All-Scan block-count model to measured times, check the automatic K, extrapolate in P.

Runs on CPU from the JSON written on the GPU machine by ``allscan_perf -j`` (the K sweep) or by
``bench/scan_bench.py`` (both write rows with ``size``, ``op``, ``method``, ``K``, ``K_auto``,
``time_us`` and a top-level ``nranks``)::

    python3 bench/fit_model.py ksweep.json [perf.json ...] --out DIR

The model (DESIGN.md; the core's allscanChooseNumBlocksModel): one message of n bytes between
neighbours costs ``a + b*n``; a chain of P ranks moving a state of N bytes in K blocks takes

    T_pipelined(P, N, K) = c + (P - 2 + K) * (a + b*N/K)

(the first block crosses P-1 links, the other K-1 follow one step behind each other; ``c`` is the
fixed cost of a call: launches, the combine kernel's tail). It is linear in (c, a, b), so it is fitted
by least squares on relative residuals over every pipelined row. At P = 2 the rows are
``c + K*a + N*b``: the K sweep gives ``a``, the sizes give ``b``.

Extrapolation (a model fitted on P-GPU measurements, NOT a measurement at larger P):

    pipelined:  c + min_K (P-2+K)(a + b N/K)
    serial:     c + (P-1)(a + b N)                         (LASP-1: every rank waits for the one before)
    allgather:  c + (P-1)(a + b N) + e (P+1) N             (LASP-2: NCCL ring all-gather, P-1 steps of
                                                            N bytes, then a local combine reading P
                                                            states; e per byte from the measured
                                                            scan-allgather minus nccl-allgather rows)

plotted next to the ZeCO paper's measured All-Scan vs All-Gather points (H100, state 32x128x128).

Outputs in --out: ``model_fit.json`` (parameters, per-size auto-K check, extrapolation table),
``model_fit.png`` (measured time vs K at every size with the model's curves) and
``model_extrapolation.png``. Exit status 0 unless the input is unusable, or ``--strict`` and the
automatic K is more than ``--tolerance`` (5%) slower than the best measured K at some size.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

# The ZeCO paper (arXiv 2507.01004): measured All-Scan vs All-Gather time of the state exchange,
# H100 GPUs, state 32x128x128. (P, all-scan ms, all-gather ms).
ZECO_PAPER_POINTS: Tuple[Tuple[int, float, float], ...] = (
    (8, 0.226, 0.375),
    (64, 0.739, 2.543),
    (256, 2.165, 8.514),
)
ZECO_STATE_ELEMS = 32 * 128 * 128

MAX_BLOCKS = 64          # allscanMaxBlocks
MIN_BLOCK_BYTES = 4096   # allscanMinBlockBytes
# Device-to-device copy on one H200 (bytes read + written per us), for the combine when unmeasured.
DEFAULT_COMBINE_US_PER_BYTE = 1.0 / 4.1e6


class ModelError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------
# Input
# ------------------------------------------------------------------------------------------------
def load_rows(paths: Sequence[str]) -> Tuple[int, List[dict], List[dict]]:
    """Rows of every file (which must agree on nranks) and the files' headers."""
    nranks: Optional[int] = None
    rows: List[dict] = []
    headers: List[dict] = []
    for p in paths:
        with open(p) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise ModelError(f"{p}: not valid JSON ({e})") from e
        if not isinstance(doc, dict) or "rows" not in doc or "nranks" not in doc:
            raise ModelError(f"{p}: expected an object with 'nranks' and 'rows' (allscan_perf -j or scan_bench.py output)")
        n = int(doc["nranks"])
        if nranks is not None and n != nranks:
            raise ModelError(f"{p}: nranks {n} differs from {nranks} of the other inputs; fit one P at a time")
        nranks = n
        for r in doc["rows"]:
            if r.get("skipped") or r.get("time_us") is None:
                continue
            rr = dict(r)
            rr["_file"] = p
            rows.append(rr)
        headers.append({k: v for k, v in doc.items() if k != "rows"})
    if nranks is None:
        raise ModelError("no input files")
    return nranks, rows, headers


def pipelined_rows(rows: Iterable[dict]) -> List[dict]:
    return [r for r in rows if r.get("method") == "pipelined" and r.get("K") and r.get("op", "").startswith("scan-")]


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
def t_pipelined(P: int, N: float, K: int, a: float, b: float, c: float = 0.0) -> float:
    return c + (P - 2 + K) * (a + b * N / K)


def k_max(N: float) -> int:
    return int(max(1, min(MAX_BLOCKS, N // MIN_BLOCK_BYTES)))


def best_k(P: int, N: float, a: float, b: float) -> int:
    """The K minimising the model (same rule as allscanChooseNumBlocksModel, searched exhaustively)."""
    if P <= 2:
        return 1
    ks = range(1, k_max(N) + 1)
    return min(ks, key=lambda k: t_pipelined(P, N, k, a, b))


def fit_pipelined(nranks: int, rows: Sequence[dict], with_constant: bool = True) -> Dict[str, float]:
    """Least squares on relative residuals: time = c + (P-2+K) a + (P-2+K)/K N b."""
    pts = [(float(r["size"]), int(r["K"]), float(r["time_us"])) for r in rows]
    if not pts:
        raise ModelError("no pipelined scan rows with a block count: run the K sweep (allscan_perf -m pipelined -K 1,2,4,...)")
    sizes = {n for n, _, _ in pts}
    ks = {k for _, k, _ in pts}
    if len(sizes) < 2:
        raise ModelError(f"the fit needs at least 2 sizes, got {sorted(sizes)}")
    P = nranks
    if P == 2 and len(ks) < 2 and with_constant:
        # c and a are not separable with one K at P = 2: fit a + b N only.
        with_constant = False
    cols = []
    for n, k, _ in pts:
        m = P - 2 + k
        row = [m, m * n / k]
        if with_constant:
            row.append(1.0)
        cols.append(row)
    A = np.array(cols, dtype=float)
    t = np.array([p[2] for p in pts], dtype=float)
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    a, b = float(coef[0]), float(coef[1])
    c = float(coef[2]) if with_constant else 0.0
    pred = A @ coef
    rel = (pred - t) / t
    return {
        "a_us": a,
        "b_us_per_byte": b,
        "c_us": c,
        "with_constant": with_constant,
        "points": len(pts),
        "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
        "max_rel_error": float(np.max(np.abs(rel))),
        "bandwidth_GBps": (1e-3 / b) if b > 0 else float("inf"),
    }


def fit_linear(rows: Sequence[dict]) -> Optional[Dict[str, float]]:
    """time = a + b N on relative residuals (for the floor and the all-gather rows)."""
    pts = [(float(r["size"]), float(r["time_us"])) for r in rows]
    if len({n for n, _ in pts}) < 2:
        return None
    A = np.array([[1.0, n] for n, _ in pts])
    t = np.array([p[1] for p in pts])
    w = 1.0 / t
    coef, *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    return {"a_us": float(coef[0]), "b_us_per_byte": float(coef[1]), "points": len(pts)}


def fit_combine(nranks: int, rows: Sequence[dict]) -> Tuple[float, str]:
    """Per-byte cost e of the all-gather method's local combine: (scan-allgather - nccl-allgather) / ((P+1) N)."""
    by_size: Dict[int, Dict[str, float]] = {}
    for r in rows:
        if r.get("op") in ("scan-allgather", "nccl-allgather"):
            by_size.setdefault(int(r["size"]), {})[r["op"]] = float(r["time_us"])
    est = []
    for n, d in by_size.items():
        if n >= (1 << 20) and "scan-allgather" in d and "nccl-allgather" in d:
            est.append(max(0.0, d["scan-allgather"] - d["nccl-allgather"]) / ((nranks + 1) * n))
    if est:
        return float(np.median(est)), f"measured ({len(est)} sizes >= 1 MiB)"
    return DEFAULT_COMBINE_US_PER_BYTE, "default (4.1 TB/s device copy)"


def auto_k_check(rows: Sequence[dict], tolerance: float = 0.05) -> List[dict]:
    """Per size: the automatic K's time against the best measured K (fixed or automatic)."""
    out = []
    by_size: Dict[int, List[dict]] = {}
    for r in pipelined_rows(rows):
        by_size.setdefault(int(r["size"]), []).append(r)
    for n in sorted(by_size):
        rs = by_size[n]
        autos = [r for r in rs if r.get("K_auto")]
        fixed = [r for r in rs if not r.get("K_auto")]
        if not autos or not fixed:
            continue
        auto = min(autos, key=lambda r: float(r["time_us"]))
        best = min(rs, key=lambda r: float(r["time_us"]))
        ratio = float(auto["time_us"]) / float(best["time_us"])
        out.append({
            "size": n,
            "auto_K": int(auto["K"]),
            "auto_time_us": float(auto["time_us"]),
            "best_K": int(best["K"]),
            "best_time_us": float(best["time_us"]),
            "ratio": ratio,
            "ok": ratio <= 1.0 + tolerance,
        })
    return out


def extrapolate(fit: Dict[str, float], e: float, N: float, Ps: Sequence[int]) -> List[dict]:
    a, b, c = fit["a_us"], fit["b_us_per_byte"], fit["c_us"]
    out = []
    for P in Ps:
        K = best_k(P, N, a, b)
        out.append({
            "P": P,
            "K": K,
            "pipelined_us": t_pipelined(P, N, K, a, b, c),
            "serial_us": c + (P - 1) * (a + b * N),
            "allgather_us": c + (P - 1) * (a + b * N) + e * (P + 1) * N,
        })
    return out


# ------------------------------------------------------------------------------------------------
# Plots (matplotlib is optional: without it the JSON and the tables are still written)
# ------------------------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception:  # noqa: BLE001
        return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024.0
    return f"{n:g}"


def plot_fit(path: str, nranks: int, rows: Sequence[dict], fit: Dict[str, float], gpu: str) -> bool:
    plt = _plt()
    if plt is None:
        return False
    pr = pipelined_rows(rows)
    sizes = sorted({int(r["size"]) for r in pr})
    fig, ax = plt.subplots(figsize=(8, 5.5))
    cmap = plt.get_cmap("viridis")
    for i, n in enumerate(sizes):
        col = cmap(i / max(1, len(sizes) - 1))
        pts = sorted(((int(r["K"]), float(r["time_us"]), bool(r.get("K_auto"))) for r in pr if int(r["size"]) == n))
        ks = [k for k, _, auto in pts if not auto]
        ts = [t for _, t, auto in pts if not auto]
        ax.plot(ks, ts, "o", color=col, label=f"{human_bytes(n)} measured")
        for k, t, auto in pts:
            if auto:
                ax.plot([k], [t], "*", color=col, markersize=13, markeredgecolor="k")
        kk = np.arange(1, max(ks + [1]) + 1)
        ax.plot(kk, [t_pipelined(nranks, n, int(k), fit["a_us"], fit["b_us_per_byte"], fit["c_us"]) for k in kk],
                "-", color=col, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("pipeline blocks K")
    ax.set_ylabel("time per All-Scan (us)")
    ax.set_title(
        f"All-Scan (pipelined) on {nranks} GPUs{(' (' + gpu + ')') if gpu else ''}: measured (dots; * = automatic K)\n"
        f"vs model c + (P-2+K)(a + bN/K): a={fit['a_us']:.2f} us, 1/b={fit['bandwidth_GBps']:.0f} GB/s, c={fit['c_us']:.2f} us",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_extrapolation(path: str, nranks: int, table: Sequence[dict], N: float, gpu: str) -> bool:
    plt = _plt()
    if plt is None:
        return False
    Ps = [r["P"] for r in table]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(Ps, [r["pipelined_us"] / 1e3 for r in table], "-o", label="All-Scan, pipelined (model)")
    ax.plot(Ps, [r["serial_us"] / 1e3 for r in table], "-s", label="serial / LASP-1 (model)")
    ax.plot(Ps, [r["allgather_us"] / 1e3 for r in table], "-^", label="all-gather / LASP-2 (model)")
    ax.plot([p for p, _, _ in ZECO_PAPER_POINTS], [s for _, s, _ in ZECO_PAPER_POINTS], "D", color="C0",
            markerfacecolor="none", markersize=10, label="ZeCO paper: All-Scan (measured, H100)")
    ax.plot([p for p, _, _ in ZECO_PAPER_POINTS], [g for _, _, g in ZECO_PAPER_POINTS], "D", color="C2",
            markerfacecolor="none", markersize=10, label="ZeCO paper: All-Gather (measured, H100)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs P")
    ax.set_ylabel("time (ms)")
    ax.set_title(
        f"MODEL fitted on {nranks}-GPU measurements{(' (' + gpu + ')') if gpu else ''}, extrapolated to P = "
        f"{Ps[0]}..{Ps[-1]} (not measured at P > {nranks})\nstate {human_bytes(N)} per rank "
        f"(paper: 32x128x128 = {ZECO_STATE_ELEMS} elements)\n"
        f"open diamonds: the ZeCO paper's measurements on H100 (other hardware, other links)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="JSON from allscan_perf -j (the K sweep) and/or scan_bench.py")
    ap.add_argument("--out", required=True, help="output directory (model_fit.json, model_fit.png, model_extrapolation.png)")
    ap.add_argument("--state-bytes", type=int, default=ZECO_STATE_ELEMS * 4,
                    help="state size N for the extrapolation (default 32x128x128 fp32 = 2 MiB, the paper's state)")
    ap.add_argument("--pmax", type=int, default=256, help="largest P of the extrapolation (default 256)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="auto K may be this much slower than the best K (0.05)")
    ap.add_argument("--no-constant", action="store_true", help="fit a and b only (c = 0)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the automatic K misses the tolerance at some size")
    args = ap.parse_args(argv)
    if args.state_bytes <= 0:
        ap.error(f"--state-bytes must be > 0, got {args.state_bytes}")
    if args.pmax < 2:
        ap.error(f"--pmax must be >= 2, got {args.pmax}")
    if not (args.tolerance >= 0):
        ap.error(f"--tolerance must be >= 0, got {args.tolerance}")

    try:
        nranks, rows, headers = load_rows(args.inputs)
        fit = fit_pipelined(nranks, pipelined_rows(rows), with_constant=not args.no_constant)
    except (ModelError, OSError) as e:
        print(f"fit_model.py: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    floor = fit_linear([r for r in rows if r.get("op") == "p2p-chain"])
    nccl_ag = fit_linear([r for r in rows if r.get("op") == "nccl-allgather"])
    e, e_src = fit_combine(nranks, rows)
    checks = auto_k_check(rows, args.tolerance)
    Ps = [p for p in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if p <= args.pmax]
    if args.pmax not in Ps:
        Ps.append(args.pmax)
    table = extrapolate(fit, e, float(args.state_bytes), Ps)
    gpu = ""
    for h in headers:
        devs = h.get("devices") or []
        if devs:
            gpu = str(devs[0]).split("] ")[-1].strip()
            break
    calibrated = next((h.get("link_model") for h in headers if h.get("link_model")), None)

    # Per size: the model's best K vs the measured best K.
    per_size = []
    pr = pipelined_rows(rows)
    for n in sorted({int(r["size"]) for r in pr}):
        rs = [r for r in pr if int(r["size"]) == n]
        mb = min(rs, key=lambda r: float(r["time_us"]))
        kb = best_k(nranks, n, fit["a_us"], fit["b_us_per_byte"])
        per_size.append({"size": n, "measured_best_K": int(mb["K"]), "model_best_K": kb,
                         "measured_best_us": float(mb["time_us"]),
                         "model_us_at_measured_best_K": t_pipelined(nranks, n, int(mb["K"]), fit["a_us"], fit["b_us_per_byte"], fit["c_us"])})

    print(f"# block-count model fitted on {nranks} GPUs{(' (' + gpu + ')') if gpu else ''}, {fit['points']} pipelined rows")
    print(f"#   T = c + (P-2+K)(a + bN/K):  a = {fit['a_us']:.3f} us   b = {fit['b_us_per_byte']:.4g} us/B "
          f"({fit['bandwidth_GBps']:.1f} GB/s)   c = {fit['c_us']:.3f} us   rms rel err {fit['rms_rel_error']:.3f}, max {fit['max_rel_error']:.3f}")
    if floor:
        print(f"#   floor (p2p-chain) a + bN:   a = {floor['a_us']:.3f} us   b = {floor['b_us_per_byte']:.4g} us/B")
    if calibrated:
        print(f"#   core's link model (allscanCalibrate/-L): {calibrated}")
    print(f"#   all-gather combine: {e:.4g} us/B ({e_src})")
    if checks:
        print("#\n# automatic K vs best measured K (tolerance {:.0%})".format(args.tolerance))
        print(f"# {'size':>12} {'auto K':>7} {'auto us':>10} {'best K':>7} {'best us':>10} {'ratio':>7}  ok")
        for c in checks:
            print(f"  {c['size']:>12} {c['auto_K']:>7} {c['auto_time_us']:>10.2f} {c['best_K']:>7} {c['best_time_us']:>10.2f} "
                  f"{c['ratio']:>7.3f}  {'yes' if c['ok'] else 'NO'}")
    else:
        print("# (no size has both an automatic-K row and a fixed-K row: auto-K check skipped)")
    print(f"#\n# MODEL extrapolation (fitted on {nranks} GPUs), state {args.state_bytes} B; paper (H100) in brackets")
    paper = {p: (s, g) for p, s, g in ZECO_PAPER_POINTS}
    print(f"# {'P':>5} {'K':>4} {'pipelined ms':>13} {'serial ms':>10} {'allgather ms':>13}   paper all-scan / all-gather ms")
    for r in table:
        pp = paper.get(r["P"])
        ptxt = f"[{pp[0]:.3f} / {pp[1]:.3f}]" if pp else ""
        print(f"  {r['P']:>5} {r['K']:>4} {r['pipelined_us'] / 1e3:>13.4f} {r['serial_us'] / 1e3:>10.4f} "
              f"{r['allgather_us'] / 1e3:>13.4f}   {ptxt}")

    out = {
        "tool": "fit_model",
        "inputs": list(args.inputs),
        "nranks": nranks,
        "gpu": gpu,
        "model": "T = c + (P-2+K)(a + b*N/K)",
        "fit": fit,
        "floor_fit": floor,
        "nccl_allgather_fit": nccl_ag,
        "combine_us_per_byte": e,
        "combine_source": e_src,
        "core_link_model": calibrated,
        "auto_k_check": checks,
        "auto_k_ok": all(c["ok"] for c in checks) if checks else None,
        "per_size": per_size,
        "extrapolation": {"state_bytes": args.state_bytes, "label": f"model fitted on {nranks}-GPU measurements", "rows": table},
        "paper_points": [{"P": p, "allscan_ms": s, "allgather_ms": g, "hardware": "H100", "state": "32x128x128"}
                         for p, s, g in ZECO_PAPER_POINTS],
    }
    with open(os.path.join(args.out, "model_fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    p1 = plot_fit(os.path.join(args.out, "model_fit.png"), nranks, rows, fit, gpu)
    p2 = plot_extrapolation(os.path.join(args.out, "model_extrapolation.png"), nranks, table, float(args.state_bytes), gpu)
    print(f"# wrote {os.path.join(args.out, 'model_fit.json')}" + ("" if p1 and p2 else " (matplotlib missing: no PNG)"))
    if args.strict and checks and not all(c["ok"] for c in checks):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
