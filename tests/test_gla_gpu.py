"""Sequence-parallel GLA on 2 GPUs (NCCL) against the exact answer and fla's single-GPU ``chunk_gla``.

    python3 -m pytest -s -q -m gpu tests/test_gla_gpu.py -p no:cacheprovider   # 2 processes, one per GPU

Every rank computes, on the whole sequence, fla's ``chunk_gla`` (same dtype) and the exact answer (the
token-by-token recurrence in float64 on the same rounded inputs, with autograd), and ``zeco_gla`` on
its shard; it compares output, final state and the gradients of q, k, v, g and the initial state.
Metric: RMS error ratio ``rms(x - exact) / rms(exact)``. Bound: 3e-3 in bf16 and 1e-5 in fp32, or
1.25x fla's own error on the same slice where that is larger (as accurate as the single-GPU kernel).
Why against the exact answer and not against fla in bf16: the difference of two bf16 computations
holds both one's rounding errors; measured on 2 H200s, plain linear attention (no decay, T = 2048):
ours against fla-bf16 3.1e-3, which is mostly fla's own bf16 rounding of its chunk states. For fp32,
Triton's dots are switched to IEEE fp32 (TRITON_F32_DEFAULT=ieee), else fla runs in tf32.

Bounded: each dtype runs in one pair of spawned processes that must finish within ``RUN_TIMEOUT``
seconds (``run_distributed`` kills them and raises otherwise; pytest-timeout is a second net). fla's
autotuning is limited to one config per kernel (``limit_fla_autotune("one")``): with fla's full
autotuning every (dtype, varlen, initial-state, ...) combination compiles and benchmarks 8-48 configs
per kernel, which alone took more than 10 minutes. Same kernels, same math; only the tiling is fixed.
Expected: about 1-2 minutes per dtype on 2 H200s, nearly all of it Triton compilation.

Progress: every rank prints one line per stage to stderr, flushed (``-s`` shows them live), and appends
it to a file whose last lines are put into the failure message if a rank fails or the run times out,
so a log always shows where it stopped.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402
from graph_replay import assert_replay_equals_eager  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 3e-3, "float32": 1e-5}
RUN_TIMEOUT = 300  # seconds for the 2 ranks of one dtype, compilation included
METHODS = ["zeco", "lasp1", "lasp2"]


def _need():
    skip_unless_nccl_ranks(2)
    _need1()


def _need1():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        import fla.ops.gla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"needs fla-core (flash-linear-attention): {e}")


def _triton_kernels():
    """allscan's Triton kernels for the incoming state; skips without CUDA or Triton (a broken
    allscan module fails)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from allscan.ops.gla import incoming_state
    return incoming_state


def _rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _cases():
    # One head shape (H, K, V) and one T for every case, so the kernels compile once per variant
    # (dtype x varlen x which optional tensors are given); the cases cost little beyond that.
    T_local = 1024
    return [
        dict(name="gla", decay="gla", B=2, T_local=T_local, cu=None),
        dict(name="simple_gla", decay="simple", B=2, T_local=T_local, cu=None),
        dict(name="linear", decay="none", B=2, T_local=T_local, cu=None),
        # a sequence crossing the rank boundary (300..1500), cuts inside both ranks, one ending at the end
        dict(name="gla_varlen", decay="gla", B=1, T_local=T_local, cu=[0, 300, 1500, 1700, 2048]),
        # a sequence starting exactly on the rank boundary
        dict(name="gla_varlen_edge", decay="gla", B=1, T_local=T_local, cu=[0, 1000, 1024, 2048]),
    ]


