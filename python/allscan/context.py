"""One batch's sequence-parallel context: the group resolved once and the batch's cut of the sequence
made and agreed across ranks once, shared by every layer that runs on the batch.

    ctx = allscan.SequenceContext(group)                                # whole sequences, B rows
    ctx = allscan.SequenceContext(group, cu_seqlens=cu)                 # packed: global offsets
    ctx = allscan.SequenceContext.from_position_ids(position_ids, group)  # packed: ids restarting at 0
    layer(x, context=ctx)                                                # every layer of the model

Building one is collective on the group (every rank builds its own for the same batch): packed
contexts exchange their cut once (from position ids the exchange *makes* the cut, so every rank holds
the same one by construction; given offsets are compared). A mismatch raises ``ValueError`` on every
rank. The ops and layers then read the context's host copy of the cut and never compare it again.
"""
from __future__ import annotations

import bisect
import hashlib
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._comm import normalize_group

__all__ = ["LOCAL", "SPGroup", "resolve_sp_group", "ShardCut", "SequenceContext"]


class _Local:
    def __repr__(self):
        return "allscan.ops.LOCAL"


LOCAL = _Local()
"""``group=LOCAL``: no sequence parallelism, even inside an initialised process group: this process
holds the whole sequence."""


@dataclass(frozen=True)
class SPGroup:
    """A sequence-parallel group resolved once: the process group (None: one process), its registered
    name ("" for one process), this process's rank in it and its size."""

    process_group: Optional[dist.ProcessGroup]
    name: str
    rank: int
    size: int


_ONE_PROCESS = SPGroup(None, "", 0, 1)
_RESOLVED: "weakref.WeakKeyDictionary[dist.ProcessGroup, SPGroup]" = weakref.WeakKeyDictionary()


def resolve_sp_group(group, op: str = "allscan") -> SPGroup:
    """``group`` as every sequence-parallel entry takes it: None (the default process group; one
    process where torch.distributed is not initialised), :data:`LOCAL` (one process), a
    ``ProcessGroup``, a group name, an :class:`SPGroup`, or a one-dimensional ``DeviceMesh`` (a mesh
    dimension: ``mesh["sp"]``)."""
    if isinstance(group, SPGroup):
        return group
    if group is LOCAL:
        return _ONE_PROCESS
    initialised = dist.is_available() and dist.is_initialized()
    if group is None and not initialised:
        return _ONE_PROCESS
    if group is not None and not initialised:
        raise RuntimeError(f"{op}: group given but torch.distributed is not initialised")
    group = mesh_dimension_group(group, op)
    pg = normalize_group(group)
    resolved = _RESOLVED.get(pg)
    if resolved is None:
        resolved = _RESOLVED[pg] = SPGroup(pg, pg.group_name, dist.get_rank(pg), dist.get_world_size(pg))
    return resolved


