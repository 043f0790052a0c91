"""``allscan.scan``: argument checks, the cross-rank signature check, the custom op with autograd and
fake implementation, the NCCL path through the C++ core, and the async handle."""
from __future__ import annotations

import os
import threading
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import _comm, _dist
from .reference import acc_dtype, expand_decay

__all__ = ["scan", "ScanHandle", "set_check_every_call", "destroy_communicators"]

METHODS = ("pipelined", "serial", "allgather")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CODE_NAME = {0: "float32", 1: "float16", 2: "bfloat16", 3: "float64", -1: "none"}

_check_every_call = os.environ.get("ALLSCAN_CHECK", "").lower() in ("always", "1", "every")


def set_check_every_call(enabled: bool) -> None:
    """Exchange the argument signature across ranks on every call (not only the first time a
    signature is seen). Costs one small all-gather and a host synchronisation per call; catches a
    rank that changes its arguments while the others keep a signature they already checked."""
    global _check_every_call
    _check_every_call = bool(enabled)


# ------------------------------------------------------------------------------------------------
# Argument checks (local) and the signature check (across ranks)
# ------------------------------------------------------------------------------------------------
def _validate(tensor, gamma, init, method, num_blocks) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allscan.scan: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise TypeError(
            f"allscan.scan: tensor must be float32, float16, bfloat16 or float64, got {tensor.dtype}"
        )
    if gamma is not None:
        if not isinstance(gamma, torch.Tensor):
            raise TypeError(f"allscan.scan: gamma must be a torch.Tensor or None, got {type(gamma).__name__}")
        if gamma.dtype not in (torch.float32, tensor.dtype):
            raise TypeError(
                f"allscan.scan: gamma must be float32 or the tensor's dtype ({tensor.dtype}), got {gamma.dtype}"
            )
        if gamma.dim() > tensor.dim() or tuple(gamma.shape) != tuple(tensor.shape[: gamma.dim()]):
            raise ValueError(
                f"allscan.scan: gamma's shape {list(gamma.shape)} must be a prefix of the tensor's shape "
                f"{list(tensor.shape)} (it is broadcast over the trailing dimensions it lacks)"
            )
        if gamma.device != tensor.device:
            raise ValueError(f"allscan.scan: gamma is on {gamma.device}, the tensor on {tensor.device}")
    if init is not None:
        if not isinstance(init, torch.Tensor):
            raise TypeError(f"allscan.scan: init must be a torch.Tensor or None, got {type(init).__name__}")
        if tuple(init.shape) != tuple(tensor.shape) or init.dtype != tensor.dtype:
            raise ValueError(
                f"allscan.scan: init must have the tensor's shape and dtype ({tensor.dtype}{list(tensor.shape)}), "
                f"got {init.dtype}{list(init.shape)}"
            )
        if init.device != tensor.device:
            raise ValueError(f"allscan.scan: init is on {init.device}, the tensor on {tensor.device}")
    if method not in METHODS:
        raise ValueError(f"allscan.scan: method must be one of {METHODS}, got {method!r}")
    if num_blocks is not None and (
        isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1
    ):
        raise ValueError(f"allscan.scan: num_blocks must be None (auto) or a positive int, got {num_blocks!r}")


_SIG_LEN = 24
_MAX_DIMS = 8
_sig_cache: Dict[tuple, set] = {}  # (group name, id(group)) -> signatures checked
_INVALID = 0xBAD  # a rank whose own arguments failed its local checks (check-every-call mode)
_sig_lock = threading.Lock()


def _signature(x, g, init, reverse, inclusive, num_blocks, method) -> Tuple[int, ...]:
    shape = list(x.shape)
    dims = shape[:_MAX_DIMS] + [-1] * (_MAX_DIMS - min(len(shape), _MAX_DIMS))
    sig = [
        0x5CA4,
        _DTYPE_CODE[x.dtype],
        x.dim(),
        x.numel(),
        *dims,
        -1 if g is None else _DTYPE_CODE[g.dtype],
        -1 if g is None else g.dim(),
        -1 if g is None else g.numel(),
        int(init is not None),
        int(reverse),
        int(inclusive),
        METHODS.index(method),
        num_blocks,
    ]
    sig += [0] * (_SIG_LEN - len(sig))
    return tuple(sig)


