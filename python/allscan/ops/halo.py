"""The halo exchange of a sequence-parallel short convolution: each rank's last ``w`` tokens go to the next rank.

    halo = halo_exchange(x, w, group=None)   # x [B, T_local, ...] -> [B, w, ...]: rank p-1's last w tokens

Rank 0 (and a single process) receives zeros. Autograd: the gradient of the received halo goes back to
its sender and is added to the gradient of its last ``w`` tokens. CUDA tensors on an NCCL group go
through the C++ core's neighbour exchange on allscan's communicator (``allscanNeighborExchange``, one
chain of sends): watched like every allscan collective, so a dead or stuck peer raises
``allscan.CommunicatorTimeout`` after ``ALLSCAN_TIMEOUT`` and the fault board spreads it, and capturable
in a CUDA graph. Elsewhere (gloo) torch's point-to-point. A custom op (:func:`halo_shift`), so
torch.compile traces it without a graph break. Before anything is sent, every rank's ``T_local >= w``
and the halo's shape and dtype are checked across the group (inside the op, so under torch.compile
too): a halo that differs between ranks raises on every rank; a shard too short raises on its rank, and
its peers learn of it as they do of any allscan call's bad arguments (gloo and ``ALLSCAN_CHECK=always``:
at once; NCCL in ``first`` mode, once the halo's signature was checked: through the fault board; on the
signature's first call its peers wait in the check's exchange until torch's timeout, as for every allscan
collective). No in-band signature: on NCCL in ``first`` mode a rank that later changes its halo's shape
to one checked before is not detected (a byte count that differs hangs until the watch's timeout).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from allscan import _C, _comm
from allscan._agreement import check_across_ranks
from allscan._dtypes import DTYPE_CODES
from allscan._threads import one_thread

from ._launch import nccl_preflight, stream_ptr, validated_group
from .batch_context import context_conflict, context_group

__all__ = ["halo_exchange"]


def _shift_core(send: torch.Tensor, pg, to_next: bool) -> torch.Tensor:
    """:func:`_shift` on allscan's (watched) communicator of ``pg``: the core's neighbour exchange cut at
    the chain's ends, which leave the zeros they were given."""
    comm = _comm.get_communicator(pg, send.device)
    recv = torch.zeros_like(send, memory_format=torch.contiguous_format)
    if send.numel():  # the same on every rank (checked)
        with torch.cuda.device(send.device):
            _C.neighbor_exchange(comm.handle, send.data_ptr(), recv.data_ptr(), send.numel() * send.element_size(),
                                 not to_next, True, stream_ptr(send.get_device()))
    return recv


def _shift(send: torch.Tensor, pg, to_next: bool) -> torch.Tensor:
    """Sends ``send`` one rank along (to rank+1 if ``to_next`` else rank-1); returns what arrives from the
    other side (zeros at the end of the chain). torch's point-to-point (gloo)."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    dst, src = (rank + 1, rank - 1) if to_next else (rank - 1, rank + 1)
    recv = torch.zeros_like(send, memory_format=torch.contiguous_format)
    ops = []  # one batch: separate isend/irecv calls along a chain can wait on each other
    if 0 <= dst < world:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(pg, dst), pg))
    if 0 <= src < world:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(pg, src), pg))
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return recv


def _check(send: torch.Tensor, pg, local_len: int) -> None:
    """This rank's ``T_local >= w`` (a failure told to the peers where they exchange, module docstring),
    then the halo's shape and dtype across the group: the exchange would hang or misread bytes otherwise."""
    w = send.shape[1]

    def validate():
        if local_len < w:
            raise ValueError(f"halo_exchange: x's local length T_local={local_len} is shorter than the halo w={w} "
                             f"(with several ranks every shard needs at least w tokens)")

    validated_group(pg, send, "halo_exchange", validate)
    nccl_preflight(pg, send, "halo_exchange")
    check_across_ranks(pg, send.device, "halo_exchange", [
        ("w (halo tokens)", w),
        ("B (x.shape[0])", send.shape[0]),
        ("x's dims", send.dim()),
        ("values per token (x.shape[2:])", send[0, 0].numel() if send.shape[0] and w else -1),
        ("x's dtype (code)", DTYPE_CODES[send.dtype] if send.dtype in DTYPE_CODES
         else zlib.crc32(str(send.dtype).encode())),
    ])


