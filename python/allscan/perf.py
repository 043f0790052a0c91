"""``allscan_perf`` on PATH: the console entry point runs the benchmark binary installed with the
package (``<site-packages>/allscan/bin/allscan_perf``), or, for an editable install, the one in the
source tree's build directory; ``ALLSCAN_PERF`` names another. Every argument is passed through
(``allscan_perf -h`` lists them; ``bench/README.md`` explains them)."""
from __future__ import annotations

import glob
import os
import sys
from typing import List, Optional

from ._settings import settings


def candidates() -> List[str]:
    """Where the binary may be, in order: ``ALLSCAN_PERF``, the package's ``bin/``, the build trees
    of the source checkout an editable install points at."""
    if settings.perf_binary:
        return [settings.perf_binary]
    pkg = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(pkg))  # <checkout>/python/allscan -> <checkout>
    return ([os.path.join(pkg, "bin", "allscan_perf")]
            + sorted(glob.glob(os.path.join(root, "build", "*", "bench", "allscan_perf")))
            + [os.path.join(root, "build", "bench", "allscan_perf")])


def find_binary() -> Optional[str]:
    for path in candidates():
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def main() -> None:
    binary = find_binary()
    if binary is None:
        sys.exit("allscan_perf: the benchmark binary is not built or installed; looked at:\n  "
                 + "\n  ".join(candidates()) + "\nBuild it with the package (pip install .) or set ALLSCAN_PERF.")
    os.execve(binary, [binary] + sys.argv[1:], _env_with_nccl())


def _env_with_nccl() -> dict:
    """The environment with the nvidia-nccl wheel's lib/ (the NCCL this Python's torch loads) first on
    the loader's path: the binary's own rpath finds it only when that wheel sits beside allscan."""
    import importlib.util

    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
        if os.path.isdir(lib):
            env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


if __name__ == "__main__":
    main()
