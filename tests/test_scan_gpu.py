"""All-Scan on GPUs through the C++/NCCL core (marked gpu; skipped without CUDA).

Every rank generates every rank's inputs from one seed, so each can check its own result against
the sequential reference (bitwise: the reference does the same fp32 multiply and add).
"""
import itertools
import time

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan.reference import scan_reference
from distributed import run_distributed, skip_unless_gpus, skip_unless_nccl_ranks

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
STATE = (2, 4, 16, 33)  # 4224 elements, odd trailing dimension
DECAYS = [None, (), (2,), (2, 4), (2, 4, 16), STATE]
METHODS = [("pipelined", 1), ("pipelined", 2), ("pipelined", 8), ("pipelined", None), ("serial", None),
           ("allgather", None)]


def _need(n):
    """Skip unless n NCCL ranks can run (on fewer GPUs with ALLSCAN_TEST_RANKS_PER_GPU: tests/distributed.py)."""
    skip_unless_nccl_ranks(n)


def _inputs(P, dtype, decay, seed, device, shape=STATE, g_fp32=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(P)]
    gs = None
    if decay is not None:
        gdt = torch.float32 if g_fp32 else dtype
        gs = [(0.5 + 0.5 * torch.rand(decay, generator=gen, device=device)).to(gdt) for _ in range(P)]
    init = torch.randn(shape, generator=gen, device=device).to(dtype)
    return xs, gs, init