def _describe(sig) -> str:
    ndim = sig[2]
    shape = [d for d in sig[4 : 4 + min(ndim, _MAX_DIMS)]]
    g = "none" if sig[12] < 0 else f"{_CODE_NAME[sig[12]]} with {sig[13]} dims ({sig[14]} elements)"
    k = "auto" if sig[19] == 0 else str(sig[19])
    return (
        f"tensor {_CODE_NAME[sig[1]]}{shape}, gamma {g}, init {'given' if sig[15] else 'none'}, "
        f"reverse={bool(sig[16])}, inclusive={bool(sig[17])}, method={METHODS[sig[18]]!r}, num_blocks={k}"
    )


def _check_signature(group, device: torch.device, sig) -> None:
    name = group.group_name
    with _sig_lock:
        seen = _sig_cache.setdefault((name, id(group)), set())
        if sig in seen and not _check_every_call:
            return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if sig in seen:
            return  # checked before capture; a check would synchronise, which capture forbids
        raise RuntimeError(
            "allscan.scan: these arguments were never checked across ranks, and the check cannot run "
            "while a CUDA graph is being captured; call allscan.scan once with them before capturing"
        )
    P = dist.get_world_size(group)
    if P > 1:
        local = torch.tensor(sig, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(P)]
        dist.all_gather(gathered, local, group=group)
        rows = [tuple(int(v) for v in t.tolist()) for t in gathered]
        bad = [q for q, row in enumerate(rows) if row[0] == _INVALID]
        if bad:
            raise ValueError(f"allscan.scan: rank(s) {bad} rejected their own arguments (see the error raised there)")
        if any(row != rows[0] for row in rows):
            desc = "; ".join(f"rank {q}: {_describe(row)}" for q, row in enumerate(rows))
            raise ValueError(
                "allscan.scan: ranks passed different arguments (an NCCL scan would hang); every rank "
                f"must pass the same shapes, dtypes and options. {desc}"
            )
    with _sig_lock:
        seen.add(sig)


# ------------------------------------------------------------------------------------------------
# The NCCL path
# ------------------------------------------------------------------------------------------------
class _Plan:
    """What one argument signature needs, prepared once (device check, signature check across
    ranks, communicator, workspace size) so that later calls only launch."""

    __slots__ = ("group_ref", "comm", "dt", "gdt", "midx", "ws_bytes")

    def __init__(self, comm, dt, gdt, midx, ws_bytes):
        self.group_ref = None
        self.comm = comm
        self.dt = dt
        self.gdt = gdt
        self.midx = midx
        self.ws_bytes = ws_bytes


_plans: Dict[tuple, _Plan] = {}


def _announce_invalid(group, device: torch.device) -> None:
    """In check-every-call mode every rank joins the signature exchange on every call, so a rank
    whose own arguments failed a local check joins it too, with a marker that makes the other ranks
    raise instead of waiting for it. (Without that mode the other ranks may not exchange at all.)"""
    if not _check_every_call or dist.get_world_size(group) == 1:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    local = torch.tensor((_INVALID,) + (0,) * (_SIG_LEN - 1), dtype=torch.int64, device=device)
    dist.all_gather([torch.empty_like(local) for _ in range(dist.get_world_size(group))], local, group=group)


def _prepare(x, g, init, group, reverse, inclusive, num_blocks, method) -> _Plan:
    nccl = _comm.uses_nccl(group, x)
    if nccl:
        try:
            _comm.check_device(group, x.device)  # before any collective
            _comm.check_env()
        except ValueError:
            _announce_invalid(group, torch.device("cuda", torch.cuda.current_device()))
            raise
    _check_signature(group, x.device if nccl else torch.device("cpu"),
                     _signature(x, g, init, reverse, inclusive, num_blocks, method))
    if not nccl:
        return _Plan(None, 0, 0, 0, 0)
    from . import _C

    comm = _comm.get_communicator(group, x.device)
    dt = _DTYPE_CODE[x.dtype]
    gdt = dt if g is None else _DTYPE_CODE[g.dtype]
    midx = METHODS.index(method)
    ws = _C.workspace_size(comm.handle, x.numel(), dt, 0 if g is None else 1, 0 if g is None else g.numel(), gdt,
                           0 if init is None else 1, reverse, inclusive, num_blocks, midx)
    return _Plan(comm, dt, gdt, midx, ws)


