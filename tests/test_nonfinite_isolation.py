"""An inf or NaN in one packed sequence never reaches another, as in one process, where each sequence is
computed alone: the scans' zero decay (or all-zero transition row) at a sequence start does not read the
state (IEEE's 0 * inf is NaN), and the short convolutions read zeros, not 0 * x, before a sequence start.

gloo, float64. The GPU kernels' side of the same rule: tests/test_scan_gpu.py, tests/test_matrix_scan_gpu.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402

import allscan  # noqa: E402
from allscan import reference  # noqa: E402
from allscan.context import SequenceContext  # noqa: E402
from allscan.integrations.hf_shard import causal_conv  # noqa: E402
from allscan.layers import GatedDeltaNet, Mamba2, zeco_gated_delta_rule  # noqa: E402
from allscan.ops.gla import zeco_gla  # noqa: E402
from allscan.ops.ssd import zeco_ssd  # noqa: E402

F64 = torch.float64
T_LOCAL, H, K = 12, 2, 4
# sequence B crosses ranks 0 -> 1 and ends inside rank 1, where C starts and runs to the end: a non-finite
# token of B (on rank 0) reaches rank 1's state, and rank 1's zero decay must keep it from rank 2
CUT_INSIDE = [0, 5, 20, 36]
BAD_TOKEN = 8
# B ends exactly at rank 1's end: its last token is rank 2's convolution halo
CUT_AT_BOUNDARY, BAD_AT_BOUNDARY = [0, 5, 24, 36], 23
C_START = {tuple(CUT_INSIDE): 20, tuple(CUT_AT_BOUNDARY): 24}


def _poisoned(t, token, bad):
    t = t.clone()
    if bad is not None:
        t[:, token] = bad
    return t


def _state(rank, sender, bad, dtype, dev):
    """Rank ``rank``'s [2, 3, 4] state: the sender's holds ``bad`` where the receiver's decay is 1 (once) and 0;
    the receiver's a -0.0 where its decay is 0 (the reference's signed zero: 0 * y + x, not x)."""
    x = (torch.arange(24, device=dev).reshape(2, 3, 4) + 10 * rank).to(dtype)
    if rank == sender:
        x[0, 0, 1] = x[0, 1, 2] = bad
        x[1] = bad
    else:
        x[0, 1, 0] = -0.0
    return x


def _bits(t):
    return t.cpu().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _scans(rank, world, bad, dtype=F64):
    """allscan.scan at P = 2, inclusive: the receiving rank's combine of the state the other sends, which
    holds inf or NaN where the receiver's decay (or transition row) is zero, and once where it is 1."""
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    gamma = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]], device=dev)  # [2, 3]: a prefix of the [2, 3, 4] state
    M = torch.eye(3, dtype=dtype, device=dev).repeat(2, 1, 1)
    M[0, 1] = 0  # row 1 of entry 0
    M[1] = 0  # every row of entry 1
    for reverse in (False, True):
        sender = 1 if reverse else 0
        x = _state(rank, sender, bad, dtype, dev)
        # the receiver's result, as the reference computes it (the head sends its x as it is)
        want = reference.combine(gamma.cpu(), _state(sender, sender, bad, dtype, dev).cpu(), x.cpu())
        finite = torch.isfinite(want)
        for method in ("pipelined", "serial", "allgather"):
            tag = f"{method} reverse={reverse} bad={bad}"
            y = allscan.scan(x, gamma, None, inclusive=True, method=method, reverse=reverse)
            if rank != sender:
                stopped = (gamma == 0)[..., None].expand_as(x)
                assert torch.equal(y[stopped], x[stopped]), f"a zero decay read the state: {tag}"
                assert not torch.isfinite(y[0, 0, 1]) and torch.isfinite(y[0, 2]).all(), tag
                assert torch.equal(_bits(y)[finite], _bits(want)[finite]), f"not bitwise the reference's: {tag}"
            y = allscan.scan(x, transition=M, inclusive=True, method=method, reverse=reverse)
            if rank != sender:
                assert torch.equal(y[0, 1], x[0, 1]) and torch.equal(y[1], x[1]), f"a zero row read: matrix {tag}"
                assert not torch.isfinite(y[0, 0, 1]), f"matrix {tag}"  # a row that reads y at all reads it all
    return True


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_zero_decay_stops_a_non_finite_state(bad):
    assert run_distributed(_scans, 2, bad) == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_the_kernels_stop_a_non_finite_state_at_a_zero_decay(dtype):
    """The NCCL path's combine, fold and matrix combine kernels (two ranks, one GPU each or sharing one)."""
    skip_unless_nccl_ranks(2)
    for bad in (float("inf"), float("nan")):
        assert run_distributed(_scans, 2, bad, dtype, backend="nccl", timeout=300) == [True, True]


