"""The diagonal All-Scan (``allscan.scan(tensor, gamma)``): validate -> plan -> launch, and the
custom op ``allscan::scan`` with its autograd and fake implementation.

Rank p holds x_p and g_p (a prefix shape of x_p, broadcast over the trailing dimensions it lacks;
None = 1)::

    forward:  y_0 = init (zeros if None)       y_{p+1} = g_p * y_p + x_p
    reverse:  y_{P-1} = init (zeros if None)   y_{p-1} = g_p * y_p + x_p

CUDA tensors on an NCCL group launch through the C++ core; everything else runs the
torch.distributed implementation (:mod:`allscan.ops._scan_dist`). The public entry is
:func:`allscan.scan` (:mod:`allscan.ops.scan`), which calls :func:`~allscan.ops._scan_body.scan_body`
with this module's :func:`validate` and :func:`scan_impl`. Benchmarks time the layers of one call
through three documented hooks (also named in :mod:`allscan.ops.scan`): :func:`plan_for` (the cached
plan of a signature), :func:`launch` (the core alone, through a plan) and :func:`run` (plan lookup
and launch).

Autograd: the gradient of the forward scan with respect to x is the reverse exclusive scan of the
incoming gradient with the same decays; the decay's gradient is y * dx summed over the dimensions
it is broadcast over; the chain head's init gets g_head * dx_head + dy_head.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import _C, _comm
from .._agreement import check_across_ranks, signature_hash
from .._dtypes import DTYPE_CODES, dtype_code
from ..reference import acc_dtype, combine, expand_decay
from . import _scan_dist
from ._launch import nccl_preflight, plan_cache, plan_is_current, stream_ptr
from ._scan_body import (ScanLaunchPlan, check_num_blocks, group_is_chain_head, needs_grad, reads_init,
                         save_call_options)

__all__ = ["METHODS", "OP", "validate", "plan_for", "plan_key", "plans", "run", "launch", "scan_op", "scan_impl"]

METHODS = ("pipelined", "serial", "allgather", "device")
OP = "scan"  # the op's name in errors and in the cross-rank signature
_MAX_DIMS = 8  # dimensions of the state compared one by one; further ones by a hash


# ------------------------------------------------------------------------------------------------
# Validate: local argument checks, and the signature compared across ranks
# ------------------------------------------------------------------------------------------------
def _check_companion(name: str, t, tensor: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"allscan.scan: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != tensor.device:
        raise ValueError(f"allscan.scan: {name} is on {t.device}, the tensor on {tensor.device}")


def validate(tensor, gamma, init, method, num_blocks) -> None:
    """The local argument checks of ``allscan.scan(tensor, gamma, ...)``: ``TypeError`` or
    ``ValueError`` naming the argument."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allscan.scan: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    dtype_code(tensor.dtype, "allscan.scan: tensor")
    if gamma is not None:
        _check_companion("gamma", gamma, tensor)
        if gamma.dtype not in (torch.float32, tensor.dtype):
            raise TypeError(
                f"allscan.scan: gamma must be float32 or the tensor's dtype ({tensor.dtype}), got {gamma.dtype}"
            )
        if gamma.dim() > tensor.dim() or tuple(gamma.shape) != tuple(tensor.shape[: gamma.dim()]):
            raise ValueError(
                f"allscan.scan: gamma's shape {list(gamma.shape)} must be a prefix of the tensor's shape "
                f"{list(tensor.shape)} (it is broadcast over the trailing dimensions it lacks)"
            )
    if init is not None:
        _check_companion("init", init, tensor)
        if tuple(init.shape) != tuple(tensor.shape) or init.dtype != tensor.dtype:
            raise ValueError(
                f"allscan.scan: init must have the tensor's shape and dtype ({tensor.dtype}{list(tensor.shape)}), "
                f"got {init.dtype}{list(init.shape)}"
            )
    if method not in METHODS:
        raise ValueError(f"allscan.scan: method must be one of {METHODS}, got {method!r}")
    check_num_blocks("allscan.scan", num_blocks, method)


def _signature(x, g, init, reverse, inclusive, num_blocks, method) -> List[Tuple[str, int]]:
    shape = tuple(x.shape)
    fields = [("tensor dtype", DTYPE_CODES[x.dtype]), ("tensor ndim", x.dim()), ("tensor numel", x.numel())]
    fields += [(f"tensor shape[{i}]", shape[i] if i < len(shape) else -1) for i in range(_MAX_DIMS)]
    fields += [
        (f"tensor shape[{_MAX_DIMS}:] (hash)", hash(shape[_MAX_DIMS:]) & ((1 << 61) - 1) if len(shape) > _MAX_DIMS else 0),
        ("gamma dtype", -1 if g is None else DTYPE_CODES[g.dtype]),
        ("gamma ndim", -1 if g is None else g.dim()),
        ("gamma numel", -1 if g is None else g.numel()),
        ("init given", int(init is not None)),
        ("reverse", int(reverse)),
        ("inclusive", int(inclusive)),
        ("method (0 pipelined, 1 serial, 2 allgather, 3 device)", METHODS.index(method)),
        ("num_blocks (0 auto)", num_blocks),
    ]
    return fields