class _Progress:
    """One line per stage: stderr (flushed) and a per-rank file the parent reads on failure."""

    def __init__(self, rank, tag, path):
        self.rank, self.tag, self.path, self.t0 = rank, tag, path, time.monotonic()

    def __call__(self, msg):
        line = f"[test_gla_gpu {self.tag} rank {self.rank} +{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def _run(rank, world, dtype_name, methods, progress_dir):
    say = _Progress(rank, dtype_name, os.path.join(progress_dir, f"rank{rank}.log"))
    say("start")
    if dtype_name == "float32":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"  # before Triton compiles anything in this process
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch.distributed as dist
    import torch.nn.functional as F
    from fla.ops.gla import chunk_gla

    from allscan.ops.gla import fused_kernels_enabled, limit_fla_autotune, recurrent_gla_reference, zeco_gla

    n = limit_fla_autotune("one")
    say(f"fla imported; autotuning limited to one config for {n} kernels")

    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    H, K, V = 4, 128, 128
    errors = {}
    for case in _cases():
        B, T_local, cu_list = case["B"], case["T_local"], case["cu"]
        T = T_local * world
        gen = torch.Generator(device=dev).manual_seed(2024)
        q = torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype)
        k = torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype)
        v = torch.randn(B, T, H, V, device=dev, generator=gen).to(dtype)
        if case["decay"] == "gla":
            g = (F.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16).to(dtype)
        elif case["decay"] == "simple":
            g = (F.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 2) / 8).to(dtype)
        else:
            g = None
        N = B if cu_list is None else len(cu_list) - 1
        h0 = 0.1 * torch.randn(N, H, K, V, device=dev, generator=gen)
        do = torch.randn(B, T, H, V, device=dev, generator=gen).to(dtype)
        dht = torch.randn(N, H, K, V, device=dev, generator=gen)
        cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long, device=dev)

        # reference: fla on the whole sequence (no communication)
        say(f"{case['name']}: reference chunk_gla fwd+bwd on the whole sequence (T={T})")
        rq, rk, rv = (x.clone().requires_grad_(True) for x in (q, k, v))
        rg = None if g is None else g.clone().requires_grad_(True)
        rh0 = h0.clone().requires_grad_(True)
        g_full = (torch.zeros(B, T, H, K, device=dev, dtype=dtype) if rg is None
                  else rg.unsqueeze(-1).expand(B, T, H, K) if rg.dim() == 3 else rg)
        ro, rht = chunk_gla(rq, rk, rv, g_full, initial_state=rh0, output_final_state=True, cu_seqlens=cu)
        ((ro.float() * do.float()).sum() + (rht * dht).sum()).backward()
        torch.cuda.synchronize()
        ref = {"o": ro, "dq": rq.grad, "dk": rk.grad, "dv": rv.grad, "dh0": rh0.grad}
        if rg is not None:
            ref["dg"] = rg.grad

        # exact answer: the token-by-token recurrence in float64 on the same (rounded) inputs
        say(f"{case['name']}: exact float64 recurrence fwd+bwd on the whole sequence")
        xq, xk, xv = (x.double().requires_grad_(True) for x in (q, k, v))
        xg = None if g is None else g.double().requires_grad_(True)
        xh0 = h0.double().requires_grad_(True)
        xo, xht = recurrent_gla_reference(xq, xk, xv, xg, initial_state=xh0, cu_seqlens=cu)
        ((xo * do.double()).sum() + (xht * dht.double()).sum()).backward()
        exact = {"o": xo.detach(), "dq": xq.grad, "dk": xk.grad, "dv": xv.grad, "dh0": xh0.grad,
                 "final": xht.detach()}
        if xg is not None:
            exact["dg"] = xg.grad
        del xq, xk, xv, xg, xh0, xo, xht

        sl = slice(rank * T_local, (rank + 1) * T_local)
        off = rank * T_local
        if cu_list is None:
            rows = list(range(N)) if rank == world - 1 else []
        else:
            rows = [i for i in range(N) if off < cu_list[i + 1] <= off + T_local]
        # fla's own error on the same part of the problem (this rank's slice, its final-state rows)
        fla_part = {"o": ref["o"][:, sl], "dq": ref["dq"][:, sl], "dk": ref["dk"][:, sl], "dv": ref["dv"][:, sl],
                    "dh0": ref["dh0"]}
        if "dg" in ref:
            fla_part["dg"] = ref["dg"][:, sl]
        if rows:
            fla_part["final"] = rht[rows]
        for name, a in fla_part.items():
            b = exact[name][rows] if name == "final" else exact[name] if name == "dh0" else exact[name][:, sl]
            errors[f"{case['name']}/fla/{name}"] = _rms_ratio(a, b)
        dfin = torch.zeros_like(dht)
        dfin[rows] = dht[rows]
        for method in methods:
            # Every rank runs the same cases and methods in the same order: the collectives (the
            # forward All-Scan, the reverse All-Scan in backward, the all_reduce of dh0) match.
            mq, mk, mv = (x[:, sl].clone().requires_grad_(True) for x in (q, k, v))
            mg = None if g is None else g[:, sl].clone().requires_grad_(True)
            mh0 = h0.clone().requires_grad_(True)
            say(f"{case['name']}/{method}: zeco_gla forward")
            o, fin = zeco_gla(mq, mk, mv, mg, dist.group.WORLD, initial_state=mh0, output_final_state=True,
                              cu_seqlens=cu, method=method)
            torch.cuda.synchronize()
            say(f"{case['name']}/{method}: backward")
            ((o.float() * do[:, sl].float()).sum() + (fin * dfin).sum()).backward()
            torch.cuda.synchronize()
            dh0 = mh0.grad.clone()
            dist.all_reduce(dh0)
            got = {"o": (o, exact["o"][:, sl]), "dq": (mq.grad, exact["dq"][:, sl]),
                   "dk": (mk.grad, exact["dk"][:, sl]), "dv": (mv.grad, exact["dv"][:, sl]),
                   "dh0": (dh0, exact["dh0"])}
            if mg is not None:
                got["dg"] = (mg.grad, exact["dg"][:, sl])
            if rows:
                got["final"] = (fin[rows], exact["final"][rows])
            worst = 0.0
            for name, (a, b) in got.items():
                assert a.shape == b.shape, f"{case['name']} {method} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
                err = _rms_ratio(a, b)
                errors[f"{case['name']}/{method}/{name}"] = err
                worst = max(worst, err)
            say(f"{case['name']}/{method}: done, worst RMS error ratio on this rank {worst:.2e}")
    assert fused_kernels_enabled(), "the fused Triton correction kernels failed and fell back to torch ops (see the warning)"
    say("all cases done")
    return errors


