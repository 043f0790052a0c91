"""CPU tests of the layer benchmarks' parts: the one-GPU stand-in for a middle rank (bench/gla_common.py),
the tables of bench/gla_host.py (``gla_bench.py --host``) and bench/delta_bench.py. The timing itself
needs GPUs and fla-core."""
import importlib
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gh, db, common = _load("gla_host"), _load("delta_bench"), _load("gla_common")


def test_one_rank_stands_in_for_a_middle_rank_and_restores():
    import torch

    from allscan.ops.hooks import op_hooks

    real = op_hooks.shard_cut
    with common.middle_rank_stand_in(1, "zeco_gla"):
        segs = op_hooks.shard_cut(None, 8, 1, None, "t")
        assert (segs.world, segs.rank, segs.continued) == (3, 1, True)
        packed = op_hooks.shard_cut(None, 8, 1, torch.tensor([0, 3, 8]), "t")  # varlen: left as it is
        assert (packed.world, packed.continued) == (1, False)
    assert op_hooks.shard_cut is real
    with common.middle_rank_stand_in(1, "zeco_gla", "last"):
        segs = op_hooks.shard_cut(None, 8, 1, None, "t")
        assert (segs.world, segs.rank, segs.continued) == (2, 1, True)
    assert op_hooks.shard_cut is real
    with common.middle_rank_stand_in(1, "zeco_gla", "first"):
        segs = op_hooks.shard_cut(None, 8, 1, None, "t")
        assert (segs.world, segs.rank, segs.continued) == (2, 0, False)
    assert op_hooks.shard_cut is real
    with common.middle_rank_stand_in(2, "zeco_gla"):
        assert op_hooks.shard_cut is real
    with pytest.raises(ValueError, match="place"):
        with common.middle_rank_stand_in(1, "zeco_gla", "second"):
            pass


def test_stage_names_are_the_ops():
    from allscan.ops.gla import STAGES

    assert set(gh.FLA_STAGES) | set(gh.ALLSCAN_KERNELS) == set(STAGES)
    assert not set(gh.FLA_STAGES) & set(gh.ALLSCAN_KERNELS)


def test_report_ratios():
    parts = dict(total=2000.0, fla_stages=1500.0, allscan_kernels=200.0, scans=60.0, layer_python=240.0)
    rows = []
    for T, (ie, ig, ze, zg) in {4096: (2.0, 1.0, 3.0, 1.1), 8192: (2.2, 2.0, 2.31, 2.06)}.items():
        rows.append(dict(T_local=T, row="ideal", host_ms=1.0, eager_ms=ie, graph_ms=ig, graph_equal=True))
        rows.append(dict(T_local=T, row="zeco", host_ms=2.0, eager_ms=ze, graph_ms=zg, graph_equal=True,
                         zeco_host_us_by_part=parts))
    text = gh.report_host(dict(world=1, middle_rank_stand_in=True, dtype="bfloat16", H=16, K=128, results=rows))
    assert "| 4096 | zeco | 2.000 | 3.000 | 1.100 | True | 1.500 | 1.100 |" in text
    assert "| 8192 | zeco | 2.000 | 2.310 | 2.060 | True | 1.050 | 1.030 |" in text
    # a run from before --stand-in existed stood in for rank 1 of 2
    assert "stands in for rank 1 of 2" in text and "8192: 2000 = 1500 + 200 + 60 + 240" in text
    for place, words in (("middle", "rank 1 of 3"), ("last", "the last of 2 ranks"), ("first", "the first of 2 ranks")):
        text = gh.report_host(dict(world=1, middle_rank_stand_in=True, stand_in=place, dtype="bfloat16", H=16,
                                   K=128, results=rows))
        assert f"stands in for {words}" in text


def test_delta_report_host_and_captured_columns(capsys):
    rows = []
    for n, (ms, host, graph) in dict(ideal=(3.0, 2.5, 2.0), zeco=(6.0, 6.0, 2.6),
                                     allgather=(6.1, 6.0, 2.7)).items():
        rows.append(dict(layer="gdn", T_local=8192, row=n, ms=ms, host_ms=host, peak_mib=100.0, graph_ms=graph,
                         graph_equal=n != "allgather"))
    rows[1].update(compiled_ms=2.2, compiled_equal=True)  # zeco under torch.compile(mode="reduce-overhead")
    db.report(dict(bench="delta_bench", world=1, middle_rank_stand_in=True, H=16, K=128, V=128, dtype="bfloat16",
                   repeats=3, results=rows, agreement_rel_err={"gdn/8192/allgather": 1e-7},
                   agreement_reference="zeco"))
    out = capsys.readouterr().out
    assert "one GPU stands in for a middle rank" in out  # a run from before --stand-in existed
    assert "  6.00 2.00x  100" in out  # zeco: 2x the ideal
    row = next(line for line in out.splitlines() if line.startswith("gdn") and "2.00x" in line)
    assert row.split()[-1] == "-"  # no fla_cp row with one rank
    assert " 6.00 1.00x  2.60 1.30x=" in out  # zeco: host-bound, captured 1.3x the ideal captured
    assert " 2.70 1.35x!" in out  # a replay that differs from eager is marked
    assert "gdn/8192/allgather: max relative error against zeco 1.00e-07" in out
    assert "gdn       8192   2.20 1.10x=" in out  # compiled: 1.1x the ideal captured, bitwise eager
    for place, words in (("middle", "rank 1 of 3"), ("last", "the last of 2 ranks"), ("first", "the first of 2 ranks")):
        db.report(dict(bench="delta_bench", world=1, middle_rank_stand_in=True, stand_in=place, H=16, K=128, V=128,
                       dtype="bfloat16", repeats=3, results=rows, agreement_rel_err={}, agreement_reference="zeco"))
        assert f"one GPU stands in for {words}" in capsys.readouterr().out


def test_stage_clock_times_wrapped_calls_and_restores_them():
    """delta_bench's host split wraps the backend's static steps, allscan.scan and the handle's wait:
    each call is timed under its label, and restore() puts every original back (a leaked wrapper
    would time, or break, the rows after it)."""
    import allscan
    from allscan.ops.delta.fla import FlaDelta
    from allscan.ops.scan import ScanHandle

    originals = (FlaDelta.__dict__["fold_state_grad"], allscan.scan, ScanHandle.wait)
    clock = db._StageClock()
    clock.wrap(FlaDelta, "fold_state_grad", "step fold_state_grad", static=True)
    clock.wrap(allscan, "scan", "scan")
    clock.wrap(ScanHandle, "wait", "wait")
    import torch

    x = torch.ones(2, 3)
    assert ScanHandle(x).wait() is x  # a complete handle gives its result
    with pytest.raises(RuntimeError, match="not initialised"):
        allscan.scan(x)  # the wrapper passes a call's failure through, timed

    class Steps:  # a static step that fails: the wrapper passes its error through, timed
        @staticmethod
        def fail(reason):
            raise ValueError(f"step failed: {reason}")

    failing = Steps.__dict__["fail"]
    clock.wrap(Steps, "fail", "step fail", static=True)
    with pytest.raises(ValueError, match="step failed: on purpose"):
        Steps.fail("on purpose")
    assert set(clock.ms) == {"step fail", "scan", "wait"} and all(v >= 0 for v in clock.ms.values())
    clock.restore()
    assert (FlaDelta.__dict__["fold_state_grad"], allscan.scan, ScanHandle.wait) == originals
    assert Steps.__dict__["fail"] is failing
