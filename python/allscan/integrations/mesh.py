"""Sequence parallelism on a DP x SP device mesh, with FSDP2: the batch, the loss and the gradients of the whole
global batch, so that no user has to get the factors right.

    from torch.distributed.device_mesh import init_device_mesh
    from allscan.integrations import mesh as spm, transformers as sp

    mesh = init_device_mesh("cuda", (dp, sp_size), mesh_dim_names=("dp", "sp"))
    sp.sequence_parallel(model, mesh["sp"])   # hybrids (or attn_implementation=sp.register(mesh["sp"]))
    spm.fully_shard(model, mesh)              # FSDP2 over every rank of the mesh; gradients summed (below)
    shard = spm.shard_batch(input_ids, labels, mesh, position_ids=pos)   # this DP row's batch, cut along sp
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    loss = sp.causal_lm_loss(logits, shard)   # this rank's share of the GLOBAL batch's mean loss
    loss.backward()                           # FSDP2 reduce-scatters: the global batch's gradient
    optimizer.step()
    spm.reduce_loss(loss, mesh)               # the global batch's loss, for logging

Each DP row (the ranks of one ``mesh["sp"]`` group) trains on its own batch; the SP ranks of a row hold that
batch's contiguous slices. The global batch is every row's batch together.

The factors. Let N be the global batch's label count (every row's, :func:`shard_batch` sums it over ``dp``).
Rank (d, s) computes ``loss_ds = sum of CE over its tokens / N`` (``causal_lm_loss``). Then the global mean loss
is ``L = sum over d, s of loss_ds`` exactly, and ``dL/dθ = sum over d, s of dloss_ds/dθ``: the gradients are
SUMMED over both dimensions, neither averaged. Over ``sp``, because each SP rank's backward yields the part of its
row's gradient that flows through its own tokens (Ulysses and the scans send the gradient of every token's mixing
back to the rank that holds the token); over ``dp``, because the rows are different data and N already counts
every row. FSDP2 averages by default (it divides by the number of ranks it reduces over, dp x sp here, which
would give ``dL/dθ / (dp * sp)``): :func:`fully_shard` sets its divide factor to 1 (:func:`sum_gradients` does it
for a model you shard yourself). Without FSDP (full replicas): :func:`sync_gradients` sums over ``sp`` and ``dp``.
The result is one process's loss and gradients on the whole global batch, whatever the token count of each row.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .batch import BatchShard
from .batch import shard_batch as _shard_row
from .batch import sync_gradients as _sync_group
from .common import comm_device, sp_group

__all__ = ["mesh_dims", "shard_batch", "reduce_loss", "sync_gradients", "fully_shard", "sum_gradients",
           "whole_mesh"]


def mesh_dims(mesh, dp: str = "dp", sp: str = "sp") -> Tuple[object, object]:
    """``(mesh[dp], mesh[sp])`` of a two-dimensional device mesh, checked: names the fix when the mesh is not."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if getattr(mesh, "ndim", None) != 2 or dp not in names or sp not in names:
        raise ValueError(f"allscan.integrations.mesh: a two-dimensional DeviceMesh with dimensions named {dp!r} and "
                         f"{sp!r} is needed (init_device_mesh(device, (dp, sp), mesh_dim_names=('{dp}', '{sp}'))), got "
                         f"{type(mesh).__name__} of {getattr(mesh, 'ndim', '?')} dimensions {names}")
    return mesh[dp], mesh[sp]


def shard_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, mesh=None, *,
                position_ids: Optional[torch.Tensor] = None, dp: str = "dp", sp: str = "sp") -> BatchShard:
    """This rank's slice of its DP row's batch ``[B, T]`` (the same on the row's SP ranks; each row its own),
    cut along ``mesh[sp]`` as :func:`allscan.integrations.batch.shard_batch` cuts it, with ``num_items`` the label
    count of the whole GLOBAL batch (summed over ``mesh[dp]``: one small all-reduce), so that
    ``causal_lm_loss(logits, shard)`` is this rank's share of the global batch's mean loss. Labels go on every
    row or on none; a row that passes them alone, or whose batch cannot be cut, raises ValueError on every rank."""
    dp_mesh, sp_mesh = mesh_dims(mesh, dp, sp)
    rows = sp_group(dp_mesh, "shard_batch")
    try:
        shard = _shard_row(input_ids, labels, group=sp_mesh, position_ids=position_ids)
    except (ValueError, NotImplementedError):
        if rows.size > 1:  # the other rows wait in the rows' exchange: tell them
            _row_counts(rows, 0, labels is not None, failed=True, like=input_ids)
        raise
    if rows.size > 1:
        # every row exchanges, labels or none, so that no row waits in it for a row that passed none
        total, failed, labelled = _row_counts(rows, shard.num_items or 0, labels is not None, failed=False,
                                                like=input_ids)
        if failed:
            raise ValueError("shard_batch: another DP row's batch could not be cut (its ranks raised why); every "
                             "row must pass a batch [B, T] with T a multiple of the SP size")
        if labelled not in (0, rows.size):
            raise ValueError(f"shard_batch: {labelled} of the {rows.size} DP rows passed labels and the others "
                             "none; pass labels on every rank or on none")
        if shard.num_items is not None:
            shard.num_items = total
    return shard


