"""What the GLA benchmarks (gla_bench.py, gla_train.py) share: progress lines, the fla autotune
option, and redrawing a run's table and plot from its JSON."""
from __future__ import annotations

import json
import os
import sys
import time

_T0 = time.monotonic()


def progress(tag: str):
    """``say(msg, rank=0, every_rank=False)``: a flushed progress line on stderr (rank 0, or every rank
    at the stage boundaries that communicate), with the seconds since start."""
    def say(msg, rank=0, every_rank=False):
        if every_rank or rank == 0:
            print(f"[{tag} rank {rank} +{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    return say


def add_fla_autotune_option(ap) -> None:
    ap.add_argument("--fla-autotune", default="one", choices=["one", "full"],
                    help="one: one fixed config per fla kernel (minutes less compilation); full: fla's autotuning")


def pyplot():
    """matplotlib's pyplot (Agg), or None with a line saying how to redraw later."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"(no plot: matplotlib unavailable: {e}; redraw with --plot on a machine that has it)")
        return None
    return plt


def redraw(path: str, outdir: str, report, plot) -> None:
    """``--plot PATH``: the table and the plot of a finished run, from its JSON (no GPU)."""
    with open(path) as f:
        out = json.load(f)
    report(out)
    os.makedirs(outdir, exist_ok=True)
    plot(out, outdir)
