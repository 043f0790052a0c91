"""Chunked all-to-all (scatter-heads / gather-heads) on CPU with gloo: values, autograd, errors."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from distributed import run_distributed  # noqa: E402

from allscan import a2a  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Head maps (no communication)
# ------------------------------------------------------------------------------------------------

def test_split_heads_uneven():
    assert a2a.split_heads(0, 5, 2) == [(0, 3), (3, 5)]
    assert a2a.split_heads(0, 7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert a2a.split_heads(3, 5, 4) == [(3, 4), (4, 5), (5, 5), (5, 5)]
    with pytest.raises(ValueError, match="world_size"):
        a2a.split_heads(0, 4, 0)


def test_kv_head_ranges_gqa():
    q = a2a.split_heads(0, 8, 4)  # 2 query heads per rank
    assert a2a.kv_head_ranges(q, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    q = a2a.split_heads(0, 8, 2)
    assert a2a.kv_head_ranges(q, 2) == [(0, 2), (2, 4)]  # split alongside
    q = a2a.split_heads(0, 8, 3)  # [0,3) [3,6) [6,8)
    assert a2a.kv_head_ranges(q, 4) == [(0, 1), (0, 2), (1, 2)]
    assert a2a.kv_head_ranges([(2, 2)], 2) == [(1, 1)]


def test_chunk_head_ranges_cover_each_rank():
    for H, P in [(5, 2), (7, 4), (40, 2), (8, 3)]:
        whole = a2a.split_heads(0, H, P)
        for C in range(1, H + 1):
            maps = a2a.chunk_head_ranges(H, P, C)
            assert len(maps) == C
            for r in range(P):
                pieces = [maps[c][r] for c in range(C)]
                assert pieces[0][0] == whole[r][0] and pieces[-1][1] == whole[r][1]
                for a, b in zip(pieces, pieces[1:]):
                    assert a[1] == b[0]
                sizes = [hi - lo for lo, hi in pieces]
                assert max(sizes) - min(sizes) <= 1
    m = a2a.chunk_head_ranges(20, 1, 3, weights=[1, 4, 1])
    assert [hi - lo for (lo, hi), in m] == [3, 14, 3]


def test_cpp_plan_simulated_on_host(tmp_path):
    """The C++ plan (pack/unpack segments, NCCL send/recv pairs, summations) executed on the host
    with the kernels' semantics, for P = 1..4, B = 1, 2, uneven, GQA and accumulate cases."""
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
    try:
        import nvidia.nccl as nccl_pkg

        nccl = list(nccl_pkg.__path__)[0]
    except ImportError:
        nccl = None
    if nvcc is None or nccl is None:
        pytest.skip("needs nvcc and the nvidia-nccl wheel")
    root = os.path.join(os.path.dirname(__file__), "..")
    exe = str(tmp_path / "plan_sim")
    subprocess.run([nvcc, "-std=c++17", "-arch=sm_80", f"-I{root}/csrc", f"-I{root}/csrc/common/include", f"-I{root}/csrc/allscan/include",
                    f"-I{root}/csrc/a2a_chunked/include", f"-I{nccl}/include",
                    f"{root}/csrc/a2a_chunked/test/plan_sim.cu", "-o", exe, f"-L{nccl}/lib", "-l:libnccl.so.2",
                    f"-Xlinker=-rpath={nccl}/lib"], check=True, capture_output=True, timeout=300)
    res = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " 0 failed" in res.stdout


# ------------------------------------------------------------------------------------------------
# Distributed values
# ------------------------------------------------------------------------------------------------

def _full(seed, B, S, H, D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, D, generator=g, dtype=torch.float64).to(dtype)