# ------------------------------------------------------------------------------------------------
# Plan: what one argument signature needs, prepared once so that later calls only launch
# ------------------------------------------------------------------------------------------------
plans: Dict[tuple, ScanLaunchPlan] = plan_cache()  # the fast path keeps a hit's plan recent here


def _prepare(x, g, init, group, reverse, inclusive, num_blocks, method) -> ScanLaunchPlan:
    nccl = nccl_preflight(group, x, OP)
    fields = _signature(x, g, init, reverse, inclusive, num_blocks, method)
    check_across_ranks(group, x.device, OP, fields)
    if not nccl:
        return ScanLaunchPlan(group, None, 0, 0, 0, 0)
    comm = _comm.get_communicator(group, x.device)
    dt = DTYPE_CODES[x.dtype]
    gdt = dt if g is None else DTYPE_CODES[g.dtype]
    midx = METHODS.index(method)
    ws = _C.workspace_size(comm.handle, x.numel(), dt, 0 if g is None else 1, 0 if g is None else g.numel(), gdt,
                           0 if init is None else 1, reverse, inclusive, num_blocks, midx)
    return ScanLaunchPlan(group, comm, dt, gdt, midx, ws, signature_hash(OP, fields))


def plan_key(x, g, init, group, reverse, inclusive, num_blocks, method) -> tuple:
    return (group.group_name, id(group), x.device, x.shape, x.dtype, None if g is None else (g.shape, g.dtype),
            init is None, reverse, inclusive, num_blocks, method)


def plan_for(x, g, init, group, reverse, inclusive, num_blocks, method) -> ScanLaunchPlan:
    """The plan of this signature: cached, prepared on first use (which checks the signature across
    ranks, so collective then), re-prepared when the check runs every call, off NCCL (where
    ``first`` checks every call) or when the group was re-created."""
    key = plan_key(x, g, init, group, reverse, inclusive, num_blocks, method)
    plan = plans.get(key)
    if not plan_is_current(plan, group):
        plan = _prepare(x, g, init, group, reverse, inclusive, num_blocks, method)
        plans[key] = plan
    return plan


def run(x, g, init, group_name, reverse, inclusive, num_blocks, method, group=None, stream=None) -> torch.Tensor:
    """The scan of contiguous tensors on the caller's current stream, or on ``stream`` (a
    torch.cuda.Stream of x's device, NCCL path only: the async fast path)."""
    if group is None:
        group = _comm.resolve_group(group_name)
    plan = plan_for(x, g, init, group, reverse, inclusive, num_blocks, method)
    if x.numel() == 0:
        return torch.empty_like(x)
    if plan.comm is None:
        return _scan_dist.scan(x, g, init, group, reverse, inclusive, num_blocks, method)
    if x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # the core launches on the current device
            return launch(plan, x, g, init, reverse, inclusive, num_blocks, stream)
    return launch(plan, x, g, init, reverse, inclusive, num_blocks, stream)


def launch(plan: ScanLaunchPlan, x, g, init, reverse, inclusive, num_blocks, stream=None) -> torch.Tensor:
    """The core's scan through an NCCL plan (no check, no lookup): the output and workspace are
    allocated here, the kernels enqueued on the current stream or ``stream``."""
    y = torch.empty_like(x)
    # The workspace depends on the rank's place in the chain; often none (an exclusive scan's tail,
    # the head without init).
    ws = torch.empty(plan.ws_bytes, dtype=torch.uint8, device=x.device) if plan.ws_bytes else None
    _C.scan(
        plan.comm.handle, x.data_ptr(), y.data_ptr(), x.numel(), plan.dt, 0 if g is None else g.data_ptr(),
        0 if g is None else g.numel(), plan.gdt, 0 if init is None else init.data_ptr(), reverse, inclusive,
        num_blocks, plan.midx, 0 if ws is None else ws.data_ptr(), plan.ws_bytes,
        stream_ptr(x.get_device()) if stream is None else stream.cuda_stream, plan.signature,
    )
    if ws is not None and stream is not None:
        ws.record_stream(stream)  # allocated on the current stream, used on `stream`: freed after it
    return y


# ------------------------------------------------------------------------------------------------
# The custom op and its autograd
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("allscan::scan", mutates_args=())
def scan_op(
    x: torch.Tensor,
    g: Optional[torch.Tensor],
    init: Optional[torch.Tensor],
    group_name: str,
    reverse: bool,
    inclusive: bool,
    num_blocks: int,
    method: str,
    *,
    chain_head: bool,
) -> torch.Tensor:
    """The All-Scan of contiguous tensors (``num_blocks`` 0 = auto; ``chain_head``: this rank's init is
    the one read, :func:`~allscan.ops._scan_body.reads_init`). Use :func:`allscan.scan`."""
    return run(x, g, init, group_name, reverse, inclusive, num_blocks, method)


@scan_op.register_fake
def _scan_fake(x, g, init, group_name, reverse, inclusive, num_blocks, method, *, chain_head):
    return x.new_empty(x.shape)


