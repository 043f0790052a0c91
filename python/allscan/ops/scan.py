"""``allscan.scan``: validate -> plan -> launch, the custom op ``allscan::scan`` with autograd and a
fake implementation, and the async handle.

CUDA tensors on an NCCL group launch through the C++ core; everything else runs the
torch.distributed implementation (:mod:`allscan.ops._scan_dist`). Benchmarks time the layers of one
call through three documented hooks: :func:`plan_for` (the cached plan of a signature),
:func:`launch` (the core alone, through a plan) and :func:`run` (plan lookup and launch).
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _C, _comm
from .. import _threads
from .._contract import (DTYPE_CODES, check_across_ranks, clear_checked_signatures, dtype_code, settings,
                         signature_hash)
from ..reference import acc_dtype, expand_decay
from . import _scan_dist
from ._launch import (PlanCache, _raw_stream, check_num_blocks, forget_plans, nccl_preflight, plan_cache,
                      plan_is_current, stream_ptr, traced_refusal, validated_group)

__all__ = ["scan", "ScanHandle", "set_check_every_call", "destroy_communicators", "ScanLaunchPlan", "plan_for",
           "launch", "run", "METHODS", "device_path"]

METHODS = ("pipelined", "serial", "allgather", "device")
_OP = "scan"
_HAS_DIST = dist.is_available()  # a torch built without it: normalize_group raises the error that says so
_MAX_DIMS = 8  # dimensions of the state compared one by one; further ones by a hash


def set_check_every_call(enabled: bool) -> None:
    """Exchange the argument signature across ranks on every call (``ALLSCAN_CHECK=always``), or
    only the first time a signature is seen (``first``). Costs one small all-gather and a host
    synchronisation per call; catches a rank that changes its arguments after the first check."""
    settings.check = "always" if enabled else "first"


# ------------------------------------------------------------------------------------------------
# Validate: local argument checks, and the signature compared across ranks
# ------------------------------------------------------------------------------------------------
def _check_companion(name: str, t, tensor: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"allscan.scan: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.device != tensor.device:
        raise ValueError(f"allscan.scan: {name} is on {t.device}, the tensor on {tensor.device}")


def _validate(tensor, gamma, init, method, num_blocks) -> None:
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


_plans: Dict[tuple, ScanLaunchPlan] = plan_cache()


def _prepare(x, g, init, group, reverse, inclusive, num_blocks, method) -> ScanLaunchPlan:
    nccl = nccl_preflight(group, x, _OP)
    fields = _signature(x, g, init, reverse, inclusive, num_blocks, method)
    check_across_ranks(group, x.device, _OP, fields)
    if not nccl:
        return ScanLaunchPlan(group, None, 0, 0, 0, 0)
    comm = _comm.get_communicator(group, x.device)
    dt = DTYPE_CODES[x.dtype]
    gdt = dt if g is None else DTYPE_CODES[g.dtype]
    midx = METHODS.index(method)
    ws = _C.workspace_size(comm.handle, x.numel(), dt, 0 if g is None else 1, 0 if g is None else g.numel(), gdt,
                           0 if init is None else 1, reverse, inclusive, num_blocks, midx)
    return ScanLaunchPlan(group, comm, dt, gdt, midx, ws, signature_hash(_OP, fields))


def _plan_key(x, g, init, group, reverse, inclusive, num_blocks, method) -> tuple:
    return (group.group_name, id(group), x.device, x.shape, x.dtype, None if g is None else (g.shape, g.dtype),
            init is None, reverse, inclusive, num_blocks, method)


def plan_for(x, g, init, group, reverse, inclusive, num_blocks, method) -> ScanLaunchPlan:
    """The plan of this signature: cached, prepared on first use (which checks the signature across
    ranks, so collective then), re-prepared when the check runs every call, off NCCL (where
    ``first`` checks every call) or when the group was re-created."""
    key = _plan_key(x, g, init, group, reverse, inclusive, num_blocks, method)
    plan = _plans.get(key)
    if not plan_is_current(plan, group):
        plan = _prepare(x, g, init, group, reverse, inclusive, num_blocks, method)
        _plans[key] = plan
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


def destroy_communicators() -> None:
    """Destroy the NCCL communicators allscan owns, forget the borrowed ones (never destroyed) and
    every prepared plan (of every collective) and checked signature; the next call prepares them
    again."""
    forget_plans()
    clear_checked_signatures()
    _comm.destroy_communicators()


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
) -> torch.Tensor:
    """The All-Scan of contiguous tensors (``num_blocks`` 0 = auto). Use :func:`allscan.scan`."""
    return run(x, g, init, group_name, reverse, inclusive, num_blocks, method)


@scan_op.register_fake
def _scan_fake(x, g, init, group_name, reverse, inclusive, num_blocks, method):
    return x.new_empty(x.shape)


def save_call_options(ctx, init, group_name, reverse, inclusive, num_blocks, method) -> None:
    """What a scan op's backward needs of its call (this op's and the matrix scan's): the options
    and whether an init was given."""
    ctx.group_name = group_name
    ctx.reverse = reverse
    ctx.inclusive = inclusive
    ctx.num_blocks = num_blocks
    ctx.method = method
    ctx.has_init = init is not None


def is_chain_head(group_name: str, reverse: bool) -> bool:
    """Whether this rank starts the chain (the one rank whose init is read)."""
    group = _comm.resolve_group(group_name)
    return dist.get_rank(group) == (dist.get_world_size(group) - 1 if reverse else 0)


def _setup_context(ctx, inputs, output):
    x, g, init, group_name, reverse, inclusive, num_blocks, method = inputs
    save_call_options(ctx, init, group_name, reverse, inclusive, num_blocks, method)
    ctx.g_shape = None if g is None else tuple(g.shape)
    ctx.g_dtype = None if g is None else g.dtype
    need_y = g is not None and ctx.needs_input_grad[1]
    ctx.save_for_backward(g, output if need_y else None)


def _backward(ctx, dy, reverse_scan=None):
    """The op's gradient; ``reverse_scan`` runs the reverse scan (default: the op, differentiable and
    traceable; the eager autograd path passes :func:`_eager_reverse`)."""
    reverse_scan = reverse_scan or scan_op
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
        if is_chain_head(ctx.group_name, ctx.reverse):
            # d/d init of y_head = init (its own output) and of y_next = g_head*init + x_head.
            acc = acc_dtype(dy.dtype)
            gb = 1.0 if g is None else expand_decay(g, dy.dim()).to(acc)
            dinit = (gb * dx.to(acc) + dy.to(acc)).to(dy.dtype)
        else:
            dinit = torch.zeros_like(dy)
    return dx, dg, dinit, None, None, None, None, None


scan_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# The public function and the async handle
# ------------------------------------------------------------------------------------------------
class ScanHandle:
    """What ``scan(..., async_op=True)`` returns. ``wait()`` returns the result; on CUDA it makes the
    current stream wait for the side stream the scan ran on (the host does not block). Until then the
    handle holds the tensors the scan reads, so the caller may drop its own references at once."""

    __slots__ = ("_result", "_event", "_raw", "_caller", "_side", "_keep", "__weakref__")

    def __init__(self, result: torch.Tensor, event: Optional["torch.cuda.Event"] = None, raw=None,
                 caller_stream: int = 0, side=None, keep=()):
        self._result = result
        self._event = event
        # Fast path: (device, pooled cudaEvent_t), held until the handle goes, the stream the call was
        # made on, the side stream, and the tensors the side stream reads (used on the calling stream),
        # held until the scan is ordered before that stream's later work or done (``_release``; None
        # once released).
        self._raw = raw
        self._caller = caller_stream
        self._side = side
        self._keep = keep

    def is_completed(self) -> bool:
        if self._raw is not None:
            done = _C.event_query(self._raw[1])
            if done:
                self._keep = None  # the scan no longer reads them
            return done
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        if self._raw is not None:
            cur = stream_ptr(self._result.get_device())
            _C.event_wait(cur, self._raw[1])
            if cur != self._caller:
                # The result was allocated on the calling stream; it is now used on this one too.
                self._result.record_stream(torch.cuda.current_stream(self._result.device))
            self._release(ordered=cur == self._caller)
            return self._result
        if self._event is not None:
            cur = torch.cuda.current_stream(self._result.device)
            cur.wait_event(self._event)
            # The result was allocated on the side stream; it is now used on this one too.
            self._result.record_stream(cur)
        return self._result

    def _release(self, ordered: bool) -> None:
        """Drop the tensors the side stream used (once). ``ordered``: the calling stream already waits
        for the scan, so the caching allocator's reuse of their memory on it comes after the scan (what
        ``record_stream`` would buy, without its cost per tensor: c10d's ``TORCH_NCCL_AVOID_RECORD_STREAMS``
        rule); otherwise the side stream is recorded on them and on the result, which keeps their memory
        from reuse until the scan is done."""
        keep, self._keep = self._keep, None
        if keep is None or ordered:
            return
        for t in (*keep, self._result):
            if t is not None:
                t.record_stream(self._side)

    def __del__(self):
        raw = getattr(self, "_raw", None)
        if raw is None:
            return
        try:  # never waited for: nothing orders the calling stream after the scan, unless it is done
            if self._keep is not None and not _C.event_query(raw[1]):
                self._release(ordered=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
        try:  # the event goes back to the pool (a wait already enqueued keeps its record)
            _C.event_release(*raw)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_side_streams: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _side_streams.get(idx)
    if s is None:
        # The highest priority (torch maps a large negative number to it): when the caller's own
        # kernels fill the GPU, the block scheduler still starts the scan's kernels first, so the
        # communication runs beside the computation instead of after it.
        s = torch.cuda.Stream(device=idx, priority=-100)
        _side_streams[idx] = s
    return s


def async_handle(group, x: torch.Tensor, inputs, impl) -> ScanHandle:
    """``impl()`` (the scan of ``x`` on the current stream) as a handle. Off NCCL the
    torch.distributed path computes on the host thread: the handle is complete at once. On NCCL it
    runs on the side stream after the current stream's work, and the tensors in ``inputs`` (None
    allowed) stay valid until the side stream is done with them. Traced by torch.compile it is the op
    in the graph, complete at once: streams and ``record_stream`` are not traceable, and the compiled
    graph orders the op itself."""
    if torch.compiler.is_compiling() or not (x.is_cuda and _comm.uses_nccl(group, x)):
        return ScanHandle(impl())
    device = x.device
    cur = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = impl()
        ev = torch.cuda.Event()
        ev.record(side)
    for t in inputs:
        if t is not None:
            t.record_stream(side)
    return ScanHandle(out, ev)


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown: assume active


def by_handle_ok(group, x: torch.Tensor, saves_output: bool) -> bool:
    """Whether an async call on ``x`` can go to the side stream by handle (:func:`side_stream_handle`):
    eager, NCCL, on the current device, and no saved-tensor hook (activation offloading,
    checkpointing) would read the output on the caller's stream while the side stream still writes it
    (``saves_output``: autograd saves the output, which the hooks see at once)."""
    return (x.is_cuda and _raw_stream is not None and not torch.compiler.is_compiling()
            and x.device.index == torch.cuda.current_device() and _comm.uses_nccl(group, x)
            and not (saves_output and _saved_tensor_hooks_active()))


def side_stream_handle(x: torch.Tensor, inputs, launch) -> ScanHandle:
    """``launch(side)`` (the scan enqueued on ``side``, returning its output) on the side stream, after
    the current stream's work, without switching torch's current stream (tens of microseconds of
    Python per call otherwise); ``inputs`` (None allowed) and the output stay valid until the side
    stream is done with them."""
    idx = x.get_device()
    side = _side_streams.get(idx)
    if side is None:
        side = _side_stream(x.device)
    caller = _raw_stream(idx)
    _C.stream_wait(side.cuda_stream, caller)
    out = launch(side)
    raw = _C.event_record(side.cuda_stream)
    # the handle holds the inputs until the caller's stream waits for the scan (ScanHandle._release)
    return ScanHandle(out, raw=raw, caller_stream=caller, side=side, keep=inputs)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _is_chain_head(group, reverse: bool) -> bool:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return rank == (world - 1 if reverse else 0)


class _EagerScan(torch.autograd.Function):
    """An eager call that needs a gradient: the op's own forward, context and backward, without the
    dispatcher's round trip (tens of microseconds per call); torch.compile traces the op."""

    @staticmethod
    def forward(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream):
        return run(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs[:8], output)

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy, _eager_reverse) + (None, None)


