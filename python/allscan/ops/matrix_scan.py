"""The matrix-transition All-Scan (``allscan.scan(tensor, transition=M)``): validate -> plan ->
launch, the custom op ``allscan::matrix_scan`` with autograd and a fake implementation.

Rank p holds a state x_p ``[..., K, V]`` and a transition M_p ``[..., K, K]`` (same leading dims)::

    forward:  y_0 = init (zeros if None)       y_{p+1} = M_p @ y_p + x_p
    reverse:  y_{P-1} = init (zeros if None)   y_{p-1} = M_p @ y_p + x_p

CUDA tensors on an NCCL group launch through the C++ core (``allscanMatrixScan``); everything else
runs the torch.distributed implementation (:mod:`allscan.ops._matrix_dist`).

Autograd: with r the reverse exclusive scan of dy with the transposed transitions
(r_{p-1} = M_p^T r_p + dy_p, r at the chain's end 0): dx_p = r_p, dM_p = r_p @ y_p^T, and on the
chain head dinit = M_head^T r_head + dy_head. (y_{p+1} = M_p y_p + x_p, so the adjoint a_p of y_p
is dy_p + M_p^T a_{p+1}; r_p = a_{p+1} is the adjoint of what rank p sends, hence dx_p = r_p and
dM_p = r_p y_p^T; init = y_head, whose adjoint is a_head.)
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import _C, _comm
from .._agreement import check_across_ranks, signature_hash
from .._dtypes import DTYPE_CODES, dtype_code
from ..reference import acc_dtype
from . import _matrix_dist
from ._launch import nccl_preflight, plan_cache, plan_is_current, stream_ptr
from ._matrix_math import combine
from ._scan_body import ScanLaunchPlan, check_num_blocks, needs_grad, reads_init, save_call_options, scan_body

__all__ = ["matrix_scan", "METHODS", "OP", "validate", "plan_for", "plan_key", "plans", "launch", "matrix_scan_op",
           "scan_impl"]

METHODS = ("pipelined", "serial", "allgather")
OP = "scan(transition=)"  # the op's name in errors and in the cross-rank signature
_WHAT = "allscan.scan"


# ------------------------------------------------------------------------------------------------
# Validate
# ------------------------------------------------------------------------------------------------
def validate(tensor, transition, init, method, num_blocks, gamma=None) -> None:
    """The local argument checks of ``allscan.scan(tensor, transition=...)``: ``TypeError`` or
    ``ValueError`` naming the argument."""
    if gamma is not None:
        raise ValueError(f"{_WHAT}: gamma and transition are mutually exclusive (pass one of them)")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_WHAT}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    dtype_code(tensor.dtype, f"{_WHAT}: tensor")
    if tensor.dim() < 2:
        raise ValueError(f"{_WHAT}: tensor must be [..., K, V] with a transition, got shape {list(tensor.shape)}")
    if not isinstance(transition, torch.Tensor):
        raise TypeError(f"{_WHAT}: transition must be a torch.Tensor, got {type(transition).__name__}")
    if transition.dtype not in (torch.float32, tensor.dtype):
        raise TypeError(f"{_WHAT}: transition must be float32 or the tensor's dtype ({tensor.dtype}), "
                        f"got {transition.dtype}")
    K = tensor.shape[-2]
    want = tuple(tensor.shape[:-1]) + (K,)
    if transition.dim() < 2 or tuple(transition.shape[-2:]) != (K, K):
        raise ValueError(f"{_WHAT}: transition must be [..., K, K] with K = tensor.shape[-2] = {K}, got shape "
                         f"{list(transition.shape)} (K mismatch)")
    if tuple(transition.shape) != want:
        raise ValueError(f"{_WHAT}: transition's shape {list(transition.shape)} must have the tensor's leading dims "
                         f"{list(tensor.shape[:-2])}: expected {list(want)}")
    if transition.device != tensor.device:
        raise ValueError(f"{_WHAT}: transition is on {transition.device}, the tensor on {tensor.device}")
    if init is not None:
        if not isinstance(init, torch.Tensor):
            raise TypeError(f"{_WHAT}: init must be a torch.Tensor or None, got {type(init).__name__}")
        if tuple(init.shape) != tuple(tensor.shape) or init.dtype != tensor.dtype:
            raise ValueError(f"{_WHAT}: init must have the tensor's shape and dtype ({tensor.dtype}"
                             f"{list(tensor.shape)}), got {init.dtype}{list(init.shape)}")
        if init.device != tensor.device:
            raise ValueError(f"{_WHAT}: init is on {init.device}, the tensor on {tensor.device}")
    if method not in METHODS:
        raise ValueError(f"{_WHAT}: method must be one of {METHODS}, got {method!r}")
    check_num_blocks(_WHAT, num_blocks, method)


def _dims(x: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, K, V): every leading dim flattened into batch."""
    K, V = x.shape[-2], x.shape[-1]
    return x.numel() // (K * V) if K * V else 0, K, V


