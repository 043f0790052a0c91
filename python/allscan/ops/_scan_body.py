"""What the diagonal and the matrix scan share (:mod:`allscan.ops.diagonal_scan`,
:mod:`allscan.ops.matrix_scan`): the body of a call (:func:`scan_body`: the local checks, then the
call synchronous or async), the launch plan, the ``num_blocks`` check, and the pieces of their
autograd (which inputs need a gradient, which rank heads the chain, the options a backward needs).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import _C, _comm
from ._launch import traced_refusal, validated_group
from ._scan_handle import ScanHandle, async_handle, by_handle_ok, side_stream_handle

__all__ = ["MAX_BLOCKS", "MAX_DEVICE_CTAS", "check_num_blocks", "ScanLaunchPlan", "scan_body", "needs_grad",
           "group_is_chain_head", "reads_init", "save_call_options"]

MAX_BLOCKS = _C.MAX_BLOCKS  # the pipeline's blocks (allscanMaxBlocks); the serial and all-gather methods use one
MAX_DEVICE_CTAS = 128  # method="device": its CTA count (kMaxCtas, csrc/allscan/device_scan_kernel.cuh)


def check_num_blocks(what: str, num_blocks, method: str) -> None:
    """``num_blocks`` of a scan with ``method`` (already checked): None (auto) or an int from 1 to
    :data:`MAX_BLOCKS`, or to :data:`MAX_DEVICE_CTAS` for ``method="device"`` (its CTA count)."""
    if num_blocks is None:
        return
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"{what}: num_blocks must be None (auto) or a positive int, got {num_blocks!r}")
    if method == "device":
        if num_blocks > MAX_DEVICE_CTAS:
            raise ValueError(f"{what}: num_blocks must be at most {MAX_DEVICE_CTAS} with method='device' (its CTA "
                             f"count, from 1 to {MAX_DEVICE_CTAS}; None: one per 64 KiB), got {num_blocks}")
    elif num_blocks > MAX_BLOCKS:
        raise ValueError(f"{what}: num_blocks must be at most {MAX_BLOCKS} (the pipeline's blocks, from 1 to "
                         f"{MAX_BLOCKS}; None: chosen from the link model), got {num_blocks}")


class ScanLaunchPlan:
    """The NCCL launch of one signature: communicator, dtype codes (the state's, and the decay's or,
    for the matrix scan, the transition's), method index, workspace size (``comm`` is None on the
    torch.distributed path). Belongs to one group object."""

    __slots__ = ("group_ref", "comm", "dt", "gdt", "midx", "ws_bytes", "signature")

    def __init__(self, group, comm, dt, gdt, midx, ws_bytes, signature=0):
        self.group_ref = weakref.ref(group)
        self.comm = comm
        self.dt = dt
        self.gdt = gdt
        self.midx = midx
        self.ws_bytes = ws_bytes
        self.signature = signature  # sent ahead of the first block, checked by the receiver (0: not)


def scan_body(op: str, validate, impl, tensor, other, group, *, init, reverse, inclusive, num_blocks, method,
              async_op):
    """One scan call after the fast path: ``validate()`` (the local checks; a rank that fails tells its
    peers; under torch.compile the refusal goes into the graph), then ``impl`` (the op's
    ``scan_impl(x, other, init, name, reverse, inclusive, k, method, group[, stream])``) on contiguous
    tensors, synchronous, or async on the side stream by handle, or through :func:`async_handle`.
    ``other`` is the decay (None: 1) or the transition."""
    try:
        group = validated_group(group, tensor, op, validate)
    except (TypeError, ValueError) as e:  # under torch.compile: refused when the graph runs, on every rank
        out = traced_refusal(group, tensor, op, e)
        return ScanHandle(out) if async_op else out
    name = group.group_name
    x = tensor.contiguous()
    o = None if other is None else other.contiguous()
    i0 = None if init is None else init.contiguous()
    k = 0 if num_blocks is None else int(num_blocks)
    if not async_op:
        return impl(x, o, i0, name, reverse, inclusive, k, method, group)
    if by_handle_ok(group, x, needs_grad(o)) and not (inclusive and needs_grad(x, o, i0)):
        return side_stream_handle(x, (x, o, i0), lambda side: impl(x, o, i0, name, reverse, inclusive, k, method,
                                                                   group, side))
    return async_handle(group, x, (x, o, i0), lambda: impl(x, o, i0, name, reverse, inclusive, k, method, group))


def needs_grad(*ts) -> bool:
    """Whether autograd records a call on these tensors (None allowed)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def group_is_chain_head(group, reverse: bool) -> bool:
    """Whether this rank starts the chain of ``group`` (the one rank whose init is read)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank == (world - 1 if reverse else 0)


def reads_init(init, group, group_name: str, reverse: bool) -> bool:
    """Whether this rank's ``init`` is the one the scan reads (given, on the chain's head; ``group``
    None: the group named ``group_name``). The scan ops take it as an argument (``chain_head``): the
    gradient of init depends on it, and a compiled graph's cache key holds the ops' arguments, not
    the rank (docs/design.md, torch.compile)."""
    if init is None:
        return False
    return group_is_chain_head(group if group is not None else _comm.resolve_group(group_name), reverse)


def save_call_options(ctx, init, group_name, reverse, inclusive, num_blocks, method, chain_head: bool) -> None:
    """What a scan op's backward needs of its call (the diagonal op's and the matrix op's): the options,
    whether an init was given and whether it is the one read (:func:`reads_init`)."""
    ctx.group_name = group_name
    ctx.reverse = reverse
    ctx.inclusive = inclusive
    ctx.num_blocks = num_blocks
    ctx.method = method
    ctx.has_init = init is not None
    ctx.chain_head = chain_head