def _eager_reverse(*args):
    """The backward's reverse scan in an eager backward: without the dispatcher, unless a double
    backward needs it differentiable (grad mode on)."""
    return scan_op(*args) if torch.is_grad_enabled() else run(*args)


def _scan_impl(x, g, init, name, reverse, inclusive, num_blocks, method, group=None, stream=None):
    """The scan of contiguous tensors (on ``stream`` when given: eager NCCL calls, never an
    inclusive one that needs a gradient)."""
    needs_grad = _needs_grad(x, g, init)
    eager = not torch.compiler.is_compiling()
    if not needs_grad and eager:
        # Eager and nothing to differentiate: the op's own implementation, without the dispatcher
        # round trip (tens of microseconds). torch.compile goes through the op.
        return run(x, g, init, name, reverse, inclusive, num_blocks, method, group, stream)
    if eager and not inclusive:
        return _EagerScan.apply(x, g, init, name, reverse, False, num_blocks, method, group, stream)
    if inclusive and needs_grad:
        # Differentiable composite: the exclusive scan, then the rank's own combine.
        y = (_EagerScan.apply(x, g, init, name, reverse, False, num_blocks, method, group, None) if eager
             else scan_op(x, g, init, name, reverse, False, num_blocks, method))
        acc = acc_dtype(x.dtype)
        if init is None and _is_chain_head(group if group is not None else _comm.resolve_group(name), reverse):
            # nothing enters the head: its inclusive result is its own x, whatever its decay (an inf
            # decay times the zero it receives would be nan); y stays in the graph with zero gradient
            return (y.to(acc) * 0 + x.to(acc)).to(x.dtype)
        if g is None:
            return (y.to(acc) + x.to(acc)).to(x.dtype)
        return (expand_decay(g, x.dim()).to(acc) * y.to(acc) + x.to(acc)).to(x.dtype)
    return scan_op(x, g, init, name, reverse, inclusive, num_blocks, method)


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
    pipelined method: :func:`device_path` says which ran; diagonal decays only). Differentiable in ``tensor``, ``gamma`` and ``init`` (through the reverse All-Scan).
    Every rank must pass the same shapes, dtypes and options; a mismatch raises ``ValueError`` on
    every rank (see ``ALLSCAN_CHECK`` and :func:`set_check_every_call`).

    With ``async_op=True`` returns a :class:`ScanHandle`; ``handle.wait()`` gives the result.

    With ``transition`` (``[..., K, K]``, instead of ``gamma``) the combine is ``M_p @ y_p + x_p`` on
    states ``[..., K, V]``: :func:`allscan.ops.matrix_scan.matrix_scan`.
    """
    if _is_compiling():  # traced into a graph: no host-thread bookkeeping there
        return _scan(tensor, gamma, group, transition, reverse, inclusive, init, num_blocks, method, async_op)
    grp = dist.group.WORLD if group is None and _HAS_DIST else group  # WORLD: None before init_process_group
    if grp.__class__ is not _ProcessGroup and not (_HAS_DIST and isinstance(grp, dist.ProcessGroup)):
        grp = _comm.normalize_group(group)  # a name, or an error naming what is wrong
    entry = _threads.enter(grp, _OP)
    try:
        other = gamma if transition is None else transition
        key = _fast_key(grp, tensor, gamma, transition, init, reverse, inclusive, num_blocks, method, async_op)
        hit = _eager.get(key)
        if hit is not None:
            y = hit.serve(grp, tensor, other, init)
            if y is not None:
                return y
        y = _scan(tensor, gamma, grp, transition, reverse, inclusive, init, num_blocks, method, async_op)
        if key is not None and _eager_ready(grp, tensor, other, init, async_op):
            call = _fast_call(tensor, other, transition is not None, init, grp, reverse, inclusive,
                              0 if num_blocks is None else num_blocks, method, async_op)
            if call is not None:
                _eager[key] = call
        return y
    finally:
        _threads.leave(grp, entry)


# ------------------------------------------------------------------------------------------------
# The eager fast path: a call whose arguments (shapes, dtypes, devices, options) have an NCCL plan
# passed every check of the first call made with them, so it goes straight to the core (issue 14:
# the host's time per call), synchronous or async, diagonal or matrix. Everything else takes the
# full path, which fills this cache. What is below runs on every call, so it is kept to one key
# tuple, one plain dict lookup and the checks the key cannot hold.
# ------------------------------------------------------------------------------------------------
# The current CUDA device without torch.cuda's lazy-init check (a hit means CUDA is initialised).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_ProcessGroup = dist.ProcessGroup if _HAS_DIST else None


class _FastCall:
    """A signature the full path checked and planned: its plan, where the plan is cached (so a hit
    keeps it recent there, as the full path would), the core's launch (``launch`` of this module or
    of the matrix scan's) with the call's options after the tensors, and the CUDA device the key's
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
                and (init is None or init.is_contiguous())) or _current_device() != self.device:
            return None
        try:
            self.plans.move_to_end(self.pkey)
        except KeyError:
            return None
        if self.async_op:
            return side_stream_handle(x, (x, other, init),
                                      lambda side: self.core(plan, x, other, init, *self.options, side))
        return self.core(plan, x, other, init, *self.options)


