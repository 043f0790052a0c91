"""The ops and layers take the batch's SequenceContext (``context=``): the same results as with
``cu_seqlens``, no cross-rank exchange for the cut (the context agreed on it once, when it was built),
and ``context=`` beside ``cu_seqlens=`` or another ``group=`` refused on every rank."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

import allscan._agreement as agreement  # noqa: E402
from allscan import SequenceContext  # noqa: E402
from allscan.layers import GatedDeltaNet, UlyssesAttention  # noqa: E402
from allscan.ops import LOCAL  # noqa: E402
from allscan.ops.delta import zeco_gated_delta_rule  # noqa: E402
from allscan.ops.gla import zeco_gla  # noqa: E402
from allscan.ops.ulysses import ulysses_attention  # noqa: E402


def _inputs(rank, T=8, H=2, K=4):
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    return q, torch.nn.functional.normalize(k, dim=-1), v, g, beta


def _ops_take_the_context(rank, world):
    torch.manual_seed(0)
    q, k, v, g, beta = _inputs(rank)
    cuts = ([0, 5, 12, 16], [0, 3, 9, 16])  # two batches' cuts: sequences starting inside either rank
    gla = lambda **kw: zeco_gla(q, k, v, g, **kw)[0]  # noqa: E731
    gdn = lambda **kw: zeco_gated_delta_rule(q, k, v, g, beta, **kw)[0]  # noqa: E731
    layer = GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, expand_v=1, conv_size=3).double()
    x = torch.randn(1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    on_layer = lambda **kw: layer(x, **kw)[0]  # noqa: E731
    uly = lambda **kw: ulysses_attention(q, k, v, causal=True, num_chunks=1, **kw)  # noqa: E731
    uly_module = lambda **kw: UlyssesAttention(num_chunks=1)(q, k, v, causal=True, **kw)  # noqa: E731
    for run in (gla, gdn, on_layer, uly, uly_module):
        for cu in cuts:
            ctx = SequenceContext(cu_seqlens=cu)
            torch.testing.assert_close(run(context=ctx), run(cu_seqlens=torch.tensor(cu)), rtol=0, atol=0)
    # Exchanges under NCCL's rule (a signature checked once, then skipped; gloo exchanges every call):
    # a new batch's cut costs the ops no exchange with a context, one per op with cu_seqlens
    exchanges = []
    real_on_nccl, real_gather = agreement._on_nccl, agreement._gather_rows
    agreement._on_nccl = lambda group, device: True
    agreement._gather_rows = lambda *a: exchanges.append(1) or real_gather(*a)
    try:
        for run in (gla, gdn, uly):
            run(context=SequenceContext(cu_seqlens=cuts[0]))  # these shapes' first call: checked
            before = len(exchanges)
            run(context=SequenceContext(cu_seqlens=cuts[1]))
            assert len(exchanges) == before, "a context's cut was exchanged again"
            run(cu_seqlens=torch.tensor(cuts[0]))
            before = len(exchanges)
            run(cu_seqlens=torch.tensor(cuts[1]))
            assert len(exchanges) > before  # (the count sees the exchanges)
    finally:
        agreement._on_nccl, agreement._gather_rows = real_on_nccl, real_gather
    # a context with cu_seqlens, or with another group: refused on every rank, naming both
    ctx = SequenceContext(cu_seqlens=cuts[0])
    for run in (gla, gdn, on_layer, uly):
        with pytest.raises(ValueError, match="context= and cu_seqlens= given together"):
            run(context=ctx, cu_seqlens=torch.tensor(cuts[0]))
    for run in (gla, gdn, uly):
        with pytest.raises(ValueError, match="context= and group= name different groups"):
            run(context=ctx, group=LOCAL)
        run(context=ctx, group=dist.group.WORLD)  # the context's own group: accepted
    # one rank's conflict alone (rank 1 names another group; the layer, another cut): its peer, which passed
    # the context alone, raises too instead of waiting (the refusal is told on the context's group)
    from allscan.ops.halo import halo_exchange

    refused = "different groups" if rank == 1 else r"rank\(s\) \[1\]"
    for run in (gla, gdn, uly, lambda **kw: halo_exchange(x, 2, **kw)):
        with pytest.raises(ValueError, match=refused):
            run(context=ctx, **({"group": LOCAL} if rank == 1 else {}))
    with pytest.raises(ValueError, match="given together" if rank == 1 else r"rank\(s\) \[1\]"):
        on_layer(context=ctx, **({"cu_seqlens": torch.tensor(cuts[0])} if rank == 1 else {}))
    return True


def test_ops_and_layers_take_the_context():
    assert run_distributed(_ops_take_the_context, 2, timeout=180) == [True, True]


def test_every_layer_honours_the_context_in_one_process():
    """Each layer given a packed context computes what it computes with the context's offsets as
    ``cu_seqlens`` (no layer may drop ``context=`` into its ``**kwargs``: it would run across the
    sequence starts), and refuses a context beside ``cu_seqlens``."""
    from allscan.layers import Attention, GatedLinearAttention, KimiDeltaAttention, Mamba2

    cu = [0, 5, 12]
    ctx = SequenceContext(LOCAL, cu_seqlens=cu)
    torch.manual_seed(0)
    layers = [GatedLinearAttention(hidden_size=16, num_heads=2, expand_k=0.5, expand_v=1),
              GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, expand_v=1, conv_size=3),
              KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, conv_size=3),
              Mamba2(hidden_size=16, num_heads=4, head_dim=4, state_size=4, expand=1, n_groups=1, conv_kernel=3),
              Attention(hidden_size=16, num_heads=2)]
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    for layer in layers:
        layer = layer.double()
        name = type(layer).__name__
        packed = layer(x, cu_seqlens=torch.tensor(cu))[0]
        assert (packed - layer(x)[0]).abs().max() > 1e-3, name  # the packing matters here
        assert torch.allclose(layer(x, context=ctx)[0], packed, rtol=0, atol=1e-12), name
        with pytest.raises(ValueError, match="context= and cu_seqlens= given together"):
            layer(x, context=ctx, cu_seqlens=torch.tensor(cu))


def test_a_conflicting_context_is_refused_after_a_plain_call(single_rank):
    """A context beside another group (or not a context at all) is refused on every call, also after a plain
    call of the same shapes passed its checks (a cached pass must not serve it: it would run unpacked)."""
    q, k, v, g, beta = _inputs(0, T=16)
    ctx = SequenceContext(None, cu_seqlens=[0, 5, 16])
    uly = lambda **kw: ulysses_attention(q, k, v, causal=True, **kw)  # noqa: E731
    for op in (lambda **kw: zeco_gla(q, k, v, g, **kw), lambda **kw: zeco_gated_delta_rule(q, k, v, g, beta, **kw),
               uly):
        op(group=single_rank)  # these shapes' checks pass once
        with pytest.raises(ValueError, match="context= and group= name different groups"):
            op(group=LOCAL, context=ctx)
        with pytest.raises(TypeError, match="context must be an allscan.SequenceContext"):
            op(context="a context")
    # Ulysses needs a process group: a context of one process is refused, naming it
    with pytest.raises(ValueError, match="the context's group is one process"):
        uly(context=SequenceContext(LOCAL))
