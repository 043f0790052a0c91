"""examples/train_sp.py trains with sequence parallelism over 2 gloo ranks (a Llama), and a hybrid on a 2 x 2
DP x SP mesh with FSDP2 over 4, and its fp32 loss and gradients equal one process's at every step, each step
from the same weights (``--compare`` exits 1 above 1e-5 relative, 2e-4 for the hybrids). Skips without
transformers 5.x."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers", minversion="5.0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Once seen in CI (2 busy cores): a gloo rank aborted inside torch's process-group teardown, after the example had
# printed its verdict and called destroy_process_group (nothing of allscan runs then). Such a run is made again,
# once; any other failure, or this one twice, fails the test.
_TEARDOWN_ABORT = "terminate called without an active exception"


def _run_example(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "examples", "train_sp.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0 and _TEARDOWN_ABORT in out.stderr and "): ok" in out.stdout:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return out


def test_train_sp_matches_one_process():
    out = _run_example(2, "--steps", "8", "--seq", "64", "--compare")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = re.search(r"largest relative difference against one process on the same weights: loss ([0-9.e+-]+), "
                  r"gradients ([0-9.e+-]+) \(bound 1e-05\): ok", out.stdout)
    assert m and float(m.group(1)) <= 1e-5 and float(m.group(2)) <= 1e-5, out.stdout[-2000:]
    assert "step 8/8" in out.stdout


def test_train_sp_hybrid_on_a_dp_sp_mesh_matches_one_process():
    """A transformers hybrid (Qwen3.5: Gated DeltaNet beside softmax attention) made sequence-parallel, on a
    2 x 2 DP x SP mesh with FSDP2 (4 gloo ranks), against one process on the global batch (fp32, 2e-4)."""
    out = _run_example(4, "--model", "qwen3_5", "--dp", "2", "--sp", "2", "--steps", "2", "--seq", "32", "--batch", "1",
                       "--hidden", "32", "--compare")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = re.search(r"largest relative difference against one process on the same weights: loss ([0-9.e+-]+), "
                  r"gradients ([0-9.e+-]+) \(bound 2e-04\): ok", out.stdout)
    assert m and float(m.group(1)) <= 2e-4 and float(m.group(2)) <= 2e-4, out.stdout[-2000:]
    assert "step 2/2" in out.stdout and "DP=2 x SP=2" in out.stdout and "tokens/s" in out.stdout