@torch.library.custom_op("allscan::halo_shift", mutates_args=())
def halo_shift(send: torch.Tensor, group_name: str, to_next: bool, local_len: int) -> torch.Tensor:
    """``send`` one rank along ``group_name``'s chain (to the next rank if ``to_next``), what arrives from
    the other side returned (zeros at the chain's end; ``""``: one process, zeros). ``local_len``: the
    sender's T_local, checked against ``w = send.shape[1]`` (and the halo's shape across the group)
    before anything is sent; -1: no check (the backward's shift, of a forward that passed it). A custom
    op: torch.compile traces it without a graph break, and its gradient is the shift the other way."""
    if not group_name:
        return torch.zeros_like(send, memory_format=torch.contiguous_format)
    pg = _comm.resolve_group(group_name)
    send = send.contiguous()  # both paths send its bytes as they lie
    with one_thread(pg, "halo_exchange"):  # paired with the peers' calls by issue order, as every collective
        if local_len >= 0:
            _check(send, pg, local_len)
        if _comm.uses_nccl(pg, send):
            return _shift_core(send, pg, to_next)
        return _shift(send, pg, to_next)


@halo_shift.register_fake
def _halo_shift_fake(send, group_name, to_next, local_len):
    return torch.empty_like(send, memory_format=torch.contiguous_format)


def _halo_shift_setup(ctx, inputs, output):
    ctx.group_name, ctx.to_next = inputs[1], inputs[2]


def _halo_shift_backward(ctx, grad):
    return halo_shift(grad.contiguous(), ctx.group_name, not ctx.to_next, -1), None, None, None


halo_shift.register_autograd(_halo_shift_backward, setup_context=_halo_shift_setup)


def halo_exchange(x: torch.Tensor, w: int, group=None, *, context=None) -> torch.Tensor:
    """Returns the previous rank's last ``w`` tokens of ``x [B, T_local, ...]`` (dim 1 is the sequence),
    zeros on rank 0. ``group``: the sequence-parallel group (rank order = sequence order); None: the
    default group (one process when torch.distributed is not initialised); ``allscan.ops.LOCAL``: this
    process alone. Every rank must pass the same ``w`` and shape; ``T_local >= w`` with several ranks.
    ``context``: the batch's :class:`allscan.SequenceContext`, whose group is taken instead (a ``group``
    given beside it must be the same)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("halo_exchange: x must be a tensor [B, T_local, ...] (dim 1 the sequence)")
    if not isinstance(w, int) or w < 0:
        raise ValueError(f"halo_exchange: w must be a non-negative int, got {w!r}")
    conflict = context_conflict(context, group, None, "halo_exchange")
    pg = context_group(context, group, "halo_exchange")
    if conflict is not None:  # refused on every rank: the peers waiting in the exchange's check are told
        if pg is None or torch.compiler.is_compiling():
            raise conflict

        def refuse():
            raise conflict

        validated_group(pg, x, "halo_exchange", refuse)
    T = x.shape[1]
    # one process: zeros, through the op all the same (so the halo is part of x's autograd graph, as
    # with several ranks); it may hold fewer than w tokens
    send = x[:, T - w:] if T >= w else torch.cat([x.new_zeros((x.shape[0], w - T) + tuple(x.shape[2:])), x], 1)
    name = pg.group_name if pg is not None and dist.get_world_size(pg) > 1 else ""
    # the gradient of the received halo goes back to the sender's last w tokens (autograd of the slice)
    return halo_shift(send.contiguous(), name, True, T)