def mesh_dimension_group(group, op: str):
    """A one-dimensional device mesh -> its process group; a larger mesh is refused, naming the fix."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch without device meshes
        return group
    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim != 1:
        names = group.mesh_dim_names or ()
        raise ValueError(f"{op}: group must be one dimension of a device mesh (e.g. mesh['sp']), got a mesh of "
                         f"{group.ndim} dimensions {tuple(names)}")
    return group.get_group()


class ShardCut:
    """This rank's shard ``[rank * T, (rank + 1) * T)`` of the global sequence, cut into local segments at
    the packed sequences' starts (``cu``: global offsets, None for whole sequences): the segment bounds,
    which global sequence each belongs to, which end on this rank, whether the first continues a sequence
    from the previous rank."""

    def __init__(self, sp: SPGroup, T: int, B: int, cu: Optional[Tuple[int, ...]]):
        self.world, self.rank = sp.size, sp.rank
        self.group = sp.process_group
        self.T = T
        self.digest = offsets_digest(cu)  # the whole cut, for the signatures compared across ranks
        self.varlen = cu is not None
        if cu is None:
            self.bounds = [0, T]
            self.seq_ids = [None]
            self.ends_here = [True]
            self.continued = self.rank > 0
            self.starts_inside = False
            self.num_seqs = B
            return
        off = self.rank * T
        cuset = set(cu)
        cut = sorted(set([0, T] + [c - off for c in cu if off < c < off + T]))
        self.bounds = cut
        self.seq_ids = [bisect.bisect_right(cu, off + s) - 1 for s in cut[:-1]]
        self.ends_here = [(off + e) in cuset for e in cut[1:]]
        self.continued = off not in cuset
        self.starts_inside = (not self.continued) or len(cut) > 2
        self.num_seqs = len(cu) - 1

    @property
    def nseg(self) -> int:
        return len(self.bounds) - 1


def checked_offsets(cu_seqlens, T: int, B: int, world: int, op: str) -> Tuple[int, ...]:
    """``cu_seqlens`` (global offsets of the sequences packed in one row) checked and read to the host
    once: a 1-D integer tensor or sequence ``[N+1]`` from 0 to ``world * T``, strictly increasing."""
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch size must be 1 (packed sequences), got B={B}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"{op}: cu_seqlens must be a 1-D tensor [N+1] of cumulative sequence lengths "
                             "over the GLOBAL packed sequence")
        if cu_seqlens.dtype.is_floating_point:
            raise ValueError(f"{op}: cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        cu = tuple(int(c) for c in cu_seqlens.tolist())
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(c, int) and not isinstance(c, bool)
                                                        for c in cu_seqlens):
        cu = tuple(cu_seqlens)
    else:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor [N+1] of cumulative sequence lengths "
                         f"over the GLOBAL packed sequence, got {type(cu_seqlens).__name__}")
    total = world * T
    if len(cu) < 2:
        raise ValueError(f"{op}: cu_seqlens must hold at least two offsets [0, ..., {total}], got {list(cu)}")
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{op}: cu_seqlens must start at 0 and end at world_size * T_local = "
                         f"{world} * {T} = {total} (the global packed length), got {cu[0]} .. {cu[-1]}")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{op}: cu_seqlens must be strictly increasing (empty sequences are not supported)")
    return cu


def offsets_digest(cu: Optional[Sequence[int]]) -> int:
    """A 62-bit hash of the whole cut (0: whole sequences), for comparing it across ranks (the exchange
    carries signed int64)."""
    if cu is None:
        return 0
    return int.from_bytes(hashlib.blake2b(repr(tuple(cu)).encode(), digest_size=8).digest(), "little") >> 2


class SequenceContext:
    """One batch's layout on one sequence-parallel group (module docstring). ``local_len`` (tokens per
    rank) is checked against each layer's input when given; packed offsets imply it."""

    def __init__(self, group=None, *, cu_seqlens=None, local_len: Optional[int] = None):
        self.group = resolve_sp_group(group, "SequenceContext")
        cu, problem = None, ""
        if cu_seqlens is not None:
            try:  # judged after the exchange, so that a rank's bad offsets raise on every rank
                cu = checked_offsets(cu_seqlens, _local_length(cu_seqlens, self.group.size), 1, self.group.size,
                                     "SequenceContext")
            except (TypeError, ValueError, IndexError) as e:
                problem = str(e)
            local_len = None if cu is None else (cu[-1] // self.group.size if local_len is None else local_len)
        self._set(cu, local_len)
        if cu_seqlens is not None:
            self._agree(problem)
            given = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
            self._premake_offsets(given if given is not None and given.type != "cpu" else _home_device(self.group))

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, group=None) -> "SequenceContext":
        """The context of a row packed by position ids restarting at 0 at each sequence's start (the
        way transformers' ``DataCollatorWithFlattening`` packs), given this rank's shard ``[1, T_local]``
        of them. One exchange gathers every rank's sequence starts into the global offsets; ids that
        are not whole sequences counted from 0 (or ``[B, T_local]`` rows with B > 1 that restart) raise
        ``ValueError`` on every rank. Ids counting straight through the shards give whole sequences."""
        sp = resolve_sp_group(group, "SequenceContext")
        # every check is judged after the exchange, so that one rank's bad ids raise on every rank
        if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2)
                or position_ids.dtype.is_floating_point or position_ids.shape[-1] == 0):
            what = (f"{position_ids.dtype} {list(position_ids.shape)}" if isinstance(position_ids, torch.Tensor)
                    else type(position_ids).__name__)
            summary = {"problem": f"position_ids must be a [B, T_local] or [T_local] integer tensor, got {what}",
                       "starts": [], "first": 0, "last": 0, "T": -1, "B": 0}
            rows = None
        else:
            rows = position_ids.reshape(-1, position_ids.shape[-1]).to("cpu", torch.long)
            summary = _shard_summary(rows)
        T = summary["T"]
        everyone = [summary] if sp.size == 1 else _gather(sp, summary)
        problem = next((f"rank {r}: {s['problem']}" for r, s in enumerate(everyone) if s["problem"]), None)
        if problem is None:
            problem = _continuity_problem(everyone, T)
        if problem is not None:
            raise ValueError(f"SequenceContext.from_position_ids: {problem} (position ids must count 0, 1, 2, ... "
                             "along each sequence, restarting at 0 where a packed sequence starts)")
        starts = sorted({r * T + s for r, info in enumerate(everyone) for s in info["starts"]} | {sp.size * T})
        cu = None if starts == [0, sp.size * T] else tuple(starts)
        if cu is not None and rows.shape[0] != 1:  # every rank's B is the same here (checked above)
            raise ValueError(f"SequenceContext.from_position_ids: packed sequences need one row (B = 1), got "
                             f"B = {rows.shape[0]}")
        ctx = cls.__new__(cls)
        ctx.group = sp
        ctx._set(cu, T)
        ctx._premake_offsets(position_ids.device if position_ids.device.type != "cpu" else _home_device(sp))
        return ctx

    @classmethod
    def from_agreed_offsets(cls, group, cu_seqlens: torch.Tensor) -> "SequenceContext":
        """The context whose offsets (``offsets(device)``) a context already agreed on across ``group``,
        rebuilt without an exchange: for torch.compile's custom ops, to which a context cannot travel (they
        take its offsets as a tensor, read here once). Nothing is compared: not for offsets no context
        agreed on (those go to the ops as ``cu_seqlens=``)."""
        sp = resolve_sp_group(group, "SequenceContext")
        cu = tuple(int(b) for b in cu_seqlens.tolist())
        ctx = cls.__new__(cls)
        ctx.group = sp
        ctx._set(cu, cu[-1] // sp.size)
        ctx._device_offsets[cu_seqlens.device] = cu_seqlens
        return ctx

    def _set(self, cu: Optional[Tuple[int, ...]], local_len: Optional[int]) -> None:
        self.cu_seqlens: Optional[Tuple[int, ...]] = cu  # global offsets on the host, None: whole sequences
        self.local_len = local_len
        self.digest = offsets_digest(cu)
        self._cuts: Dict[Tuple[int, int], ShardCut] = {}
        self._device_offsets: Dict[torch.device, torch.Tensor] = {}

    def _agree(self, problem: str) -> None:
        """Compare the packed offsets across the group once: a rank whose offsets are malformed
        (``problem``) or differ from its peers' makes every rank raise."""
        if self.group.size == 1:
            if problem:
                raise ValueError(problem)
            return
        rows = _gather(self.group, (problem, 0 if problem else len(self.cu_seqlens), self.digest))
        bad = [(r, row[0]) for r, row in enumerate(rows) if row[0]]
        if bad:
            raise ValueError(f"SequenceContext: rank {bad[0][0]}'s cu_seqlens: {bad[0][1]}")
        if any(row != rows[self.group.rank] for row in rows):
            differ = [r for r, row in enumerate(rows) if row != rows[0]]
            raise ValueError(f"SequenceContext: the ranks of the group passed different cu_seqlens (ranks {differ} "
                             "differ from rank 0); pass the same global offsets on every rank")

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def cut(self, T: int, B: int = 1, op: str = "allscan") -> ShardCut:
        """This rank's cut of a layer input of ``T`` local tokens and ``B`` rows (made once per shape)."""
        key = (T, B)
        got = self._cuts.get(key)
        if got is None:
            if self.local_len is not None and T != self.local_len:
                raise ValueError(f"{op}: the input holds {T} tokens per rank, its SequenceContext "
                                 f"{self.local_len}")
            if self.packed and B != 1:
                raise ValueError(f"{op}: with packed sequences the batch size must be 1, got B={B}")
            got = self._cuts[key] = ShardCut(self.group, T, B, self.cu_seqlens)
        return got

    def _premake_offsets(self, device) -> None:
        """The device copy of the packed offsets, made now, outside any trace: a compiled op takes it as a
        graph input (one made while torch.compile traces would be a constant: each batch's cut a new graph)."""
        if self.cu_seqlens is not None:
            self.offsets(device)

    def offsets(self, device) -> Optional[torch.Tensor]:
        """The packed offsets as an int32 tensor on ``device`` (copied once per device), or None."""
        if self.cu_seqlens is None:
            return None
        device = torch.device(device)
        t = self._device_offsets.get(device)
        if t is None:
            t = self._device_offsets[device] = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)
        return t

    def __repr__(self) -> str:
        what = f"{len(self.cu_seqlens) - 1} packed sequences" if self.packed else "whole sequences"
        return f"SequenceContext(rank {self.group.rank} of {self.group.size}, {what})"


