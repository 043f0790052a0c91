"""``allscan.scan``'s eager fast path: a call whose arguments (shapes, dtypes, devices, options) have an
NCCL plan that passed every check of the first call made with them goes straight to the core (issue
14: the host's time per call), synchronous or async, diagonal or matrix. Everything else takes the
full path (:func:`allscan.ops.scan.full_path`), which fills this cache (:func:`eager_ready`,
:func:`fast_call`). What :func:`allscan.ops.scan.scan` runs of this on every call is kept to one key
tuple (:func:`fast_key`), one plain dict lookup (:data:`eager_calls`) and the checks the key cannot
hold (:meth:`FastCall.serve`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .diagonal_scan import launch as diagonal_launch
from .diagonal_scan import plan_key as diagonal_plan_key
from .diagonal_scan import plans as diagonal_plans
from .matrix_scan import launch as matrix_launch
from .matrix_scan import plan_key as matrix_plan_key
from .matrix_scan import plans as matrix_plans
from ._launch import PlanCache, plan_cache, plan_is_current, raw_stream
from ._scan_body import needs_grad
from ._scan_handle import side_stream_handle

__all__ = ["FastCall", "EagerCache", "eager_calls", "fast_key", "fast_call", "eager_ready", "current_device"]

# The current CUDA device without torch.cuda's lazy-init check (a hit means CUDA is initialised).
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_grad_enabled = torch.is_grad_enabled


class FastCall:
    """A signature the full path checked and planned: its plan, where the plan is cached (so a hit
    keeps it recent there, as the full path would), the core's launch (``launch`` of the diagonal scan's
    module or of the matrix scan's) with the call's options after the tensors, and the CUDA device the key's
    tensors are on."""

    __slots__ = ("plan", "plans", "pkey", "core", "options", "async_op", "device")

    def __init__(self, plan, plans, pkey, core, options, async_op, device: int):
        self.plan, self.plans, self.pkey, self.core, self.options, self.async_op, self.device = (
            plan, plans, pkey, core, options, async_op, device)

    def serve(self, group, x, other, init):
        """The call through the core, or None where this call of the entry's key may not go straight
        to it: the plan no longer current for ``group`` (checks run every call with
        ``ALLSCAN_CHECK=always``: never), something to differentiate, a tensor not contiguous (the key
        holds shapes, dtypes and devices), another current device than the tensors', or the plan no
        longer cached (a hit keeps it recent there, so every rank evicts the same signatures: an
        eviction means a new, collective, check, which the full path makes)."""
        plan = self.plan
        if not plan_is_current(plan, group):
            return None
        if _grad_enabled() and (x.requires_grad or (other is not None and other.requires_grad)
                                or (init is not None and init.requires_grad)):
            return None
        if not (x.is_contiguous() and (other is None or other.is_contiguous())
                and (init is None or init.is_contiguous())) or current_device() != self.device:
            return None
        try:
            self.plans.move_to_end(self.pkey)
        except KeyError:
            return None
        if self.async_op:
            return side_stream_handle(x, (x, other, init),
                                      lambda side: self.core(plan, x, other, init, *self.options, side))
        return self.core(plan, x, other, init, *self.options)


class EagerCache(PlanCache):
    """The fast path's entries, bounded as every plan cache, looked up with plain ``dict.get``: a hit
    does not reorder them (an entry evicted while in use costs one full-path call); each hit keeps its
    plan recent in the plan's own cache instead, which is what every rank must agree on."""

    get = dict.get


eager_calls: Dict[tuple, FastCall] = plan_cache(EagerCache)


def fast_key(group, tensor, gamma, transition, init, reverse, inclusive, num_blocks, method, async_op):
    """The fast path's key of a call (None: not keyed; the full path's checks name what is wrong).
    Only ``torch.Tensor`` itself is keyed (a subclass may override what the core would read), flags
    only as ``bool``, ``num_blocks`` only as an int, ``method`` only as a str: every key is hashable,
    and a flag given as another type (a tensor, an array) never fills the cache with keys no later
    call can match."""
    if (tensor.__class__ is not torch.Tensor or (reverse is not False and reverse is not True)
            or (inclusive is not False and inclusive is not True) or (async_op is not False and async_op is not True)
            or method.__class__ is not str or not (num_blocks is None or num_blocks.__class__ is int)):
        return None
    if transition is None:
        other = gamma
    elif gamma is None:
        other = transition
    else:
        return None
    if other is None:
        oshape = odtype = odevice = None
    elif other.__class__ is torch.Tensor:
        oshape, odtype, odevice = other.size(), other.dtype, other.device
    else:
        return None
    if init is None:
        ishape = idtype = idevice = None
    elif init.__class__ is torch.Tensor:
        ishape, idtype, idevice = init.size(), init.dtype, init.device
    else:
        return None
    return (id(group), tensor.size(), tensor.dtype, tensor.device, transition is not None, oshape, odtype, odevice,
            ishape, idtype, idevice, reverse, inclusive, num_blocks, method, async_op)


def fast_call(x, other, matrix, init, group, reverse, inclusive, k, method, async_op) -> Optional[FastCall]:
    """The fast path's entry for a call the full path just ran (None: its plan is not a current NCCL
    plan, so the next call takes the full path again)."""
    if matrix:
        pkey, plans = matrix_plan_key(x, other, init, group, reverse, inclusive, False, k, method), matrix_plans
    else:
        pkey, plans = diagonal_plan_key(x, other, init, group, reverse, inclusive, k, method), diagonal_plans
    plan = plans.get(pkey)
    if plan is None or not plan_is_current(plan, group):
        return None
    if matrix:
        return FastCall(plan, plans, pkey, matrix_launch, (reverse, inclusive, False, k), async_op, x.get_device())
    return FastCall(plan, plans, pkey, diagonal_launch, (reverse, inclusive, k), async_op, x.get_device())


def eager_ready(group, tensor, other, init, async_op) -> bool:
    """Whether a call the full path just ran may be served by the fast path next time (then
    :meth:`FastCall.serve` checks what may change from call to call): a non-empty CUDA tensor on
    the current device, the side stream by handle for an async call (:func:`by_handle_ok`), nothing to
    differentiate and every tensor contiguous (the full path would copy)."""
    if not tensor.is_cuda or tensor.numel() == 0 or (async_op and raw_stream is None):
        return False
    if needs_grad(tensor, other, init):
        return False
    return (tensor.is_contiguous() and (other is None or other.is_contiguous())
            and (init is None or init.is_contiguous()) and tensor.device.index == torch.cuda.current_device())
