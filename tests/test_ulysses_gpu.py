"""UlyssesAttention and the C++ chunked all-to-all on 2 GPUs with NCCL (marked gpu).

    pytest -m gpu tests/test_ulysses_gpu.py
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from distributed import nccl_ranks, run_distributed  # noqa: E402
from graph_replay import assert_replay_equals_eager  # noqa: E402

pytestmark = pytest.mark.gpu


def _gpus(n):
    return pytest.mark.skipif(nccl_ranks() < n, reason=f"needs {n} CUDA GPU{'s' if n > 1 else ''} "
                              "(or ALLSCAN_TEST_RANKS_PER_GPU: tests/distributed.py)")


two_gpus = _gpus(2)


def _rms_ratio(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _layer(rank, world, dtype_name, cases):
    import torch.nn.functional as F

    from allscan import a2a
    from allscan.layers import UlyssesAttention

    dtype = getattr(torch, dtype_name)
    tol = 3e-3 if dtype == torch.bfloat16 else 1e-5
    dev = torch.device("cuda", torch.cuda.current_device())
    report = []
    for (B, S, Hq, Hkv, D, causal, C, weights, *packed) in cases:
        bounds = packed[0] if packed else (0, S)
        g = torch.Generator(device=dev).manual_seed(1234)
        mk = lambda h: torch.randn(B, S, h, D, generator=g, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
        q, k, v, w = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
        # single-GPU SDPA on the whole sequence, same dtype; k/v expanded for grouped-query attention
        # and the expanded heads' gradients summed in fp32 (rounded once)
        rep = Hq // Hkv
        qr = q.clone().requires_grad_(True)
        kr, vr = (t.repeat_interleave(rep, 2).requires_grad_(True) for t in (k, v))
        o_ref = torch.cat([F.scaled_dot_product_attention(qr[:, a:b].transpose(1, 2), kr[:, a:b].transpose(1, 2),
                                                          vr[:, a:b].transpose(1, 2), is_causal=causal).transpose(1, 2)
                           for a, b in zip(bounds[:-1], bounds[1:]) if b > a], 1)
        (o_ref.float() * w.float()).sum().backward()
        dk_ref, dv_ref = (t.grad.view(B, S, Hkv, rep, D).float().sum(3).to(dtype) for t in (kr, vr))
        Sl = S // world
        sl = slice(rank * Sl, (rank + 1) * Sl)
        ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
        layer = UlyssesAttention(num_chunks=C, chunk_weights=weights)
        cu = torch.tensor(packed[0], device=dev, dtype=torch.int32) if packed else None
        out = layer(ql, kl, vl, causal=causal, cu_seqlens=cu)
        (out.float() * w[:, sl].float()).sum().backward()
        torch.cuda.synchronize()
        errs = {
            "out": _rms_ratio(out, o_ref[:, sl]),
            "dq": _rms_ratio(ql.grad, qr.grad[:, sl]),
            "dk": _rms_ratio(kl.grad, dk_ref[:, sl]),
            "dv": _rms_ratio(vl.grad, dv_ref[:, sl]),
        }
        report.append(((B, S, Hq, Hkv, D, causal, C, weights, *packed), layer.last_info["num_chunks"], errs))
        for name, e in errs.items():
            assert e <= tol, f"{dtype_name} case {(B, S, Hq, Hkv, D, causal, C, weights)}: {name} RMS error ratio {e:.3g} > {tol}"
    return report


_CASES = [
    # B, S(total), Hq, Hkv, D, causal, C, weights
    (1, 2048, 8, 8, 128, False, 1, None),
    (1, 2048, 8, 8, 128, True, 4, None),
    (2, 1024, 8, 8, 64, True, 2, None),       # B > 1: pack and unpack on both sides
    (1, 2048, 5, 5, 128, True, 3, None),      # uneven heads
    (1, 2048, 8, 2, 128, True, 2, None),      # GQA, k/v split alongside
    (1, 2048, 8, 1, 128, False, 4, None),     # GQA, the one k/v head replicated
    (2, 1024, 6, 3, 64, True, 3, None),       # GQA with unaligned chunks (k/v grads summed across chunks)
    (1, 2048, 8, 8, 128, True, 4, [1, 2, 2, 1]),
    (1, 4096, 8, 8, 128, True, "auto", None),
    # packed sequences (cu_seqlens), one bound on the rank boundary, attended each on its own
    (1, 2048, 8, 2, 128, True, 4, None, (0, 300, 1024, 1500, 2048)),
    (1, 4096, 8, 8, 128, True, "auto", None, (0, 700, 4096)),
]


@two_gpus
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_layer_matches_single_gpu_sdpa(dtype_name):
    report = run_distributed(_layer, 2, dtype_name, _CASES, backend="nccl", timeout=300)
    for case, C, errs in report[0]:
        print(dtype_name, case, "C =", C, {k: f"{v:.2e}" for k, v in errs.items()})


def _auto_measures(rank, world):
    """auto C times the layer at the model's C against C = 1 and keeps the faster; forward-only and
    training uses are measured separately (the model is forced to propose C = 4 here, so the
    measurement runs whatever the hardware)."""
    from allscan.layers import UlyssesAttention
    from allscan.ops import ulysses as U
    from allscan.ops.ulysses import api, tune

    dev = torch.device("cuda", torch.cuda.current_device())
    U.clear_auto_cache()
    tune.choose_num_chunks = lambda *a, **kw: 4
    g = torch.Generator(device=dev).manual_seed(5 + rank)
    q, k, v = (torch.randn(1, 2048, 8, 128, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    layer = UlyssesAttention(num_chunks="auto")
    seen = []
    for train in (False, True):
        qi, ki, vi = (t.clone().requires_grad_(train) for t in (q, k, v))
        out = layer(qi, ki, vi, causal=True)
        info = layer.last_info["auto"]
        assert info["model_num_chunks"] == 4
        m = info["measured_ms"]
        assert set(m) == {1, 4} and all(t > 0 for t in m.values()), m
        assert info["measured_pass"] == ("forward+backward" if train else "forward")
        assert layer.last_info["num_chunks"] == U.pick_measured(m) == info["num_chunks"]
        ref = UlyssesAttention(num_chunks=1)(qi, ki, vi, causal=True)
        assert torch.equal(out, ref) or _rms_ratio(out, ref) < 3e-3
        seen.append(layer.last_info["num_chunks"])
    assert len(api._AUTO_CACHE) == 2  # one entry per use
    return seen


@two_gpus
def test_auto_times_the_model_choice_against_one_chunk():
    res = run_distributed(_auto_measures, 2, backend="nccl", timeout=300)
    assert res[0] == res[1], f"the ranks chose different C: {res}"


def _overlaps(hm):
    heads = [h for lo, hi in hm for h in range(lo, hi)]
    return len(heads) != len(set(heads))


def _cpp_vs_torch(rank, world):
    import allscan
    from allscan import a2a

    dev = torch.device("cuda", torch.cuda.current_device())
    checked = 0
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for B in (1, 2):
            Sl, D = 5, 64
            g = torch.Generator(device=dev).manual_seed(7 + rank)
            mk = lambda *s: torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(dtype)  # noqa: E731
            configs = []
            for H in (8, 5):
                m = a2a.split_heads(0, H, world)
                configs.append(([H, H, H], [m, m, m], [False] * 3))
            qm = a2a.chunk_head_ranges(8, world, 3)[1]
            configs.append(([8, 2, 2], [qm, a2a.kv_head_ranges(qm, 4)] + [a2a.kv_head_ranges(qm, 4)], [False] * 3))
            q8 = a2a.split_heads(0, 8, world)
            k1 = a2a.kv_head_ranges(q8, 8)  # one k/v head, replicated: overlapping map
            configs.append(([8, 1, 1], [q8, k1, k1], [False, True, True]))
            for heads, maps, acc in configs:
                xs = [mk(B, Sl, h, D) for h in heads]
                outs = {}
                for impl in ("cpp", "torch"):
                    allscan.settings.a2a_impl = "auto" if impl == "cpp" else "torch"
                    ys = a2a.scatter_heads_multi(xs, maps)
                    init = [torch.full((B, Sl, h, D), 0.5, device=dev, dtype=dtype) for h in heads]
                    zs = a2a.gather_heads_multi(ys, maps, heads, outs=init, accumulate=acc)
                    torch.cuda.synchronize()
                    outs[impl] = (ys, zs)
                allscan.settings.a2a_impl = "auto"
                for t in range(len(heads)):
                    for kind, i in (("scatter", 0), ("gather", 1)):
                        a, b = outs["cpp"][i][t], outs["torch"][i][t]
                        assert torch.equal(a, b), (
                            f"C++ and torch {kind} differ: dtype {dtype}, B {B}, heads {heads}, tensor {t}, "
                            f"max diff {(a.float() - b.float()).abs().max().item()}")
                    checked += 1
                # and the values themselves: scatter then gather (disjoint maps) is the identity
                for t, (x, z) in enumerate(zip(xs, outs["cpp"][1])):
                    if not acc[t] and not _overlaps(maps[t]):
                        covered = sorted({h for lo, hi in maps[t] for h in range(lo, hi)})
                        assert torch.equal(z[:, :, covered], x[:, :, covered]), f"gather(scatter(x)) != x, tensor {t}"
    # the custom ops on CUDA go through C++ too, and autograd works
    x = torch.randn(1, 4, 6, 32, device=dev, requires_grad=True)
    y = a2a.scatter_heads(x)
    z = a2a.gather_heads(y * 3, num_heads=6)
    z.sum().backward()
    assert torch.equal(z, x.detach() * 3)
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    return checked


@two_gpus
def test_cpp_a2a_bitwise_equals_torch_path():
    counts = run_distributed(_cpp_vs_torch, 2, backend="nccl", timeout=300)
    assert counts[0] > 0


@_gpus(3)
def test_bf16_grouped_kv_with_a_chunk_empty_on_one_rank_over_nccl():
    """tests/test_ulysses.py's case through the core's all-to-all: 8 query heads over 3 ranks in 3
    chunks, so the last rank has none in one chunk and sends empty fp32 k/v gradients for it."""
    from test_ulysses import _bf16_grouped_kv_empty_chunk

    assert run_distributed(_bf16_grouped_kv_empty_chunk, 3, "cuda", backend="nccl", timeout=300) == [True] * 3


@two_gpus
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2)])
def test_retained_graph_backpropagates_twice_over_nccl(Hq, Hkv):
    """tests/test_ulysses.py's case through the core's all-to-all and the two-stream pipeline."""
    from test_ulysses import _retained_twice

    assert run_distributed(_retained_twice, 2, Hq, Hkv, "cuda", backend="nccl", timeout=300) == [True, True]


@two_gpus
def test_double_backward_is_refused_on_every_rank_over_nccl():
    """tests/test_ulysses.py's case through the core's all-to-all: every rank refuses before the backward's
    first all-to-all and reports the call it skips on the fault board; all skipped it, so the group carries on."""
    from test_ulysses import _double_backward_refused

    assert run_distributed(_double_backward_refused, 2, "all", "cuda", backend="nccl", timeout=300) == ["refused"] * 2


def _cross_rank_error(rank, world):
    from allscan.layers import UlyssesAttention

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1, 64 + 64 * rank, 4, 64, device=dev, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ranks disagree on local sequence length S_local \(rank 0: 64, rank 1: 128\)"):
        UlyssesAttention(num_chunks=2)(x, x, x)


@two_gpus
def test_cross_rank_mismatch_raises_on_nccl():
    run_distributed(_cross_rank_error, 2, backend="nccl", timeout=120)


def _chunking_invariance(rank, world, dtype_name):
    """Same inputs through C = 1 (no overlap), C = 4 on two streams, C = 4 on one stream
    (ALLSCAN_ULYSSES_STREAMS=0) and C = 4 with ALLSCAN_CHECK=always: the all-to-alls are the same
    for all, so any difference is a pipeline (synchronisation) bug, not an a2a bug."""
    import allscan
    from allscan.layers import UlyssesAttention

    dtype = getattr(torch, dtype_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    B, Sl, H, D = 1, 1024, 8, 128
    g = torch.Generator(device=dev).manual_seed(99 + rank)
    q, k, v, w = (torch.randn(B, Sl, H, D, generator=g, device=dev, dtype=torch.float32).to(dtype) for _ in range(4))
    results = {}
    for name, C, env in (("C1", 1, {}), ("C4", 4, {}), ("C4_one_stream", 4, {"ALLSCAN_ULYSSES_STREAMS": "0"}),
                         ("C4_checked", 4, {"ALLSCAN_CHECK": "always"})):
        old = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        allscan.settings.reload()  # the settings are read once; these runs change them
        try:
            ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = UlyssesAttention(num_chunks=C)(ql, kl, vl, causal=True)
            (out.float() * w.float()).sum().backward()
            torch.cuda.synchronize()
            results[name] = (out.detach(), ql.grad, kl.grad, vl.grad)
        finally:
            for key, val in old.items():
                if val is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = val
            allscan.settings.reload()
    # Per-head attention does not depend on how many heads a chunk has, so the outputs agree to
    # rounding (bitwise with per-head kernels); the backward may differ by atomics' order in dq.
    tol = 2e-3 if dtype == torch.bfloat16 else 1e-5
    errs = {}
    for name in ("C4", "C4_one_stream", "C4_checked"):
        for i, t in enumerate(("out", "dq", "dk", "dv")):
            e = _rms_ratio(results[name][i], results["C1"][i])
            errs[f"{name} {t}"] = e
            assert e <= tol, f"{dtype_name}: {name} {t} differs from C=1: RMS error ratio {e:.3g} > {tol}"
    # same chunks, same kernels, one stream or two: the forward must match bitwise
    assert torch.equal(results["C4"][0], results["C4_one_stream"][0]), "C=4 forward: two streams != one stream"
    return errs


@two_gpus
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_num_chunks_1_equals_4(dtype_name):
    report = run_distributed(_chunking_invariance, 2, dtype_name, backend="nccl", timeout=300)
    for errs in report:
        print(dtype_name, {k: f"{v:.2e}" for k, v in errs.items()})


def _graph_replay(rank, world, C):
    """UlyssesAttention fwd+bwd (C head chunks: both all-to-alls of every chunk, forward and backward,
    on the communication stream) captured in one CUDA graph on every rank and replayed: bitwise the
    eager call's output and gradients, also after new values are copied into the captured inputs."""
    import torch.distributed as dist

    from allscan.layers import UlyssesAttention

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(21 + rank)
    B, Sl, Hq, Hkv, D = 1, 512, 8, 4, 64

    def fresh():
        return [torch.randn(B, Sl, h, D, device=dev, generator=gen).to(torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq)]

    *ins, do = fresh()
    ins = [t.requires_grad_(True) for t in ins]
    layer = UlyssesAttention(dist.group.WORLD, num_chunks=C)

    def step():
        out = layer(*ins, causal=True)
        return (out,) + torch.autograd.grad(out, ins, do)

    def refill():
        for t, new in zip(ins + [do], fresh()):
            t.copy_(new)

    assert_replay_equals_eager(step, refill, ("out", "dq", "dk", "dv"), rank, dev)
    dist.barrier()
    return True


