"""What every collective's launch shares: which path a call takes (and the local checks made before
the first collective of the NCCL path), the device a rank that failed locally exchanges on, the
current stream's raw handle, and the caches of prepared plans (one per collective, all forgotten
together by ``allscan.destroy_communicators``)."""
from __future__ import annotations

from collections import OrderedDict
from typing import List

import torch

from .. import _comm
from .._agreement import announce_invalid
from .._settings import settings

__all__ = ["validated_group", "traced_refusal", "or_empty", "absent", "nccl_preflight", "announce_device",
           "tell_peers_of_failure", "own_work", "refuse_double_backward", "raw_stream", "stream_ptr", "plan_cache",
           "plan_is_current", "forget_plans", "PlanCache", "MAX_PLANS"]


def validated_group(group, tensor, op: str, validate, *, every_call: bool = False):
    """The group (None: the default group) once ``validate()`` (the local argument checks) passed. A
    rank whose checks fail tells its peers (so their signature exchange fails too) and re-raises; not
    while torch.compile traces (the trace runs no collective: the ops check again when they run).
    ``every_call``: the peers' signature check exchanges on every call (``check_across_ranks``)."""
    group = _comm.normalize_group(group)
    try:
        validate()
    except (TypeError, ValueError) as e:
        if isinstance(tensor, torch.Tensor) and not torch.compiler.is_compiling():
            announce_invalid(group, announce_device(group), op, str(e), every_call=every_call)
        raise
    return group


@torch.library.custom_op("allscan::refused", mutates_args=())
def refused_op(like: torch.Tensor, group_name: str, op: str, error_type: str, message: str) -> torch.Tensor:
    """A call refused by its local checks while torch.compile traced it (:func:`traced_refusal`): when
    it runs, it tells the peers as the eager call would, then raises ``error_type(message)``."""
    group = _comm.normalize_group(group_name or None)
    announce_invalid(group, announce_device(group), op, message)
    raise (TypeError if error_type == "TypeError" else ValueError)(message)


@refused_op.register_fake
def _refused_fake(like, group_name, op, error_type, message):
    return like.new_empty(like.shape)


def traced_refusal(group, tensor, op: str, error: Exception) -> torch.Tensor:
    """Under torch.compile, a call whose local checks failed while tracing (``error``) becomes
    ``allscan::refused`` in the graph, which tells the peers and raises when the graph runs (as the
    eager call does at once); the trace goes on with a placeholder of ``tensor``'s shape (the scan's
    output shape; for the all-to-alls, whose output shape differs, code after the call that needs it
    can still fail this rank's trace alone). Raises ``error`` outside a trace, or with no tensor to
    stand in for."""
    if not (torch.compiler.is_compiling() and isinstance(tensor, torch.Tensor)):
        raise error
    return refused_op(tensor.detach(), _comm.group_name(group), op, type(error).__name__, str(error))


def or_empty(t, like: torch.Tensor) -> torch.Tensor:
    """A custom op's optional result: ``t`` contiguous, or for None a new empty fp32 tensor (one each:
    an op's outputs may not alias; a schema has no optional outputs)."""
    return like.new_empty(0, dtype=torch.float32) if t is None else t.contiguous()


def absent(t):
    """The inverse of :func:`or_empty`: None for an empty tensor."""
    return None if t is None or t.numel() == 0 else t


