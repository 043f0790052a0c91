"""What the CPU tests of allscan's Triton kernels share: run a check under Triton's interpreter."""
import os
import subprocess
import sys


def assert_passes_interpreted(module: str, check: str):
    """``module.check('cpu')`` in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen
    when the kernels are defined, so not in this process) must succeed."""
    assert_passes_in_subprocess(module, check, "cpu", TRITON_INTERPRET="1")


def assert_passes_in_subprocess(module: str, check: str, device: str, **env):
    """``module.check(device)`` in a subprocess with ``env`` added to the environment (settings Triton
    reads when it compiles, such as ``TRITON_F32_DEFAULT``) must succeed."""
    code = f"import sys; sys.path.insert(0, 'tests'); from {module} import {check}; {check}({device!r})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, **env), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
