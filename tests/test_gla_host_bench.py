"""CPU tests of bench/gla_host.py (``gla_bench.py --host``): its one-GPU stand-in for a middle rank
and its table. The timing itself needs GPUs and fla-core."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location("gla_host", os.path.join(ROOT, "bench", "gla_host.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gh = _load()


def test_one_rank_stands_in_for_a_middle_rank_and_restores():
    import torch

    import allscan.ops.gla.zeco as Z

    real = Z.ShardSegments
    with gh._middle_rank_stand_in(1):
        segs = Z.ShardSegments(None, 8, 1, None, "t")
        assert (segs.world, segs.rank, segs.continued) == (2, 1, True)
        packed = Z.ShardSegments(None, 8, 1, torch.tensor([0, 3, 8]), "t")  # varlen: left as it is
        assert (packed.world, packed.continued) == (1, False)
    assert Z.ShardSegments is real
    with gh._middle_rank_stand_in(2):
        assert Z.ShardSegments is real


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
    assert "middle rank" in text and "8192: 2000 = 1500 + 200 + 60 + 240" in text
