"""Work issued beside the calling stream: on CUDA, on a second stream of the device, so that it runs
while the calling stream does something else, joined where its result is needed.

The delta layers' backward issues its reverse All-Scan (and the ``Q'^T do`` that feeds it) this way,
beside fla's recomputation of the chunk states: a latency-bound kernel that occupies a few dozen of
the GPU's SMs for hundreds of microseconds, while the scan's own kernels and its wait for the next rank
need little of the GPU. The local backward asks for the scan's result only where it needs it (the
final state's gradient, before fla's backward state kernel).

Ordering, as torch requires across streams: the work starts after what the calling stream had issued
when :meth:`Beside.mark` (or else :meth:`Beside.issue`) was called; :meth:`Beside.result` makes the
calling stream wait for it. The tensors the work reads (``keep``) are held until then, so that the
caching allocator cannot give their memory to the calling stream while the work still reads it; a
result the work allocated is recorded on the calling stream (it belongs to the second stream's pool).
That holding is enough only for tensors in use on the calling stream: one made on a third stream must
be recorded on the calling stream first, as torch requires of any use across streams.
Off CUDA the work runs at once, on the host's order. CUDA graphs capture the fork and the join.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

__all__ = ["Beside"]

_streams: Dict[int, "torch.cuda.Stream"] = {}


def _second_stream(device: torch.device) -> "torch.cuda.Stream":
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(idx)
    if s is None:
        # the calling stream's priority (torch's default), not a higher one: the work must not take the
        # SMs from the kernel it is meant to run beside, which was issued first
        s = torch.cuda.Stream(device=idx)
        _streams[idx] = s
    return s


class Beside:
    """``work()`` (a function of no arguments, returning a tensor or None) issued beside the calling
    stream; ``keep``: the tensors it reads, held until it is joined. Issued at most once, by
    :meth:`issue` or by the first :meth:`result`."""

    def __init__(self, device: torch.device, work: Callable[[], Optional[torch.Tensor]],
                 keep: Sequence[Optional[torch.Tensor]] = ()):
        self._device = device
        self._cuda = device.type == "cuda"
        self._work = work
        self._keep = tuple(keep)
        self._after = None      # the calling stream's event the work starts after (mark)
        self._done = None       # the second stream's event after the work
        self._result = None
        self._issued = False
        self._joined = False

    def mark(self) -> None:
        """The work starts after what the calling stream has issued so far (not after what it issues
        between now and :meth:`issue`: the kernel meant to run beside it)."""
        if self._cuda and not self._issued:
            self._after = torch.cuda.current_stream(self._device).record_event()

    def issue(self) -> None:
        if self._issued:
            return
        self._issued = True
        work, self._work = self._work, None  # its closure's references go with it; keep holds the inputs
        if not self._cuda:
            self._result = work()
            return
        caller = torch.cuda.current_stream(self._device)
        second = _second_stream(self._device)
        if self._after is None:
            second.wait_stream(caller)
        else:
            second.wait_event(self._after)
        try:
            with torch.cuda.stream(second):
                self._result = work()
        finally:
            self._done = second.record_event()
            if self._result is None:  # failed, or nothing to hand over: join now, so nothing it read is reused early
                self.join()

    def result(self) -> Optional[torch.Tensor]:
        """The work's result, the calling stream ordered after the work (issued first if need be)."""
        self.issue()
        self.join()
        return self._result

    def join(self) -> None:
        """The calling stream waits for the work (once); the inputs are let go."""
        if self._joined or not self._issued:
            return
        self._joined = True
        if self._cuda:
            caller = torch.cuda.current_stream(self._device)
            caller.wait_event(self._done)
            if self._result is not None:
                self._result.record_stream(caller)
        self._keep = ()
