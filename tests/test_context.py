"""allscan.SequenceContext: the group resolved once (process group, group name, device-mesh dimension,
LOCAL), the packed cut made once from global offsets or from position ids restarting at 0, agreed across
ranks at construction (a mismatch raises on every rank), and each rank's cut of its shard."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

import allscan  # noqa: E402
from allscan.context import LOCAL, SequenceContext, resolve_sp_group  # noqa: E402


def test_one_process_contexts():
    ctx = SequenceContext()  # torch.distributed not initialised: one process
    assert (ctx.group.size, ctx.group.rank, ctx.packed, ctx.digest) == (1, 0, False, 0)
    assert resolve_sp_group(LOCAL).size == 1
    packed = SequenceContext(cu_seqlens=torch.tensor([0, 3, 8]))
    cut = packed.cut(8)
    assert (cut.bounds, cut.seq_ids, cut.ends_here, cut.continued) == ([0, 3, 8], [0, 1], [True, True], False)
    assert packed.cut(8) is cut  # made once
    assert packed.offsets("cpu").tolist() == [0, 3, 8] and packed.offsets("cpu") is packed.offsets("cpu")
    with pytest.raises(ValueError, match="holds 6 tokens per rank, its SequenceContext 8"):
        packed.cut(6)
    with pytest.raises(ValueError, match="strictly increasing"):
        SequenceContext(cu_seqlens=[0, 4, 4, 8])
    assert allscan.SequenceContext is SequenceContext and allscan.ops.LOCAL is LOCAL
    with pytest.raises(ValueError, match="must start at 0"):
        SequenceContext(cu_seqlens=[1, 8])
    ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert SequenceContext.from_position_ids(ids).cu_seqlens == (0, 3, 5, 8)
    assert SequenceContext.from_position_ids(torch.arange(8).expand(2, 8)).packed is False
    with pytest.raises(ValueError, match="neither count up by one nor restart at 0"):
        SequenceContext.from_position_ids(torch.tensor([[0, 1, 3, 4]]))
    with pytest.raises(ValueError, match=r"need one row \(B = 1\)"):
        SequenceContext.from_position_ids(torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]]))


def _packed_by_position_ids(rank, world):
    T = 8
    # three sequences of the global row: 0..4 | 0..8 | 0..(rest): starts at 0, 5 and 14 (inside rank 1;
    # a sequence crosses every rank boundary)
    total = world * T
    glob = torch.cat([torch.arange(5), torch.arange(9), torch.arange(total - 14)])[None]
    ctx = SequenceContext.from_position_ids(glob[:, rank * T:(rank + 1) * T])
    assert ctx.cu_seqlens == (0, 5, 14, total)
    assert ctx.digest == SequenceContext(cu_seqlens=torch.tensor([0, 5, 14, total])).digest
    cut = ctx.cut(T)
    assert cut.continued == (rank > 0) and cut.bounds[0] == 0 and cut.bounds[-1] == T
    # whole sequences: ids counting straight through the shards
    plain = SequenceContext.from_position_ids(torch.arange(total)[None, rank * T:(rank + 1) * T])
    assert not plain.packed
    # a rank whose ids break the count: every rank raises, naming it
    bad = glob[:, rank * T:(rank + 1) * T].clone()
    if rank == world - 1:  # ids off by one up to the shard's first sequence start
        k = int(torch.nonzero(bad[0] == 0)[0]) if bool((bad[0] == 0).any()) else T
        bad[0, :k] += 1
    with pytest.raises(ValueError, match=f"rank {world - 1}'s first position id"):
        SequenceContext.from_position_ids(bad)
    # a rank whose ids are broken inside its shard: every rank raises, naming the rank
    inner = glob[:, rank * T:(rank + 1) * T].clone()
    if rank == 0:
        inner[0, 2] = 9
    with pytest.raises(ValueError, match="rank 0: position ids neither count up"):
        SequenceContext.from_position_ids(inner)
    # one rank's ids of the wrong kind, or a batch size of its own: every rank raises, naming it
    with pytest.raises(ValueError, match=f"rank {world - 1}: position_ids must be a"):
        SequenceContext.from_position_ids(glob[:, rank * T:(rank + 1) * T].float() if rank == world - 1
                                          else glob[:, rank * T:(rank + 1) * T])
    with pytest.raises(ValueError, match="different batch sizes"):
        SequenceContext.from_position_ids(torch.arange(total)[None, rank * T:(rank + 1) * T].expand(1 + (rank == 0), T))
    # different offsets given on the ranks: every rank raises
    mine = [0, 5, total] if rank == 0 else [0, 7, total]
    with pytest.raises(ValueError, match="passed different cu_seqlens"):
        SequenceContext(cu_seqlens=mine)
    # malformed offsets on one rank: every rank raises, naming it
    with pytest.raises(ValueError, match="rank 0's cu_seqlens: .*strictly increasing"):
        SequenceContext(cu_seqlens=[0, 5, 5, total] if rank == 0 else [0, 5, total])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_packed_by_position_ids_across_ranks(world):
    assert run_distributed(_packed_by_position_ids, world, timeout=120) == [True] * world


def _mesh_dimension(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp = resolve_sp_group(mesh["sp"])
    assert sp.size == 2 and sp.rank == dist.get_rank(mesh["sp"].get_group())
    assert resolve_sp_group(mesh["sp"]) is sp  # resolved once per group
    with pytest.raises(ValueError, match=r"one dimension of a device mesh \(e.g. mesh\['sp'\]\)"):
        resolve_sp_group(mesh)
    # the two sp groups build their contexts side by side, each from its own data
    row = mesh.get_coordinate()[0]
    cu = [0, 3 + row, 8]
    ctx = SequenceContext(mesh["sp"], cu_seqlens=cu)
    assert ctx.cu_seqlens == tuple(cu) and ctx.group is sp
    # the ops and layers take the mesh dimension as their group= too (what the fla integration hands them)
    from allscan.layers import GatedLinearAttention

    layer = GatedLinearAttention(hidden_size=8, num_heads=2, expand_k=0.5, expand_v=1, group=mesh["sp"]).double()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    on_group = GatedLinearAttention(hidden_size=8, num_heads=2, expand_k=0.5, expand_v=1,
                                    group=mesh["sp"].get_group()).double()
    on_group.load_state_dict(layer.state_dict())
    assert torch.equal(layer(x)[0], on_group(x)[0])
    return True


def test_a_device_mesh_dimension_is_a_group():
    assert run_distributed(_mesh_dimension, 4, timeout=120) == [True] * 4
