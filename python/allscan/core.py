"""The C++ core under the Python layer, for benchmarks that time the core alone (``bench/scan_bench.py``:
the floor of one neighbour exchange, a scan with its workspace allocated ahead). Everything here takes
integers: the group's core handle (:func:`communicator`'s ``handle``), device pointers, byte and element
counts, dtype codes (:data:`DTYPE_CODES`) and a ``cudaStream_t``; no argument is checked across ranks
and nothing is differentiable. Use :func:`allscan.scan` and :mod:`allscan.a2a` for everything else."""
from __future__ import annotations

import torch

from . import _C, _comm
from ._dtypes import DTYPE_CODES

__all__ = ["communicator", "link_model", "workspace_size", "choose_num_blocks", "neighbor_exchange", "scan",
           "DTYPE_CODES"]

# The core's own bindings (allscan._C), under the names the benchmarks call.
workspace_size = _C.workspace_size        # (handle, count, dtype, g_ptr, g_count, g_dtype, ...) -> bytes
choose_num_blocks = _C.choose_num_blocks  # (handle, nbytes) -> the block count auto picks
neighbor_exchange = _C.neighbor_exchange  # (handle, send_ptr, recv_ptr, nbytes, reverse, chain, stream)
scan = _C.scan                            # the diagonal All-Scan of device pointers, into preallocated memory
link_model = _C.get_link_model            # (handle) -> (latency_us, us_per_byte, is_set)


def communicator(group, device: torch.device):
    """The cached NCCL communicator of ``group`` (None: the default group) on the CUDA ``device``, created
    collectively on first use as any allscan call would; its ``handle`` is what the functions above take."""
    return _comm.get_communicator(group, device)
