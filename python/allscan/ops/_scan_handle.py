"""The async scan handle and the side streams an async scan runs on (``scan(..., async_op=True)``),
for the diagonal and the matrix scan alike.

- :class:`ScanHandle`: what an async call returns; ``wait()`` orders the caller's stream after the scan.
- :func:`side_stream_handle`: the eager NCCL path by handle (raw streams and pooled events, no
  ``torch.cuda.stream`` switch), where :func:`by_handle_ok`; else :func:`async_handle` (torch's
  stream objects and ``record_stream``; complete at once off NCCL and under torch.compile).
- :data:`side_streams`: one high-priority side stream per device.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import _C, _comm
from ._launch import raw_stream, stream_ptr

__all__ = ["ScanHandle", "side_stream", "side_streams", "async_handle", "saved_tensor_hooks_active", "by_handle_ok",
           "side_stream_handle"]


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


side_streams: Dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = side_streams.get(idx)
    if s is None:
        # The highest priority (torch maps a large negative number to it): when the caller's own
        # kernels fill the GPU, the block scheduler still starts the scan's kernels first, so the
        # communication runs beside the computation instead of after it.
        s = torch.cuda.Stream(device=idx, priority=-100)
        side_streams[idx] = s
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
    side = side_stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        out = impl()
        ev = torch.cuda.Event()
        ev.record(side)
    for t in inputs:
        if t is not None:
            t.record_stream(side)
    return ScanHandle(out, ev)


def saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown: assume active


def by_handle_ok(group, x: torch.Tensor, saves_output: bool) -> bool:
    """Whether an async call on ``x`` can go to the side stream by handle (:func:`side_stream_handle`):
    eager, NCCL, on the current device, and no saved-tensor hook (activation offloading,
    checkpointing) would read the output on the caller's stream while the side stream still writes it
    (``saves_output``: autograd saves the output, which the hooks see at once)."""
    return (x.is_cuda and raw_stream is not None and not torch.compiler.is_compiling()
            and x.device.index == torch.cuda.current_device() and _comm.uses_nccl(group, x)
            and not (saves_output and saved_tensor_hooks_active()))


def side_stream_handle(x: torch.Tensor, inputs, launch) -> ScanHandle:
    """``launch(side)`` (the scan enqueued on ``side``, returning its output) on the side stream, after
    the current stream's work, without switching torch's current stream (tens of microseconds of
    Python per call otherwise); ``inputs`` (None allowed) and the output stay valid until the side
    stream is done with them."""
    idx = x.get_device()
    side = side_streams.get(idx)
    if side is None:
        side = side_stream(x.device)
    caller = raw_stream(idx)
    _C.stream_wait(side.cuda_stream, caller)
    out = launch(side)
    raw = _C.event_record(side.cuda_stream)
    # the handle holds the inputs until the caller's stream waits for the scan (ScanHandle._release)
    return ScanHandle(out, raw=raw, caller_stream=caller, side=side, keep=inputs)
