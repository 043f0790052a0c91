"""The Mamba2 mixer layer (:class:`allscan.layers.Mamba2`) in float64 on CPU.

In one process: transformers' ``Mamba2Mixer`` state_dict loads, and with the same weights the layer computes
what the mixer computes (output, the input's and every parameter's gradient), the parameters meaning the same
thing; a packed row equals each of its sequences run alone. At P = 2 (one spawn of gloo ranks): the layer
sequence-parallel equals the same layer in one process on the whole sequence (output and every parameter
gradient), batch 2 and a packed row with a start inside a shard and one on the rank boundary; a rank failing
in its own work reaches its peer.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from failing_rank import outcome_when_a_layer_fails_on_rank_1  # noqa: E402

from allscan.layers import Mamba2  # noqa: E402
from allscan.ops import LOCAL  # noqa: E402

F64 = torch.float64
TOL = 1e-6  # float64 throughout (zeco_gla's torch backend; transformers' chunked scan computes its fp32 parts: 1e-6)
SIZES = dict(hidden_size=16, num_heads=8, head_dim=4, state_size=6, expand=2, n_groups=2, conv_kernel=4,
             use_conv_bias=True, use_bias=True, time_step_limit=(0.01, 2.0))


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _randomised(layer, seed=0):
    """Weights away from the initialisation (every parameter matters, none sits at a clamp's edge)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return layer


def _fwd_bwd(layer, x, dy, *, cu_seqlens=None):
    """(output, {name: gradient} of the input "x" and every parameter) for the loss sum(y dy)."""
    x = x.clone().requires_grad_(True)
    out = layer(x, cu_seqlens=cu_seqlens) if isinstance(layer, Mamba2) else (layer(x),)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad((out[0] * dy).sum(), [x] + list(layer.parameters()))
    return out[0].detach(), dict(zip(names, grads))


def test_layer_is_transformers_mamba2_mixer():
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    config = Mamba2Config(num_hidden_layers=1, chunk_size=16, **SIZES)
    theirs = _randomised(Mamba2Mixer(config, layer_idx=0).double()).eval()  # eval: transformers' torch path
    ours = Mamba2.from_config(config, layer_idx=0, group=LOCAL).double()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert {n: p.shape for n, p in ours.state_dict().items()} == {n: p.shape for n, p in theirs.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(2, 37, 16, generator=gen, dtype=F64) for _ in range(2))
    y_theirs, g_theirs = _fwd_bwd(theirs, x, dy)
    y_ours, g_ours = _fwd_bwd(ours, x, dy)
    assert _rel(y_ours, y_theirs) < TOL
    assert g_ours.keys() == g_theirs.keys()
    for name, g in g_theirs.items():
        assert _rel(g_ours[name], g) < TOL, name
    # a packed row: each sequence as if alone (no convolution window, no state across a start)
    bounds = [0, 5, 19, 37]
    xp, dyp = x[:1], dy[:1]
    y_packed, g_packed = _fwd_bwd(ours, xp, dyp, cu_seqlens=torch.tensor(bounds))
    alone = [_fwd_bwd(ours, xp[:, s:e], dyp[:, s:e]) for s, e in zip(bounds, bounds[1:])]
    assert _rel(y_packed, torch.cat([y for y, _ in alone], 1)) < TOL
    for name, g in g_packed.items():
        want = torch.cat([a[name] for _, a in alone], 1) if name == "x" else sum(a[name] for _, a in alone)
        assert _rel(g, want) < TOL, f"packed {name}"


def _run_sequence_parallel(rank, world):
    torch.manual_seed(0)
    layer = _randomised(Mamba2(**SIZES, group=dist.group.WORLD).double())
    whole = Mamba2(**SIZES, group=LOCAL).double()
    whole.load_state_dict(layer.state_dict())
    T_local = 12
    gen = torch.Generator().manual_seed(2)
    for b, cu in ((2, None), (1, torch.tensor([0, 5, T_local, 2 * T_local]))):
        x, dy = (torch.randn(b, T_local * world, 16, generator=gen, dtype=F64) for _ in range(2))
        sl = slice(rank * T_local, (rank + 1) * T_local)
        y_ref, g_ref = _fwd_bwd(whole, x, dy, cu_seqlens=cu)
        y, g = _fwd_bwd(layer, x[:, sl], dy[:, sl], cu_seqlens=cu)
        assert _rel(y, y_ref[:, sl]) < TOL, f"output, packed {cu is not None}"
        assert _rel(g.pop("x"), g_ref.pop("x")[:, sl]) < TOL
        for name, grad in g.items():
            dist.all_reduce(grad)  # replicated parameters: their gradient is the sum over the shards
            assert _rel(grad, g_ref[name]) < TOL, f"{name}, packed {cu is not None}"
    # a rank failing in its own work (a padding mask it refuses; its projection) reaches its peer
    x = torch.randn(1, T_local, 16, dtype=F64, requires_grad=True)
    for where in ("attention_mask", "in_proj"):
        outcome = outcome_when_a_layer_fails_on_rank_1(layer, x, where)
        assert outcome == ("raised" if rank == 1 else "told"), (where, outcome)


def test_layer_sequence_parallel_equals_one_process():
    run_distributed(_run_sequence_parallel, 2, timeout=300)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        Mamba2(hidden_size=16, num_heads=3, head_dim=4)
    with pytest.raises(ValueError, match="n_groups=3 must divide num_heads=8"):
        Mamba2(hidden_size=16, head_dim=4, n_groups=3)
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):
        Mamba2(hidden_size=16, head_dim=4, hidden_act="gelu")
    with pytest.raises(ValueError, match="method must be one of"):
        Mamba2(hidden_size=16, head_dim=4, method="ring")
    layer = Mamba2(hidden_size=16, head_dim=4, state_size=2)
    with pytest.raises(ValueError, match="batch size must be 1"):
        layer(torch.randn(2, 8, 16), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="hidden_states must be"):
        layer(torch.randn(1, 8, 15))
