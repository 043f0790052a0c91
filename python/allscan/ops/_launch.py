"""What every collective's launch shares: which path a call takes (and the local checks made before
the first collective of the NCCL path), the device a rank that failed locally exchanges on, and the
current stream's raw handle."""
from __future__ import annotations

import torch

from .. import _comm
from .._contract import announce_invalid

__all__ = ["nccl_preflight", "announce_device", "stream_ptr"]


def announce_device(group) -> torch.device:
    """The device a rank that failed its local checks exchanges on: the one its peers use."""
    if "nccl" in _comm.backend_name(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nccl_preflight(group, x: torch.Tensor, op: str) -> bool:
    """True when ``x`` goes through the C++ core on ``group``; then the device and the settings are
    checked first (local checks, so a misconfigured rank fails before any collective, joining its
    peers' signature exchange when they make one)."""
    if not _comm.uses_nccl(group, x):
        return False
    try:
        _comm.check_device(group, x.device)
        _comm.check_env()
    except ValueError:
        announce_invalid(group, torch.device("cuda", torch.cuda.current_device()), op)
        raise
    return True


# The current stream's handle without building a torch.cuda.Stream object (a few microseconds per
# call); the public route where this private helper is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_ptr(device: torch.device) -> int:
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream
