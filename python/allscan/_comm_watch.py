"""The watch of a communicator (:mod:`allscan._comm`): its timeout (``ALLSCAN_TIMEOUT``, by default the
group's own), this rank's own failure of it, and its place on the fault board (:mod:`allscan._faults`),
which spreads one rank's failure to the others."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C, _faults
from ._groups import backend_name
from ._settings import settings

__all__ = ["group_timeout", "watch", "local_failure", "put_on_board"]


def group_timeout(group, device: torch.device) -> float:
    """The group's own timeout in seconds (its backend's options; torch's default for the backend
    when they do not say)."""
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except Exception:  # noqa: BLE001 - private API: fall back to torch's defaults
        from torch.distributed import distributed_c10d as c10d

        try:
            return float(c10d._get_default_timeout(backend_name(group)).total_seconds())
        except Exception:  # noqa: BLE001
            return float(c10d.default_pg_timeout.total_seconds())


def watch(nccl: int, owned: bool, group, device: torch.device) -> int:
    """A watch on ``nccl`` with ``ALLSCAN_TIMEOUT`` (0: none), aborting it on timeout when ``owned``."""
    setting = settings.timeout
    if setting == "off":
        return 0
    timeout = group_timeout(group, device) if setting == "group" else float(setting)
    return int(_C.watch_create(nccl, timeout, owned))


def local_failure(comm):
    """(code, reason) when this rank's own view of ``comm`` failed (its watch's timeout, or a mismatch
    its kernels found), else None (also when a peer's report failed it, or it was retired: not this
    rank's to report; a retired handle's status is the failure it was given). The watch first: after
    an abort, a receive that never completed looks like a mismatch."""
    try:
        _C.watch_status(comm.watch)
    except _C.CommunicatorTimeout as e:
        return _C.TIMEOUT, str(e)
    except _C.CommunicatorError:
        return None
    try:
        _C.comm_status(comm.handle)
    except _C.CommunicatorError as e:
        # retired (failure set before its handle is failed, so this sees it): not a mismatch
        return None if comm.failure is not None else (_C.MISMATCH, str(e))
    return None


def put_on_board(comm, key: str) -> None:
    """Register a watched communicator on the fault board (no store: no board, the watch alone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API, or no default group store
        return
    target = _faults.Target(
        rank=comm.rank,
        size=comm.size,
        calls=lambda: _C.watch_calls(comm.watch),
        local_failure=lambda: local_failure(comm),
        fail=lambda code, reason: _C.watch_fail(comm.watch, code, reason),
    )
    _faults.board().register(key, target, store)
    comm.fault_key = key
