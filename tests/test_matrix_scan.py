"""The matrix-transition All-Scan on the torch.distributed path (gloo ranks on CPU): against a float64
chain for every method, direction, init and block count; gradients of x, M and init against autograd
through a float64 chain; the custom op; errors naming the argument; the block partition of both paths."""
import itertools

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan import _C
from allscan.ops import matrix_scan as _matrix_scan_module  # registers allscan::matrix_scan
from allscan.ops._matrix_dist import matrix_blocks
from allscan.ops._matrix_math import matrix_scan_reference
from distributed import run_distributed
from grad_check import check_compiled, check_grads

STATE = (2, 3, 5, 7)  # batch 6 (two leading dims), K = 5, V = 7
# (method, num_blocks): auto, one block, fewer blocks than batch entries (uneven), as many, more
# (V columns split), the most (64, the core's cap: more are refused; more than the 42 columns), serial, all-gather.
METHODS = [("pipelined", None), ("pipelined", 1), ("pipelined", 4), ("pipelined", 6), ("pipelined", 13),
           ("pipelined", 64), ("serial", None), ("allgather", None)]
TOL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _transition(shape, gen, dtype):
    """A random transition with norm about 0.9 (the chain neither explodes nor vanishes)."""
    K = shape[-1]
    return (0.9 * torch.randn(shape, generator=gen, dtype=torch.float64) / K ** 0.5).to(dtype)


def _inputs(P, dtype, m_dtype, seed, shape=STATE):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(P)]
    ms = [_transition(shape[:-1] + (shape[-2],), gen, m_dtype) for _ in range(P)]
    init = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return xs, ms, init


def _rel(y, exact):
    return ((y.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def _chain(rank, P, dtypes):
    checked = 0
    for case, (dtype, reverse, inclusive, use_init) in enumerate(
            itertools.product(dtypes, (False, True), (False, True), (False, True))):
        m_dtype = torch.float32 if case % 2 == 0 else dtype
        xs, ms, init = _inputs(P, dtype, m_dtype, 100 + case)
        i0 = init if use_init else None
        exact = matrix_scan_reference(xs, ms, i0, reverse=reverse, inclusive=inclusive, exact=True)
        for method, k in METHODS:
            y = allscan.scan(xs[rank], transition=ms[rank], reverse=reverse, inclusive=inclusive, init=i0,
                             num_blocks=k, method=method)
            where = (f"P={P} rank={rank} dtype={dtype} m_dtype={m_dtype} reverse={reverse} inclusive={inclusive} "
                     f"init={use_init} method={method} K={k}")
            assert y.dtype == dtype and y.shape == xs[rank].shape, where
            head_zero = not inclusive and not use_init and rank == (P - 1 if reverse else 0)
            if head_zero:
                assert torch.equal(y, torch.zeros_like(y)), where
            else:
                err = _rel(y, exact[rank])
                assert err <= TOL[dtype], where + f": relative error {err}"
            checked += 1
    return checked


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_chain(P):
    dtypes = [torch.float32, torch.float64, torch.bfloat16]
    counts = run_distributed(_chain, P, dtypes, timeout=900)
    assert counts[0] == len(dtypes) * 8 * len(METHODS)


def _signed_permutations(P, shape, gen):
    """Per rank, per batch entry: a signed permutation matrix scaled by a power of two (1/2, 1, 2), so
    M @ y has one exact product per row and every path's arithmetic is exact."""
    K = shape[-1]
    batch = 1
    for d in shape[:-2]:
        batch *= d
    out = []
    for _ in range(P):
        perm = torch.stack([torch.randperm(K, generator=gen) for _ in range(batch)])
        sign = torch.randint(0, 2, (batch, K), generator=gen) * 2 - 1
        scale = 2.0 ** torch.randint(-1, 2, (batch, 1), generator=gen)
        m = torch.zeros(batch, K, K, dtype=torch.float64)
        m.scatter_(2, perm.unsqueeze(-1), (sign * scale).double().unsqueeze(-1))
        out.append(m.reshape(shape))
    return out


def _exact(rank, P):
    """Exactly representable data: every method, both paths' block layouts, every dtype gives bitwise
    the rounded reference, and (in fp32/fp64) the exact float64 chain."""
    gen = torch.Generator().manual_seed(5)
    for dtype, reverse, inclusive, use_init in itertools.product(
            (torch.float32, torch.float64, torch.bfloat16, torch.float16), (False, True), (False, True), (False, True)):
        xs = [torch.randint(-4, 5, STATE, generator=gen).to(dtype) for _ in range(P)]
        ms = [m.to(dtype) for m in _signed_permutations(P, STATE[:-1] + (STATE[-2],), gen)]
        init = torch.randint(-4, 5, STATE, generator=gen).to(dtype) if use_init else None
        ref = matrix_scan_reference(xs, ms, init, reverse=reverse, inclusive=inclusive)
        exact = matrix_scan_reference(xs, ms, init, reverse=reverse, inclusive=inclusive, exact=True)
        for method, k in METHODS:
            y = allscan.scan(xs[rank], transition=ms[rank], reverse=reverse, inclusive=inclusive, init=init,
                             num_blocks=k, method=method)
            where = f"dtype={dtype} reverse={reverse} inclusive={inclusive} init={use_init} {method} K={k}"
            assert torch.equal(y, ref[rank]), where
            if dtype in (torch.float32, torch.float64):
                assert torch.equal(y.double(), exact[rank]), where


@pytest.mark.parametrize("P", [2, 3])
def test_exact_data(P):
    run_distributed(_exact, P, timeout=600)


def _grads(rank, P, dtype):
    gen = torch.Generator().manual_seed(11)
    shape = (2, 3, 4, 5)  # batch 6, K = 4, V = 5
    mshape = (2, 3, 4, 4)
    for reverse, inclusive, (method, k) in itertools.product(
            (False, True), (False, True), [("pipelined", None), ("pipelined", 10), ("serial", None),
                                           ("allgather", None)]):
        xs = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(P)]
        ms = [_transition(mshape, gen, dtype) for _ in range(P)]
        init = torch.randn(shape, generator=gen, dtype=dtype)
        ws = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(P)]
        check_grads(rank, P, xs, ms, init, ws, matrix_scan_reference,
                    lambda x, m, i0: allscan.scan(x, transition=m, reverse=reverse, inclusive=inclusive, init=i0,
                                                  method=method, num_blocks=k),
                    reverse=reverse, inclusive=inclusive, op_name="M",
                    where=f"rank={rank} reverse={reverse} inclusive={inclusive} method={method} K={k}")


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_grads(P):
    run_distributed(_grads, P, torch.float64, timeout=600)


