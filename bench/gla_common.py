"""What the layer benchmarks (gla_bench.py, gla_host.py, gla_train.py, delta_bench.py) share: progress
lines, the fla autotune option, redrawing a run's table and plot from its JSON, one GPU standing in for
a middle rank, and the time of a captured CUDA graph."""
from __future__ import annotations

import contextlib
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


def add_fla_autotune_option(ap, default: str = "one") -> None:
    ap.add_argument("--fla-autotune", default=default, choices=["one", "full"],
                    help="one: one fixed config per fla kernel (minutes less compilation); full: fla's autotuning "
                         "(what users run; fla keeps its results on disk for the next run on the machine)")


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


PLACES = ("middle", "last", "first")  # the ranks one GPU can stand in for (middle_rank_stand_in)


@contextlib.contextmanager
def middle_rank_stand_in(world: int, module: str = "", place: str = "middle"):
    """With one rank: the sequence-parallel ops (``zeco_gla`` and the delta rules alike; ``module`` names
    the op for the reader only) cut their shards as rank 1 of 3 (``place="middle"``), as the last of 2
    (``"last"``) or as the first of 2 (``"first"``), through the documented hook
    ``allscan.ops.hooks.op_hooks.shard_cut``. For the first two the sequence continues from a previous
    rank, so the incoming-state work is issued (GLA's last rank takes its incoming state's gradient from
    its local backward; a middle rank computes it beside); every place issues both scans, over the
    one-rank group, so one GPU issues that rank's work. Ops handed a batch's ``SequenceContext`` (a whole
    model made sequence-parallel: ``allscan.integrations``' layers) take their cut from it rather than
    from the hook: its ``cut`` is stood in for the same way, and the ``cut_world`` hook tells the compiled ops
    the ranks the stood-in cut spans. With more ranks: nothing changes."""
    import copy

    from allscan.context import SequenceContext
    from allscan.ops.hooks import forget_plans, op_hooks, replaced

    if place not in PLACES:
        raise ValueError(f"place: one of {PLACES}, got {place!r}")
    if world > 1:
        yield
        return
    real, real_context_cut = op_hooks.shard_cut, SequenceContext.cut

    def as_place(cut):
        if not cut.varlen:
            cut = copy.copy(cut)  # a context keeps its cuts: leave its own as they were
            cut.world, cut.rank = {"middle": (3, 1), "last": (2, 1), "first": (2, 0)}[place]
            cut.continued = cut.rank > 0
        return cut

    def stand_in(*args):
        return as_place(real(*args))

    def context_cut(ctx, *args, **kwargs):
        return as_place(real_context_cut(ctx, *args, **kwargs))

    # the ops reuse the cut of a call repeated with the same arguments: forget the cuts made before
    # (and, leaving, under) the stand-in
    forget_plans()
    try:
        # the compiled ops are traced for the ranks the stood-in cut spans (packed cuts are left as they are)
        world_of_cut = {"middle": 3, "last": 2, "first": 2}[place]
        with replaced(op_hooks, shard_cut=stand_in, cut_world=lambda group, packed: 1 if packed else world_of_cut):
            SequenceContext.cut = context_cut
            try:
                yield
            finally:
                SequenceContext.cut = real_context_cut
    finally:
        forget_plans()


def add_stand_in_option(ap) -> None:
    ap.add_argument("--stand-in", default="middle", choices=list(PLACES),
                    help="with one GPU, the rank it stands in for: rank 1 of 3, the last of 2 or the first of 2")


def captured_time(fwd_bwd, name, calls, dev):
    """(replay ms per call, bitwise equal to eager): one ``fwd_bwd(name)`` (returning a tuple of
    tensors) captured in a CUDA graph after warm-up on a side stream, replayed ``calls`` times, best of 3."""
    import torch

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd(name)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(name)
    eager = fwd_bwd(name)
    graph.replay()
    torch.cuda.synchronize(dev)
    equal = all(torch.equal(a, b) for a, b in zip(captured, eager))
    times = []
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            graph.replay()
        e1.record()
        torch.cuda.synchronize(dev)
        times.append(e0.elapsed_time(e1) / calls)
    del graph
    return min(times), equal
