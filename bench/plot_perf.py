"""Plot allscan_perf runs side by side: each row's ratio to the floor (the bare send/recv of the same
bytes, measured in the same run) against the state size.

    python3 bench/plot_perf.py LABEL=perf.json [LABEL=perf2.json ...] --out ratio.png [--op scan-pipelined]

Every JSON is one allscan_perf run (``-j``); its ``vs_floor`` column is already a same-run ratio, so
runs made in different processes (e.g. with different ALLSCAN_HEAD_FILL) compare fairly. Prints a
table (size x label) and writes the PNG; a dashed line marks 1.10x, the issue's bound at 2 MiB.
"""
from __future__ import annotations

import argparse
import json
import sys


def load(path: str, op: str):
    with open(path) as f:
        doc = json.load(f)
    rows = [r for r in doc.get("rows", []) if r.get("op") == op and r.get("vs_floor") is not None]
    # One point per size: the automatic block count when the run has several K for this op.
    by_size = {}
    for r in rows:
        if r["size"] not in by_size or r.get("K_auto"):
            by_size[r["size"]] = r
    fixed = sorted({str(r.get("K")) for r in by_size.values() if not r.get("K_auto")})
    if fixed:
        print(f"# {path}: no automatic-K row at some sizes; plotted K = {', '.join(fixed)} there")
    return doc, {s: by_size[s]["vs_floor"] for s in sorted(by_size)}


def human(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=path.json (an allscan_perf -j output)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--op", default="scan-pipelined", help="the row to plot (default scan-pipelined)")
    args = ap.parse_args(argv)

    series = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"runs: expected LABEL=path.json, got {spec!r}")
        doc, pts = load(path, args.op)
        if not pts:
            ap.error(f"runs: {path} has no {args.op!r} rows with a ratio to the floor")
        series.append((label, pts, doc))

    sizes = sorted({s for _, pts, _ in series for s in pts})
    print(f"{args.op}: time / floor (bare send/recv of the same bytes, same run)")
    print(f"{'size':>10} " + " ".join(f"{label:>10}" for label, _, _ in series))
    for s in sizes:
        print(f"{human(s):>10} " + " ".join(
            f"{pts[s]:>10.3f}" if s in pts else f"{'-':>10}" for _, pts, _ in series))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for label, pts, _ in series:
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.10, color="gray", linestyle="--", linewidth=0.8, label="1.10x")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([human(s) for s in sizes], rotation=45, ha="right")
    ax.set_xlabel("state bytes")
    ax.set_ylabel("time / bare send (same run)")
    first = series[0][2]
    v = first.get("nccl_version")
    nccl = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if isinstance(v, int) and v >= 10000 else str(v)
    ax.set_title(f"{args.op}, P = {first.get('nranks', '?')}, NCCL {nccl}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
