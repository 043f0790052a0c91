"""The C++ core installs as a CMake package that another project finds and links (no GPU needed)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="needs the CUDA compiler")
def test_find_package_consumer(tmp_path):
    build, prefix, cbuild = tmp_path / "build", tmp_path / "prefix", tmp_path / "consumer"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # One architecture keeps this quick: what is tested here is the package, not the kernels.
    _run(["cmake", "-S", ROOT, "-B", str(build), *gen, "-DCMAKE_CUDA_ARCHITECTURES=80-real",
          "-DALLSCAN_BUILD_BENCH=OFF", f"-DCMAKE_INSTALL_PREFIX={prefix}"])
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], timeout=1800)
    _run(["cmake", "--install", str(build)])
    for header in ("common.h", "allscan.h", "a2a_chunked.h"):  # every part's public header, in one folder
        assert (prefix / "include" / "allscan" / header).exists(), header
    _run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_consumer"), "-B", str(cbuild), *gen,
          f"-DCMAKE_PREFIX_PATH={prefix}"])
    _run(["cmake", "--build", str(cbuild)])
    exe = cbuild / "consumer"
    # libnccl.so.2 by SONAME: point the loader at the one CMake found (the wheel's here).
    nccl_lib = subprocess.run(["cmake", "-L", "-N", str(build)], capture_output=True, text=True).stdout
    libdir = [l.split("=", 1)[1] for l in nccl_lib.splitlines() if l.startswith("NCCL_LIBRARY")]
    env = dict(os.environ)
    if libdir:
        env["LD_LIBRARY_PATH"] = os.path.dirname(libdir[0]) + ":" + env.get("LD_LIBRARY_PATH", "")
    out = _run([str(exe)], env=env)
    assert re.search(r"consumer ok \(allscan \d+\.\d+\.\d+\)", out.stdout) and "g_count" in out.stdout
    assert "a2a last error: allscanA2ASplitHeads: nranks must be >= 1" in out.stdout
    # Without the build's Python (the consumer's own, or none): the package's recorded NCCL is used.
    _run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_consumer"), "-B", str(tmp_path / "nopy"), *gen,
          f"-DCMAKE_PREFIX_PATH={prefix}", "-DPython_EXECUTABLE=/nonexistent/python3"])
    # An NCCL_HOME that holds no NCCL: the error says what to set.
    bad = subprocess.run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_consumer"), "-B", str(tmp_path / "bad"),
                          *gen, f"-DCMAKE_PREFIX_PATH={prefix}", f"-DNCCL_HOME={tmp_path / 'no_nccl'}",
                          "-DPython_EXECUTABLE=/nonexistent/python3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "set NCCL_HOME" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
