"""The NCCL library, loaded when the core first needs it.

The extension binds NCCL lazily (``CMakeLists.txt``), so ``import allscan`` and everything on gloo work
where no NCCL is installed (a CPU build of torch, no nvidia-nccl wheel). Before the first communicator
is made, :func:`load` puts one libnccl.so.2 in the process's global scope, where the core's NCCL calls
are bound: the one torch already loaded (one NCCL in the process), else the nvidia-nccl wheel's.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import Optional

__all__ = ["load"]

_SONAME = "libnccl.so.2"
_lock = threading.Lock()
_loaded = False


def _wheel_library() -> Optional[str]:
    """The nvidia-nccl wheel's libnccl.so.2, if that wheel is installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ImportError:  # no ``nvidia`` namespace package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "lib", _SONAME)
    return path if os.path.exists(path) else None


def load() -> None:
    """Make NCCL's functions resolvable for the core (idempotent, thread-safe); raise ``RuntimeError``
    naming the fix when there is no NCCL to load."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        try:  # the one torch loaded (a CUDA build of torch does): into the global scope
            ctypes.CDLL(_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError:
            path = _wheel_library()
            if path is None:
                raise RuntimeError(
                    "allscan: CUDA tensors on an NCCL group need the NCCL library, and none is loaded or "
                    "installed: use a CUDA build of torch (it brings NCCL) or `pip install nvidia-nccl-cu13` "
                    "(CPU tensors on gloo need no NCCL)") from None
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        _loaded = True