def _progress_tail(progress_dir, world, lines=6):
    out = []
    for r in range(world):
        path = os.path.join(progress_dir, f"rank{r}.log")
        try:
            with open(path) as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            tail = ["(no progress written)"]
        out.append(f"rank {r}, last progress lines:\n    " + "\n    ".join(tail))
    return "\n".join(out)


@pytest.mark.timeout(RUN_TIMEOUT + 90)  # run_distributed's own timeout (and its clean-up) fires first
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_zeco_gla_matches_fla_whole_sequence(dtype_name):
    _need()
    world = 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="allscan_gla_gpu_") as progress_dir:
        try:
            results = run_distributed(_run, world, dtype_name, METHODS, progress_dir, timeout=RUN_TIMEOUT,
                                      backend="nccl")
        except (AssertionError, TimeoutError) as e:
            raise AssertionError(f"{e}\n{_progress_tail(progress_dir, world)}") from e
    tol = TOL[dtype_name]
    worst = {}
    for per_rank in results:
        for key, err in per_rank.items():
            worst[key] = max(worst.get(key, 0.0), err)
    print(f"\nRMS error ratio against the exact (float64) answer, {dtype_name}, max over ranks, "
          f"{time.monotonic() - t0:.0f} s: zeco_gla per method, and fla's chunk_gla on the whole sequence "
          f"(same dtype) on the same slice:", flush=True)
    for key in sorted(worst):
        case, method, name = key.split("/")
        if method != "fla":
            print(f"  {key:40s} {worst[key]:.2e}   (fla {worst.get(f'{case}/fla/{name}', float('nan')):.2e})")
    expected = {f"{c['name']}/{m}/o" for c in _cases() for m in METHODS}
    assert expected <= set(worst), f"missing results: {sorted(expected - set(worst))}"
    # Within the tolerance, or (where fla's own single-GPU error on the same slice is larger than
    # the tolerance) at most 1.25x fla's own error: as accurate as the single-GPU kernel.
    bad = {}
    for key, v in worst.items():
        case, method, name = key.split("/")
        if method == "fla":
            continue
        bound = max(tol, 1.25 * worst.get(f"{case}/fla/{name}", 0.0))
        if not v <= bound:
            bad[key] = (v, bound)
    assert not bad, f"RMS error ratio above the bound ({dtype_name}; (error, bound)): {bad}"


