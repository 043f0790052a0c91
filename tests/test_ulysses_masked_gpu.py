"""Sliding windows, soft-caps and sinks on the GPU (marked gpu): the FlexAttention path against the math path
(fp64) on one GPU, and Ulysses with every option over two NCCL ranks against one process's math attention.

    pytest -m gpu tests/test_ulysses_masked_gpu.py
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import nccl_ranks, run_distributed  # noqa: E402

pytestmark = pytest.mark.gpu

BOUNDS = (0, 300, 700, 1024)  # the middle sequence crosses the boundary of two ranks


def _rms(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _inputs(dev, S=1024, H=8, Hkv=8, D=64, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, w = (torch.randn(1, S, h, D, generator=g, device=dev, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    return q, k, v, w, torch.randn(H, generator=g, device=dev, dtype=torch.float64)


def _grads(fn, tensors, w):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad((out.double() * w).sum(), leaves))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_flex_equals_math(dtype_name):
    from allscan.ops.ulysses import MaskSpec, masked_attention
    from allscan.ops.ulysses.masked import flex_ok

    dtype, dev = getattr(torch, dtype_name), torch.device("cuda")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    q, k, v, w, sinks = _inputs(dev)
    assert flex_ok(q.to(dtype))
    for spec, with_sinks in ((MaskSpec(scale=0.125, window=100), False),
                             (MaskSpec(scale=0.125, window=64, softcap=2.0, bounds=BOUNDS), True),
                             (MaskSpec(scale=0.125, softcap=5.0), True)):
        ins = [q, k, v] + ([sinks] if with_sinks else [])
        ref = _grads(lambda *t: masked_attention(*t[:3], spec, t[3] if with_sinks else None, kernel="math"), ins, w)
        got = _grads(lambda *t: masked_attention(*t[:3], spec, t[3] if with_sinks else None, kernel="flex"),
                     [t.to(dtype) for t in ins], w)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
            assert _rms(a, b) < tol, (dtype_name, spec, name, _rms(a, b))


def _ulysses(rank, world):
    from allscan.ops.ulysses import MaskSpec, masked_attention, ulysses_attention

    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v, w, sinks = _inputs(dev, Hkv=2)
    spec = MaskSpec(scale=0.125, window=128, softcap=3.0, bounds=BOUNDS)
    ref = _grads(lambda q, k, v, s: masked_attention(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), spec,
                                                     s, kernel="math"), [q, k, v, sinks], w)
    T = q.shape[1] // world
    sl = slice(rank * T, (rank + 1) * T)
    mine = [t[:, sl].float().contiguous() for t in (q, k, v)] + [sinks.float()]
    got = _grads(lambda q, k, v, s: ulysses_attention(q, k, v, None, causal=True, scale=0.125, num_chunks=2,
                                                      cu_seqlens=list(BOUNDS), window=128, softcap=3.0, sinks=s),
                 mine, w[:, sl])
    torch.distributed.all_reduce(got[4])  # each rank holds its heads' share of the sinks' gradient
    errs = {name: _rms(a, b[:, sl] if b.dim() == 4 else b)
            for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref)}
    assert all(e < 1e-4 for e in errs.values()), errs
    return errs


@pytest.mark.skipif(nccl_ranks() < 2, reason="needs 2 CUDA GPUs (or ALLSCAN_TEST_RANKS_PER_GPU: tests/distributed.py)")
def test_ulysses_window_softcap_sinks_nccl():
    run_distributed(_ulysses, 2, backend="nccl", timeout=300)