def _row_counts(rows, count: int, labelled: bool, failed: bool, like) -> Tuple[int, int, int]:
    """Summed over the DP rows: their label counts, how many rows failed to cut their batch, how many passed
    labels (one all-reduce)."""
    t = torch.tensor([count, int(failed), int(labelled)], dtype=torch.int64, device=comm_device(rows, like))
    dist.all_reduce(t, group=rows.process_group)
    total, failed_rows, labelled_rows = t.tolist()
    return total, failed_rows, labelled_rows


def reduce_loss(loss: torch.Tensor, mesh, dp: str = "dp", sp: str = "sp") -> torch.Tensor:
    """The global batch's loss from every rank's share (a detached sum over ``sp`` and ``dp``)."""
    out = loss.detach().clone()
    for dim in mesh_dims(mesh, dp, sp)[::-1]:
        g = sp_group(dim, "reduce_loss")
        if g.size > 1:
            dist.all_reduce(out, group=g.process_group)
    return out


def sync_gradients(model: nn.Module, mesh, dp: str = "dp", sp: str = "sp") -> None:
    """Full replicas (no FSDP): every parameter's gradient summed over ``sp`` and over ``dp`` (module docstring:
    the global batch's gradient; :func:`allscan.integrations.batch.sync_gradients`' agreement on None gradients
    on each)."""
    dp_mesh, sp_mesh = mesh_dims(mesh, dp, sp)
    _sync_group(model, sp_mesh)
    _sync_group(model, dp_mesh)


_WHOLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def whole_mesh(mesh):
    """A one-dimensional DeviceMesh over every rank of ``mesh`` (in the mesh's order), made once per mesh: what
    :func:`fully_shard` shards over. Collective over the default group the first time (a new process group)."""
    if mesh.ndim == 1:
        return mesh
    got = _WHOLE.get(mesh)
    if got is None:
        from torch.distributed.device_mesh import DeviceMesh

        names = "_".join(mesh.mesh_dim_names or ("all",))
        got = _WHOLE[mesh] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1), mesh_dim_names=(names,))
    return got


def sum_gradients(model: nn.Module) -> int:
    """Make every FSDP2 module of ``model`` sum its gradients over the ranks it reduces over, instead of averaging
    them (``set_gradient_divide_factor(1.0)``): what the loss normalised by the global token count needs (module
    docstring). The reduction is a plain SUM (``set_force_sum_reduction_for_comms``): with a divide factor FSDP2
    would otherwise ask for ``PREMUL_SUM``, which gloo lacks for fp32 and bf16. Returns how many FSDP modules it
    set."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.8
                m.set_force_sum_reduction_for_comms(True)
            count += 1
    return count


def _default_layers(model: nn.Module) -> Iterable[nn.Module]:
    """The decoder layers of a transformers model (classes named ``*DecoderLayer``), outermost ones."""
    layers, taken = [], []
    for name, m in model.named_modules():
        if type(m).__name__.endswith("DecoderLayer") and not any(name.startswith(t + ".") for t in taken):
            layers.append(m)
            taken.append(name)
    return layers


def fully_shard(model: nn.Module, mesh, *, layers: Optional[Iterable[nn.Module]] = None, dp: str = "dp",
                sp: str = "sp", **fsdp_kwargs) -> nn.Module:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over every rank of the DP x SP ``mesh`` (sharded over all
    of them: :func:`whole_mesh`), each of ``layers`` (default: the decoder layers, ``*DecoderLayer``) its own unit,
    then the root; gradients summed, not averaged (:func:`sum_gradients`; module docstring). Call it after
    ``sequence_parallel`` / with the model set to ``register``'s attention, before building the optimizer.
    ``fsdp_kwargs`` go to torch's ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...). In place;
    returns ``model``."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh_dims(mesh, dp, sp)
    flat = whole_mesh(mesh)
    for layer in (_default_layers(model) if layers is None else layers):
        torch_fully_shard(layer, mesh=flat, **fsdp_kwargs)
    torch_fully_shard(model, mesh=flat, **fsdp_kwargs)
    sum_gradients(model)
    return model
