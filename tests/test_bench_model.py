"""CPU tests of bench/fit_model.py: the block-count model fit recovers known parameters."""
import importlib.util
import json
import math
import os
import random

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("fit_model", os.path.join(ROOT, "bench", "fit_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fm = _load()

A, B, C = 7.5, 1.0 / 300e3, 4.0  # 7.5 us per message, 300 GB/s, 4 us per call


def synthetic(P, a=A, b=B, c=C, ks=(1, 2, 4, 8, 16, 32, 64), noise=0.0, seed=0, auto_k=None):
    rnd = random.Random(seed)
    rows = []
    for e in range(12, 29, 2):  # 4 KiB .. 256 MiB
        n = 1 << e
        for k in ks:
            t = fm.t_pipelined(P, n, k, a, b, c) * (1 + noise * rnd.uniform(-1, 1))
            rows.append({"size": n, "op": "scan-pipelined", "method": "pipelined", "K": k, "K_auto": False, "time_us": t})
        ka = auto_k(n) if auto_k else fm.best_k(P, n, a, b)
        rows.append({"size": n, "op": "scan-pipelined", "method": "pipelined", "K": ka, "K_auto": True,
                     "time_us": fm.t_pipelined(P, n, ka, a, b, c)})
        rows.append({"size": n, "op": "p2p-chain", "method": None, "K": None, "K_auto": False, "time_us": a + b * n})
    return {"tool": "allscan_perf", "nranks": P, "rows": rows}


@pytest.mark.parametrize("P", [2, 4, 8])
def test_fit_recovers_known_parameters(P):
    doc = synthetic(P)
    fit = fm.fit_pipelined(P, fm.pipelined_rows(doc["rows"]))
    assert fit["a_us"] == pytest.approx(A, rel=1e-6)
    assert fit["b_us_per_byte"] == pytest.approx(B, rel=1e-6)
    assert fit["c_us"] == pytest.approx(C, rel=1e-5, abs=1e-6)
    assert fit["max_rel_error"] < 1e-9


def test_fit_with_noise_is_close():
    doc = synthetic(2, noise=0.02, seed=3)
    fit = fm.fit_pipelined(2, fm.pipelined_rows(doc["rows"]))
    assert fit["a_us"] == pytest.approx(A, rel=0.1)
    assert fit["b_us_per_byte"] == pytest.approx(B, rel=0.05)


def test_best_k_matches_core_rule_shape():
    # At P = 2 the best block count is 1 whatever the link; past 2 it grows like sqrt((P-2) bN / a).
    assert fm.best_k(2, 256 << 20, A, B) == 1
    assert fm.best_k(64, 4096, A, B) == 1
    k_small = fm.best_k(64, 1 << 20, A, B)
    k_big = fm.best_k(64, 64 << 20, A, B)
    assert 1 <= k_small < k_big <= fm.MAX_BLOCKS
    kstar = math.sqrt(62 * B * (1 << 20) / A)
    assert abs(k_small - kstar) <= 1


def test_auto_k_check_flags_a_bad_choice():
    good = fm.auto_k_check(synthetic(8)["rows"])
    assert good and all(c["ok"] for c in good)
    bad = fm.auto_k_check(synthetic(8, auto_k=lambda n: 64)["rows"])
    assert any(not c["ok"] for c in bad)
    assert all(c["ratio"] >= 1.0 for c in bad)


def test_extrapolation_orders_methods():
    fit = {"a_us": A, "b_us_per_byte": B, "c_us": C}
    table = fm.extrapolate(fit, fm.DEFAULT_COMBINE_US_PER_BYTE, 2 << 20, [2, 8, 64, 256])
    for r in table:
        assert r["pipelined_us"] <= r["serial_us"] + 1e-9
        assert r["serial_us"] < r["allgather_us"]
    assert table[-1]["K"] > 1


def test_main_writes_outputs(tmp_path):
    p = tmp_path / "ksweep.json"
    p.write_text(json.dumps(synthetic(2)))
    rc = fm.main([str(p), "--out", str(tmp_path / "o"), "--strict"])
    assert rc == 0
    out = json.loads((tmp_path / "o" / "model_fit.json").read_text())
    assert out["fit"]["a_us"] == pytest.approx(A, rel=1e-6)
    assert out["auto_k_ok"] is True
    assert [r["P"] for r in out["extrapolation"]["rows"]][:3] == [2, 4, 8]
    assert out["floor_fit"]["b_us_per_byte"] == pytest.approx(B, rel=1e-6)


def test_main_strict_fails_on_bad_auto_k(tmp_path):
    p = tmp_path / "ksweep.json"
    p.write_text(json.dumps(synthetic(8, auto_k=lambda n: 64)))
    assert fm.main([str(p), "--out", str(tmp_path / "o"), "--strict"]) == 1


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
    one = synthetic(2)
    one["rows"] = [r for r in one["rows"] if r["size"] == 4096]
    p = tmp_path / "one.json"
    p.write_text(json.dumps(one))
    assert fm.main([str(p), "--out", str(tmp_path / "o")]) == 2
    assert "at least 2 sizes" in capsys.readouterr().err
    q = tmp_path / "bad.json"
    q.write_text("{\"rows\": []}")
    assert fm.main([str(q), "--out", str(tmp_path / "o")]) == 2
    assert "nranks" in capsys.readouterr().err
    r2 = tmp_path / "p4.json"
    r2.write_text(json.dumps(synthetic(4)))
    r1 = tmp_path / "p2.json"
    r1.write_text(json.dumps(synthetic(2)))
    assert fm.main([str(r1), str(r2), "--out", str(tmp_path / "o")]) == 2
    assert "differs" in capsys.readouterr().err


def test_scan_host_reaches_the_hooks_it_times():
    """bench/scan_host.py times allscan.ops.scan's plan_for / launch / run (GPU only): they exist
    with the arguments it passes (it once imported the function ``scan`` in the module's place)."""
    import inspect

    spec = importlib.util.spec_from_file_location("scan_host", os.path.join(ROOT, "bench", "scan_host.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    S = mod.scan_module()
    assert len(inspect.signature(S.plan_for).parameters) == 8
    inspect.signature(S.launch).bind("plan", "x", "g", None, False, False, 0)
    inspect.signature(S.run).bind("x", "g", None, "name", False, False, 0, "pipelined", "group")
