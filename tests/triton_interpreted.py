"""What the CPU tests of allscan's Triton kernels share: run a check under Triton's interpreter."""
import os
import subprocess
import sys


def assert_passes_interpreted(module: str, check: str):
    """``module.check('cpu')`` in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen
    when the kernels are defined, so not in this process) must succeed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import sys; sys.path.insert(0, 'tests'); from {module} import {check}; {check}('cpu')"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
