"""bench/plot_perf.py: the table and plot of allscan_perf runs' ratios to the floor (CPU)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "plot_perf.py")


def _run_json(path, ratios, version=22809):
    rows = []
    for size, r in ratios.items():
        rows.append({"size": size, "op": "p2p-chain", "K_auto": False, "vs_floor": 1.0})
        rows.append({"size": size, "op": "scan-pipelined", "K": 4, "K_auto": False, "vs_floor": 9.0})
        rows.append({"size": size, "op": "scan-pipelined", "K": 1, "K_auto": True, "vs_floor": r})
    with open(path, "w") as f:
        json.dump({"nranks": 2, "nccl_version": version, "rows": rows}, f)


def _plot(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_table_and_png(tmp_path):
    pytest.importorskip("matplotlib")  # the "bench" extra (CI installs it)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _run_json(a, {4096: 1.25, 2 << 20: 0.994})
    _run_json(b, {2 << 20: 1.163})
    out = tmp_path / "ratio.png"
    r = _plot(f"auto={a}", f"side={b}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["size", "auto", "side"]
    # The automatic block count's row, not the fixed-K one; a size a run lacks shows "-".
    assert lines[2].split() == ["4", "KiB", "1.250", "-"]
    assert lines[3].split() == ["2", "MiB", "0.994", "1.163"]
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec,needle", [("nolabel.json", "LABEL=path.json"), ("x=", "LABEL=path.json")])
def test_bad_run_spec_is_a_clear_error(tmp_path, spec, needle):
    r = _plot(spec, "--out", str(tmp_path / "x.png"))
    assert r.returncode != 0 and needle in r.stderr


def test_run_without_the_op_is_a_clear_error(tmp_path):
    a = tmp_path / "a.json"
    _run_json(a, {4096: 1.0})
    r = _plot(f"a={a}", "--op", "scan-serial", "--out", str(tmp_path / "x.png"))
    assert r.returncode != 0 and "no 'scan-serial' rows" in r.stderr
