"""The two-stream pipeline of a Ulysses pass: S(c) (chunk c's input all-to-all) on the comm stream,
A(c) (its attention) on the current stream, G(c) (its output all-to-all) on the comm stream; and where
a rank whose step failed reports it, so that its peers do not wait in its next all-to-all."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ... import _C, _comm
from ..._contract import announce_invalid, peers_exchange, settings
from ..a2a import use_cpp as _use_cpp
from .checks import OP
from .plan import ChunkPlan


def _streams_for(device: torch.device):
    """The communication stream of a device (one per device, created on first use)."""
    st = _COMM_STREAMS.get(device.index)
    if st is None:
        st = torch.cuda.Stream(device=device, priority=-1)
        _COMM_STREAMS[device.index] = st
    return st


_COMM_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def use_streams(x: torch.Tensor) -> bool:
    return x.is_cuda and settings.ulysses_streams


class _CudaSync:
    """The two streams of the pipeline and how to make an event (tests pass a fake with the same
    surface: ``main``, ``comm`` with ``wait_stream``/``wait_event``, ``event()`` with ``record(stream)``)."""

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.comm = _streams_for(device)

    @staticmethod
    def event():
        return torch.cuda.Event()


def run_pipeline(n: int, scatter, attend, gather, cuda_device: Optional[torch.device], sync=None, failed=None):
    """scatter(c, stream) issues chunk c's input all-to-all, attend(c) its computation on the current
    (main) stream (returns what gather needs), gather(c, result, stream) its output all-to-all.

    Cross-stream dependencies, each made here by the driver itself (never by a callee):
      1. main -> comm before the first scatter: the inputs and every buffer allocated so far on main
         (scatter outputs, gather outputs, zeroed accumulators) are ready and no longer in use there;
      2. scatter(c) on comm -> attend(c) on main: an event recorded on comm right after scatter(c)
         is enqueued, waited on by main before attend(c) (events are in stream order, so this also
         covers the earlier chunks' k/v that grouped-query attention reuses);
      3. attend(c) on main -> gather(c) on comm: an event recorded on main after attend(c), waited on
         by comm before gather(c);
      4. comm -> main at the end: every gather has landed before main reads the outputs or frees or
         reuses any buffer the comm stream touched. The attend results read by comm are kept alive
         until then (they were allocated on main; the caching allocator could otherwise hand their
         memory to main-stream work while comm still reads it).
    Without a CUDA device (or with ``ALLSCAN_ULYSSES_STREAMS=0``) it runs the same steps sequentially
    on the current stream.

    If a step of chunk c raises (out of memory, say), ``failed(c, error, step)`` runs before the error
    propagates (``step``: "scatter", "attend" or "gather"): the peers are waiting in this rank's next
    all-to-all. (4) is made whatever raised, so no buffer the comm stream may still write is handed to
    other work."""
    if n == 0:
        return
    at, step = 0, "scatter"  # the chunk and step running: the ones ``failed`` names
    if sync is None and cuda_device is None:
        try:
            for at in range(n):
                step = "scatter"
                scatter(at, None)
                step = "attend"
                res = attend(at)
                step = "gather"
                gather(at, res, None)
        except Exception as e:
            if failed is not None:
                failed(at, e, step)
            raise
        return
    if sync is None:
        sync = _CudaSync(cuda_device)
    main, comm = sync.main, sync.comm
    comm.wait_stream(main)                      # (1)
    in_ev = [None] * n
    keep = []

    def issue(c):
        scatter(c, comm)
        ev = sync.event()
        ev.record(comm)
        in_ev[c] = ev

    try:
        issue(0)
        for c in range(n):
            if c + 1 < n:
                at = c + 1
                issue(c + 1)
            at, step = c, "attend"
            main.wait_event(in_ev[c])           # (2)
            res = attend(c)
            ev = sync.event()
            ev.record(main)
            keep.append(res)
            comm.wait_event(ev)                 # (3)
            step = "gather"
            gather(c, res, comm)
            step = "scatter"
    except Exception as e:
        if failed is not None:
            failed(at, e, step)
        raise
    finally:
        main.wait_stream(comm)                  # (4)
        del keep


def chunks_checked(group, x: torch.Tensor) -> bool:
    """Whether each head chunk's all-to-all is checked across ranks (``a2a_multi(check=True)``): with
    torch's all-to-all where every rank exchanges its signature on every call anyway (gloo; any group
    with ``ALLSCAN_CHECK=always``), so that a rank whose own work failed between two all-to-alls can
    tell its peers in the next one's check (:func:`report_failure`). The core's all-to-all carries its
    signature in band instead, and its failures go to the fault board."""
    return not _use_cpp(group, x) and peers_exchange(group, x.device)


def report_failure(plan: "ChunkPlan", like: torch.Tensor, phase: str):
    """``failed(c, error, step)`` for a rank whose ``phase`` (forward or backward) raised in ``step``
    of head chunk c (c None: before its first all-to-all), where its peers wait in its next all-to-all.
    With the core's all-to-all (NCCL) it reports the call it skips on the fault board: the peers'
    communicators fail within seconds, unless every rank skipped that same call (then the group carries
    on). With torch's all-to-all and every chunk checked (:func:`chunks_checked`: gloo) a failure of
    the rank's own work (its buffers, a chunk's attention) joins the next all-to-all's check marked
    invalid, so the peers raise there at once. A failure inside an all-to-all is not announced again:
    its check failed on every rank, or the all-to-all announced it itself (its arguments, or its
    buffers, which torch's all-to-all allocates before its check), or its exchange failed on the peers
    too. Elsewhere (torch's all-to-all on NCCL without ``ALLSCAN_CHECK=always``; ``never``) the peers
    wait until their timeout.
    Nothing is reported alone, for a failed communicator (the board spreads that already; NCCL's
    remote error, a ``CommunicatorError`` too, means a peer aborted, which the board spreads, or
    exited, which every rank's watch finds) or under CUDA graph capture (nothing runs before the
    replay)."""
    checked = chunks_checked(plan.group, like)

    def failed(c: Optional[int], error: BaseException, step: Optional[str] = None) -> None:
        if plan.world == 1 or isinstance(error, _C.CommunicatorError):
            return
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        where = "before its first all-to-all" if c is None else f"at head chunk {c}"
        reason = f"{OP}: its {phase} failed {where}: {type(error).__name__}: {error}"
        if _use_cpp(plan.group, like):
            _comm.report_local_error(plan.group, like.device, reason)
        elif checked and step in (None, "attend"):
            announce_invalid(plan.group, like.device, OP, reason)
    return failed