def _scatter_values(rank, world, B, Sl, H, D, dtype, head_map):
    import torch.distributed as dist

    S = Sl * world
    x_full = _full(1, B, S, H, D, dtype)
    x = x_full[:, rank * Sl:(rank + 1) * Sl].clone()
    hm = head_map if head_map is not None else a2a.split_heads(0, H, world)
    lo, hi = hm[rank]
    y = a2a.scatter_heads(x, head_map=hm)
    assert y.shape == (B, S, hi - lo, D)
    assert torch.equal(y, x_full[:, :, lo:hi]), "scatter-heads value"
    # gather inverts scatter (disjoint maps) / sums the copies (overlapping maps)
    z = a2a.gather_heads(y, num_heads=H, head_map=hm)
    expect = torch.zeros(B, Sl, H, D, dtype=torch.float64)
    for r in range(world):
        l2, h2 = hm[r]
        expect[:, :, l2:h2] += x[:, :, l2:h2].double()
    assert torch.equal(z, expect.to(dtype)), "gather-heads value"
    dist.barrier()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatter_gather_even(world):
    run_distributed(_scatter_values, world, 2, 3, 4 * world, 8, torch.float32, None)


@pytest.mark.parametrize("world,H", [(2, 5), (4, 7), (3, 2)])
def test_scatter_gather_uneven(world, H):
    run_distributed(_scatter_values, world, 1, 4, H, 4, torch.float32, None)


def test_scatter_gather_overlapping_map_bf16():
    # GQA replication: 2 kv heads for 4 ranks
    hm = a2a.kv_head_ranges(a2a.split_heads(0, 8, 4), 4)
    run_distributed(_scatter_values, 4, 2, 2, 2, 8, torch.bfloat16, hm)