@pytest.mark.parametrize("world, C", [pytest.param(1, 1, marks=_gpus(1)), pytest.param(2, 1, marks=two_gpus),
                                      pytest.param(2, 4, marks=two_gpus)])
def test_fwd_bwd_graph_replay_equals_eager(world, C):
    assert run_distributed(_graph_replay, world, C, timeout=240, backend="nccl") == [True] * world


def _compiled(rank, world):
    """UlyssesAttention fwd+bwd under torch.compile(fullgraph=True) with aot_eager and with
    mode="reduce-overhead" (inductor, CUDA graphs; the traced form: allscan's all-to-all ops on NCCL and
    SDPA): the same output and gradients as eager within bf16 rounding of the k/v gradient sums (eager
    sums a grouped k/v head's gradients in fp32, the traced form in bf16), after the calls that warm up
    and record the graphs."""
    import torch.distributed as dist

    from allscan.layers import UlyssesAttention

    torch._dynamo.reset()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(31 + rank)
    B, Sl, Hq, Hkv, D = 1, 512, 8, 4, 64
    *ins, do = [torch.randn(B, Sl, h, D, device=dev, generator=gen).to(torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq)]
    layer = UlyssesAttention(dist.group.WORLD, num_chunks=1)

    def step(q, k, v):
        return layer(q, k, v, causal=True)

    results = {}
    for name, fn in (("eager", step), ("aot_eager", torch.compile(step, fullgraph=True, backend="aot_eager")),
                     ("reduce-overhead", torch.compile(step, fullgraph=True, mode="reduce-overhead"))):
        for _ in range(3):
            xs = [t.clone().requires_grad_(True) for t in ins]
            out = fn(*xs)
            results[name] = [t.detach().clone() for t in (out,) + torch.autograd.grad(out, xs, do)]
    torch.cuda.synchronize(dev)
    for name in ("aot_eager", "reduce-overhead"):
        for what, a, b in zip(("out", "dq", "dk", "dv"), results[name], results["eager"]):
            assert _rms_ratio(a, b) < 1e-2, f"rank {rank}: {name}'s {what} differs from eager: {_rms_ratio(a, b):.2e}"
    dist.barrier()
    return True


