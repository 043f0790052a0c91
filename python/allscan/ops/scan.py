"""``allscan.scan``, the All-Scan's public entry, with its companions (``ScanHandle``,
``set_check_every_call``, ``destroy_communicators``, ``device_path``).

A call first tries the eager fast path (:mod:`allscan.ops._scan_fast`: a signature already checked
and planned goes straight to the core), else takes the full path (:func:`full_path`): the diagonal
scan (:mod:`allscan.ops.diagonal_scan`) or, with ``transition=``, the matrix scan
(:mod:`allscan.ops.matrix_scan`), both through one body (:mod:`allscan.ops._scan_body`); an async
call returns a :class:`ScanHandle` (:mod:`allscan.ops._scan_handle`, with the side streams).

CUDA tensors on an NCCL group launch through the C++ core; everything else runs the
torch.distributed implementation (:mod:`allscan.ops._scan_dist`). Benchmarks time the layers of one
call through four documented hooks: :func:`plan_for` (the cached plan of a diagonal signature),
:func:`launch` (the core alone, through a plan), :func:`run` (plan lookup and launch) and
:func:`full_path` (every check and lookup: what a call costs when the fast path cannot serve it);
the matrix scan's ``plan_for`` and ``launch`` are :mod:`allscan.ops.matrix_scan`'s.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _C, _comm, _threads
from .._agreement import clear_checked_signatures
from .._settings import settings
from ._launch import forget_plans
from ._scan_body import ScanLaunchPlan, scan_body
from ._scan_fast import eager_calls, eager_ready, fast_call, fast_key
from ._scan_handle import ScanHandle
from .diagonal_scan import METHODS, launch, plan_for, run
from .diagonal_scan import OP as DIAGONAL_OP
from .diagonal_scan import scan_impl as diagonal_impl
from .diagonal_scan import validate as diagonal_validate
from .matrix_scan import OP as MATRIX_OP
from .matrix_scan import scan_impl as matrix_impl
from .matrix_scan import validate as matrix_validate

__all__ = ["scan", "ScanHandle", "set_check_every_call", "destroy_communicators", "ScanLaunchPlan", "plan_for",
           "launch", "run", "full_path", "METHODS", "device_path"]

_HAS_DIST = dist.is_available()  # a torch built without it: normalize_group raises the error that says so
_ProcessGroup = dist.ProcessGroup if _HAS_DIST else None
_is_compiling = torch.compiler.is_compiling


def set_check_every_call(enabled: bool) -> None:
    """Exchange the argument signature across ranks on every call (``ALLSCAN_CHECK=always``), or
    only the first time a signature is seen (``first``). Costs one small all-gather and a host
    synchronisation per call; catches a rank that changes its arguments after the first check."""
    settings.check = "always" if enabled else "first"


def scan(
    tensor: torch.Tensor,
    gamma: Optional[torch.Tensor] = None,
    group=None,
    *,
    transition: Optional[torch.Tensor] = None,
    reverse: bool = False,
    inclusive: bool = False,
    init: Optional[torch.Tensor] = None,
    num_blocks: Optional[int] = None,
    method: str = "pipelined",
    async_op: bool = False,
):
    """All-Scan over the ranks of ``group`` (default: the default group), in group-rank order.

    Rank p holds ``tensor`` = x_p and ``gamma`` = g_p (a prefix shape of x_p, broadcast over the
    trailing dimensions it lacks; ``None`` = 1)::

        forward:  y_0 = init (zeros if None)       y_{p+1} = g_p * y_p + x_p
        reverse:  y_{P-1} = init (zeros if None)   y_{p-1} = g_p * y_p + x_p

    Returns y_p (the state entering rank p), or g_p * y_p + x_p with ``inclusive=True``. Arithmetic
    is fp32 (fp64 for fp64 tensors), rounded to the tensor's dtype at each rank boundary; every method
    gives bitwise the same answer. ``method``: "pipelined" (ZeCO All-Scan, ``num_blocks`` blocks,
    chosen from the link model when None), "serial" (LASP-1 pattern), "allgather" (LASP-2
    pattern) or "device" (on NCCL: one kernel per rank storing into the next rank's memory over
    NVLink, ``num_blocks`` its CTA count; where the ranks are not all load/store accessible, the
    pipelined method: :func:`device_path` says which ran; diagonal decays only). Differentiable in
    ``tensor``, ``gamma`` and ``init`` (through the reverse All-Scan).
    Every rank must pass the same shapes, dtypes and options; a mismatch raises ``ValueError`` on
    every rank (see ``ALLSCAN_CHECK`` and :func:`set_check_every_call`).

    With ``async_op=True`` returns a :class:`ScanHandle`; ``handle.wait()`` gives the result.

    With ``transition`` (``[..., K, K]``, instead of ``gamma``) the combine is ``M_p @ y_p + x_p`` on
    states ``[..., K, V]``: :func:`allscan.ops.matrix_scan.matrix_scan`.
    """
    if _is_compiling():  # traced into a graph: no host-thread bookkeeping there
        return full_path(tensor, gamma, group, transition, reverse, inclusive, init, num_blocks, method, async_op)
    grp = dist.group.WORLD if group is None and _HAS_DIST else group  # WORLD: None before init_process_group
    if grp.__class__ is not _ProcessGroup and not (_HAS_DIST and isinstance(grp, dist.ProcessGroup)):
        grp = _comm.normalize_group(group)  # a name, or an error naming what is wrong
    entry = _threads.enter(grp, DIAGONAL_OP)
    try:
        other = gamma if transition is None else transition
        key = fast_key(grp, tensor, gamma, transition, init, reverse, inclusive, num_blocks, method, async_op)
        hit = eager_calls.get(key)
        if hit is not None:
            y = hit.serve(grp, tensor, other, init)
            if y is not None:
                return y
        y = full_path(tensor, gamma, grp, transition, reverse, inclusive, init, num_blocks, method, async_op)
        if key is not None and eager_ready(grp, tensor, other, init, async_op):
            call = fast_call(tensor, other, transition is not None, init, grp, reverse, inclusive,
                             0 if num_blocks is None else num_blocks, method, async_op)
            if call is not None:
                eager_calls[key] = call
        return y
    finally:
        _threads.leave(grp, entry)


def full_path(tensor, gamma, group, transition, reverse, inclusive, init, num_blocks, method, async_op):
    """A scan call past the fast path (a documented hook: benchmarks time it; the arguments as
    :func:`scan` passes them): every check, the plan lookup and
    the launch, of the matrix scan with ``transition``, else of the diagonal scan."""
    if transition is not None:
        return scan_body(MATRIX_OP, lambda: matrix_validate(tensor, transition, init, method, num_blocks, gamma),
                         matrix_impl, tensor, transition, group, init=init, reverse=reverse, inclusive=inclusive,
                         num_blocks=num_blocks, method=method, async_op=async_op)
    return scan_body(DIAGONAL_OP, lambda: diagonal_validate(tensor, gamma, init, method, num_blocks), diagonal_impl,
                     tensor, gamma, group, init=init, reverse=reverse, inclusive=inclusive, num_blocks=num_blocks,
                     method=method, async_op=async_op)


def destroy_communicators() -> None:
    """Destroy the NCCL communicators allscan owns, forget the borrowed ones (never destroyed) and
    every prepared plan (of every collective) and checked signature; the next call prepares them
    again."""
    forget_plans()
    clear_checked_signatures()
    _comm.destroy_communicators()


def device_path(group=None, device=None) -> str:
    """Which path ``method="device"`` took on ``group``'s communicator (None: the default group) on
    ``device`` (None: the current CUDA device): ``"device"`` (NVLink load/store, one kernel per
    rank), ``"nccl: <why not>"`` (the pipelined NCCL path), or ``"not tried"`` (no such call on it yet,
    or no CUDA). A host query: no collective, on any rank alone."""
    if device is None:
        if not torch.cuda.is_available():
            return "not tried"
        device = torch.cuda.current_device()
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    comm = _comm.find_communicator(group, dev)  # a query: never creates one (that is collective)
    if comm is None:
        return "not tried"
    state, why = _C.device_path(comm.handle)
    return {1: "device", 0: "not tried"}.get(state, f"nccl: {why}")