def _run(x, g, init, group_name, reverse, inclusive, num_blocks, method, group=None, stream=None) -> torch.Tensor:
    """The scan on the caller's current stream, or on ``stream`` (a torch.cuda.Stream of x's device,
    NCCL path only: the async fast path)."""
    if group is None:
        group = _comm.resolve_group(group_name)
    key = (group_name, id(group), x.device, x.shape, x.dtype, None if g is None else (g.shape, g.dtype),
           init is None, reverse, inclusive, num_blocks, method)
    plan = _plans.get(key)
    # A plan belongs to one group object: a group destroyed and re-created under the same name (and
    # possibly the same id) gets a new plan, never a stale communicator.
    if plan is None or _check_every_call or plan.group_ref() is not group:
        plan = _prepare(x, g, init, group, reverse, inclusive, num_blocks, method)
        plan.group_ref = weakref.ref(group)
        _plans[key] = plan
    if x.numel() == 0:
        return torch.empty_like(x)
    if plan.comm is None:
        return _dist.scan(x, g, init, group, reverse, inclusive, num_blocks, method)
    if x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):  # the core launches on the current device
            return _nccl_launch(plan, x, g, init, reverse, inclusive, num_blocks, stream)
    return _nccl_launch(plan, x, g, init, reverse, inclusive, num_blocks, stream)


# The current stream's handle without building a torch.cuda.Stream object (a few microseconds per
# call); the public route where this private helper is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_ptr(device: torch.device) -> int:
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _nccl_launch(plan, x, g, init, reverse, inclusive, num_blocks, stream=None) -> torch.Tensor:
    from . import _C

    y = torch.empty_like(x)
    # The workspace depends on the rank's place in the chain; often none (an exclusive scan's tail,
    # the head without init).
    ws = torch.empty(plan.ws_bytes, dtype=torch.uint8, device=x.device) if plan.ws_bytes else None
    _C.scan(
        plan.comm.handle, x.data_ptr(), y.data_ptr(), x.numel(), plan.dt, 0 if g is None else g.data_ptr(),
        0 if g is None else g.numel(), plan.gdt, 0 if init is None else init.data_ptr(), reverse, inclusive,
        num_blocks, plan.midx, 0 if ws is None else ws.data_ptr(), plan.ws_bytes,
        _stream_ptr(x.device) if stream is None else stream.cuda_stream,
    )
    if ws is not None and stream is not None:
        ws.record_stream(stream)  # allocated on the current stream, used on `stream`: freed after it
    return y


def destroy_communicators() -> None:
    """Destroy the NCCL communicators allscan owns, forget the borrowed ones (never destroyed) and
    every prepared plan and checked signature; the next call prepares them again."""
    _plans.clear()
    with _sig_lock:
        _sig_cache.clear()
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
    return _run(x, g, init, group_name, reverse, inclusive, num_blocks, method)


@scan_op.register_fake
def _scan_fake(x, g, init, group_name, reverse, inclusive, num_blocks, method):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, g, init, group_name, reverse, inclusive, num_blocks, method = inputs
    ctx.group_name = group_name
    ctx.reverse = reverse
    ctx.inclusive = inclusive
    ctx.num_blocks = num_blocks
    ctx.method = method
    ctx.has_g = g is not None
    ctx.has_init = init is not None
    ctx.g_shape = None if g is None else tuple(g.shape)
    ctx.g_dtype = None if g is None else g.dtype
    need_y = g is not None and ctx.needs_input_grad[1]
    ctx.save_for_backward(g, output if need_y else None)


