"""allscan: All-Scan and chunked all-to-all collectives for sequence parallelism.

    import allscan
    y = allscan.scan(state, gamma, group)          # the state entering this rank

See README.md for the contract. CUDA tensors on NCCL groups run through the C++/CUDA core;
CPU tensors (or any other backend) through a pure torch.distributed implementation.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os

import torch  # noqa: F401  (import torch first: its libnccl.so.2 is the one the core uses)


def _preload_nccl() -> None:
    """Make sure one libnccl.so.2 is loaded before the core is: torch's when torch loaded one,
    else the nvidia-nccl wheel's (CPU builds of torch load none)."""
    try:
        with open("/proc/self/maps") as f:
            if "libnccl.so" in f.read():
                return
    except OSError:
        return
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        return
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libnccl.so.2")
    if os.path.exists(lib):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


_preload_nccl()

from . import _C, a2a  # noqa: E402
from ._C import CommunicatorError  # noqa: E402  (a group's NCCL communicator failed: mismatch, a peer's report)
from ._C import CommunicatorTimeout  # noqa: E402  (a CommunicatorError: a collective on NCCL timed out)
from ._contract import settings  # noqa: E402
from .ops.scan import ScanHandle, destroy_communicators, device_path, scan, set_check_every_call  # noqa: E402
from .reference import scan_reference  # noqa: E402

# The one version: the C API header's ALLSCAN_VERSION_* macros (the wheel's metadata reads them too).
__version__ = "{}.{}.{}".format(_C.version() // 10000, _C.version() // 100 % 100, _C.version() % 100)

# Submodules that pull in more (nn.Modules, optional libraries) load on first access:
# ``import allscan; allscan.layers.GatedLinearAttention`` works without importing them all up front.
_LAZY = ("layers", "integrations", "info", "perf", "demo")


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
    "CommunicatorError",
    "CommunicatorTimeout",
]
