"""CPU test of bench/hybrid_bench.py (transformers' Qwen3-Next against the same model made sequence-parallel, and
under the one-GPU stand-in for a middle rank): the tiny model runs every row, the losses were checked against
transformers' own before timing, and the stand-in reached the whole model's delta-rule ops (through the batch's
SequenceContext) and was undone. On CPU transformers runs its torch fallbacks (it keeps fla's Triton kernels for
GPU inputs), allscan its torch backend. The GPU timing itself: bench/README.md."""
import importlib.util
import json
import math
import os
import sys

import pytest

pytest.importorskip("transformers", minversion="5.0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclass looks its module up while the module runs
    spec.loader.exec_module(mod)
    return mod


def test_tiny_model_on_cpu_rows_agree_and_stand_in_reaches_the_model(tmp_path, monkeypatch):
    import torch.distributed as dist

    from allscan.context import SequenceContext
    from allscan.ops.hooks import op_hooks

    hb = _load("hybrid_bench")
    real_cut, real_scan = SequenceContext.cut, op_hooks.delta_scan
    scans = []

    def scan(*args, **kwargs):  # the delta rule issues its scans only where the shard is cut as one of several
        scans.append(1)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(op_hooks, "delta_scan", scan)
    monkeypatch.setattr(hb, "_say", lambda *a, **k: None)
    out = hb.main(["--device", "cpu", "--tiny", "--tokens", "256", "--repeats", "2", "--out", str(tmp_path)])

    assert json.loads((tmp_path / "hybrid_bench.json").read_text())["rows"] == out["rows"]
    assert [r["row"] for r in out["rows"]] == list(hb.ROWS)
    for r in out["rows"]:
        assert len(r["ms_all"]) == 2 and all(math.isfinite(t) and t > 0 for t in r["ms_all"]), r
        assert math.isfinite(r["x_time"]) and r["peak_mib"] is None  # no peak memory on CPU
    agreement = out["agreement"]
    assert agreement["checked"] and set(agreement["rel_err"]) == {"allscan", "allscan_middle"}
    assert max(agreement["rel_err"].values()) <= agreement["tol"] == 1e-4
    assert math.isfinite(agreement["loss"]["hf"])
    # the middle row's layers ran as rank 1 of 3 (the model hands its ops a SequenceContext: the stand-in cuts
    # there too); nothing is left patched
    assert scans
    assert SequenceContext.cut is real_cut
    assert not dist.is_initialized()  # the bench's own one-rank group is gone