def _op_setup_context(ctx, inputs, keyword_only_inputs, output):
    _setup_context(ctx, inputs, output, keyword_only_inputs["chain_head"])


def _setup_context(ctx, inputs, output, chain_head: bool):
    x, g, init, group_name, reverse, inclusive, num_blocks, method = inputs
    save_call_options(ctx, init, group_name, reverse, inclusive, num_blocks, method, chain_head)
    ctx.g_shape = None if g is None else tuple(g.shape)
    ctx.g_dtype = None if g is None else g.dtype
    need_y = g is not None and ctx.needs_input_grad[1]
    ctx.save_for_backward(g, output if need_y else None)


def _backward(ctx, dy, reverse_scan=None):
    """The op's gradient; ``reverse_scan`` runs the reverse scan (default: the op, differentiable and
    traceable; the eager autograd path passes :func:`_eager_reverse`)."""
    reverse_scan = reverse_scan or _reverse_op
    if ctx.inclusive:
        raise RuntimeError(
            "allscan::scan with inclusive=True has no registered gradient; allscan.scan() computes the "
            "inclusive result as the exclusive scan plus one combine, which is differentiable"
        )
    g, y = ctx.saved_tensors
    dy = dy.contiguous()
    # The gradient of the forward scan with respect to x is the reverse exclusive scan of the
    # incoming gradient with the same decays: r_{p-1} = g_p * r_p + dy_p, r at the chain's end = 0.
    dx = reverse_scan(dy, g, None, ctx.group_name, not ctx.reverse, False, ctx.num_blocks, ctx.method)
    dg = dinit = None
    if ctx.needs_input_grad[1] and g is not None:
        acc = acc_dtype(dy.dtype)
        prod = y.to(acc) * dx.to(acc)
        dg = prod.reshape(tuple(ctx.g_shape) + (-1,)).sum(-1).to(ctx.g_dtype)
    if ctx.has_init and ctx.needs_input_grad[2]:
        if ctx.chain_head:
            # d/d init of y_head = init (its own output) and of y_next = g_head*init + x_head.
            acc = acc_dtype(dy.dtype)
            gb = 1.0 if g is None else expand_decay(g, dy.dim()).to(acc)
            dinit = (gb * dx.to(acc) + dy.to(acc)).to(dy.dtype)
        else:
            dinit = torch.zeros_like(dy)
    return dx, dg, dinit, None, None, None, None, None


scan_op.register_autograd(_backward, setup_context=_op_setup_context)


# ------------------------------------------------------------------------------------------------
# An eager call: the op's own implementation, without the dispatcher
# ------------------------------------------------------------------------------------------------
class _EagerScan(torch.autograd.Function):
    """An eager call that needs a gradient: the op's own forward, context and backward, without the
    dispatcher's round trip (tens of microseconds per call); torch.compile traces the op."""

    @staticmethod
    def forward(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream):
        return run(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, init, name, reverse, *_, group, _ = inputs
        _setup_context(ctx, inputs[:8], output, reads_init(init, group, name, reverse))

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy, _eager_reverse) + (None, None)


def _reverse_op(*args):
    """The backward's reverse scan as the op (no init: no rank's is read)."""
    return scan_op(*args, chain_head=False)


def _eager_reverse(*args):
    """The backward's reverse scan in an eager backward: without the dispatcher, unless a double
    backward needs it differentiable (grad mode on)."""
    return _reverse_op(*args) if torch.is_grad_enabled() else run(*args)


def scan_impl(x, g, init, name, reverse, inclusive, num_blocks, method, group=None, stream=None):
    """The scan of contiguous tensors (on ``stream`` when given: eager NCCL calls, never an
    inclusive one that needs a gradient)."""
    grad = needs_grad(x, g, init)
    eager = not torch.compiler.is_compiling()
    if not grad and eager:
        # Eager and nothing to differentiate: the op's own implementation, without the dispatcher
        # round trip (tens of microseconds). torch.compile goes through the op.
        return run(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream)
    if eager and not inclusive:
        return _EagerScan.apply(x, g, init, name, reverse, False, num_blocks, method, group, stream)
    if inclusive and grad:
        # Differentiable composite: the exclusive scan, then the rank's own combine.
        y = (_EagerScan.apply(x, g, init, name, reverse, False, num_blocks, method, group, None) if eager
             else scan_op(x, g, init, name, reverse, False, num_blocks, method,
                          chain_head=reads_init(init, group, name, reverse)))
        acc = acc_dtype(x.dtype)
        if init is None and group_is_chain_head(group if group is not None else _comm.resolve_group(name), reverse):
            # nothing enters the head: its inclusive result is its own x, whatever its decay (an inf
            # decay times the zero it receives would be nan); y stays in the graph with zero gradient
            return (y.to(acc) * 0 + x.to(acc)).to(x.dtype)
        return combine(g, y, x)
    return scan_op(x, g, init, name, reverse, inclusive, num_blocks, method,
                   chain_head=reads_init(init, group, name, reverse))
