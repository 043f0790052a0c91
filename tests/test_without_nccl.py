"""Where no NCCL library is present (a CPU build of torch, no nvidia-nccl wheel), ``import allscan`` and
everything on gloo work: the core binds NCCL lazily and loads it only when a communicator is made; asked
for one then, it names the fix. The nvidia package is hidden from the processes (theirs and the demo's
ranks) by a ``sitecustomize`` on PYTHONPATH."""
import os
import subprocess
import sys

import pytest

HIDE_NVIDIA = '''
import importlib.abc, sys

class _NoNvidia(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "nvidia" or name.startswith("nvidia."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoNvidia())
'''

PROBE = '''
import torch, allscan, allscan.layers, allscan.integrations.batch
assert "libnccl" not in open("/proc/self/maps").read(), "NCCL was loaded by the import"
try:
    allscan._nccl.load()
except RuntimeError as e:
    assert "pip install nvidia-nccl-cu13" in str(e), e
    print("refused:", e)
else:
    raise AssertionError("NCCL loaded although no NCCL is present")
'''


@pytest.fixture
def without_nvidia(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_NVIDIA)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_import_works_and_nccl_is_refused_by_name(without_nvidia):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA build of torch loads its own NCCL")
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=without_nvidia)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "refused: allscan: CUDA tensors on an NCCL group need the NCCL library" in r.stdout


def test_demo_runs_on_gloo_without_nccl(without_nvidia):
    r = subprocess.run([sys.executable, "-m", "allscan.demo", "--cpu", "--nproc", "2", "--iters", "1",
                        "--state", "1,2,8,8"], capture_output=True, text=True, timeout=300, env=without_nvidia)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: every rank equals the sequential reference" in r.stdout