def _signature(x, m, init, reverse, inclusive, transpose, num_blocks, method) -> List[Tuple[str, int]]:
    batch, K, V = _dims(x)
    return [
        ("tensor dtype", DTYPE_CODES[x.dtype]),
        ("batch (tensor's leading dims)", batch),
        ("K (tensor.shape[-2])", K),
        ("V (tensor.shape[-1])", V),
        ("transition dtype", DTYPE_CODES[m.dtype]),
        ("transposed transition", int(transpose)),
        ("init given", int(init is not None)),
        ("reverse", int(reverse)),
        ("inclusive", int(inclusive)),
        ("method (0 pipelined, 1 serial, 2 allgather)", METHODS.index(method)),
        ("num_blocks (0 auto)", num_blocks),
    ]


# ------------------------------------------------------------------------------------------------
# Plan and launch (the diagonal scan's plan: its gdt is the transition's dtype code here)
# ------------------------------------------------------------------------------------------------
plans: Dict[tuple, ScanLaunchPlan] = plan_cache()  # the fast path keeps a hit's plan recent here


def _prepare(x, m, init, group, reverse, inclusive, transpose, num_blocks, method) -> ScanLaunchPlan:
    nccl = nccl_preflight(group, x, OP)
    fields = _signature(x, m, init, reverse, inclusive, transpose, num_blocks, method)
    check_across_ranks(group, x.device, OP, fields)
    if not nccl:
        return ScanLaunchPlan(group, None, 0, 0, 0, 0)
    comm = _comm.get_communicator(group, x.device)
    dt, mdt, midx = DTYPE_CODES[x.dtype], DTYPE_CODES[m.dtype], METHODS.index(method)
    batch, K, V = _dims(x)
    ws = _C.matrix_workspace_size(comm.handle, batch, K, V, dt, mdt, transpose, init is not None, reverse, inclusive,
                                  num_blocks, midx)
    return ScanLaunchPlan(group, comm, dt, mdt, midx, ws, signature_hash(OP, fields))


def plan_key(x, m, init, group, reverse, inclusive, transpose, num_blocks, method) -> tuple:
    return (group.group_name, id(group), x.device, x.shape, x.dtype, m.dtype, init is None, reverse, inclusive,
            transpose, num_blocks, method)


def plan_for(x, m, init, group, reverse, inclusive, transpose, num_blocks, method) -> ScanLaunchPlan:
    """The plan of this signature (as :func:`allscan.ops.diagonal_scan.plan_for`; a benchmarks' hook)."""
    key = plan_key(x, m, init, group, reverse, inclusive, transpose, num_blocks, method)
    plan = plans.get(key)
    if not plan_is_current(plan, group):
        plan = _prepare(x, m, init, group, reverse, inclusive, transpose, num_blocks, method)
        plans[key] = plan
    return plan


def launch(plan: ScanLaunchPlan, x, m, init, reverse, inclusive, transpose, num_blocks, stream=None) -> torch.Tensor:
    """The core's matrix scan through an NCCL plan (no check, no lookup), on the current device:
    the output and workspace allocated here, the kernels enqueued on the current stream or ``stream``."""
    batch, K, V = _dims(x)
    y = torch.empty_like(x)
    ws = torch.empty(plan.ws_bytes, dtype=torch.uint8, device=x.device) if plan.ws_bytes else None
    _C.matrix_scan(plan.comm.handle, x.data_ptr(), y.data_ptr(), batch, K, V, plan.dt, m.data_ptr(), plan.gdt,
                   transpose, 0 if init is None else init.data_ptr(), reverse, inclusive, num_blocks, plan.midx,
                   0 if ws is None else ws.data_ptr(), plan.ws_bytes,
                   stream_ptr(x.get_device()) if stream is None else stream.cuda_stream, plan.signature)
    if ws is not None and stream is not None:
        ws.record_stream(stream)  # allocated on the current stream, used on `stream`
    return y