def _chunk_local_log2(g, BT):
    """Chunk-local cumulative decays in log2 units, as fla's chunk_local_cumsum(g, BT, scale=1/ln2)
    makes them (no fla needed: the kernel tests run with Triton alone)."""
    B, T, H, K = g.shape
    NT = (T + BT - 1) // BT
    pad = torch.zeros(B, NT * BT, H, K, device=g.device)
    pad[:, :T] = g
    return (pad.view(B, NT, BT, H, K).cumsum(2) / 0.6931471805599453).view(B, NT * BT, H, K)[:, :T].contiguous()


def test_chunk_offsets_kernel_matches_torch():
    """The one-launch Triton prefix of the chunk decays against the torch-op reference, at segment
    lengths that end inside a chunk, span several 64-chunk tiles, and K not a power of two."""
    GT = _triton_kernels()
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    for B, T, H, K, BT, L1 in [(1, 8192, 4, 128, 64, 8192), (2, 300, 3, 48, 16, 250),
                               (1, 64 * 130 + 5, 2, 64, 64, 64 * 130 + 5), (1, 100, 2, 16, 64, 1)]:
        raw = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=g, device=dev)) / 16
        gc = _chunk_local_log2(raw, BT)
        off, e = GT.chunk_offsets(gc, L1, BT)
        off_ref, e_ref = GT.chunk_offsets_torch(gc, L1, BT)
        assert off.shape == off_ref.shape and e.shape == e_ref.shape
        torch.testing.assert_close(off, off_ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"{(B, T, H, K, BT, L1)}: {m}")
        torch.testing.assert_close(e, e_ref, rtol=1e-4, atol=1e-30, msg=lambda m: f"{(B, T, H, K, BT, L1)}: {m}")


@pytest.mark.parametrize("tiles", [None, dict(BK=128, BV=128, num_warps=8), dict(BK=16, BV=32, num_warps=4)])
def test_incoming_state_kernels_match_torch(tiles):
    """The fused forward correction and backward state gradient against the torch-op reference, at
    the default tiles and others (K sliced or whole, V split), K and V not powers of two, a first
    segment shorter than the shard."""
    GT = _triton_kernels()
    from allscan.ops.gla.chunk import torch_correct_, torch_state_grad
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(11)
    for B, T, H, K, V, L1, BT in [(1, 1024, 2, 128, 128, 1024, 64), (2, 200, 3, 48, 80, 130, 16)]:
        q = torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16)
        do = torch.randn(B, T, H, V, device=dev, generator=gen).to(torch.bfloat16)
        o0 = torch.randn(B, T, H, V, device=dev, generator=gen)  # fp32: the comparison sees the dot's error
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16
        gc = _chunk_local_log2(g, BT)
        S = torch.randn(B, H, K, V, device=dev, generator=gen) / K
        scale = K ** -0.5
        o_ref = o0.clone()
        e_ref = torch_correct_(q, g, o_ref, S, scale, L1)
        X_ref, _ = torch_state_grad(q, g, do, scale, L1)
        o = o0.clone()
        e = GT.correct_output_(o, q, gc, S, scale, L1, BT, tiles=tiles)
        X, e2 = GT.state_grad(q, gc, do, scale, L1, BT, tiles=tiles)
        case = (B, T, H, K, V, L1, BT, tiles)
        d_ref = (o_ref.float() - o0.float())
        err_o = ((o.float() - o_ref.float()).norm() / d_ref.norm()).item()
        err_x = ((X - X_ref).norm() / X_ref.norm()).item()
        # tf32 dots (Triton's default) against an fp32 einsum
        assert err_o < 5e-3, f"{case}: forward correction rel err {err_o:.3g}"
        assert err_x < 5e-3, f"{case}: state gradient rel err {err_x:.3g}"
        assert torch.equal(o[:, L1:], o0[:, L1:]), f"{case}: tokens after the first segment were touched"
        torch.testing.assert_close(e, e_ref.reshape(e.shape).float(), rtol=1e-4, atol=1e-30)
        torch.testing.assert_close(e2, e, rtol=0, atol=0)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("varlen", [False, True])
