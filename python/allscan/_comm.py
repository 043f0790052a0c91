"""Process group -> NCCL communicator.

By default (``ALLSCAN_COMM=owned``) allscan creates and owns the NCCL communicator of a group, from
an ``ncclUniqueId`` broadcast over the group, and destroys it at exit or in
:func:`destroy_communicators`. With ``ALLSCAN_COMM=borrowed`` it borrows torch's own
ProcessGroupNCCL communicator when it can (``group._get_backend(device)._comm_ptr()``, forcing its
creation with one tiny collective when it reads 0; never destroyed here), else owns one.
Communicators are cached per (group, device).

Each communicator of more than one rank is watched (``allscanWatchCreate``, ``ALLSCAN_TIMEOUT``): a
collective not done within the group's timeout fails it, aborts it when allscan owns it, and every
later call on it raises :class:`allscan.CommunicatorTimeout`. Watched communicators are on the fault
board (``_faults``), which spreads one rank's failure to the others (the watch and the board: ``_comm_watch``;
the group itself, resolved from None, a name or a group: ``_groups``, re-exported here).
"""
from __future__ import annotations

import atexit
import hashlib
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C, _faults, _nccl
from ._comm_watch import group_timeout, put_on_board, watch
from ._groups import backend_name, group_name, normalize_group, resolve_group, uses_nccl
from ._settings import settings

__all__ = [
    "Communicator",
    "normalize_group",
    "backend_name",
    "check_env",
    "group_name",
    "resolve_group",
    "uses_nccl",
    "check_device",
    "get_communicator",
    "destroy_communicators",
    "report_local_error",
    "group_timeout",
]

_lock = threading.Lock()
_comms: Dict[Tuple[str, int], "Communicator"] = {}
_borrowed_made: Dict[str, int] = {}  # group name -> borrowed communicators made (their board keys)


@dataclass
class Communicator:
    """An NCCL communicator for one group on one device, wrapped for the C++ core."""

    group_name: str
    device: torch.device
    rank: int
    size: int
    nccl: int            # ncclComm_t as an integer
    handle: int          # allscanComm_t as an integer
    owned: bool          # True when allscan created the NCCL communicator (and destroys it)
    link_model: Optional[Tuple[float, float]] = None  # (latency_us, us_per_byte) in use, if any
    group_ref: Optional[weakref.ReferenceType] = None  # the group object it was made for
    watch: int = 0       # allscanWatch_t as an integer (0: not watched)
    fault_key: str = ""  # its key on the fault board ("" : not on it)
    failure: Optional[BaseException] = None  # set when retired (_retire_aliases): what later calls raise

    def destroy(self) -> None:
        if self.fault_key:
            _faults.board().unregister(self.fault_key)  # waits for a board round using it
            self.fault_key = ""
        aborted = False
        if self.watch:
            aborted = _C.watch_destroy(self.watch)  # after its thread stopped: an abort cannot follow
            self.watch = 0
        if self.handle:
            # NCCL's own resources (the device path's windows) go with an aborted communicator, and
            # with a borrowed one whose group (or torch's whole world) is gone: then the core must not
            # call NCCL.
            if aborted or (not self.owned and (self.group_ref is None or self.group_ref() is None
                                               or not dist.is_initialized())):
                _C.comm_forget_nccl(self.handle)
            _C.comm_destroy(self.handle)
            self.handle = 0
        if self.owned and self.nccl and not aborted:  # ncclCommAbort freed an aborted one
            _C.nccl_comm_destroy(self.nccl)
        self.nccl = 0


def _borrow_torch_comm(group, device: torch.device) -> int:
    try:
        backend = group._get_backend(device)
    except Exception:  # noqa: BLE001 - torch raises different types across versions
        return 0
    get_ptr = getattr(backend, "_comm_ptr", None)
    if get_ptr is None:
        return 0
    try:
        ptr = int(get_ptr())
    except Exception:  # noqa: BLE001
        return 0
    if ptr == 0:
        # Lazily initialised: one tiny collective makes torch create its communicator.
        with torch.cuda.device(device):
            t = torch.zeros(1, device=device)
            dist.all_reduce(t, group=group)
            torch.cuda.current_stream(device).synchronize()
        try:
            ptr = int(get_ptr())
        except Exception:  # noqa: BLE001
            ptr = 0
    return ptr


