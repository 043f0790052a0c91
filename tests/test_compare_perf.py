"""bench/compare_perf.py: before/after medians of allscan_perf runs (CPU)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "compare_perf.py")


def _run_json(path, t_scan, t_floor=10.0, size=2 << 20):
    rows = [{"size": size, "op": "p2p-chain", "K": None, "K_auto": False, "time_us": t_floor},
            {"size": size, "op": "scan-pipelined", "K": 1, "K_auto": True, "time_us": t_scan},
            {"size": 4096, "op": "scan-pipelined", "K": 1, "K_auto": True, "time_us": 3 * t_scan}]
    with open(path, "w") as f:
        json.dump({"rows": rows}, f)


def _compare(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=60)


def test_medians_and_verdict(tmp_path):
    b = [tmp_path / f"b{i}.json" for i in range(3)]
    a = [tmp_path / f"a{i}.json" for i in range(3)]
    for p, t in zip(b, (10.0, 11.0, 30.0)):   # median 11
        _run_json(p, t)
    for p, t in zip(a, (12.1, 12.1, 1.0)):    # median 12.1: 1.10x
        _run_json(p, t)
    r = _compare("--before", *map(str, b), "--after", *map(str, a), "--limit", "1.05")
    assert r.returncode == 1, r.stdout + r.stderr
    row = [line.split() for line in r.stdout.splitlines() if line.startswith("scan-pipelined") and " 2097152 " in line]
    assert row == [["scan-pipelined", "auto", "2097152", "11.00", "12.10", "1.100"]]
    # The 4 KiB row is below --min-size (1 MiB): printed, but not in the verdict.
    assert "largest after/before from 1048576 B: 1.100 (scan-pipelined, K auto, 2097152 B)" in r.stdout
    assert _compare("--before", *map(str, b), "--after", *map(str, a), "--limit", "1.2").returncode == 0


def test_nothing_in_common_is_an_error(tmp_path):
    b, a = tmp_path / "b.json", tmp_path / "a.json"
    _run_json(b, 10.0)
    with open(a, "w") as f:
        json.dump({"rows": [{"size": 1, "op": "other", "K": None, "K_auto": False, "time_us": 1.0}]}, f)
    r = _compare("--before", str(b), "--after", str(a))
    assert r.returncode == 2 and "share no (op, K, size) row" in r.stderr


def test_bad_size_is_a_clear_error(tmp_path):
    r = _compare("--before", "x", "--after", "y", "--min-size", "1Q")
    assert r.returncode == 2 and "expected a size like" in r.stderr
