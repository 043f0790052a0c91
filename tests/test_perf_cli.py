"""The allscan_perf binary's command line (CPU: -h and argument errors, parsed before any CUDA call),
and one short 2-GPU run (marked gpu).

The binary is found as the ``allscan_perf`` console command finds it (:func:`allscan.perf.find_binary`:
$ALLSCAN_PERF, else <package>/bin/allscan_perf, else the checkout's build trees); the tests skip when
none is built.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from allscan.perf import find_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


BINARY = find_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="allscan_perf is not built (set ALLSCAN_PERF or build bench/)")


def _env(hide_gpus=True):
    env = dict(os.environ)
    # libnccl.so.2 from the nvidia-nccl wheel when the binary's RPATH does not name it.
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    if hide_gpus:
        # Argument errors must be reported before any CUDA call: with no visible GPU, a binary that
        # touched CUDA first would fail with a device error instead of the argument error.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(*args, hide_gpus=True, timeout=60):
    return subprocess.run([BINARY, *args], capture_output=True, text=True, env=_env(hide_gpus), timeout=timeout)


def test_help_lists_every_flag():
    p = _run("-h")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Usage: allscan_perf")
    for flag in ("-o", "-b", "-e", "-i", "-f", "-g", "-n", "-w", "-N", "-c", "-d", "-z", "-G", "-K", "-m", "-x",
                 "-r", "-S", "-D", "-L", "-j", "-h", "-H", "-A", "-B", "-C", "-k", "-T"):
        assert f"  {flag}" in p.stdout, f"{flag} missing from -h"
    assert "-o scan:" in p.stdout and "-o a2a:" in p.stdout  # every row set's options, under its name
    assert p.stderr == ""
    assert _run("--help").returncode == 0


BAD_ARGS = [
    (["-b", "0"], "-b (minbytes)"),
    (["-b", "4Q"], "-b (minbytes)"),
    (["-b", "2"], "-b (minbytes)"),          # less than one float
    (["-e", "1K", "-b", "4K"], "-e (maxbytes)"),
    (["-f", "0"], "-f (stepfactor)"),
    (["-f", "1", "-i", "0", "-b", "4K", "-e", "8K"], "-i (stepbytes)"),
    (["-g", "0"], "-g (ngpus)"),
    (["-n", "0"], "-n (iters)"),
    (["-w", "-1"], "-w (warmup_iters)"),
    (["-N", "0"], "-N (repeats)"),
    (["-c", "2"], "-c (check)"),
    (["-z", "x"], "-z (blocking)"),
    (["-d", "int8"], "-d (datatype)"),
    (["-m", "nosuch"], "-m (methods)"),
    (["-m", "pipelined,nosuch"], "-m (methods)"),
    (["-o", "matrix", "-m", "device"], "device serves the diagonal scan (-o scan) only"),
    (["-K", "-3"], "-K (blocks)"),
    (["-K", "0"], "-K (blocks)"),
    (["-K", "auto,65"], "-K (blocks)"),
    (["-K", "two"], "-K (blocks)"),
    (["-D", "diag"], "-D (decay)"),
    (["-x", "alltoall"], "-x (refs)"),
    (["-L", "fast"], "-L (link_model)"),
    (["-L", "1,-2"], "-L (link_model)"),
    (["-G", "1", "-z", "1"], "-G (cudagraph)"),
    (["-r2"], "-r (reverse)"),
    (["-r", "1"], "-r takes its value attached"),
    (["-q"], "unknown option -q"),
    (["--nosuch"], "unknown option '--nosuch'"),
    (["-b"], "option -b needs a value"),
    (["stray"], "unexpected argument 'stray'"),
    (["-o", "nosuch"], "-o (op): expected scan|a2a"),
    (["-o"], "option -o needs a value"),
    # An option of another row set names the row set it belongs to.
    (["-o", "a2a", "-K", "2"], "-K is an option of -o scan"),
    (["-o", "a2a", "-r"], "-r is an option of -o scan"),
    (["-S", "maybe"], "-S (signature): expected on, off or both"),
    (["-o", "a2a", "-S", "maybe"], "-S (signature): expected on, off or both"),
    (["-H", "4"], "-H is an option of -o a2a, not of -o scan"),
    (["--chunks=2"], "-k is an option of -o a2a"),
    (["-o", "a2a", "-H", "0"], "-H (heads)"),
    (["-o", "a2a", "-A", "x"], "-A (head_dim)"),
    (["-o", "a2a", "-B", "0"], "-B (batch)"),
    (["-o", "a2a", "-C", "5"], "-C (tensors)"),
    (["-o", "a2a", "-k", "0"], "-k (chunks)"),
    (["-o", "a2a", "-k", "1,two"], "-k (chunks)"),
    (["-o", "a2a", "-H", "8", "-k", "9"], "-k (chunks): 9 chunks of 8 heads"),
    (["-o", "a2a", "-T", "both"], "-T (directions)"),
    (["-o", "a2a", "-b", "0"], "-b (minbytes)"),
]


@pytest.mark.parametrize("args,needle", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_argument_is_a_clear_error_before_cuda(args, needle):
    p = _run(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "allscan_perf: error:" in p.stderr
    assert needle in p.stderr, p.stderr
    assert "-h" in p.stderr  # points at the usage
    assert "CUDA" not in p.stderr and "no usable" not in p.stderr  # no device was touched
    assert p.stdout == ""


def test_good_arguments_reach_the_device_check():
    # Valid arguments get past parsing; with no visible GPU the binary fails with a clear device error.
    p = _run("-b", "4K", "-e", "64K", "-f", "2", "-g", "2", "-K", "auto,2,4", "-m", "all,device", "-D", "head",
             "-d", "bf16", "-r", "-G", "2", "-L", "5.0,3e-6", "-x", "chain,device")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "for usage" not in p.stderr, p.stderr  # not an argument error
    assert "cuda" in p.stderr.lower() or "-g (ngpus)" in p.stderr, p.stderr


def test_good_a2a_arguments_reach_the_device_check():
    p = _run("-o", "a2a", "-b", "1M", "-e", "4M", "-f", "2", "-g", "2", "-H", "6", "-A", "64", "-B", "2", "-C", "2",
             "-k", "1,2,3", "-T", "gather,scatter", "-d", "half", "-G", "2")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "for usage" not in p.stderr, p.stderr
    assert "cuda" in p.stderr.lower() or "-g (ngpus)" in p.stderr, p.stderr


def _gpu_count():
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["-r", "-D", "full", "-d", "bfloat16", "-K", "auto,2,64", "-S", "both"],
                                   ["-G", "2", "-D", "none", "-S", "both"]],
                         ids=["default", "reverse-bf16-full", "graph"])
def test_two_gpu_run_is_exact(tmp_path, extra):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "perf.json"
    p = _run("-b", "4K", "-e", "1M", "-f", "16", "-g", "2", "-n", "5", "-w", "2", "-N", "2", "-j", str(out), *extra,
             hide_gpus=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["wrong_total"] == 0
    ops = {r["op"] for r in doc["rows"]}
    assert {"p2p-chain", "p2p-ring", "nccl-allgather", "nccl-allreduce", "scan-pipelined", "scan-serial",
            "scan-allgather"} <= ops
    if "both" in extra:  # -S both: every scan row also without the in-band signature
        assert {"scan-pipelined-nosig", "scan-serial-nosig", "scan-allgather-nosig"} <= ops
        assert {r["signature"] for r in doc["rows"] if r["op"].startswith("scan-")} == {True, False}
    for r in doc["rows"]:
        assert "skipped" not in r, r
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["-r", "-d", "bfloat16", "-K", "auto,3"], ["-G", "2", "-D", "none"]],
                         ids=["default", "reverse-bf16", "graph"])
def test_two_gpu_device_path_run_is_exact(tmp_path, extra):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "perf.json"
    p = _run("-b", "4K", "-e", "16M", "-f", "64", "-g", "2", "-n", "5", "-w", "2", "-N", "2", "-m", "pipelined,device",
             "-j", str(out), *extra, hide_gpus=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["wrong_total"] == 0
    ops = {r["op"] for r in doc["rows"]}
    assert {"p2p-chain", "dev-chain", "scan-pipelined", "scan-device"} <= ops
    for r in doc["rows"]:
        assert "skipped" not in r, r
        assert r["wrong"] == 0, r
    # the device path ran (not its NCCL fallback): the K column says dev
    assert "dev:" in p.stdout, p.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["-B", "2", "-H", "6", "-k", "1,4", "-d", "bfloat16", "-S", "both"],
                                   ["-G", "2", "-C", "1", "-T", "gather", "-S", "both"]],
                         ids=["default", "batch2-uneven-heads-bf16", "graph-gather"])
def test_two_gpu_a2a_run_is_exact(tmp_path, extra):
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "a2a.json"
    p = _run("-o", "a2a", "-b", "64K", "-e", "4M", "-f", "4", "-g", "2", "-n", "5", "-w", "2", "-N", "2", "-j", str(out),
             *extra, hide_gpus=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["wrong_total"] == 0 and doc["op"] == "a2a"
    ops = {r["op"] for r in doc["rows"] if "skipped" not in r}
    want = {"nccl-alltoall", "a2a-gather"} if "gather" in extra else {"nccl-alltoall", "a2a-scatter", "a2a-gather"}
    if "both" in extra:  # -S both: every a2a row also without the in-band signature
        want |= {f"{op}-nosig" for op in want if op.startswith("a2a-")}
    assert ops == want, ops
    for r in doc["rows"]:
        if "skipped" in r:
            assert "less than one token" in r["skipped"], r
            continue
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0 and r["vs_floor"] is not None


def test_console_entry_point_runs_the_binary():
    out = subprocess.run([sys.executable, "-m", "allscan.perf", "-h"], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert out.returncode == 0 and "-o" in out.stdout + out.stderr, out.stdout + out.stderr