def _matrix(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 0
    for case, (dtype, decay, reverse, inclusive, use_init) in enumerate(
        itertools.product(DTYPES, DECAYS, (False, True), (False, True), (False, True))
    ):
        xs, gs, init = _inputs(P, dtype, decay, 100 + case, dev, g_fp32=case % 2 == 0)
        i0 = init if use_init else None
        ref = scan_reference([x.cpu() for x in xs], None if gs is None else [g.cpu() for g in gs],
                             None if i0 is None else i0.cpu(), reverse=reverse, inclusive=inclusive)
        for method, k in METHODS:
            y = allscan.scan(xs[rank], None if gs is None else gs[rank], reverse=reverse, inclusive=inclusive,
                             init=i0, num_blocks=k, method=method)
            assert y.is_cuda and y.dtype == dtype
            assert torch.equal(y.cpu(), ref[rank]), (dtype, decay, reverse, inclusive, use_init, method, k)
            n += 1
    # The NCCL path against the torch.distributed (gloo) path of the same inputs.
    gloo = dist.new_group(backend="gloo")
    xs, gs, init = _inputs(P, torch.float32, (2, 4), 7, dev)
    a = allscan.scan(xs[rank], gs[rank], init=init)
    b = allscan.scan(xs[rank].cpu(), gs[rank].cpu(), group=gloo, init=init.cpu())
    assert torch.equal(a.cpu(), b)
    return n


# How the chain head writes its own result (ALLSCAN_HEAD_FILL, read when the communicator is made):
# "auto" (default) is an NCCL self send/recv in the chain's group call up to 8 MiB (every state
# here), else a kernel beside the send on a side stream ("side"); "series" writes it after the send
# on the caller's stream (also taken for unaligned buffers).
FILLS = [(1, "auto"), (2, "auto"), (2, "side"), (2, "series")]  # P = 1: no chain, no head fill


@pytest.fixture
def fill_mode(request, monkeypatch):
    if request.param != "auto":
        monkeypatch.setenv("ALLSCAN_HEAD_FILL", request.param)
    return request.param


@pytest.mark.parametrize("P,fill_mode", FILLS, indirect=["fill_mode"])
def test_nccl_matrix(P, fill_mode):
    _need(P)
    counts = run_distributed(_matrix, P, backend="nccl", timeout=600)
    assert counts[0] == len(DTYPES) * len(DECAYS) * 8 * len(METHODS)


def _sizes(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    # 8 MiB is the largest state the head's self copy takes by default; 8 MiB + 256 B the smallest
    # that goes to the side kernel.
    for nbytes in (4 << 10, 64 << 10, 1 << 20, 2 << 20, 8 << 20, (8 << 20) + 256, 16 << 20, 256 << 20):
        n = nbytes // 4
        gen = torch.Generator(device=dev).manual_seed(nbytes)
        xs = [torch.randn(n, generator=gen, device=dev) for _ in range(P)]
        gs = [0.5 + 0.5 * torch.rand((), generator=gen, device=dev) for _ in range(P)]
        # Reference on the GPU with the library's arithmetic (reference.combine runs on any device).
        ref = scan_reference(xs, gs)
        for k in (1, 2, 8, None):
            y = allscan.scan(xs[rank], gs[rank], num_blocks=k)
            assert torch.equal(y, ref[rank]), (nbytes, k)
        yb = allscan.scan(xs[rank].bfloat16(), gs[rank])
        refb = scan_reference([x.bfloat16() for x in xs], gs)
        assert torch.equal(yb, refb[rank]), ("bf16", nbytes)


def test_nccl_sizes_4k_to_256m():
    # Default head fill: the self copy up to 8 MiB, the side kernel above (both sides covered).
    _need(2)
    run_distributed(_sizes, 2, backend="nccl", timeout=600)


def _capture_before_zeros(rank, P):
    from allscan import _C, _comm
    from allscan._dtypes import DTYPE_CODES

    dev = torch.device("cuda", torch.cuda.current_device())
    # A fresh group: its communicator has no zero buffer yet. The inclusive scan needs none at the
    # head (it copies x), so priming with it leaves the buffer unallocated.
    group = dist.new_group(backend="nccl")
    n = 1 << 18  # 1 MiB fp32: the self-copy path when not capturing
    xs = [torch.randn(n, generator=torch.Generator(device=dev).manual_seed(q), device=dev) for q in range(P)]
    ref = scan_reference(xs, None)
    assert torch.equal(allscan.scan(xs[rank], group=group, inclusive=True), scan_reference(xs, None, inclusive=True)[rank])
    comm = _comm.get_communicator(group, dev)
    assert _C.workspace_size(comm.handle, n, 0, 0, 0, 0, 0, False, False, 0, 0) == 0

    def raw_scan(x, y):  # the exclusive scan, straight into the core (no signature check)
        _C.scan(comm.handle, x.data_ptr(), y.data_ptr(), n, DTYPE_CODES[x.dtype], 0, 0, 0, 0, False, False, 0, 0,
                0, 0, torch.cuda.current_stream(dev).cuda_stream, 0)

    # Captured before the buffer exists: the head cannot allocate under capture and writes its
    # zeros with the side kernel instead.
    x_static = xs[rank].clone()
    y_static = torch.full_like(x_static, float("nan"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        raw_scan(x_static, y_static)
    for trial in range(2):
        y_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, ref[rank]), trial
    # Eagerly the head allocates it; a graph captured afterwards uses the self copy.
    y = torch.full_like(x_static, float("nan"))
    raw_scan(x_static, y)
    torch.cuda.synchronize()
    assert torch.equal(y, ref[rank])
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        raw_scan(x_static, y_static)
    y_static.fill_(float("nan"))
    graph2.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_static, ref[rank])


def test_capture_before_zero_buffer():
    _need(2)
    run_distributed(_capture_before_zeros, 2, backend="nccl", timeout=300)


def _zero_buffer_growth(rank, P):
    # ALLSCAN_HEAD_FILL=self: the self copy at every size, so a 16 MiB state replaces the head's
    # 8 MiB zero buffer; a graph captured before keeps reading the old one, which must still be
    # there, and zero.
    dev = torch.device("cuda", torch.cuda.current_device())
    small, large = (1 << 20) // 4, (16 << 20) // 4
    gen = torch.Generator(device=dev).manual_seed(3)
    xs = [torch.randn(small, generator=gen, device=dev) for _ in range(P)]
    xl = [torch.randn(large, generator=gen, device=dev) for _ in range(P)]
    x_static = xs[rank].clone()
    assert torch.equal(allscan.scan(x_static), scan_reference(xs, None)[rank])  # allocates 8 MiB
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = allscan.scan(x_static)
    assert torch.equal(allscan.scan(xl[rank]), scan_reference(xl, None)[rank])  # grows to 16 MiB
    junk = torch.full((large,), 7.0, device=dev)  # memory handed out after the growth
    for trial in range(2):
        y_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_static, scan_reference(xs, None)[rank]), trial
    del junk


def test_zero_buffer_growth_keeps_captured_graphs_valid(monkeypatch):
    _need(2)
    monkeypatch.setenv("ALLSCAN_HEAD_FILL", "self")
    run_distributed(_zero_buffer_growth, 2, backend="nccl", timeout=300)


def _streams_graphs_grads(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, gs, init = _inputs(P, torch.float32, (2, 4), 11, dev)
    ref = scan_reference(xs, gs)
    # A non-default stream.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = allscan.scan(xs[rank], gs[rank], num_blocks=2)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y, ref[rank])

    # CUDA graph capture and replay (called once eagerly first: communicator and signature check).
    x_static = xs[rank].clone()
    g_static = gs[rank].clone()
    for k in (1, 2):
        allscan.scan(x_static, g_static, num_blocks=k)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = allscan.scan(x_static, g_static, num_blocks=k)
        for trial in range(3):
            xs2, gs2, _ = _inputs(P, torch.float32, (2, 4), 50 + trial, dev)
            x_static.copy_(xs2[rank])
            g_static.copy_(gs2[rank])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, scan_reference(xs2, gs2)[rank]), (k, trial)

    # Autograd on the NCCL path equals the gloo path's.
    gloo = dist.new_group(backend="gloo")
    w = torch.randn(STATE, generator=torch.Generator().manual_seed(5)).to(dev)
    grads = []
    for group, device in ((None, dev), (gloo, torch.device("cpu"))):
        x = xs[rank].detach().to(device).requires_grad_()
        g = gs[rank].detach().to(device).requires_grad_()
        i0 = init.detach().to(device).requires_grad_()
        out = allscan.scan(x, g, group, init=i0, inclusive=True)
        (out * w.to(device)).sum().backward()
        grads.append([t.grad.cpu() for t in (x, g, i0)])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    # A tensor on another GPU than the group's communicator.
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
        with pytest.raises(ValueError, match=f"allscan: the tensor is on {other}, but "):
            allscan.scan(xs[rank].to(other))


@pytest.mark.parametrize("P,fill_mode", FILLS, indirect=["fill_mode"])
def test_streams_graphs_grads(P, fill_mode):
    _need(P)
    run_distributed(_streams_graphs_grads, P, backend="nccl", timeout=600)


def _async_overlap(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    n = (256 << 20) // 4
    gen = torch.Generator(device=dev).manual_seed(1)
    xs = [torch.randn(n, generator=gen, device=dev) for _ in range(P)]
    gs = [torch.rand((), generator=gen, device=dev) for _ in range(P)]
    ref = scan_reference(xs, gs)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    u = torch.randn(n, device=dev)
    w = torch.empty_like(u)

    def timed(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    def scan_only():
        allscan.scan(xs[rank], gs[rank])

    def gemm():  # one cuBLAS GEMM: a persistent kernel on Hopper, one CTA per SM to the end
        a @ a

    def stream():  # ten elementwise kernels of 256 MiB each: many CTAs, SMs free up all the time
        for _ in range(5):
            torch.mul(u, 1.0001, out=w)
            torch.mul(w, 0.9999, out=u)

    def with_scan(work):
        def both():
            h = allscan.scan(xs[rank], gs[rank], async_op=True)
            work()
            return h.wait()
        return both

    y = with_scan(stream)()
    torch.cuda.synchronize()
    assert torch.equal(y, ref[rank])
    return {"scan": timed(scan_only), "gemm": timed(gemm), "scan+gemm": timed(with_scan(gemm)),
            "stream": timed(stream), "scan+stream": timed(with_scan(stream))}


def _async_handles(rank, P):
    """The async path's memory and handle rules: inputs freed right after the call and their memory
    not handed out again while the scan may read them, results waited for on another stream (the
    calling stream then not ordered after the scan), handles dropped unwaited (their events recycled,
    their tensors and result kept from reuse), waited twice, polled. Inclusive scans, so that every
    rank's result reads its own x (also at P = 1)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(5)
    n = (16 << 20) // 4
    xs = [torch.randn(n, generator=gen, device=dev) for _ in range(P)]
    gs = [torch.rand(4, generator=gen, device=dev) for _ in range(P)]
    ref = scan_reference([x.view(4, -1) for x in xs], gs, inclusive=True)

    def busy():  # the side stream waits for this (tens of ms) before it reads x: far longer than the host's steps
        torch.cuda._sleep(100_000_000)

    # The first call of a signature checks it across ranks, which synchronises the host with the
    # GPU: made here, so that no call in the loop waits for the GPU it is queued behind.
    allscan.scan(xs[rank].view(4, -1), gs[rank], inclusive=True, async_op=True).wait()
    # made before the loop: the first stream a process makes can block the host until the GPU is idle
    # (then the scan is done and its inputs' memory free to reuse, as seen on the H200)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    probed = 0
    for it in range(20):
        x = xs[rank].clone().view(4, -1)
        g = gs[rank].clone()
        busy()
        h = allscan.scan(x, g, inclusive=True, async_op=True)
        assert not h.is_completed(), f"iteration {it}"  # it waits behind the sleep on the side stream
        x_ptr = x.data_ptr()
        del x, g  # freed while the scan may still read them ...
        junk = [torch.full((n,), 7.0, device=dev) for _ in range(3)]  # ... and memory handed out again
        assert all(j.data_ptr() != x_ptr for j in junk), f"iteration {it}: x's memory reused before the scan read it"
        if it % 3 == 0:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                y = h.wait()
                y2 = y.clone()
            # the calling stream is not ordered after the scan: while it runs, x's memory is still not
            # that stream's to reuse
            if not h.is_completed():
                probe = torch.empty(n, device=dev)
                assert probe.data_ptr() != x_ptr, f"iteration {it}: x's memory reused after a wait on another stream"
                del probe
                probed += 1
            torch.cuda.current_stream().wait_stream(s)
        else:
            y = h.wait()
            y2 = y.clone()
        assert h.wait() is y  # a second wait is harmless
        torch.cuda.synchronize()
        assert h.is_completed()
        torch.testing.assert_close(y2, ref[rank], rtol=1e-6, atol=1e-6, msg=lambda m: f"iteration {it}: {m}")
        del junk
        x = xs[rank].clone().view(4, -1)
        busy()
        dropped = allscan.scan(x, gs[rank], inclusive=True, async_op=True)  # never waited for
        x_ptr, y_ptr = x.data_ptr(), dropped._result.data_ptr()
        del dropped, x
        again = [torch.empty(n, device=dev) for _ in range(2)]
        assert not {a.data_ptr() for a in again} & {x_ptr, y_ptr}, \
            f"iteration {it}: a dropped handle's input or result reused before the scan was done"
        del again
    torch.cuda.synchronize()
    assert probed >= 4, f"the scan was done before the probe in {7 - probed} of 7 waits on another stream"
    return True


def test_async_handles_and_memory():
    P = min(2, torch.cuda.device_count())
    _need(1)
    assert run_distributed(_async_handles, P, backend="nccl", timeout=300) == [True] * P


@pytest.fixture(scope="module")
def async_times():
    skip_unless_gpus(2)  # it times the overlap: ranks sharing a GPU would not tell
    # Also asserts, inside each rank, that the async result equals the reference.
    return run_distributed(_async_overlap, 2, backend="nccl", timeout=300)


def test_async_result(async_times):
    assert len(async_times) == 2
    for rank, t in enumerate(async_times):  # shown by pytest -rP (scripts/gpu_suite.sh)
        print(f"rank {rank}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items()))


def test_async_overlaps_computation(async_times):
    """The scan on its high-priority side stream runs beside the caller's kernels: here ten
    elementwise kernels (each many CTAs, so SMs free up as CTAs finish and the scheduler starts the
    scan's CTAs first). Not asserted, only reported: beside one 8192^3 bf16 GEMM, which cuBLAS runs
    as a persistent kernel holding every SM until it ends (measured on 2 H200s: scan 0.76 ms, GEMM
    1.40 ms, both 2.44 ms, also with torch's experimental SM carve-out for matmuls)."""
    for t in async_times:
        # Overlapped: clearly less than running one after the other.
        assert t["scan+stream"] < 0.9 * (t["scan"] + t["stream"]), t


def _eager_fast_path(rank, P):
    import importlib

    S = importlib.import_module("allscan.ops.scan")  # the module (allscan.ops.scan is also the function)
    F = importlib.import_module("allscan.ops._scan_fast")

    dev = torch.device("cuda", torch.cuda.current_device())
    xs, gs, init = _inputs(P, torch.float32, (2, 4), 21, dev)
    ref = scan_reference(xs, gs, init)
    F.eager_calls.clear()
    assert torch.equal(allscan.scan(xs[rank], gs[rank], init=init), ref[rank])  # the full path fills the cache
    assert len(F.eager_calls) == 1
    full = S.full_path
    S.full_path = None  # the fast path must not need the full path: calling it would raise
    try:
        for _ in range(3):  # the fast path: straight to the core
            assert torch.equal(allscan.scan(xs[rank], gs[rank], init=init), ref[rank])
    finally:
        S.full_path = full
    assert len(F.eager_calls) == 1
    # Calls the fast path must leave to the full path, each still right:
    # a gradient to take (through the op),
    xr = xs[rank].clone().requires_grad_(True)
    y = allscan.scan(xr, gs[rank], init=init)
    assert torch.equal(y.detach(), ref[rank]) and y.grad_fn is not None
    # non-contiguous tensors of the cached shape (the full path makes them contiguous),
    xt = xs[rank].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not xt.is_contiguous() and torch.equal(allscan.scan(xt, gs[rank], init=init), ref[rank])
    # a bad argument of a cached shape is still named (the fast path keys on what the checks check),
    with pytest.raises(ValueError, match="method must be one of"):
        allscan.scan(xs[rank], gs[rank], init=init, method="nosuch")
    # and every-call checks: the fast path is never taken
    allscan.set_check_every_call(True)
    try:
        assert torch.equal(allscan.scan(xs[rank], gs[rank], init=init), ref[rank])
    finally:
        allscan.set_check_every_call(False)
    # a CUDA tensor on a gloo group never uses an NCCL plan, so never the fast path
    if P > 1:
        gloo = dist.new_group(backend="gloo")
        n = len(F.eager_calls)
        assert torch.equal(allscan.scan(xs[rank], gs[rank], gloo, init=init), ref[rank])
        assert len(F.eager_calls) == n
    # async calls (the side stream by handle) and matrix transitions (sync and async) take it too: the
    # delta layers' scans
    from allscan.ops._matrix_math import matrix_scan_reference

    gen = torch.Generator().manual_seed(23)
    mxs = [torch.randn(2, 3, 16, 8, generator=gen) for _ in range(P)]
    mms = [torch.randn(2, 3, 16, 16, generator=gen) / 4 for _ in range(P)]
    m_init = torch.randn(2, 3, 16, 8, generator=gen)
    calls = {
        "async": (lambda: allscan.scan(xs[rank], gs[rank], init=init, async_op=True).wait(), ref[rank]),
        "matrix": (lambda: allscan.scan(mxs[rank].to(dev), transition=mms[rank].to(dev), init=m_init.to(dev),
                                        reverse=True), None),
        "matrix async": (lambda: allscan.scan(mxs[rank].to(dev), transition=mms[rank].to(dev), init=m_init.to(dev),
                                              reverse=True, async_op=True).wait(), None),
    }
    m_ref = matrix_scan_reference(mxs, mms, m_init, reverse=True)[rank].to(dev)
    for what, (call, want) in calls.items():
        n = len(F.eager_calls)
        first = call()  # the full path fills the cache
        assert len(F.eager_calls) == n + 1, what
        S.full_path = None
        try:
            again = [call() for _ in range(3)]
        finally:
            S.full_path = full
        if want is None:
            assert (first - m_ref).abs().max().item() <= 1e-5 * m_ref.abs().max().item(), what
            want = first
        assert all(torch.equal(a, want) for a in again), what + ": the fast path differs from the full path"
    # a matrix call that needs a gradient still takes the full path (autograd through the scan)
    mx = mxs[rank].to(dev).requires_grad_(True)
    y = allscan.scan(mx, transition=mms[rank].to(dev), init=m_init.to(dev), reverse=True)
    assert y.grad_fn is not None and torch.equal(y.detach(), calls["matrix"][0]())


def test_eager_fast_path():
    P = min(2, torch.cuda.device_count())
    _need(1)
    run_distributed(_eager_fast_path, P, backend="nccl", timeout=300)


def _async_grads(rank, P):
    """async_op with gradients: the result and the gradients of x, gamma and init through the handle
    (the side stream by handle, autograd without the dispatcher) equal the synchronous call's."""
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, gs, init = _inputs(P, torch.float32, (2, 4), 21, dev)
    w = torch.randn(STATE, generator=torch.Generator(device=dev).manual_seed(22 + rank), device=dev)
    for inclusive in (False, True):
        got = {}
        for async_op in (False, True):
            x, g, i0 = (t.clone().requires_grad_() for t in (xs[rank], gs[rank], init))
            out = allscan.scan(x, g, init=i0, inclusive=inclusive, async_op=async_op)
            y = out.wait() if async_op else out
            (y * w).sum().backward()
            got[async_op] = (y.detach(), x.grad, g.grad, i0.grad)
        for a, b, what in zip(got[False], got[True], ("y", "dx", "dgamma", "dinit")):
            assert torch.equal(a, b), f"rank {rank}, inclusive={inclusive}: async {what} differs from sync"
    return True


@pytest.mark.parametrize("P", [1, 2])
def test_async_gradients_equal_sync(P):
    _need(P)
    assert run_distributed(_async_grads, P, backend="nccl", timeout=300) == [True] * P