def announce_device(group) -> torch.device:
    """The device a rank that failed its local checks exchanges on: the one its peers use."""
    if "nccl" in _comm.backend_name(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tell_peers_of_failure(group, op: str, step: str, error: BaseException, *, every_call: bool = False) -> None:
    """A rank whose own work before its part of ``op`` raised (out of memory, say) tells its peers as a
    rank with bad arguments does (:func:`allscan._agreement.announce_invalid`; ``every_call``: the
    peers' check exchanges on every call), so that they raise instead of waiting in ``op`` until the
    timeout; the caller re-raises ``error``."""
    announce_invalid(group, announce_device(group), op, f"{step} failed: {type(error).__name__}: {error}",
                     every_call=every_call)


def own_work(group, op: str, step: str, work, *args, every_call: bool = False):
    """``work(*args)``: a layer's own work before its peers' next collective of the same call (``group``
    as :func:`allscan.ops.sequence_parallel_group` returns it: None for one process). If it raises, the
    peers are told (:func:`tell_peers_of_failure`), so that they raise in that collective instead of
    waiting for this rank until the timeout, and the error is re-raised. Only before a collective every
    rank makes next: after a layer's last collective the peers' next one may be anything, torch's own
    included. ``every_call``: the peers' next collective checks its arguments on every call
    (:func:`allscan._agreement.check_across_ranks`). While torch.compile traces, plainly ``work(*args)``
    (the trace runs no collective)."""
    if group is None or torch.compiler.is_compiling():
        return work(*args)
    try:
        return work(*args)
    except Exception as e:
        tell_peers_of_failure(group, op, step, e, every_call=every_call)
        raise


def refuse_double_backward(op: str, why: str) -> None:
    """Raise where a backward runs with ``create_graph=True`` (the engine runs a backward in grad mode only then):
    ``op``'s backward is not differentiable (``why``). Refused then, not later: torch's ``once_differentiable``
    raises only where the second backward reaches its node, and ``autograd.grad`` skips that node whenever
    another path (a residual, a skip term) reaches the inputs, returning second-order gradients without the
    op's terms. Every rank runs the same graph, so every rank raises, before its backward's first collective."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: double backward (a backward with create_graph=True, e.g. for a gradient penalty) "
                           f"is not supported: {why}. Take the gradients without create_graph=True")


def nccl_preflight(group, x: torch.Tensor, op: str) -> bool:
    """True when ``x`` goes through the C++ core on ``group``; then the device and the settings are
    checked first (local checks, so a misconfigured rank fails before any collective, joining its
    peers' signature exchange when they make one)."""
    if not _comm.uses_nccl(group, x):
        return False
    try:
        _comm.check_device(group, x.device)
        _comm.check_env()
    except ValueError as e:
        announce_invalid(group, torch.device("cuda", torch.cuda.current_device()), op, str(e))
        raise
    return True


# The current stream's handle without building a torch.cuda.Stream object (a few microseconds per
# call); the public route where this private helper is missing.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_ptr(device_index: int) -> int:
    """The current stream of CUDA device ``device_index`` (``tensor.get_device()``), as a raw handle."""
    if raw_stream is not None:
        return raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# ------------------------------------------------------------------------------------------------
# Plans: what one argument signature needs, prepared once so that later calls only launch. A plan
# has ``comm`` (None on the torch.distributed path) and ``group_ref`` (its group, weakly).
# ------------------------------------------------------------------------------------------------
_plan_caches: List[dict] = []


MAX_PLANS = 1024  # per cache; an evicted signature is prepared (and checked across ranks) again when next used


class PlanCache(OrderedDict):
    """A bounded LRU map (signature key -> plan): at most :data:`MAX_PLANS` entries, the least
    recently used evicted first, so a process that sees ever new shapes does not grow without bound."""

    def get(self, key, default=None):
        value = super().get(key, default)
        if key in self:
            self.move_to_end(key)
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > MAX_PLANS:
            self.popitem(last=False)


def plan_cache(kind=PlanCache) -> PlanCache:
    """A collective's cache of plans (a :class:`PlanCache` or a subclass), emptied by :func:`forget_plans`."""
    cache = kind()
    _plan_caches.append(cache)
    return cache


def plan_is_current(plan, group) -> bool:
    """Whether a cached plan (or None) serves this call: not when the check runs every call, off
    NCCL (where ``first`` checks every call) or when the group was re-created."""
    return (plan is not None and plan.comm is not None and settings.check != "always"
            and plan.group_ref() is group)


def forget_plans() -> None:
    """Forget every collective's plans (they hold communicators: ``allscan.destroy_communicators``)."""
    for cache in _plan_caches:
        cache.clear()