def _create_owned_comm(group, device: torch.device) -> Tuple[int, str]:
    """A new NCCL communicator of the group and its fault-board key (from its unique id, which every
    rank holds)."""
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    obj = [_C.nccl_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(obj, group_src=0, group=group)
    key = "allscan/fault/" + hashlib.blake2b(obj[0], digest_size=12).hexdigest()
    with torch.cuda.device(device):
        return int(_C.nccl_comm_init_rank(size, obj[0], rank)), key


def _retire_aliases(nccl: int) -> None:
    """A cached communicator holding ``nccl``, the address of a communicator just created, is one that
    was aborted (NCCL freed it and reused the address) or, borrowed, freed by torch. It is retired
    before the new one is watched: its failure is kept (what its watch said), raised by every later
    call on its group, here and by the core (``allscanCommFail``); its handle forgets NCCL and its watch
    and board entry go (a watch is found by address: the new communicator's must be the only one)."""
    with _lock:
        aliases = [c for c in _comms.values() if c.nccl == nccl]
        for c in aliases:
            c.nccl = 0
    for c in aliases:
        failure = _C.CommunicatorError(f"allscan: the NCCL communicator of group {c.group_name!r} is gone")
        code = _C.REMOTE_ERROR
        try:
            if c.watch:
                _C.watch_status(c.watch)
        except _C.CommunicatorTimeout as e:
            failure, code = e, _C.TIMEOUT
        except _C.CommunicatorError as e:  # a mismatch, or a peer's report
            failure = e
        c.failure = failure
        # the handle first: once its watch is gone nothing else would stop a call made with it
        _C.comm_fail(c.handle, code, str(failure).removeprefix("allscan: "))
        _C.comm_forget_nccl(c.handle)
        if c.fault_key:
            _faults.board().unregister(c.fault_key)
            c.fault_key = ""
        if c.watch:
            _C.watch_destroy(c.watch)  # its thread and any abort it made are done
            c.watch = 0


def _raise_if_retired(comm: "Communicator") -> None:
    if comm.failure is not None:
        raise type(comm.failure)(str(comm.failure))


def report_local_error(group, device: torch.device, reason: str) -> None:
    """This rank raised where its peers do not exchange with it first (its own arguments on NCCL in
    ``first`` mode, or its own work between the collectives of one layer call): if the group's
    communicator exists, report the skipped call on the fault board (its thread posts it)."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        comm = _comms.get((group.group_name, index))
    if comm is not None and comm.fault_key and comm.group_ref is not None and comm.group_ref() is group:
        board = _faults.board()
        board.report_skip(comm.fault_key, reason)
        board.wait_skip(comm.fault_key, board.skip_grace_s + 4 * board.poll_s + 1.0)


def check_env() -> None:
    """Raise ``ValueError`` naming the variable if an ``ALLSCAN_*`` setting does not parse (a local
    check, no collective: made before the first one, so a misconfigured rank fails there rather than
    after the other ranks entered NCCL). The settings apply the core's rules to the variables the core
    reads itself when it makes a communicator."""
    settings.check  # noqa: B018 - the first access reads and validates every variable


def check_device(group, device: torch.device) -> None:
    """Raise if ``device`` is not the one ``group`` communicates on (a local check, no collective)."""
    group = normalize_group(group)
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound != device:
        raise ValueError(f"allscan: the tensor is on {device}, but the group is bound to {bound}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        others = [c.device for (n, i), c in _comms.items()
                  if n == group.group_name and i != index and c.group_ref is not None and c.group_ref() is group]
    if others:
        raise ValueError(
            f"allscan: the tensor is on {device}, but group {group.group_name!r} communicates on "
            f"{others[0]} (one device per process and group)"
        )


def find_communicator(group, device: torch.device) -> Optional[Communicator]:
    """The communicator of ``group`` on ``device`` if one exists (never creates one: no collective)."""
    group = normalize_group(group)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        comm = _comms.get((group.group_name, index))
    if comm is None or comm.group_ref is None or comm.group_ref() is not group:
        return None
    return comm


def get_communicator(group, device: torch.device) -> Communicator:
    """The cached communicator of ``group`` on ``device`` (created collectively on first use)."""
    group = normalize_group(group)
    if device.type != "cuda":
        raise ValueError(f"allscan: an NCCL communicator needs a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    name = group.group_name
    key = (name, index)
    with _lock:
        comm = _comms.get(key)
        if comm is not None and comm.group_ref is not None and comm.group_ref() is group:
            _raise_if_retired(comm)
            return comm
        # Communicators of groups that are gone (this name re-registered, or any dead group): a
        # borrowed one may be gone with its group, and its address reused by a new one, which a
        # stale watch would then claim. Forget them (and destroy those allscan owns).
        stale = [_comms.pop(k) for k, c in list(_comms.items())
                 if k == key or c.group_ref is None or c.group_ref() is None]
    for c in stale:
        try:
            c.destroy()
        except Exception:  # noqa: BLE001 - its group is gone; nothing more to do
            pass
    check_device(group, device)  # one device per process and group
    check_env()  # before the collectives below (owned communicator, calibration)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "allscan: the first call on a group creates its communicator, which cannot happen while a "
            "CUDA graph is being captured; call allscan once before capturing"
        )

    _nccl.load()  # the core's NCCL, bound at its first call (allscan._nccl)
    nccl = _borrow_torch_comm(group, device) if settings.comm == "borrowed" else 0
    owned = nccl == 0
    if owned:
        nccl, board_key = _create_owned_comm(group, device)
    else:
        # The group's name and how many borrowed communicators this process made for it: the same
        # on every rank (they make them together), new for each.
        _borrowed_made[name] = _borrowed_made.get(name, 0) + 1
        board_key = f"allscan/fault/borrowed/{name}/{_borrowed_made[name]}"
    _retire_aliases(nccl)
    handle = int(_C.comm_create(nccl))
    comm = Communicator(
        group_name=name,
        device=device,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        nccl=nccl,
        handle=handle,
        owned=owned,
        group_ref=weakref.ref(group),
    )
    try:
        if comm.size > 1:
            comm.watch = watch(nccl, owned, group, device)
            if comm.watch:
                put_on_board(comm, board_key)
        if _C.comm_rank(handle) != comm.rank or _C.comm_size(handle) != comm.size:
            raise RuntimeError(
                f"allscan: the NCCL communicator of group {name!r} has rank/size "
                f"{_C.comm_rank(handle)}/{_C.comm_size(handle)}, the group {comm.rank}/{comm.size}"
            )
        model = settings.link_model
        if model is not None:
            _C.set_link_model(handle, *model)
        elif comm.size > 2:
            # The block count only matters past two ranks (at P = 2 the best K is 1 whatever the link).
            with torch.cuda.device(device):
                _C.calibrate(handle, torch.cuda.current_stream(device).cuda_stream)
        a, b, is_set = _C.get_link_model(handle)
        comm.link_model = (a, b) if is_set else None
    except BaseException:
        comm.destroy()  # nothing of it is cached: no watch thread, handle or owned communicator left
        raise
    with _lock:
        _comms[key] = comm
    return comm


def destroy_communicators() -> None:
    """Destroy the communicators allscan owns and forget the borrowed ones (never destroyed)."""
    with _lock:
        comms = list(_comms.values())
        _comms.clear()
    for c in comms:
        try:
            c.destroy()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    _faults.board().stop()  # nothing left to watch; the next communicator starts it again


atexit.register(destroy_communicators)