def test_output_with_state_matches_fla_output_plus_correction(varlen, dtype_name):
    """The output kernel with the incoming state folded in against fla's output kernel followed by
    the torch-op correction, with and without packing (the state reaches the first sequence only);
    16-bit inputs take the bf16 hi/lo products, fp32 inputs one fp32 product."""
    GT = _triton_kernels()
    try:
        from fla.ops.common.chunk_h import chunk_fwd_h
        from fla.ops.gla import chunk as fgc
        from fla.ops.utils import prepare_chunk_indices
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum
    except Exception as e:  # noqa: BLE001 - ImportError, or Triton failing to initialise
        pytest.skip(f"needs fla-core: {e}")
    from allscan.ops.gla import limit_fla_autotune
    from allscan.ops.gla.chunk import torch_correct_
    limit_fla_autotune("one")
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(21)
    B, T, H, K, V, BT = (1, 700, 2, 128, 64, 64) if varlen else (2, 1000, 3, 64, 128, 64)
    cu = torch.tensor([0, 300, 310, 700], device=dev) if varlen else None
    ci = prepare_chunk_indices(cu, BT) if varlen else None
    L1 = 300 if varlen else T
    dtype = getattr(torch, dtype_name)
    q, k = (torch.randn(B, T, H, K, device=dev, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev, generator=gen).to(dtype)
    # slow decays: the incoming state reaches the whole first segment with a weight comparable to
    # the local output's, so a wrong or missing state term cannot hide in the rounding
    g = -1e-3 * torch.rand(B, T, H, K, device=dev, generator=gen)
    S = 32 * torch.randn(B, H, K, V, device=dev, generator=gen)  # the size of a state after ~1000 tokens
    scale = K ** -0.5
    gcum = chunk_local_cumsum(g, BT, scale=RCP_LN2, cu_seqlens=cu)
    h, _ = chunk_fwd_h(k=k, v=v, g=None, gk=gcum, gv=None, h0=None, output_final_state=False, cu_seqlens=cu,
                       chunk_size=BT, states_in_fp32=False)
    A = fgc.chunk_gla_fwd_intra_gk(q=q, k=k, g=gcum, scale=scale, cu_seqlens=cu, chunk_size=BT, chunk_indices=ci)
    o_fla = fgc.chunk_gla_fwd_o_gk(q=q, v=v, g=gcum, A=A, h=h, scale=scale, cu_seqlens=cu, chunk_size=BT,
                                   chunk_indices=ci)
    o_ref = o_fla.float().clone()  # a copy also when o_fla is fp32 (the correction works in place)
    torch_correct_(q, g, o_ref, S, scale, L1)
    o = GT.output_with_state(q, v, gcum, A, h, S, scale, BT, GT.chunk_offsets(gcum, L1, BT), cu_seqlens=cu,
                             chunk_indices=ci)
    torch.cuda.synchronize()

    def rms(a, b):
        return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()

    head, tail = o[:, :L1], o[:, L1:]
    assert rms(o_ref[:, :L1], o_fla[:, :L1]) > 0.3, "the test state is too small to show the correction"
    assert rms(head, o_ref[:, :L1]) < 1e-2, f"{dtype_name} varlen={varlen}: first segment off by {rms(head, o_ref[:, :L1]):.3g}"
    if varlen:
        assert rms(tail, o_fla[:, L1:]) < 1e-2, f"{dtype_name}: later sequences off by {rms(tail, o_fla[:, L1:]):.3g}"


def _fused_vs_separate(rank, world):
    """zeco_gla with the state folded into the output kernel against the same call with the separate
    correction kernel (the fallback), output and gradients, with and without packing."""
    import torch.distributed as dist

    from allscan.ops.gla import limit_fla_autotune, set_fused_output, zeco_gla

    limit_fla_autotune("one")
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(3)  # same inputs on every rank: a fixed global sequence
    B, T, H, K = 1, 2 * 512, 4, 64
    full = [torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
    gfull = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16)
    Tl = T // world
    sl = slice(rank * Tl, (rank + 1) * Tl)
    do = torch.randn(B, Tl, H, K, device=dev, generator=torch.Generator(device=dev).manual_seed(9 + rank))
    do = do.to(torch.bfloat16)
    worst = {}
    for cu in (None, torch.tensor([0, 300, 700, T], device=dev)):
        res = {}
        for fused in (True, False):
            set_fused_output(fused)
            q, k, v = (t[:, sl].clone().requires_grad_(True) for t in full)
            g = gfull[:, sl].clone().requires_grad_(True)
            o, _ = zeco_gla(q, k, v, g, dist.group.WORLD, cu_seqlens=cu)
            grads = torch.autograd.grad(o, (q, k, v, g), do)
            res[fused] = (o,) + grads
        set_fused_output(True)
        for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), res[True], res[False]):
            err = _rms_ratio(a, b)
            worst[f"{'varlen' if cu is not None else 'fixed'}/{name}"] = err
            assert err < 3e-3, f"rank {rank}, cu_seqlens={cu}: {name} differs by {err:.3g} (fused vs separate)"
    return worst