def _run(x, m, init, group_name, reverse, inclusive, transpose, num_blocks, method, *, group=None, stream=None):
    if group is None:
        group = _comm.resolve_group(group_name)
    plan = plan_for(x, m, init, group, reverse, inclusive, transpose, num_blocks, method)
    if x.numel() == 0:
        return torch.empty_like(x)
    if plan.comm is None:
        batch, K, V = _dims(x)
        y = _matrix_dist.scan(x.reshape(batch, K, V), m.reshape(batch, K, K),
                              None if init is None else init.reshape(batch, K, V), group, reverse, inclusive,
                              transpose, num_blocks, method)
        return y.reshape(x.shape)
    with torch.cuda.device(x.device):  # the core launches on the current device
        return launch(plan, x, m, init, reverse, inclusive, transpose, num_blocks, stream)


# ------------------------------------------------------------------------------------------------
# The custom op and its autograd
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("allscan::matrix_scan", mutates_args=())
def matrix_scan_op(
    x: torch.Tensor,
    m: torch.Tensor,
    init: Optional[torch.Tensor],
    group_name: str,
    reverse: bool,
    inclusive: bool,
    transpose: bool,
    num_blocks: int,
    method: str,
    *,
    chain_head: bool,
) -> torch.Tensor:
    """The matrix All-Scan of contiguous tensors (``num_blocks`` 0 = auto; ``transpose``: M^T is the
    transition; ``chain_head``: this rank's init is the one read,
    :func:`~allscan.ops._scan_body.reads_init`). Use :func:`allscan.scan` with ``transition=``."""
    return _run(x, m, init, group_name, reverse, inclusive, transpose, num_blocks, method)


@matrix_scan_op.register_fake
def _matrix_scan_fake(x, m, init, group_name, reverse, inclusive, transpose, num_blocks, method, *, chain_head):
    return x.new_empty(x.shape)


def _op_setup_context(ctx, inputs, keyword_only_inputs, output):
    _setup_context(ctx, inputs, output, keyword_only_inputs["chain_head"])


def _setup_context(ctx, inputs, output, chain_head: bool):
    x, m, init, group_name, reverse, inclusive, transpose, num_blocks, method = inputs
    save_call_options(ctx, init, group_name, reverse, inclusive, num_blocks, method, chain_head)
    ctx.transpose = transpose
    need_y = ctx.needs_input_grad[1]
    ctx.save_for_backward(m, output if need_y else None)


def _backward(ctx, dy, reverse_scan=None):
    """The op's gradient; ``reverse_scan`` runs the adjoint scan (default: the op, differentiable and
    traceable; the eager autograd path passes :func:`_eager_reverse`)."""
    reverse_scan = reverse_scan or _reverse_op
    if ctx.inclusive:
        raise RuntimeError(
            "allscan::matrix_scan with inclusive=True has no registered gradient; allscan.scan() computes the "
            "inclusive result as the exclusive scan plus one combine, which is differentiable")
    m, y = ctx.saved_tensors
    dy = dy.contiguous()
    # The adjoint chain runs the other way with the transposed transitions (module docstring).
    r = reverse_scan(dy, m, None, ctx.group_name, not ctx.reverse, False, not ctx.transpose, ctx.num_blocks,
                     ctx.method)
    dm = dinit = None
    if ctx.needs_input_grad[1]:
        acc = acc_dtype(dy.dtype)
        outer = torch.matmul(r.to(acc), y.to(acc).transpose(-1, -2))  # d(transition used) = r y^T
        dm = (outer.transpose(-1, -2) if ctx.transpose else outer).to(m.dtype)
    if ctx.has_init and ctx.needs_input_grad[2]:
        if ctx.chain_head:
            dinit = combine(m, r, dy, not ctx.transpose)  # M_head^T r_head + dy_head
        else:
            dinit = torch.zeros_like(dy)
    return r, dm, dinit, None, None, None, None, None, None


