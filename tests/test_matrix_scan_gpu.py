"""The matrix-transition All-Scan on GPUs through the C++/NCCL core (marked gpu; skipped without CUDA).

Every rank builds every rank's inputs from one seed (on the CPU, then copied), so each checks its
own result: against the float64 chain (fp32 within 1e-6 relative), against the torch.distributed
(gloo) path of the same inputs, and bitwise on exactly representable data (signed permutations scaled
by powers of two, small integers), where every path's arithmetic is exact. P = 2 runs on two GPUs;
P = 3 and 4 (which exercise the inner ranks: receive, combine, send on) need as many GPUs.
"""
import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan.ops import matrix_scan as _matrix_scan_module  # noqa: F401  (registers allscan::matrix_scan)
from allscan.ops._matrix_math import matrix_scan_reference
from distributed import run_distributed, skip_unless_gpus, skip_unless_nccl_ranks
from test_matrix_scan import _signed_permutations

pytestmark = pytest.mark.gpu

# (method, num_blocks): one block, fewer than the batch entries, auto, more than the entries (V
# columns split, staged packed), serial, all-gather.
METHODS = [("pipelined", 1), ("pipelined", 3), ("pipelined", None), ("pipelined", 40), ("serial", None),
           ("allgather", None)]
# (leading dims, K, V): the main case K = V = 128, K = 64, the largest K (256), odd sizes.
SHAPES = [((2, 4), 128, 128), ((3,), 64, 64), ((1,), 256, 96), ((2, 3), 5, 7)]
TOL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _need(n):
    skip_unless_nccl_ranks(n)


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _random(P, lead, K, V, dtype, m_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = lead + (K, V)
    xs = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(P)]
    ms = [(0.9 * torch.randn(lead + (K, K), generator=gen, dtype=torch.float64) / K ** 0.5).to(m_dtype)
          for _ in range(P)]
    init = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return xs, ms, init