class _EagerCache(PlanCache):
    """The fast path's entries, bounded as every plan cache, looked up with plain ``dict.get``: a hit
    does not reorder them (an entry evicted while in use costs one full-path call); each hit keeps its
    plan recent in the plan's own cache instead, which is what every rank must agree on."""

    get = dict.get


_eager: Dict[tuple, _FastCall] = plan_cache(_EagerCache)


def _fast_key(group, tensor, gamma, transition, init, reverse, inclusive, num_blocks, method, async_op):
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


def _fast_call(x, other, matrix, init, group, reverse, inclusive, k, method, async_op) -> Optional[_FastCall]:
    """The fast path's entry for a call the full path just ran (None: its plan is not a current NCCL
    plan, so the next call takes the full path again)."""
    if matrix:
        from . import matrix_scan as M

        pkey, plans = M.plan_key(x, other, init, group, reverse, inclusive, False, k, method), M._plans
    else:
        pkey, plans = _plan_key(x, other, init, group, reverse, inclusive, k, method), _plans
    plan = plans.get(pkey)
    if plan is None or not plan_is_current(plan, group):
        return None
    if matrix:
        return _FastCall(plan, plans, pkey, M.launch, (reverse, inclusive, False, k), async_op, x.get_device())
    return _FastCall(plan, plans, pkey, launch, (reverse, inclusive, k), async_op, x.get_device())