def test_grads_fp32():
    run_distributed(_grads, 3, torch.float32, timeout=600)


def _gradcheck(rank, P):
    """torch.autograd.gradcheck of the distributed function of every rank's inputs (x, M, init)."""
    from test_scan import _Gather, _Take

    gen = torch.Generator().manual_seed(3)
    x_all = torch.randn((P, 2, 3, 2), generator=gen, dtype=torch.float64)
    m_all = torch.randn((P, 2, 3, 3), generator=gen, dtype=torch.float64) / 2
    i_all = torch.randn((P, 2, 3, 2), generator=gen, dtype=torch.float64)
    for reverse, inclusive in itertools.product((False, True), (False, True)):
        def f(xa, ma, ia):
            y = allscan.scan(_Take.apply(xa), transition=_Take.apply(ma), reverse=reverse, inclusive=inclusive,
                             init=_Take.apply(ia))
            return _Gather.apply(y)

        assert torch.autograd.gradcheck(f, (x_all.clone().requires_grad_(), m_all.clone().requires_grad_(),
                                            i_all.clone().requires_grad_()), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("P", [1, 3])
def test_gradcheck(P):
    run_distributed(_gradcheck, P, timeout=600)


# ------------------------------------------------------------------------------------------------
# The custom op, errors, the partition
# ------------------------------------------------------------------------------------------------
def test_opcheck_single_rank(single_rank):
    name = single_rank.group_name
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    m = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    init = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    for args in [(x, m, init, name, False, False, False, 0, "pipelined"),
                 (x, m, None, name, True, False, True, 2, "serial"),
                 (x, m, init, name, True, False, False, 0, "allgather")]:
        # one rank heads the chain both ways: its init is the one read
        torch.library.opcheck(torch.ops.allscan.matrix_scan.default, args, {"chain_head": args[2] is not None})


def test_async_handle_on_cpu(single_rank):
    x = torch.randn(2, 3, 4)
    m = torch.randn(2, 3, 3)
    init = torch.randn(2, 3, 4)
    h = allscan.scan(x, transition=m, init=init, inclusive=True, async_op=True)
    assert isinstance(h, allscan.ScanHandle) and h.is_completed()
    expect = matrix_scan_reference([x], [m], init, inclusive=True)[0]
    assert torch.equal(h.wait(), expect)


def test_destroy_communicators_forgets_both_scans_plans(single_rank):
    from allscan.ops import diagonal_scan as diagonal

    x, m = torch.randn(2, 3, 4), torch.randn(2, 3, 3)
    y0 = allscan.scan(x, transition=m, inclusive=True)
    allscan.scan(torch.randn(3))
    assert _matrix_scan_module.plans and diagonal.plans  # off NCCL a plan is kept too (and re-checked)
    allscan.destroy_communicators()
    assert not _matrix_scan_module.plans and not diagonal.plans
    assert torch.equal(allscan.scan(x, transition=m, inclusive=True), y0)


def _opcheck_and_compile(rank, P):
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(P)]
    ms = [torch.randn(2, 3, 3, generator=gen, dtype=torch.float64) / 2 for _ in range(P)]
    x = xs[rank].clone().requires_grad_()
    m = ms[rank].clone().requires_grad_()
    op, no_init = torch.ops.allscan.matrix_scan.default, {"chain_head": False}
    torch.library.opcheck(op, (x, m, None, name, False, False, False, 0, "pipelined"), no_init)
    torch.library.opcheck(op, (x, m, None, name, True, False, True, 0, "allgather"), no_init)

    def f(x, m):
        return allscan.scan(x * 2, transition=m, reverse=True, inclusive=True).sin()

    ref = matrix_scan_reference([2 * t for t in xs], ms, reverse=True, inclusive=True)[rank].sin()
    check_compiled(f, x, m, ref, 1e-12)