def _home_device(sp: SPGroup) -> torch.device:
    """Where the ops of a group run: on an NCCL group its bound GPU (``init_process_group(device_id=)``), else
    the current one; elsewhere the CPU."""
    pg = sp.process_group
    if pg is not None and "nccl" in str(dist.get_backend(pg)):
        bound = getattr(pg, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_length(cu_seqlens, world: int) -> int:
    """Tokens per rank implied by packed offsets (their last is the whole row's length)."""
    total = int(cu_seqlens[-1])
    if total % world:
        raise ValueError(f"the packed length cu_seqlens[-1] = {total} must be a multiple of the group size {world}")
    return total // world


def _shard_summary(rows: torch.Tensor) -> dict:
    """What the other ranks need of this shard's position ids: its sequence starts, first and last id;
    and what is wrong with them here, if anything (judged by everyone after the exchange)."""
    step = rows[:, 1:] - rows[:, :-1]
    restart = rows[:, 1:] == 0
    problem = ""
    if bool(((step != 1) & ~restart).any()):
        problem = "position ids neither count up by one nor restart at 0"
    elif rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
        problem = "the rows' position ids differ"
    row = rows[0]
    starts: List[int] = [int(i) for i in torch.nonzero(row == 0).flatten().tolist()]
    return {"problem": problem, "starts": starts, "first": int(row[0]), "last": int(row[-1]), "T": rows.shape[1],
            "B": rows.shape[0]}


def _continuity_problem(everyone: List[dict], T: int) -> Optional[str]:
    """Each rank's first id continues the previous rank's last (or restarts at 0); rank 0 starts at 0."""
    if any(s["T"] != T for s in everyone):
        return f"the ranks hold different shard lengths {[s['T'] for s in everyone]}"
    if any(s["B"] != everyone[0]["B"] for s in everyone):
        return f"the ranks hold different batch sizes {[s['B'] for s in everyone]}"
    if everyone[0]["first"] != 0:
        return f"rank 0's first position id is {everyone[0]['first']}, not 0"
    for r in range(1, len(everyone)):
        first, before = everyone[r]["first"], everyone[r - 1]["last"]
        if first != 0 and first != before + 1:
            return f"rank {r}'s first position id {first} neither restarts at 0 nor follows rank {r - 1}'s last {before}"
    return None


def _gather(sp: SPGroup, obj) -> list:
    out = [None] * sp.size
    dist.all_gather_object(out, obj, group=sp.process_group)
    return out
