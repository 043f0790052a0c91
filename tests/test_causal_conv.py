"""The depthwise causal convolution with the previous rank's halo in one autograd node
(:func:`allscan.layers.causal_conv.conv_with_halo`): in one process it is ``nn.Conv1d``'s with the left zero
padding, values and gradients (the shard shorter than the halo included); across ranks, the whole
sequence's convolution (each rank's slice of it) and its gradients, the halo's sent back to its rank; a backward
with ``create_graph=True`` refused on every rank."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from allscan.layers.causal_conv import conv_with_halo  # noqa: E402


def _reference(x, weight, bias):
    """``[B, C, T]``: the causal conv of the whole ``x [B, T, C]``, zero-padded on the left."""
    k = weight.shape[-1]
    return F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight, bias, groups=x.shape[2])


def test_one_process_is_the_zero_padded_conv():
    gen = torch.Generator().manual_seed(0)
    for T in (7, 2):  # 2: shorter than the halo (k - 1 = 3), allowed alone
        x = torch.randn(2, T, 5, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(5, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda *a: conv_with_halo(*a, ""), (x, weight, bias))
        torch.testing.assert_close(conv_with_halo(x, weight, bias, ""), _reference(x, weight, bias))


def test_under_autocast_it_is_the_conv_autocast_runs():
    """Under autocast (fp32 parameters, bf16 compute: a trainer's mixed precision) the output is F.conv1d's in
    autocast's dtype, and the gradients come back to the fp32 tensors as F.conv1d's do."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 9, 6, generator=gen, requires_grad=True)
    weight = torch.randn(6, 1, 4, generator=gen, requires_grad=True)
    bias = torch.randn(6, generator=gen, requires_grad=True)
    dout = torch.randn(1, 6, 9, generator=gen)
    got, want = [], []
    for fn, into in ((lambda: conv_with_halo(x, weight, bias, ""), got), (lambda: _reference(x, weight, bias), want)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        into += [out, *torch.autograd.grad(out, (x, weight, bias), dout.to(out.dtype))]
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _across_ranks(rank, world):
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1)
    T = 6
    x = torch.randn(2, T * world, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 5, T * world, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(_reference(x, weight, bias), (x, weight, bias), dout)
    mine = x.detach()[:, rank * T:(rank + 1) * T].clone().requires_grad_(True)
    out = conv_with_halo(mine, weight, bias, dist.group.WORLD.group_name)
    torch.testing.assert_close(out, _reference(x, weight, bias)[..., rank * T:(rank + 1) * T])
    dx, dw, db = torch.autograd.grad(out, (mine, weight, bias), dout[..., rank * T:(rank + 1) * T])
    torch.testing.assert_close(dx, want[0][:, rank * T:(rank + 1) * T])  # the next rank's halo gradient added
    for g in (dw, db):  # the parameters' gradients summed over the ranks are one process's
        dist.all_reduce(g)
    torch.testing.assert_close(dw, want[1])
    torch.testing.assert_close(db, want[2])
    # a gradient penalty: refused on every rank (the halo is a constant in the backward), also with a residual
    # giving x another path, and the group goes on
    out = conv_with_halo(mine, weight, bias, dist.group.WORLD.group_name)
    try:
        torch.autograd.grad(out + mine.transpose(1, 2), (mine, weight), dout[..., rank * T:(rank + 1) * T],
                            create_graph=True)
        raise AssertionError("a backward with create_graph=True through the halo exchange was not refused")
    except RuntimeError as e:
        assert "halo exchange: double backward" in str(e), e
    out = conv_with_halo(mine, weight, bias, dist.group.WORLD.group_name)
    torch.autograd.grad(out, mine, dout[..., rank * T:(rank + 1) * T])
    return True


def test_across_three_ranks_is_the_whole_sequence():
    assert run_distributed(_across_ranks, 3) == [True] * 3