matrix_scan_op.register_autograd(_backward, setup_context=_op_setup_context)


# ------------------------------------------------------------------------------------------------
# The public function
# ------------------------------------------------------------------------------------------------
class _EagerMatrixScan(torch.autograd.Function):
    """An eager call that needs a gradient: the op's own forward, context and backward, without the
    dispatcher's round trip (tens of microseconds per call); torch.compile traces the op."""

    @staticmethod
    def forward(x, m, init, name, reverse, num_blocks, method, group, stream):
        return _run(x, m, init, name, reverse, False, False, num_blocks, method, group=group, stream=stream)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, m, init, name, reverse, num_blocks, method, group, _ = inputs
        _setup_context(ctx, (x, m, init, name, reverse, False, False, num_blocks, method), output,
                       reads_init(init, group, name, reverse))

    @staticmethod
    def backward(ctx, dy):
        r, dm, dinit = _backward(ctx, dy, _eager_reverse)[:3]
        return r, dm, dinit, None, None, None, None, None, None


def _reverse_op(*args):
    """The backward's adjoint scan as the op (no init: no rank's is read)."""
    return matrix_scan_op(*args, chain_head=False)


def _eager_reverse(*args):
    """The backward's adjoint scan in an eager backward: without the dispatcher, unless a double
    backward needs it differentiable (grad mode on)."""
    return _reverse_op(*args) if torch.is_grad_enabled() else _run(*args)


def scan_impl(x, m, init, name, reverse, inclusive, num_blocks, method, group=None, stream=None):
    """The scan of contiguous tensors (on ``stream`` when given: eager NCCL calls, never an
    inclusive one that needs a gradient)."""
    grad = needs_grad(x, m, init)
    eager = not torch.compiler.is_compiling()
    if not grad and eager:
        # Eager and nothing to differentiate: skip the dispatcher round trip.
        return _run(x, m, init, name, reverse, inclusive, False, num_blocks, method, group=group, stream=stream)
    if grad and eager:
        y = _EagerMatrixScan.apply(x, m, init, name, reverse, num_blocks, method, group, stream)
    elif grad:
        y = matrix_scan_op(x, m, init, name, reverse, False, False, num_blocks, method,
                           chain_head=reads_init(init, group, name, reverse))
    else:
        return matrix_scan_op(x, m, init, name, reverse, inclusive, False, num_blocks, method,
                              chain_head=reads_init(init, group, name, reverse))
    # inclusive: a differentiable composite, the exclusive scan then the rank's own combine
    return combine(m, y, x) if inclusive else y


def matrix_scan(tensor: torch.Tensor, transition: torch.Tensor, group, *, reverse: bool, inclusive: bool,
                init: Optional[torch.Tensor], num_blocks: Optional[int], method: str, async_op: bool, gamma=None):
    """The matrix All-Scan over the ranks of ``group`` (None: the default group); what
    ``allscan.scan(tensor, transition=M, ...)`` runs, with every option as ``allscan.scan`` passes it
    (the defaults are ``allscan.scan``'s; a ``gamma`` beside the transition is refused). See the module
    docstring for the contract.

    ``tensor`` ``[..., K, V]`` (float32, bfloat16, float16, float64), ``transition`` ``[..., K, K]``
    (float32 or the tensor's dtype) with the same leading dims. Arithmetic fp32 (fp64 for fp64),
    rounded to the tensor's dtype at every rank boundary. ``method``: "pipelined" (blocks of whole
    leading-dim entries, V columns split only when more blocks than entries are asked), "serial" or
    "allgather" (fla's context-parallel pattern). Differentiable in all three tensors. With
    ``async_op=True`` returns an :class:`allscan.ScanHandle`."""
    return scan_body(OP, lambda: validate(tensor, transition, init, method, num_blocks, gamma), scan_impl, tensor,
                     transition, group, init=init, reverse=reverse, inclusive=inclusive, num_blocks=num_blocks,
                     method=method, async_op=async_op)