def test_fused_output_matches_separate_correction():
    _need()
    res = run_distributed(_fused_vs_separate, 2, timeout=RUN_TIMEOUT, backend="nccl")
    print("fused vs separate correction, RMS ratio:", res)


def _graph_replay(rank, world):
    """zeco_gla fwd+bwd captured in one CUDA graph on every rank (the forward and reverse All-Scans
    included) and replayed: bitwise the eager call's output, final state and gradients, then again
    after new values are copied into the captured inputs (the graph reads them, nothing stale)."""
    import torch.distributed as dist

    from allscan.ops.gla import limit_fla_autotune, zeco_gla

    limit_fla_autotune("one")
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(11 + rank)
    B, T, H, K = 1, 512, 4, 64
    q, k, v = (torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16).requires_grad_(True)
    do = torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16)
    ins = (q, k, v, g)

    def step():
        o, final = zeco_gla(q, k, v, g, dist.group.WORLD, output_final_state=True)
        return (o, final) + torch.autograd.grad((o, final), ins, (do, torch.ones_like(final)))

    def refill():
        for t in (q, k, v, do):
            t.copy_(torch.randn(t.shape, device=dev, generator=gen))
        g.copy_(torch.nn.functional.logsigmoid(torch.randn(g.shape, device=dev, generator=gen)) / 16)

    assert_replay_equals_eager(step, refill, ("o", "final", "dq", "dk", "dv", "dg"), rank, dev)
    dist.barrier()
    return True


def test_zeco_gla_fwd_bwd_graph_replay_equals_eager():
    _need()
    assert run_distributed(_graph_replay, 2, timeout=RUN_TIMEOUT, backend="nccl") == [True, True]