@pytest.mark.parametrize("world", [pytest.param(1, marks=_gpus(1)), pytest.param(2, marks=two_gpus)])
def test_compiled_equals_eager(world):
    assert run_distributed(_compiled, world, timeout=300, backend="nccl") == [True] * world


@_gpus(1)
def test_pipeline_on_two_streams_waits_for_the_comm_stream_after_a_failure():
    """The two-stream pipeline driver on one GPU, copies standing in for the all-to-alls: the result
    equals twice the input; with attend raising at chunk 1 the error propagates and work enqueued
    on the main stream afterwards sees chunk 0's gather complete (the driver joined the streams)."""
    from allscan.ops.ulysses import pipeline as P

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n, size = 3, 1 << 20
    x = torch.randn(n, size, device=dev)
    for failing in (None, 1):
        mid, out = torch.empty_like(x), torch.zeros_like(x)

        def scatter(c, stream):
            with torch.cuda.stream(stream):
                mid[c].copy_(x[c])

        def attend(c):
            if c == failing:
                raise RuntimeError("injected out of memory")
            return mid[c] * 2

        def gather(c, res, stream):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(100_000_000)  # tens of ms: a main stream not joined to comm reads zeros
                out[c].copy_(res)

        told = []
        if failing is None:
            P.run_pipeline(n, scatter, attend, gather, dev, failed=lambda c, e, step: told.append((c, step)))
            assert torch.equal(out, 2 * x) and not told
        else:
            with pytest.raises(RuntimeError, match="injected"):
                P.run_pipeline(n, scatter, attend, gather, dev, failed=lambda c, e, step: told.append((c, step)))
            seen = out[0].clone()  # on the main stream
            torch.cuda.synchronize()
            assert told == [(1, "attend")] and torch.equal(seen, 2 * x[0])
