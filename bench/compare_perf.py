"""Before/after of two sets of allscan_perf runs (e.g. a refactor): per size and row, the median time
of the "after" runs over the median of the "before" runs, each run's time being its own median of
repeats. Runs made alternately in one session (scripts/gpu_suite.sh stage perfbase) compare fairly.

    python3 bench/compare_perf.py --before b1.json b2.json --after a1.json a2.json [--min-size 1M]

Prints one line per (op, K) and size, and the largest ratio from --min-size up; exits 1 when that
exceeds --limit (default: no limit).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(s[:-1]) * units[s[-1].upper()] if s and s[-1].upper() in units else int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4096, 64K or 1M, got {s!r}") from None


def times(paths):
    """(op, K label, size) -> the median over runs of each run's median time (us)."""
    per = defaultdict(list)
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        for r in doc.get("rows", []):
            if r.get("time_us") is None:
                continue
            k = "auto" if r.get("K_auto") else ("-" if r.get("K") is None else str(r["K"]))
            per[(r["op"], k, r["size"])].append(r["time_us"])
    return {key: statistics.median(v) for key, v in per.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", nargs="+", required=True, help="allscan_perf -j files of the earlier tree")
    ap.add_argument("--after", nargs="+", required=True, help="allscan_perf -j files of the later tree")
    ap.add_argument("--min-size", type=parse_size, default=1 << 20, help="smallest size the verdict covers")
    ap.add_argument("--limit", type=float, default=None, help="exit 1 when a ratio from --min-size exceeds it")
    args = ap.parse_args(argv)
    before, after = times(args.before), times(args.after)
    common = sorted(set(before) & set(after), key=lambda k: (k[0], k[1], k[2]))
    if not common:
        print("compare_perf: the two sets share no (op, K, size) row", file=sys.stderr)
        return 2
    print(f"{'op':<18} {'K':>5} {'size':>11} {'before_us':>10} {'after_us':>10} {'after/before':>12}")
    worst = None
    for op, k, size in common:
        b, a = before[(op, k, size)], after[(op, k, size)]
        ratio = a / b
        print(f"{op:<18} {k:>5} {size:>11} {b:>10.2f} {a:>10.2f} {ratio:>12.3f}")
        if size >= args.min_size and (worst is None or ratio > worst[0]):
            worst = (ratio, op, k, size)
    if worst is not None:
        print(f"# largest after/before from {args.min_size} B: {worst[0]:.3f} ({worst[1]}, K {worst[2]}, {worst[3]} B)")
        if args.limit is not None and worst[0] > args.limit:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
