"""The process group an allscan call runs on: ``None`` (the default group), a group name or a group,
resolved to the group; its name and backend. No NCCL here (:mod:`allscan._comm` makes communicators)."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["normalize_group", "group_name", "resolve_group", "backend_name", "uses_nccl"]


def _default_group():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "allscan: torch.distributed is not initialised; call torch.distributed.init_process_group "
            "first (or pass group= explicitly)"
        )
    return dist.group.WORLD


def normalize_group(group):
    """``None`` -> the default group; a group name -> the group; a group -> itself."""
    if group is None:
        return _default_group()
    if isinstance(group, str):
        return resolve_group(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, int) and not isinstance(group, bool)
                                                       and group == dist.GroupMember.NON_GROUP_MEMBER):
        raise ValueError(
            f"allscan: this process (global rank {dist.get_rank()}) is not a member of the group it was given: "
            "torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on ranks outside the group; call the "
            "collective only on the group's own ranks")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError("allscan: group must be a torch.distributed ProcessGroup, a group name or None, got "
                        f"{type(group).__name__}")
    return group


def group_name(group) -> str:
    """The registered name of a group (what torch's functional collectives pass around)."""
    group = normalize_group(group)
    return group.group_name


def resolve_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def backend_name(group) -> str:
    return str(dist.get_backend(group)).lower()


def uses_nccl(group, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` goes through the C++/NCCL core: a CUDA tensor and an NCCL group."""
    return tensor.is_cuda and "nccl" in backend_name(group)