def test_opcheck_and_compile_two_ranks():
    run_distributed(_opcheck_and_compile, 2, timeout=600)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(transition=torch.zeros(2, 4, 4)), ValueError, ["transition", "K mismatch"]),
    (dict(transition=torch.zeros(3, 3, 3)), ValueError, ["transition", "leading dims"]),
    (dict(transition=torch.zeros(2, 3, 3, dtype=torch.float64)), TypeError, ["transition", "float32"]),
    (dict(transition=torch.zeros(3, 3)), ValueError, ["transition", "leading dims"]),
    (dict(transition=[[1.0]]), TypeError, ["transition", "torch.Tensor"]),
    (dict(transition=torch.zeros(2, 3, 3), init=torch.zeros(2, 3)), ValueError, ["init", "shape"]),
    (dict(transition=torch.zeros(2, 3, 3), method="ring"), ValueError, ["method"]),
    (dict(transition=torch.zeros(2, 3, 3), num_blocks=0), ValueError, ["num_blocks"]),
    (dict(transition=torch.zeros(2, 3, 3), gamma=torch.ones(2)), ValueError, ["gamma", "transition"]),
])
def test_errors_name_the_argument(single_rank, kwargs, exc, words):
    kwargs = dict(kwargs)
    gamma = kwargs.pop("gamma", None)
    with pytest.raises(exc) as info:
        allscan.scan(torch.zeros(2, 3, 5), gamma, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_errors_scalar_state(single_rank):
    with pytest.raises(ValueError, match="tensor must be"):
        allscan.scan(torch.zeros(5), transition=torch.zeros(5, 5))
    with pytest.raises(TypeError, match="tensor must be float32"):
        allscan.scan(torch.zeros(2, 3, 5, dtype=torch.int32), transition=torch.zeros(2, 3, 3))


def _k_mismatch(rank, P):
    K = 4 + rank % 2  # ranks disagree on K
    try:
        allscan.scan(torch.zeros(2, K, 6), transition=torch.zeros(2, K, K))
    except ValueError as e:
        assert "K (tensor.shape[-2])" in str(e), str(e)
        return True
    return False


def test_k_mismatch_raises_on_every_rank():
    assert run_distributed(_k_mismatch, 3) == [True] * 3


def test_partition_matches_core():
    for batch, k, v, nb in itertools.product((1, 2, 5, 16), (1, 3, 128), (1, 7, 128), (1, 2, 3, 5, 16, 17, 64)):
        blocks = matrix_blocks(batch, k, v, nb)
        n, cols = _C.matrix_blocks(batch, k, v, nb)
        assert len(blocks) == n, (batch, k, v, nb)
        assert all(vc <= cols for _, _, _, vc in blocks) and blocks[0][3] == cols, (batch, k, v, nb)
        # Every (entry, column) is in exactly one block.
        seen = torch.zeros(batch, v, dtype=torch.int64)
        for b0, nbat, c0, vc in blocks:
            seen[b0:b0 + nbat, c0:c0 + vc] += 1
        assert torch.equal(seen, torch.ones_like(seen)), (batch, k, v, nb)
        # Whole batch entries (contiguous) whenever there are enough of them.
        if nb <= batch:
            assert cols == v and len(blocks) <= nb, (batch, k, v, nb)


def test_core_checks_name_the_argument():
    c = _C.comm_create_detached(1, 3)
    try:
        assert _C.matrix_workspace_size(c, 2, 4, 8, _C.FLOAT32, _C.FLOAT32, False, False, False, False, 0, 0) > 0
        with pytest.raises(ValueError, match="m_dtype"):
            _C.matrix_workspace_size(c, 2, 4, 8, _C.FLOAT32, _C.FLOAT16, False, False, False, False, 0, 0)
        with pytest.raises(ValueError, match="method"):
            _C.matrix_workspace_size(c, 2, 4, 8, _C.FLOAT32, _C.FLOAT32, False, False, False, False, 0, 7)
        with pytest.raises(ValueError, match="num_blocks"):
            _C.matrix_workspace_size(c, 2, 4, 8, _C.FLOAT32, _C.FLOAT32, False, False, False, False, -1, 0)
        with pytest.raises(ValueError, match="dtype"):
            _C.matrix_workspace_size(c, 2, 4, 8, 9, _C.FLOAT32, False, False, False, False, 0, 0)
        with pytest.raises(ValueError, match="overflows"):
            _C.matrix_workspace_size(c, 1 << 40, 1 << 20, 1 << 20, _C.FLOAT32, _C.FLOAT32, False, False, False, False,
                                     0, 0)
        with pytest.raises(ValueError, match="num_blocks"):
            _C.matrix_blocks(2, 3, 4, 0)
    finally:
        _C.comm_destroy(c)


# ------------------------------------------------------------------------------------------------
# allscan_perf -o matrix: argument errors, parsed before any CUDA call
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["-o", "matrix", "-V", "0"], "-V (vdim)"),
    (["-o", "matrix", "-K", "65"], "-K (blocks)"),
    (["-o", "matrix", "-m", "ring"], "-m (methods)"),
    (["-o", "matrix", "-L", "1,x"], "-L (link_model)"),
    (["-o", "matrix", "-H", "4"], "-H is an option of -o a2a, not of -o matrix"),
])
def test_perf_matrix_argument_errors(args, words):
    from test_perf_cli import BINARY, _run

    if BINARY is None:
        pytest.skip("allscan_perf is not built")
    p = _run(*args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert words in p.stderr, p.stderr
    help_text = _run("-h").stdout
    assert "-o matrix:" in help_text and "--vdim" in help_text


def test_core_workspace_by_role():
    """What each rank of a 3-rank chain stages (a [2, 4, 8] fp32 state is 256 bytes, one aligned
    buffer): the head only a packed or init-combined send, an inner rank what it sends (exclusive)
    or receives (inclusive), both when blocks are packed; the exclusive tail nothing unless packed."""
    F32, PIPE, AG = _C.FLOAT32, _C.PIPELINED, _C.ALLGATHER
    cases = [  # (rank, reverse, init, inclusive, num_blocks, method) -> bytes
        ((0, False, False, False, 1, PIPE), 0), ((0, False, True, False, 1, PIPE), 256),
        ((0, False, True, True, 1, PIPE), 0), ((0, False, False, False, 5, PIPE), 256),
        ((1, False, False, False, 1, PIPE), 256), ((1, False, False, True, 1, PIPE), 256),
        ((1, False, False, False, 5, PIPE), 512), ((1, False, False, True, 5, PIPE), 512),
        ((2, False, False, False, 1, PIPE), 0), ((2, False, False, True, 1, PIPE), 256),
        ((2, False, False, False, 5, PIPE), 256), ((0, True, False, False, 1, PIPE), 0),
        ((2, True, True, False, 1, PIPE), 256),
        ((1, False, False, False, 0, AG), 768 + 512 + 256), ((1, False, True, False, 0, AG), 768 + 512 + 256 + 256),
    ]
    for (rank, reverse, init, inclusive, nb, method), want in cases:
        c = _C.comm_create_detached(rank, 3)
        try:
            got = _C.matrix_workspace_size(c, 2, 4, 8, F32, F32, False, init, reverse, inclusive, nb, method)
        finally:
            _C.comm_destroy(c)
        assert got == want, (rank, reverse, init, inclusive, nb, method, got, want)