def _backward(ctx, dy):
    if ctx.inclusive:
        raise RuntimeError(
            "allscan::scan with inclusive=True has no registered gradient; allscan.scan() computes the "
            "inclusive result as the exclusive scan plus one combine, which is differentiable"
        )
    g, y = ctx.saved_tensors
    dy = dy.contiguous()
    # The gradient of the forward scan with respect to x is the reverse exclusive scan of the
    # incoming gradient with the same decays: r_{p-1} = g_p * r_p + dy_p, r at the chain's end = 0.
    dx = scan_op(dy, g, None, ctx.group_name, not ctx.reverse, False, ctx.num_blocks, ctx.method)
    dg = dinit = None
    if ctx.needs_input_grad[1] and g is not None:
        acc = acc_dtype(dy.dtype)
        prod = y.to(acc) * dx.to(acc)
        dg = prod.reshape(tuple(ctx.g_shape) + (-1,)).sum(-1).to(ctx.g_dtype)
    if ctx.has_init and ctx.needs_input_grad[2]:
        group = _comm.resolve_group(ctx.group_name)
        P = dist.get_world_size(group)
        head = P - 1 if ctx.reverse else 0
        if dist.get_rank(group) == head:
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
    current stream wait for the side stream the scan ran on (the host does not block)."""

    def __init__(self, result: torch.Tensor, event: Optional["torch.cuda.Event"] = None, raw=None,
                 caller_stream: int = 0):
        self._result = result
        self._event = event
        # Fast path: (device, pooled cudaEvent_t), held until the handle goes, and the stream the
        # result was allocated on.
        self._raw = raw
        self._caller = caller_stream

    def is_completed(self) -> bool:
        if self._raw is not None:
            from . import _C
            return _C.event_query(self._raw[1])
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        if self._raw is not None:
            from . import _C
            dev = self._result.device
            cur = _stream_ptr(dev)
            _C.event_wait(cur, self._raw[1])
            if cur != self._caller:
                # The result was allocated on the calling stream; it is now used on this one too.
                self._result.record_stream(torch.cuda.current_stream(dev))
            return self._result
        if self._event is not None:
            cur = torch.cuda.current_stream(self._result.device)
            cur.wait_event(self._event)
            # The result was allocated on the side stream; it is now used on this one too.
            self._result.record_stream(cur)
        return self._result

    def __del__(self):
        raw = getattr(self, "_raw", None)
        if raw is not None:  # the event goes back to the pool (a wait already enqueued keeps its record)
            try:
                from . import _C
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


def _scan_impl(x, g, init, name, reverse, inclusive, num_blocks, method, group=None):
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, g, init)
    )
    if inclusive and needs_grad:
        # Differentiable composite: the exclusive scan, then the rank's own combine.
        y = scan_op(x, g, init, name, reverse, False, num_blocks, method)
        acc = acc_dtype(x.dtype)
        if g is None:
            return (y.to(acc) + x.to(acc)).to(x.dtype)
        return (expand_decay(g, x.dim()).to(acc) * y.to(acc) + x.to(acc)).to(x.dtype)
    if not needs_grad and not torch.compiler.is_compiling():
        # Eager and nothing to differentiate: the op's own implementation, without the dispatcher
        # round trip (tens of microseconds). Autograd and torch.compile go through the op.
        return _run(x, g, init, name, reverse, inclusive, num_blocks, method, group)
    return scan_op(x, g, init, name, reverse, inclusive, num_blocks, method)


def scan(
    tensor: torch.Tensor,
    gamma: Optional[torch.Tensor] = None,
    group=None,
    *,
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
    chosen from the link model when None), "serial" (LASP-1 pattern) or "allgather" (LASP-2
    pattern). Differentiable in ``tensor``, ``gamma`` and ``init`` (through the reverse All-Scan).
    Every rank must pass the same shapes, dtypes and options; a mismatch raises ``ValueError`` on
    every rank the first time a signature is seen (or on every call, see
    :func:`set_check_every_call`).

    With ``async_op=True`` returns a :class:`ScanHandle`; ``handle.wait()`` gives the result.
    """
    group = _comm.normalize_group(group)
    try:
        _validate(tensor, gamma, init, method, num_blocks)
    except (TypeError, ValueError):
        if isinstance(tensor, torch.Tensor):
            nccl_dev = "nccl" in _comm.backend_name(group) and torch.cuda.is_available()
            _announce_invalid(group, torch.device("cuda", torch.cuda.current_device()) if nccl_dev
                              else torch.device("cpu"))
        raise
    name = group.group_name
    x = tensor.contiguous()
    g = None if gamma is None else gamma.contiguous()
    i0 = None if init is None else init.contiguous()
    k = 0 if num_blocks is None else int(num_blocks)
    if not async_op:
        return _scan_impl(x, g, i0, name, reverse, inclusive, k, method, group)
    if not (x.is_cuda and _comm.uses_nccl(group, x)):
        # The torch.distributed path computes on the host thread; the handle is complete at once.
        return ScanHandle(_scan_impl(x, g, i0, name, reverse, inclusive, k, method, group))
    if (_raw_stream is not None and not torch.compiler.is_compiling() and x.device.index == torch.cuda.current_device()
            and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, g, i0)))):
        # Nothing to differentiate, eager: the scan goes to the side stream by handle, without
        # switching torch's current stream (tens of microseconds of Python per call otherwise).
        from . import _C
        side = _side_stream(x.device)
        caller = _raw_stream(x.device.index)
        _C.stream_wait(side.cuda_stream, caller)
        out = _run(x, g, i0, name, reverse, inclusive, k, method, group, stream=side)
        raw = _C.event_record(side.cuda_stream)
        for t in (x, g, i0, out):
            if t is not None:
                t.record_stream(side)  # freed only after the side stream is done with them
        return ScanHandle(out, raw=raw, caller_stream=caller)
    cur = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = _scan_impl(x, g, i0, name, reverse, inclusive, k, method, group)
        ev = torch.cuda.Event()
        ev.record(side)
    for t in (x, g, i0):
        if t is not None:
            t.record_stream(side)  # inputs stay valid until the side stream is done with them
    return ScanHandle(out, ev)
