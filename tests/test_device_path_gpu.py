"""The device-initiated All-Scan (``method="device"``: one kernel per rank storing into the next rank's
NCCL window over NVLink) on 2 GPUs: bitwise equal to the exact chain for every dtype, decay shape,
direction, exclusive/inclusive and init; many calls in a row (the flags and acknowledgements are
reused), a state larger than the first window (it grows), CUDA graph capture and replay, gradients,
and the fallback to the NCCL path (NCCL_P2P_DISABLE=1, NCCL without windows, ALLSCAN_DEVICE_PATH=off).
The kernel alone on P = 2..4 simulated ranks of one GPU: the last test. Marked gpu; skipped without
the GPUs each needs."""
import itertools

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan.reference import scan_reference
from distributed import run_distributed, skip_unless_gpus
from test_scan_gpu import DTYPES, STATE, _inputs  # the GPU scan tests' dtypes, state, inputs

pytestmark = pytest.mark.gpu

DECAYS = [None, (), (2, 4), STATE]


def _exact(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 0
    for case, (dtype, decay, reverse, inclusive, use_init) in enumerate(
            itertools.product(DTYPES, DECAYS, (False, True), (False, True), (False, True))):
        xs, gs, init = _inputs(P, dtype, decay, 300 + case, dev)
        i0 = init if use_init else None
        ref = scan_reference(xs, gs, i0, reverse=reverse, inclusive=inclusive)
        for ctas in (None, 1, 3):
            y = allscan.scan(xs[rank], None if gs is None else gs[rank], reverse=reverse, inclusive=inclusive,
                             init=i0, num_blocks=ctas, method="device")
            assert torch.equal(y, ref[rank]), (dtype, decay, reverse, inclusive, use_init, ctas)
            n += 1
    assert allscan.device_path() == "device", allscan.device_path()
    # Many calls in a row, both directions interleaved, results checked every time: the flags,
    # acknowledgements and per-CTA call counters are reused without a reset.
    xs, gs, _ = _inputs(P, torch.float32, (2, 4), 9, dev)
    for it in range(200):
        reverse = it % 3 == 0
        x = xs[rank] * (it + 1)
        y = allscan.scan(x, gs[rank], reverse=reverse, method="device")
        assert torch.equal(y, scan_reference([v * (it + 1) for v in xs], gs, reverse=reverse)[rank]), it
    return n


def test_device_path_exact():
    skip_unless_gpus(2)  # NVLink between GPUs
    counts = run_distributed(_exact, 2, backend="nccl", timeout=600)
    assert counts[0] == len(DTYPES) * len(DECAYS) * 8 * 3


def _sizes_graphs_grads(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    # Sizes across the first window (8 MiB per direction) and past it: the window grows at 64 MiB.
    for nbytes in (16, 4 << 10, 1 << 20, 8 << 20, 64 << 20, 4 << 10):
        n = max(1, nbytes // 4)
        gen = torch.Generator(device=dev).manual_seed(nbytes)
        xs = [torch.randn(n, generator=gen, device=dev) for _ in range(P)]
        gs = [0.5 + 0.5 * torch.rand((), generator=gen, device=dev) for _ in range(P)]
        ref = scan_reference(xs, gs)
        for ctas in (None, 128):
            assert torch.equal(allscan.scan(xs[rank], gs[rank], method="device", num_blocks=ctas), ref[rank]), nbytes
    # CUDA graph: captured once, replayed with new inputs in the captured buffers.
    n = 1 << 16
    x = torch.empty(n, device=dev)
    g = torch.full((), 0.75, device=dev)
    allscan.scan(x, g, method="device")  # signature checked and window made before capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        y = allscan.scan(x, g, method="device")
    for it in range(5):
        xs = [torch.randn(n, generator=torch.Generator(device=dev).manual_seed(50 + it * P + q), device=dev)
              for q in range(P)]
        x.copy_(xs[rank])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, scan_reference(xs, [g] * P)[rank]), it
    # An async call (on the side stream) and a call on the current stream right after it, same
    # direction: the second waits for the first (they share the window)
    n = 1 << 20
    xa = [torch.randn(n, generator=torch.Generator(device=dev).manual_seed(70 + q), device=dev) for q in range(P)]
    xb = [torch.randn(n, generator=torch.Generator(device=dev).manual_seed(80 + q), device=dev) for q in range(P)]
    for _ in range(5):
        h = allscan.scan(xa[rank], g, method="device", async_op=True)
        yb = allscan.scan(xb[rank], g, method="device")
        assert torch.equal(h.wait(), scan_reference(xa, [g] * P)[rank])
        assert torch.equal(yb, scan_reference(xb, [g] * P)[rank])
    # Gradients: the backward's reverse scan takes the device path too.
    xs, gs, init = _inputs(P, torch.float32, (2, 4), 11, dev)
    outs = {}
    for method in ("pipelined", "device"):
        xr = xs[rank].clone().requires_grad_(True)
        gr = gs[rank].clone().requires_grad_(True)
        ir = init.clone().requires_grad_(True)
        y = allscan.scan(xr, gr, init=ir, method=method)
        (y * (rank + 1)).sum().backward()
        outs[method] = (y.detach(), xr.grad, gr.grad, ir.grad)
    for a, b in zip(outs["pipelined"], outs["device"]):
        assert torch.equal(a, b)
    assert allscan.device_path() == "device"


def test_device_path_sizes_graphs_grads():
    skip_unless_gpus(2)  # NVLink between GPUs
    run_distributed(_sizes_graphs_grads, 2, backend="nccl", timeout=600)


def _fallback(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    xs, gs, init = _inputs(P, torch.bfloat16, (2, 4), 5, dev)
    y = allscan.scan(xs[rank], gs[rank], init=init, method="device")
    assert torch.equal(y, scan_reference(xs, gs, init)[rank])
    return allscan.device_path()


def test_device_path_falls_back_without_p2p(monkeypatch):
    skip_unless_gpus(2)  # NVLink between GPUs
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    paths = run_distributed(_fallback, 2, backend="nccl", timeout=300)
    assert all(p == "nccl: NCCL_P2P_DISABLE=1" for p in paths), paths


def test_device_path_falls_back_without_symmetric_windows(monkeypatch):
    # NCCL without windows (NCCL_WIN_ENABLE=0): its device communicator cannot be made, on any rank
    skip_unless_gpus(2)  # NVLink between GPUs
    monkeypatch.setenv("NCCL_WIN_ENABLE", "0")
    paths = run_distributed(_fallback, 2, backend="nccl", timeout=300)
    assert all(p.startswith("nccl:") for p in paths), paths


def test_device_path_off_by_setting(monkeypatch):
    skip_unless_gpus(2)  # NVLink between GPUs
    monkeypatch.setenv("ALLSCAN_DEVICE_PATH", "off")
    paths = run_distributed(_fallback, 2, backend="nccl", timeout=300)
    assert all(p == "nccl: ALLSCAN_DEVICE_PATH=off" for p in paths), paths


def _matrix_refused(rank, P):
    dev = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(ValueError, match="method"):
        allscan.scan(torch.zeros(2, 4, 4, device=dev), transition=torch.zeros(2, 4, 4, device=dev), method="device")
    dist.barrier()


def test_device_method_refused_for_transitions():
    skip_unless_gpus(2)  # NVLink between GPUs
    run_distributed(_matrix_refused, 2, backend="nccl", timeout=300)


def test_device_kernel_on_simulated_ranks_of_one_gpu(tmp_path):
    """The kernel and its window protocol on P = 2, 3, 4 simulated ranks of one GPU (cudaMalloc'd
    windows, one stream per rank, all in flight at once): csrc/allscan/test/device_sim.cu."""
    import os
    import shutil
    import subprocess

    skip_unless_gpus(1)
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    nccl_pkg = pytest.importorskip("nvidia.nccl", reason="needs the nvidia-nccl wheel's headers")
    nccl = list(nccl_pkg.__path__)[0]
    root = os.path.join(os.path.dirname(__file__), "..")
    major, minor = torch.cuda.get_device_capability()
    exe = str(tmp_path / "device_sim")
    subprocess.run([nvcc, "-std=c++17", f"-arch=sm_{major}{minor}", f"-I{root}/csrc", f"-I{root}/csrc/common/include",
                    f"-I{root}/csrc/allscan/include", f"-I{nccl}/include", f"{root}/csrc/allscan/test/device_sim.cu",
                    "-o", exe], check=True, capture_output=True, timeout=600)
    res = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " 0 failed" in res.stdout, res.stdout
