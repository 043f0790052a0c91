"""The README's demo command runs on CPU with gloo ranks and checks itself."""
import subprocess
import sys


def test_demo_runs_and_checks():
    r = subprocess.run([sys.executable, "-m", "allscan.demo", "--cpu", "--nproc", "3", "--iters", "1",
                        "--state", "1,2,8,8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gloo on CPU, 3 ranks" in r.stdout
    assert r.stdout.count(" yes ") == 24  # 3 methods x reverse x inclusive x init, all bitwise equal
    assert "check: every rank equals the sequential reference" in r.stdout


def test_demo_rejects_bad_state():
    r = subprocess.run([sys.executable, "-m", "allscan.demo", "--state", "1,2,x"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--state" in r.stderr