def _multi(rank, world):
    # q, k, v of one chunk in one collective, with different head maps (GQA)
    B, Sl, D = 2, 3, 4
    S = Sl * world
    qf, kf, vf = _full(1, B, S, 8, D), _full(2, B, S, 2, D), _full(3, B, S, 2, D)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    qm = a2a.chunk_head_ranges(8, world, 2)[1]
    km = a2a.kv_head_ranges(qm, 4)
    q, k, v = a2a.scatter_heads_multi([qf[:, sl], kf[:, sl], vf[:, sl]], [qm, km, km])
    assert torch.equal(q, qf[:, :, qm[rank][0]:qm[rank][1]])
    assert torch.equal(k, kf[:, :, km[rank][0]:km[rank][1]])
    assert torch.equal(v, vf[:, :, km[rank][0]:km[rank][1]])
    # gather into existing outputs, accumulating k
    out_q = torch.full((B, Sl, 8, D), 7.0, dtype=torch.float64)
    out_k = torch.ones(B, Sl, 2, D, dtype=torch.float64)
    a2a.gather_heads_multi([q, k], [qm, km], [8, 2], outs=[out_q, out_k], accumulate=[False, True])
    exp_q = torch.full((B, Sl, 8, D), 7.0, dtype=torch.float64)
    for lo, hi in qm:
        exp_q[:, :, lo:hi] = qf[:, sl, lo:hi]
    exp_k = torch.ones(B, Sl, 2, D, dtype=torch.float64)
    for lo, hi in km:
        exp_k[:, :, lo:hi] += kf[:, sl, lo:hi]
    assert torch.equal(out_q, exp_q)
    assert torch.allclose(out_k, exp_k, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_tensor_and_accumulate(world):
    run_distributed(_multi, world)


def _autograd(rank, world, H, hm_kind):
    B, Sl, D = 2, 3, 4
    S = Sl * world
    sl = slice(rank * Sl, (rank + 1) * Sl)
    if hm_kind == "gqa":
        hm = a2a.kv_head_ranges(a2a.split_heads(0, 2 * world, world), 4)  # overlapping
    else:
        hm = a2a.split_heads(0, H, world)
    x_full = _full(1, B, S, H, D)
    w_full = _full(2, B, S, H, D)
    x = x_full[:, sl].clone().requires_grad_(True)
    lo, hi = hm[rank]
    y = a2a.scatter_heads(x, head_map=hm)
    (y * w_full[:, :, lo:hi]).sum().backward()
    expect = torch.zeros(B, Sl, H, D, dtype=torch.float64)
    for l2, h2 in hm:
        expect[:, :, l2:h2] += w_full[:, sl, l2:h2]
    assert torch.allclose(x.grad, expect, rtol=0, atol=1e-12), "scatter backward"
    # gather's backward is scatter
    yy = x_full[:, :, lo:hi].clone().requires_grad_(True)
    z = a2a.gather_heads(yy, num_heads=H, head_map=hm)
    (z * w_full[:, sl]).sum().backward()
    assert torch.equal(yy.grad, w_full[:, :, lo:hi]), "gather backward"


@pytest.mark.parametrize("world,H,kind", [(1, 3, "split"), (2, 5, "split"), (3, 6, "split"), (4, 7, "split"),
                                          (4, 2, "gqa")])
def test_autograd(world, H, kind):
    run_distributed(_autograd, world, H, kind)


def _compile(rank, world):
    x = _full(1 + rank, 1, 4, 4, 8, torch.float32)

    def f(t):
        return a2a.gather_heads(a2a.scatter_heads(t) * 2, num_heads=4)

    out = torch.compile(f, backend="eager", fullgraph=True)(x)
    assert torch.equal(out, x * 2)


def test_torch_compile_fullgraph():
    run_distributed(_compile, 2)


# ------------------------------------------------------------------------------------------------
# Errors: clear messages; mismatches across ranks raise on every rank instead of hanging
# ------------------------------------------------------------------------------------------------

def _errors_local(rank, world):
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4-D"):
        a2a.scatter_heads(torch.zeros(2, 4, 8))
    with pytest.raises(TypeError, match="x must be float32, float16, bfloat16 or float64"):
        a2a.scatter_heads(torch.zeros(1, 2, 4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="head_range"):
        a2a.scatter_heads(x, head_range=(0, 5))
    with pytest.raises(ValueError, match="one \\(lo, hi\\) range per rank"):
        a2a.scatter_heads(x, head_map=[(0, 4)] * (world + 1))
    with pytest.raises(ValueError, match="num_heads"):
        a2a.gather_heads(torch.zeros(1, 2 * world, 2, 8))
    with pytest.raises(ValueError, match="this rank's"):
        a2a.gather_heads(torch.zeros(1, 2 * world, 3, 8), num_heads=4)
    with pytest.raises(TypeError, match="tensors\\[1\\] has dtype torch.float64, tensors\\[0\\] has torch.float32"):
        a2a.scatter_heads_multi([x, x.double()], [a2a.split_heads(0, 4, world)] * 2)
    with pytest.raises(ValueError, match="B, S and D must agree"):
        a2a.scatter_heads_multi([x, torch.zeros(1, 3, 4, 8)], [a2a.split_heads(0, 4, world)] * 2)


def test_errors_local():
    run_distributed(_errors_local, 2)


def _errors_cross_rank(rank, world, what):
    if what == "shape":
        x = torch.zeros(1, 2 + rank, 4, 8)  # S_local differs across ranks
        with pytest.raises(ValueError, match="ranks disagree on local sequence length"):
            a2a.scatter_heads(x)
    elif what == "heads":
        x = torch.zeros(1, 2, 4 + 2 * rank, 8)
        with pytest.raises(ValueError, match="ranks disagree on tensors\\[0\\] num_heads"):
            a2a.scatter_heads(x)
    elif what == "dtype":
        x = torch.zeros(1, 2, 4, 8, dtype=torch.float32 if rank == 0 else torch.float64)
        with pytest.raises(ValueError, match=r"ranks disagree on dtype \(rank 0: float32, rank 1: float64\)"):
            a2a.scatter_heads(x)
    elif what == "one_rank_bad":
        # rank 1 passes a 3-D tensor: it raises its own error, rank 0 is told instead of hanging
        x = torch.zeros(1, 2, 4, 8) if rank == 0 else torch.zeros(2, 4, 8)
        with pytest.raises(ValueError, match="rank\\(s\\) \\[1\\] rejected their own arguments" if rank == 0 else "4-D"):
            a2a.scatter_heads_multi([x], [a2a.split_heads(0, 4, world)])


    elif what == "one_rank_bad_single":  # the same through scatter_heads and gather_heads
        x = torch.zeros(1, 2, 4, 8) if rank == 0 else torch.zeros(2, 4, 8)
        with pytest.raises(ValueError, match="rank\\(s\\) \\[1\\] rejected their own arguments" if rank == 0 else "4-D"):
            a2a.scatter_heads(x)
        y = torch.zeros(1, 4, 2, 8)
        with pytest.raises(ValueError, match="rank\\(s\\) \\[1\\] rejected their own arguments" if rank == 0
                           else "head_range must satisfy"):
            a2a.gather_heads(y, num_heads=4, head_range=(0, 4) if rank == 0 else (0, 9))


@pytest.mark.parametrize("what", ["shape", "heads", "dtype", "one_rank_bad", "one_rank_bad_single"])
def test_errors_cross_rank(what):
    run_distributed(_errors_cross_rank, 2, what, timeout=60)


class _NoMemory(torch.Tensor):
    """A tensor whose contiguous copy runs out of memory."""

    def contiguous(self, *args, **kwargs):
        raise RuntimeError("injected out of memory")


def _out_of_memory_before_the_check(rank, world):
    """Rank 1 runs out of memory making its input contiguous (before the cross-rank check): it raises
    that, its peers raise at once naming it (gloo: they wait in the check), and the group carries on."""
    from allscan.ops.a2a import SCATTER, a2a_multi

    x = torch.randn(1, 4, 2 * world, 4).transpose(1, 3).contiguous().transpose(1, 3)  # not contiguous
    mine = x.as_subclass(_NoMemory) if rank == 1 else x
    hm = a2a.split_heads(0, 2 * world, world)
    with pytest.raises(RuntimeError if rank == 1 else ValueError,
                       match="injected out of memory" if rank == 1 else r"rank\(s\) \[1\] rejected"):
        a2a_multi(SCATTER, [mine], [hm], [2 * world])
    y, = a2a_multi(SCATTER, [x], [hm], [2 * world])
    return tuple(y.shape)


def test_out_of_memory_before_the_check_tells_the_peers():
    assert run_distributed(_out_of_memory_before_the_check, 3, timeout=60) == [(1, 12, 2, 4)] * 3


def test_cpp_path_records_completion_event_through_torch(monkeypatch):
    """Regression: torch.cuda.Event creates its cudaEvent lazily, so a fresh event's raw handle is 0;
    the C++ path must record the event through torch after the enqueue (not hand over the raw
    handle), or stream.wait_event() on it silently does nothing. Checked with fakes on CPU."""
    from allscan.ops import a2a as ops_a2a

    calls = []

    class FakeC:
        @staticmethod
        def a2a_workspace_size(*args, **kw):
            return 0

        @staticmethod
        def a2a(*args, check_comm=0, signature=0):
            calls.append(("a2a", args[-2], args[-1]))
            assert check_comm == FakeComm.handle  # the in-band signature's table: the group's allscan communicator

    class FakeComm:
        nccl, handle, rank, size, device = 1, 2, 0, 1, None

    class FakeStream:
        cuda_stream = 1234

    class FakeEvent:
        cuda_event = 0  # not created yet, like a fresh torch.cuda.Event

        def record(self, stream):
            calls.append(("record", stream))

    monkeypatch.setattr(ops_a2a, "_C", FakeC)
    monkeypatch.setattr(ops_a2a._comm, "get_communicator", lambda group, device: FakeComm)
    x = torch.zeros(1, 2, 3, 4)
    stream = FakeStream()
    ops_a2a._cpp_a2a(ops_a2a.SCATTER, [x], [[(0, 3)]], [3], None, [torch.empty(1, 2, 3, 4)], [False], stream, FakeEvent())
    assert calls == [("a2a", 1234, 0), ("record", stream)], calls