def _eager_ready(group, tensor, other, init, async_op) -> bool:
    """Whether a call the full path just ran may be served by the fast path next time (then
    :meth:`_FastCall.serve` checks what may change from call to call): a non-empty CUDA tensor on
    the current device, the side stream by handle for an async call (:func:`by_handle_ok`), nothing to
    differentiate and every tensor contiguous (the full path would copy)."""
    if not tensor.is_cuda or tensor.numel() == 0 or (async_op and _raw_stream is None):
        return False
    if _needs_grad(tensor, other, init):
        return False
    return (tensor.is_contiguous() and (other is None or other.is_contiguous())
            and (init is None or init.is_contiguous()) and tensor.device.index == torch.cuda.current_device())


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


def _scan(tensor, gamma, group, transition, reverse, inclusive, init, num_blocks, method, async_op):
    if transition is not None:
        from .matrix_scan import matrix_scan
        return matrix_scan(tensor, transition, group, reverse=reverse, inclusive=inclusive, init=init,
                           num_blocks=num_blocks, method=method, async_op=async_op, gamma=gamma)
    try:
        group = validated_group(group, tensor, _OP, lambda: _validate(tensor, gamma, init, method, num_blocks))
    except (TypeError, ValueError) as e:  # under torch.compile: refused when the graph runs, on every rank
        out = traced_refusal(group, tensor, _OP, e)
        return ScanHandle(out) if async_op else out
    name = group.group_name
    x = tensor.contiguous()
    g = None if gamma is None else gamma.contiguous()
    i0 = None if init is None else init.contiguous()
    k = 0 if num_blocks is None else int(num_blocks)
    if not async_op:
        return _scan_impl(x, g, i0, name, reverse, inclusive, k, method, group)
    if by_handle_ok(group, x, _needs_grad(g)) and not (inclusive and _needs_grad(x, g, i0)):
        return side_stream_handle(x, (x, g, i0), lambda side: _scan_impl(x, g, i0, name, reverse, inclusive, k,
                                                                         method, group, side))
    return async_handle(group, x, (x, g, i0), lambda: _scan_impl(x, g, i0, name, reverse, inclusive, k, method, group))