def _compiled(rank, world):
    """zeco_gla fwd+bwd under torch.compile(fullgraph=True): its custom ops run what eager runs, so
    aot_eager and mode="reduce-overhead" (inductor, CUDA graphs) give bitwise the eager output, final
    state and gradients, after the calls that warm up and record the graphs."""
    import torch.distributed as dist

    from allscan.ops.gla import limit_fla_autotune, zeco_gla

    limit_fla_autotune("one")
    torch._dynamo.reset()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(5 + rank)
    B, T, H, K = 1, 256, 4, 64
    ins = [torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
    ins.append(torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16)
    do = torch.randn(B, T, H, K, device=dev, generator=gen).to(torch.bfloat16)

    def step(q, k, v, g):
        return zeco_gla(q, k, v, g, dist.group.WORLD, output_final_state=True)

    results = {}
    for name, fn in (("eager", step), ("aot_eager", torch.compile(step, fullgraph=True, backend="aot_eager")),
                     ("reduce-overhead", torch.compile(step, fullgraph=True, mode="reduce-overhead"))):
        for _ in range(3):  # CUDA-graph trees warm up, then record, then replay
            xs = [t.clone().requires_grad_(True) for t in ins]
            o, final = fn(*xs)
            grads = torch.autograd.grad((o, final), xs, (do, torch.ones_like(final)))
            results[name] = [t.detach().clone() for t in (o, final) + grads]
    torch.cuda.synchronize(dev)
    differ = [f"{name}'s {what} (max |diff| {(a.float() - b.float()).abs().max().item():.3g}, "
              f"{int(a.isnan().sum())} NaN)"
              for name in ("aot_eager", "reduce-overhead")
              for what, a, b in zip(("o", "final", "dq", "dk", "dv", "dg"), results[name], results["eager"])
              if not torch.equal(a, b)]
    assert not differ, f"rank {rank}: differ from eager: {', '.join(differ)}"  # all of them, to tell causes apart
    dist.barrier()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_zeco_gla_compiled_equals_eager(world):
    skip_unless_nccl_ranks(world)
    _need1()
    assert run_distributed(_compiled, world, timeout=RUN_TIMEOUT, backend="nccl") == [True] * world


class _Ready:
    """What an async scan returns, for a result known in advance."""

    def __init__(self, y):
        self.y = y

    def wait(self):
        return self.y


def _stand_in(rank, world, dtype_name, decay, place):
    """One GPU as rank 1 of 3 (``place="middle"``) or as the last of 2, with the exact boundary states:
    the shard is cut as that rank's, and the two scans deliver what they would there (the state
    entering the shard; the gradient of the state leaving it, zero on the last rank, whose final state
    gets the caller's gradient instead), taken from a float64 recurrence over the shards. So the
    incoming-state kernels (the output with the state folded in; a middle rank's state gradient, the
    last rank's from its local backward) run on values as they are at P > 1, without the transfers.
    Output, final state, the gradients of q, k, v, g and of the state entering the shard (what this
    rank sends back, combined as the scan combines it) against the exact answer, within 1.1x of fla's
    own error on the same slice (chunk_gla on the whole sequence; for the incoming state's gradient,
    chunk_gla on the shards from this one on); the floor is below fla's bf16 error, so the bound is the
    ratio."""
    if dtype_name == "float32":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"  # before Triton compiles anything in this process
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch.distributed as dist
    import torch.nn.functional as F
    from fla.ops.gla import chunk_gla

    from allscan.ops.gla import fused_kernels_enabled, limit_fla_autotune, recurrent_gla_reference, zeco_gla
    from allscan.ops.hooks import forget_plans, op_hooks, replaced

    limit_fla_autotune("one")
    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    shards = 3 if place == "middle" else 2
    B, T, H, K, V = 2, 1000, 4, 128, 128  # T: not a multiple of the 64-token chunk
    gen = torch.Generator(device=dev).manual_seed(7)
    q, k = (torch.randn(B, shards * T, H, K, device=dev, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, shards * T, H, V, device=dev, generator=gen).to(dtype)
    shape = (B, shards * T, H, K) if decay == "gla" else (B, shards * T, H)
    g = (F.logsigmoid(torch.randn(shape, device=dev, generator=gen) + (0 if decay == "gla" else 2)) / 16).to(dtype)
    h0 = 0.1 * torch.randn(B, H, K, V, device=dev, generator=gen)
    do = torch.randn(B, shards * T, H, V, device=dev, generator=gen).to(dtype)
    dht = torch.randn(B, H, K, V, device=dev, generator=gen) if place == "last" else torch.zeros(B, H, K, V, device=dev)
    mid = slice(T, 2 * T)
    names = ("o", "dq", "dk", "dv", "dg")

    # exact: the recurrence shard by shard in float64, the boundary states kept with their gradients
    xs = [t.double().requires_grad_(True) for t in (q, k, v, g)]
    state, boundary, outs = h0.double(), [], []
    for p in range(shards):
        o_p, state = recurrent_gla_reference(*(t[:, p * T:(p + 1) * T] for t in xs), initial_state=state)
        state.retain_grad()
        boundary.append(state)
        outs.append(o_p)
    ((torch.cat(outs, 1) * do.double()).sum() + (state * dht.double()).sum()).backward()
    exact = dict(zip(names, [torch.cat(outs, 1).detach()[:, mid]] + [t.grad[:, mid] for t in xs]))
    exact["final"] = boundary[1].detach()
    S_in = boundary[0].detach().float()
    dS_out = boundary[1].grad.float() if place == "middle" else torch.zeros_like(S_in)

    # fla on the whole sequence, the same slice
    fs = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    g_full = fs[3] if decay == "gla" else fs[3].unsqueeze(-1).expand(B, shards * T, H, K)
    fo, ffin = chunk_gla(fs[0], fs[1], fs[2], g_full, initial_state=h0, output_final_state=True)
    ((fo.float() * do.float()).sum() + (ffin * dht).sum()).backward()
    fla = dict(zip(names, [fo.detach()[:, mid]] + [t.grad[:, mid] for t in fs]))
    fla["final"] = ffin.detach()
    if place == "middle":  # the state after this rank's shard
        _, fla["final"] = chunk_gla(*(t[:, :2 * T].contiguous() for t in (q, k, v, g_full.detach())),
                                    initial_state=h0, output_final_state=True)
    # the gradient of the state entering the shard, as fla computes it: from the shards after it
    rest = [t[:, T:].contiguous() for t in (q, k, v, g_full.detach())]
    fh = S_in.clone().requires_grad_(True)
    fo, ffin = chunk_gla(*rest, initial_state=fh, output_final_state=True)
    ((fo.float() * do[:, T:].float()).sum() + (ffin * dht).sum()).backward()
    fla["dS_in"], exact["dS_in"] = fh.grad, boundary[0].grad

    sent = {}

    def exact_scan(x, gamma, group, *, reverse=False, async_op=False, method=None):
        sent["reverse" if reverse else "forward"] = gamma.clone()  # the shard's decay, both directions
        if reverse:
            sent["x"] = x.clone()  # this rank's part of the gradient the previous rank receives
        y = (dS_out if reverse else S_in).clone()
        return _Ready(y) if async_op else y

    real_cut = op_hooks.shard_cut

    def stand_in(*args):
        cut = real_cut(*args)
        cut.world, cut.rank, cut.continued = shards, 1, True
        return cut

    forget_plans()  # a repeated call reuses its cut: none made before the stand-in
    try:
        # the op's documented hooks: how it issues its scans, how it cuts the shard
        with replaced(op_hooks, gla_scan=exact_scan, shard_cut=stand_in):
            ms = [t[:, mid].clone().requires_grad_(True) for t in (q, k, v, g)]
            o, final = zeco_gla(*ms, dist.group.WORLD, output_final_state=True)
            ((o.float() * do[:, mid].float()).sum() + (final * dht).sum()).backward()
    finally:
        forget_plans()
    mine = dict(zip(names, [o.detach()] + [t.grad for t in ms]))
    mine["final"] = final.detach()
    # what the reverse scan makes of it on this rank: x + (the shard's total decay) * dS_out
    gamma = torch.exp(g[:, mid].double().sum(1))  # the shard's decay as the scans take it: [B, H, K] or [B, H]
    for direction in ("forward", "reverse"):
        if place == "last":  # the chain's end: no scan reads its decay, it passes zeros
            assert not sent[direction].any(), f"the last rank passed the {direction} scan a nonzero decay"
        else:
            assert _rms_ratio(sent[direction], gamma) < 1e-5, f"the {direction} scan's decay is off"
    decay_total = gamma if decay == "gla" else gamma.unsqueeze(-1)
    mine["dS_in"] = sent["x"].double() + decay_total.unsqueeze(-1) * dS_out.double()
    assert fused_kernels_enabled(), "the fused Triton kernels failed and fell back to torch ops (see the warning)"
    bad = {}
    for n in names + ("final", "dS_in"):
        err, fla_err = _rms_ratio(mine[n], exact[n]), _rms_ratio(fla[n], exact[n])
        if not err <= max(MIDDLE_FLOOR[dtype_name], MIDDLE_RATIO * fla_err):
            bad[n] = f"{err:.2e} (fla {fla_err:.2e})"
    assert not bad, f"GLA ({decay}, {dtype_name}) as the {place} rank: errors above {MIDDLE_RATIO}x fla's own: {bad}"
    return True


MIDDLE_RATIO = 1.1
MIDDLE_FLOOR = {"bfloat16": 1e-3, "float32": 1e-5}


@pytest.mark.timeout(RUN_TIMEOUT + 90)
@pytest.mark.parametrize("place", ["middle", "last"])
@pytest.mark.parametrize("decay", ["gla", "simple"])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_one_gpu_as_another_rank_matches_exact(dtype_name, decay, place):
    _need1()
    assert run_distributed(_stand_in, 1, dtype_name, decay, place, timeout=RUN_TIMEOUT, backend="nccl") == [True]
