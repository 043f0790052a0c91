"""Sequence-parallel GLA on 2 GPUs (NCCL) against fla's single-GPU ``chunk_gla`` on the whole sequence.

    python3 -m pytest -q -m gpu tests/test_gla_gpu.py      # spawns 2 processes, one per GPU

Every rank computes fla's ``chunk_gla`` on the whole sequence (the reference) and ``zeco_gla`` on its
shard, then compares output, final state and the gradients of q, k, v, g and the initial state.
Metric: RMS error ratio ``rms(ours - ref) / rms(ref)``; at most 3e-3 in bf16 and 1e-5 in fp32 (for
fp32, Triton's dots are switched to IEEE fp32 with TRITON_F32_DEFAULT=ieee, else fla itself runs in
tf32 and the reference is not an fp32 one).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 3e-3, "float32": 1e-5}


def _need():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    try:
        import fla.ops.gla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"needs fla-core (flash-linear-attention): {e}")


def _rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _cases():
    T_local = 1024
    return [
        dict(name="gla", decay="gla", B=2, T_local=T_local, cu=None),
        dict(name="simple_gla", decay="simple", B=2, T_local=T_local, cu=None),
        dict(name="linear", decay="none", B=1, T_local=T_local, cu=None),
        # a sequence crossing the rank boundary (300..1500), cuts inside both ranks, one ending at the end
        dict(name="gla_varlen", decay="gla", B=1, T_local=T_local, cu=[0, 300, 1500, 1700, 2048]),
        # a sequence starting exactly on the rank boundary
        dict(name="gla_varlen_edge", decay="gla", B=1, T_local=T_local, cu=[0, 1000, 1024, 2048]),
    ]


def _run(rank, world, dtype_name, methods):
    if dtype_name == "float32":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch.distributed as dist
    import torch.nn.functional as F
    from fla.ops.gla import chunk_gla

    from allscan.layers.gla import zeco_gla

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

        # reference: fla on the whole sequence
        rq, rk, rv = (x.clone().requires_grad_(True) for x in (q, k, v))
        rg = None if g is None else g.clone().requires_grad_(True)
        rh0 = h0.clone().requires_grad_(True)
        g_full = (torch.zeros(B, T, H, K, device=dev, dtype=dtype) if rg is None
                  else rg.unsqueeze(-1).expand(B, T, H, K) if rg.dim() == 3 else rg)
        ro, rht = chunk_gla(rq, rk, rv, g_full, initial_state=rh0, output_final_state=True, cu_seqlens=cu)
        ((ro.float() * do.float()).sum() + (rht * dht).sum()).backward()
        ref = {"o": ro, "dq": rq.grad, "dk": rk.grad, "dv": rv.grad, "dh0": rh0.grad}
        if rg is not None:
            ref["dg"] = rg.grad

        sl = slice(rank * T_local, (rank + 1) * T_local)
        off = rank * T_local
        if cu_list is None:
            rows = list(range(N)) if rank == world - 1 else []
        else:
            rows = [i for i in range(N) if off < cu_list[i + 1] <= off + T_local]
        dfin = torch.zeros_like(dht)
        dfin[rows] = dht[rows]
        for method in methods:
            mq, mk, mv = (x[:, sl].clone().requires_grad_(True) for x in (q, k, v))
            mg = None if g is None else g[:, sl].clone().requires_grad_(True)
            mh0 = h0.clone().requires_grad_(True)
            o, fin = zeco_gla(mq, mk, mv, mg, dist.group.WORLD, initial_state=mh0, output_final_state=True,
                              cu_seqlens=cu, method=method)
            ((o.float() * do[:, sl].float()).sum() + (fin * dfin).sum()).backward()
            dh0 = mh0.grad.clone()
            dist.all_reduce(dh0)
            got = {"o": (o, ref["o"][:, sl]), "dq": (mq.grad, ref["dq"][:, sl]), "dk": (mk.grad, ref["dk"][:, sl]),
                   "dv": (mv.grad, ref["dv"][:, sl]), "dh0": (dh0, ref["dh0"])}
            if mg is not None:
                got["dg"] = (mg.grad, ref["dg"][:, sl])
            if rows:
                got["final"] = (fin[rows], rht[rows])
            for name, (a, b) in got.items():
                assert a.shape == b.shape, f"{case['name']} {method} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
                errors[f"{case['name']}/{method}/{name}"] = _rms_ratio(a, b)
    from allscan.layers._gla_local import _fused_ok
    assert _fused_ok(), "the fused Triton correction kernels failed and fell back to torch ops (see the warning)"
    return errors


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_zeco_gla_matches_fla_whole_sequence(dtype_name):
    _need()
    methods = ["zeco", "lasp1", "lasp2"]
    results = run_distributed(_run, 2, dtype_name, methods, timeout=900, backend="nccl")
    tol = TOL[dtype_name]
    worst = {}
    for per_rank in results:
        for key, err in per_rank.items():
            worst[key] = max(worst.get(key, 0.0), err)
    print(f"\nzeco_gla vs fla chunk_gla (whole sequence), {dtype_name}, RMS error ratio (max over ranks):")
    for key in sorted(worst):
        print(f"  {key:40s} {worst[key]:.2e}")
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, f"RMS error ratio above {tol} ({dtype_name}): {bad}"