def _rel(y, exact):
    return ((y.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def _vs_reference_and_gloo(rank, P):
    dev = _dev()
    gloo = dist.new_group(backend="gloo")
    n = 0
    for case, ((lead, K, V), dtype, reverse, inclusive, use_init) in enumerate(itertools.product(
            SHAPES, (torch.float32, torch.bfloat16, torch.float64), (False, True), (False, True), (False, True))):
        m_dtype = torch.float32 if case % 2 == 0 else dtype
        xs, ms, init = _random(P, lead, K, V, dtype, m_dtype, 1000 + case)
        i0 = init if use_init else None
        exact = matrix_scan_reference(xs, ms, i0, reverse=reverse, inclusive=inclusive, exact=True)
        head_zero = not inclusive and not use_init and rank == (P - 1 if reverse else 0)
        for method, k in METHODS:
            where = (f"P={P} rank={rank} {lead}x{K}x{V} {dtype} m={m_dtype} reverse={reverse} "
                     f"inclusive={inclusive} init={use_init} {method} K={k}")
            y = allscan.scan(xs[rank].to(dev), transition=ms[rank].to(dev), reverse=reverse, inclusive=inclusive,
                             init=None if i0 is None else i0.to(dev), num_blocks=k, method=method)
            assert y.is_cuda and y.dtype == dtype and y.shape == xs[rank].shape, where
            y = y.cpu()
            if head_zero:
                assert torch.equal(y, torch.zeros_like(y)), where
            else:
                err = _rel(y, exact[rank])
                assert err <= TOL[dtype], where + f": relative error {err} to the float64 chain"
            if dtype == torch.float32 and K == 128:
                # The same call on the gloo path (CPU) agrees to fp32 accuracy.
                yg = allscan.scan(xs[rank], transition=ms[rank], group=gloo, reverse=reverse, inclusive=inclusive,
                                  init=i0, num_blocks=k, method=method)
                if not head_zero:
                    assert _rel(y, yg.double()) <= TOL[dtype], where + " vs gloo"
            n += 1
    return n


@pytest.mark.parametrize("P", [2, 3, 4])
def test_nccl_against_float64_chain_and_gloo(P):
    _need(P)
    counts = run_distributed(_vs_reference_and_gloo, P, backend="nccl", timeout=900)
    assert counts[0] == len(SHAPES) * 3 * 8 * len(METHODS)


def _exact_data(rank, P):
    dev = _dev()
    gen = torch.Generator().manual_seed(7)
    for (lead, K, V), dtype, reverse, inclusive, use_init in itertools.product(
            SHAPES, (torch.float32, torch.bfloat16, torch.float16, torch.float64), (False, True), (False, True),
            (False, True)):
        shape = lead + (K, V)
        xs = [torch.randint(-4, 5, shape, generator=gen).to(dtype) for _ in range(P)]
        ms = [m.to(dtype) for m in _signed_permutations(P, lead + (K, K), gen)]
        init = torch.randint(-4, 5, shape, generator=gen).to(dtype) if use_init else None
        ref = matrix_scan_reference(xs, ms, init, reverse=reverse, inclusive=inclusive)
        for method, k in METHODS:
            y = allscan.scan(xs[rank].to(dev), transition=ms[rank].to(dev), reverse=reverse, inclusive=inclusive,
                             init=None if init is None else init.to(dev), num_blocks=k, method=method)
            assert torch.equal(y.cpu(), ref[rank]), (lead, K, V, dtype, reverse, inclusive, use_init, method, k)
        # An fp32 transition with a narrower state.
        if dtype != torch.float32:
            y = allscan.scan(xs[rank].to(dev), transition=ms[rank].float().to(dev), reverse=reverse,
                             inclusive=inclusive, init=None if init is None else init.to(dev))
            assert torch.equal(y.cpu(), ref[rank]), (lead, K, V, dtype, "fp32 transition")


@pytest.mark.parametrize("P", [2, 3, 4])
def test_nccl_exact_data_bitwise(P):
    _need(P)
    run_distributed(_exact_data, P, backend="nccl", timeout=900)


def _kernel_one_rank(rank, P):
    """P = 1 inclusive with init is one combine, M @ init + x (and M^T through the op's transpose
    flag, which the backward uses): fp32 within 1e-6 of float64 for every K up to 256, with the
    small (32 x 32) and the large (64 x 64, from 128 CTAs of those) output tiles."""
    dev = _dev()
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(3)
    for (lead, K, V), transpose in itertools.product(
            [((4,), 128, 128), ((40,), 128, 128), ((2,), 64, 64), ((1,), 256, 256), ((3,), 1, 1), ((2,), 70, 300),
             ((5,), 200, 3), ((64,), 200, 100)],
            (False, True)):
        x = torch.randn(lead + (K, V), generator=gen, dtype=torch.float64)
        m = torch.randn(lead + (K, K), generator=gen, dtype=torch.float64) / K ** 0.5
        y0 = torch.randn(lead + (K, V), generator=gen, dtype=torch.float64)
        exact = (m.transpose(-1, -2) if transpose else m) @ y0 + x
        out = torch.ops.allscan.matrix_scan(x.float().to(dev), m.float().to(dev), y0.float().to(dev), name, False,
                                            True, transpose, 0, "pipelined", chain_head=True)
        err = _rel(out.cpu(), exact)
        assert err <= 1e-6, (lead, K, V, transpose, err)


def test_combine_kernel_accuracy():
    _need(1)
    run_distributed(_kernel_one_rank, 1, backend="nccl", timeout=300)


def _graphs(rank, P):
    """Every method captured in a CUDA graph replays to the eager result (bitwise: same kernels)."""
    dev = _dev()
    xs, ms, init = _random(P, (2, 4), 128, 128, torch.float32, torch.float32, 5)
    x, m, i0 = xs[rank].to(dev), ms[rank].to(dev), init.to(dev)
    for (method, k), use_init, inclusive, reverse in itertools.product(METHODS, (False, True), (False, True),
                                                                       (False, True)):
        kw = dict(transition=m, init=i0 if use_init else None, inclusive=inclusive, reverse=reverse, method=method,
                  num_blocks=k)
        eager = allscan.scan(x, **kw)  # communicator, signature check, the head's zero buffer
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = allscan.scan(x, **kw)
        for trial in range(2):
            y_static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, eager), (method, k, use_init, inclusive, reverse, trial)


@pytest.mark.parametrize("P", [2, 3])
def test_graph_capture_replays_eager(P):
    _need(P)
    run_distributed(_graphs, P, backend="nccl", timeout=600)


def _grads_and_async(rank, P):
    dev = _dev()
    xs, ms, init = _random(P, (2, 3), 64, 32, torch.float32, torch.float32, 9)
    gen = torch.Generator().manual_seed(10)
    ws = [torch.randn(xs[0].shape, generator=gen) for _ in range(P)]
    for reverse, inclusive, (method, k) in itertools.product((False, True), (False, True), METHODS):
        rx = [t.to(torch.float64, copy=True).requires_grad_() for t in xs]
        rm = [t.to(torch.float64, copy=True).requires_grad_() for t in ms]
        ri = init.to(torch.float64, copy=True).requires_grad_()
        outs = matrix_scan_reference(rx, rm, ri, reverse=reverse, inclusive=inclusive, exact=True)
        sum((o * w.double()).sum() for o, w in zip(outs, ws)).backward()
        x = xs[rank].to(dev).requires_grad_()
        m = ms[rank].to(dev).requires_grad_()
        i0 = init.to(dev).requires_grad_()
        y = allscan.scan(x, transition=m, init=i0, reverse=reverse, inclusive=inclusive, method=method, num_blocks=k)
        (y * ws[rank].to(dev)).sum().backward()
        where = f"reverse={reverse} inclusive={inclusive} {method} K={k}"
        head = P - 1 if reverse else 0
        for got, want, what in ((x.grad, rx[rank].grad, "dx"), (m.grad, rm[rank].grad, "dM"),
                                (i0.grad, ri.grad if rank == head else torch.zeros_like(ri), "dinit")):
            if want is None:  # an input no output of the chain depends on (the tail's x when exclusive)
                want = torch.zeros(got.shape, dtype=torch.float64)
            assert _rel(got.cpu(), want) <= 1e-5 or want.norm() == 0 and got.abs().max() == 0, where + " " + what
    # async_op: the handle's result equals the synchronous one, and so do the gradients through it
    # (the side stream by handle, autograd without the dispatcher).
    x, m = xs[rank].to(dev), ms[rank].to(dev)
    h = allscan.scan(x, transition=m, async_op=True)
    assert torch.equal(h.wait(), allscan.scan(x, transition=m))
    # Also under a saved-tensor hook (activation offloading), which reads the saved output at once.
    for inclusive, offload in ((False, False), (True, False), (False, True)):
        got = {}
        for async_op in (False, True):
            x, m, i0 = (t.to(dev).requires_grad_() for t in (xs[rank], ms[rank], init))
            with torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext():
                out = allscan.scan(x, transition=m, init=i0, inclusive=inclusive, async_op=async_op)
                y = out.wait() if async_op else out
            (y * ws[rank].to(dev)).sum().backward()
            got[async_op] = (y.detach(), x.grad, m.grad, i0.grad)
        for a, b, what in zip(got[False], got[True], ("y", "dx", "dM", "dinit")):
            assert torch.equal(a, b), f"async vs sync, inclusive={inclusive}, offload={offload}: {what}"


@pytest.mark.parametrize("P", [1, 2, 3])
def test_gradients_and_async(P):
    _need(P)
    run_distributed(_grads_and_async, P, backend="nccl", timeout=600)


def _head_fill(rank, P):
    dev = _dev()
    n = 0
    # fp32 [entries, 128, 128]: 8 MiB (auto: the self copy), 8 MiB + 64 KiB and 32 MiB (auto: the
    # side kernel beside the send).
    for entries in (128, 129, 512):
        xs, ms, init = _random(P, (entries,), 128, 128, torch.float32, torch.float32, entries)
        xs, ms, init = [t.to(dev) for t in xs], [t.to(dev) for t in ms], init.to(dev)
        for use_init, inclusive in ((False, False), (True, False), (False, True)):
            i0 = init if use_init else None
            y = allscan.scan(xs[rank], transition=ms[rank], init=i0, inclusive=inclusive)
            where = f"entries={entries} init={use_init} inclusive={inclusive}"
            if rank == 0:  # the head's own result: x itself, init or zeros
                expect = xs[0] if inclusive else (init if use_init else torch.zeros_like(init))
                assert torch.equal(y, expect), where
            else:
                exact = matrix_scan_reference([t.double() for t in xs], [m.double() for m in ms],
                                              None if i0 is None else i0.double(), inclusive=inclusive, exact=True)
                assert _rel(y, exact[rank]) < 1e-6, where
            n += 1
    torch.cuda.synchronize()
    return n


# How the chain head writes its own result (ALLSCAN_HEAD_FILL, read when the communicator is made),
# the diagonal scan's rule (head_result.h): every mode gives the same result on both sides of 8 MiB.
@pytest.mark.parametrize("fill", ["auto", "self", "side", "series"])
def test_head_fill_modes(fill, monkeypatch):
    _need(2)
    monkeypatch.setenv("ALLSCAN_HEAD_FILL", fill)
    assert run_distributed(_head_fill, 2, backend="nccl", timeout=600) == [9, 9]


@pytest.mark.parametrize("extra", [[], ["-r1", "-K", "2,16", "-d", "bfloat16"], ["-G", "2", "-V", "64", "-d", "double"]],
                         ids=["default", "reverse-blocks-bf16", "graph-k64-fp64"])
def test_two_gpu_perf_matrix_run_is_exact(tmp_path, extra):
    """allscan_perf -o matrix on 2 GPUs: every row runs and #wrong is 0 (exact transitions)."""
    import json

    from test_perf_cli import BINARY, _run

    if BINARY is None:
        pytest.skip("allscan_perf is not built")
    skip_unless_gpus(2)  # one process drives both ranks: NCCL needs a GPU per rank
    out = tmp_path / "matrix.json"
    p = _run("-o", "matrix", "-b", "64K", "-e", "8M", "-f", "4", "-g", "2", "-n", "5", "-w", "2", "-N", "2", "-j",
             str(out), *extra, hide_gpus=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "# Out of bounds values : 0 OK" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["wrong_total"] == 0 and doc["op"] == "matrix"
    ops = {r["op"] for r in doc["rows"] if "skipped" not in r}
    assert ops == {"p2p-chain", "matrix-pipelined", "matrix-serial", "matrix-allgather"}, ops
    for r in doc["rows"]:
        if "skipped" in r:
            assert "whole number" in r["skipped"], r
            continue
        assert r["wrong"] == 0 and r["time_us"] > 0, r