def _inputs(bad, cu, token, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q, k, v = (torch.randn(1, T, H, K, generator=g, dtype=F64) for _ in range(3))
    gate = -F.softplus(torch.randn(1, T, H, K, generator=g, dtype=F64))
    beta = torch.rand(1, T, H, generator=g, dtype=F64)
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), _poisoned(v, token, bad), gate, beta


def _op(name, method, q, k, v, gate, beta, cu):
    if name == "gla":
        return zeco_gla(q, k, v, gate, None, cu_seqlens=cu, method=method)[0]
    if name == "gated_delta_rule":
        return zeco_gated_delta_rule(q, k, v, gate[..., 0], beta, None, cu_seqlens=cu, method=method)[0]
    A = -torch.linspace(0.5, 1.5, H, dtype=F64)  # Mamba2's SSD: x = v, dt = beta, B = q, C = k (N = K)
    return zeco_ssd(v, beta, A, q[:, :, :1], k[:, :, :1], None, None, cu_seqlens=cu, method=method)[0]


OPS = [("gla", "zeco"), ("gla", "lasp1"), ("gla", "lasp2"), ("gated_delta_rule", "zeco"),
       ("gated_delta_rule", "allgather"), ("ssd", "zeco")]


def _ops(rank, world, bad):
    cu = torch.tensor(CUT_INSIDE)
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    c = slice(max(0, C_START[tuple(CUT_INSIDE)] - sl.start), T_LOCAL)  # sequence C's tokens on this rank
    for name, method in OPS:
        outs, grads = [], []
        for b in (None, bad):
            ins = [t[:, sl].clone().requires_grad_() for t in _inputs(b, CUT_INSIDE, BAD_TOKEN)]
            o = _op(name, method, *ins, cu)
            w = torch.linspace(-1, 1, o[:, c].numel(), dtype=F64).reshape(o[:, c].shape)
            got = torch.autograd.grad((o[:, c] * w).sum(), ins, allow_unused=True)  # a loss on C alone
            outs.append(o[:, c].detach())
            grads.append([None if gr is None else gr[:, c] for gr in got])
        tag = f"{name} {method} rank {rank} bad={bad}"
        assert torch.isfinite(outs[0]).all(), tag
        assert torch.equal(outs[0], outs[1]), f"sequence C's outputs changed: {tag}"
        for i, (g0, g1) in enumerate(zip(*grads)):
            assert (g0 is None) == (g1 is None), tag
            if g0 is not None:
                assert torch.equal(g0, g1), f"sequence C's input {i} gradient changed: {tag}"
    return True


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_ops_keep_a_non_finite_sequence_to_itself(bad):
    assert run_distributed(_ops, 3, bad) == [True] * 3


def _layers(rank, world):
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    gen = torch.Generator().manual_seed(3)
    layers = {"GatedDeltaNet": GatedDeltaNet(hidden_size=16, expand_v=1, head_dim=4, num_heads=2, group=None),
              "Mamba2": Mamba2(hidden_size=16, num_heads=8, head_dim=4, state_size=4, n_groups=1, group=None)}
    for bad in (float("inf"), float("nan")):
        for cut, token in ((CUT_INSIDE, BAD_TOKEN), (CUT_AT_BOUNDARY, BAD_AT_BOUNDARY)):
            c = slice(max(0, C_START[tuple(cut)] - sl.start), T_LOCAL)
            x = torch.randn(1, cut[-1], 16, generator=gen, dtype=F64)
            for name, layer in layers.items():
                layer = layer.double()
                outs = [layer(_poisoned(x, token, b)[:, sl], cu_seqlens=torch.tensor(cut))[0][:, c].detach()
                        for b in (None, bad)]
                tag = f"{name} cut={cut} bad={bad} rank {rank}"
                assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), tag
            # the transformers hybrids' packed convolution (their mixers' conv1d and activation)
            ctx = SequenceContext(None, cu_seqlens=torch.tensor(cut))
            mixer = torch.nn.Module()
            mixer.conv1d = torch.nn.Conv1d(16, 16, 4, groups=16, padding=3, dtype=F64)
            mixer.activation = "silu"
            outs = [causal_conv(mixer, _poisoned(x, token, b)[:, sl], ctx)[:, c].detach() for b in (None, bad)]
            assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), f"hf conv cut={cut} bad={bad}"
    return True


def test_layers_keep_a_non_finite_sequence_to_itself():
    """The short convolution's halo and window (the token before C's start is B's non-finite one) and the scan."""
    assert run_distributed(_layers, 3) == [True] * 3
