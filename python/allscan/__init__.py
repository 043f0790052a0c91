"""allscan: All-Scan and chunked all-to-all collectives for sequence parallelism.

    import allscan
    y = allscan.scan(state, gamma, group)          # the state entering this rank

See README.md for the contract. CUDA tensors on NCCL groups run through the C++/CUDA core;
CPU tensors (or any other backend) through a pure torch.distributed implementation.
"""
from __future__ import annotations

import os
import sys

import torch  # noqa: F401  (import torch first: the NCCL it loads is the one the core uses)

# The core binds NCCL lazily (allscan._nccl loads it before the first communicator): import its module
# with lazy binding, so that it loads where no NCCL is installed.
_dlopen_flags = sys.getdlopenflags()
sys.setdlopenflags((_dlopen_flags & ~os.RTLD_NOW) | os.RTLD_LAZY)
try:
    from . import _C  # noqa: E402
finally:
    sys.setdlopenflags(_dlopen_flags)

from . import a2a  # noqa: E402
from ._C import CommunicatorError  # noqa: E402  (a group's NCCL communicator failed: mismatch, a peer's report)
from ._C import CommunicatorTimeout  # noqa: E402  (a CommunicatorError: a collective on NCCL timed out)
from ._settings import settings  # noqa: E402
from .context import SequenceContext  # noqa: E402  (one batch's group and packed cut, shared by every layer)
from .ops.scan import ScanHandle, destroy_communicators, device_path, scan, set_check_every_call  # noqa: E402
from .reference import scan_reference  # noqa: E402

# The one version: the C API header's ALLSCAN_VERSION_* macros (the wheel's metadata reads them too).
__version__ = "{}.{}.{}".format(_C.version() // 10000, _C.version() // 100 % 100, _C.version() % 100)

# Submodules that pull in more (nn.Modules, optional libraries) load on first access:
# ``import allscan; allscan.layers.GatedLinearAttention`` works without importing them all up front.
_LAZY = ("layers", "integrations", "info", "perf", "demo", "core")


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "scan",
    "ScanHandle",
    "device_path",
    "set_check_every_call",
    "destroy_communicators",
    "scan_reference",
    "a2a",
    "settings",
    "SequenceContext",
    "CommunicatorError",
    "CommunicatorTimeout",
]
