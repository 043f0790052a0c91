"""All-Scan on the torch.distributed path (gloo ranks on CPU) against the sequential references."""
import itertools

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan.reference import scan_reference
from distributed import run_distributed
from grad_check import check_grads

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
STATE = (2, 3, 5, 7)  # 210 elements: no block count divides it evenly
# Decay shapes: None (plain prefix sum), every prefix of the state's shape.
DECAYS = [None, (), (2,), (2, 3), (2, 3, 5), STATE]
# (method, num_blocks): auto, one, two, three blocks, the most (64: more are refused), serial, all-gather.
METHODS = [("pipelined", None), ("pipelined", 1), ("pipelined", 2), ("pipelined", 3), ("pipelined", 64),
           ("serial", None), ("allgather", None)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 5e-2, torch.float16: 5e-3}


def _inputs(P, dtype, decay, g_fp32, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(STATE, generator=gen, dtype=torch.float64).to(dtype) for _ in range(P)]
    gs = None
    if decay is not None:
        gdt = torch.float32 if g_fp32 else dtype
        gs = [(0.5 + 0.5 * torch.rand(decay, generator=gen, dtype=torch.float64)).to(gdt) for _ in range(P)]
    init = torch.randn(STATE, generator=gen, dtype=torch.float64).to(dtype)
    return xs, gs, init


def _matrix(rank, P, dtypes, decays):
    checked = 0
    for case, (dtype, decay, reverse, inclusive, use_init) in enumerate(itertools.product(
        dtypes, decays, (False, True), (False, True), (False, True)
    )):
        seed = 1000 + case  # the same on every rank (str hashes are salted per process)
        xs, gs, init = _inputs(P, dtype, decay, g_fp32=(seed % 2 == 0), seed=seed)
        init_ = init if use_init else None
        ref = scan_reference(xs, gs, init_, reverse=reverse, inclusive=inclusive)
        exact = scan_reference(xs, gs, init_, reverse=reverse, inclusive=inclusive, exact=True)
        for method, k in METHODS:
            y = allscan.scan(xs[rank], None if gs is None else gs[rank], reverse=reverse, inclusive=inclusive,
                             init=init_, num_blocks=k, method=method)
            where = (f"P={P} rank={rank} dtype={dtype} decay={decay} reverse={reverse} inclusive={inclusive} "
                     f"init={use_init} method={method} K={k}")
            assert y.dtype == dtype and y.shape == xs[rank].shape, where
            # Bitwise equal to the reference that uses the same operation.
            assert torch.equal(y, ref[rank]), where + f": max diff {(y.double() - ref[rank].double()).abs().max()}"
            # And close to the float64 ground truth.
            err = (y.double() - exact[rank]).norm() / exact[rank].norm().clamp_min(1e-30)
            assert err <= TOL[dtype] or exact[rank].norm() == 0, where + f": relative error {err}"
            checked += 1
    return checked


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_scan_matrix(P):
    counts = run_distributed(_matrix, P, DTYPES, DECAYS, timeout=900)
    assert counts[0] == len(DTYPES) * len(DECAYS) * 8 * len(METHODS)


def test_scan_matrix_8_ranks():
    counts = run_distributed(_matrix, 8, [torch.float32, torch.bfloat16], [None, (2, 3), STATE], timeout=900)
    assert counts[0] == 2 * 3 * 8 * len(METHODS)


def _sizes(rank, P):
    # Empty, one element, fewer elements than blocks, sizes around the block alignment.
    for n in (0, 1, 3, 4, 5, 17, 1023):
        gen = torch.Generator().manual_seed(n)
        xs = [torch.randn(n, generator=gen) for _ in range(P)]
        gs = [torch.rand((), generator=gen) for _ in range(P)]
        ref = scan_reference(xs, gs)
        for k in (1, 2, 7, 64):  # 64: the most (more are refused)
            y = allscan.scan(xs[rank], gs[rank], num_blocks=k)
            assert torch.equal(y, ref[rank]), (n, k)


def test_scan_sizes():
    run_distributed(_sizes, 3)


def _grads(rank, P, dtype):
    gen = torch.Generator().manual_seed(7)
    shape, gshape = (2, 3, 4), (2, 3)
    for reverse, inclusive, method in itertools.product((False, True), (False, True), ("pipelined", "allgather")):
        xs = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(P)]
        gs = [0.5 + 0.5 * torch.rand(gshape, generator=gen, dtype=dtype) for _ in range(P)]
        init = torch.randn(shape, generator=gen, dtype=dtype)
        ws = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(P)]
        check_grads(rank, P, xs, gs, init, ws, scan_reference,
                    lambda x, g, i0: allscan.scan(x, g, reverse=reverse, inclusive=inclusive, init=i0, method=method),
                    reverse=reverse, inclusive=inclusive, op_name="g",
                    where=f"rank={rank} reverse={reverse} inclusive={inclusive} method={method}")


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_scan_grads(P):
    run_distributed(_grads, P, torch.float64)


def test_scan_grads_fp32():
    run_distributed(_grads, 3, torch.float32)


class _Take(torch.autograd.Function):
    """x_all[rank] forward; backward all-gathers every rank's gradient of its own slice, so the
    composite below is the global function of every rank's inputs on every rank."""

    @staticmethod
    def forward(ctx, x_all):
        ctx.shape = x_all.shape
        return x_all[dist.get_rank()].clone()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        return torch.stack(parts)


class _Gather(torch.autograd.Function):
    """all-gather forward; backward keeps this rank's slice (gradcheck gives every rank the same
    output gradient, so no reduction is needed)."""

    @staticmethod
    def forward(ctx, y):
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, y.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[dist.get_rank()]


def _gradcheck(rank, P):
    gen = torch.Generator().manual_seed(3)
    shape = (2, 3)
    x_all = torch.randn((P,) + shape, generator=gen, dtype=torch.float64)
    g_all = 0.5 + 0.5 * torch.rand((P, 2), generator=gen, dtype=torch.float64)
    init = torch.randn(shape, generator=gen, dtype=torch.float64)
    for reverse, inclusive in itertools.product((False, True), (False, True)):
        def f(xa, ga, i0):
            y = allscan.scan(_Take.apply(xa), _Take.apply(ga), reverse=reverse, inclusive=inclusive, init=i0)
            return _Gather.apply(y)

        # init is only read on the chain head: its gradient is the head's alone, so check it there
        # by making it a per-rank input too.
        def f_init(i_all):
            y = allscan.scan(x_all[rank], g_all[rank], reverse=reverse, inclusive=inclusive, init=_Take.apply(i_all))
            return _Gather.apply(y)

        assert torch.autograd.gradcheck(
            f, (x_all.clone().requires_grad_(), g_all.clone().requires_grad_(), init), eps=1e-6, atol=1e-8)
        i_all = init.expand((P,) + shape).clone().requires_grad_()
        assert torch.autograd.gradcheck(f_init, (i_all,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("P", [1, 2, 3])
def test_gradcheck(P):
    run_distributed(_gradcheck, P, timeout=600)
