"""Mamba2's SSD (:func:`allscan.ops.ssd.zeco_ssd`) on fla-core's kernels (through zeco_gla) against the exact
recurrence and against fla's ``chunk_gla`` on the whole sequence: one rank (``LOCAL``, the whole sequence) and two
NCCL ranks (sharing one GPU with ``ALLSCAN_TEST_RANKS_PER_GPU=2``).

    ALLSCAN_TEST_RANKS_PER_GPU=2 python3 -m pytest -s -q -m gpu tests/test_ssd_gpu.py -p no:cacheprovider

Every rank computes on the whole sequence the exact answer (:func:`allscan.ssd_reference.ssd_recurrence` in
float64 on the same rounded inputs, with autograd) and fla's ``chunk_gla`` with q = C, k = B, v = dt x, g = dt A
broadcast over the state's K, scale 1 (the skip term D x added, the groups broadcast to the heads), then zeco_ssd
on the whole sequence and on its shard; outputs, final states and the gradients of x, dt, A, B, C, D and the
initial state. Metric: RMS error ratio against the exact answer; bound: ``TOL`` or 1.25x fla's own error on the
same slice (as accurate as the single-GPU kernel). fp32 runs Triton's dots in IEEE fp32
(TRITON_F32_DEFAULT=ieee). Not fla's ``chunk_simple_gla`` (the SSD's own form): fla-core 0.6 refuses its gated
backward on Hopper with Triton 3.4 to 3.7.0 (fla issue #640) unless tilelang takes it, which it does only for
fp32, with TF32 products.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 3e-3, "float32": 1e-5}
RUN_TIMEOUT = 300
H, G, P, N = 4, 2, 64, 64  # heads, groups of B and C, head dim, state size
T_LOCAL = 512


def _rms_ratio(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _fla_ssd(x, dt, A, B, C, D, h0, cu):
    """SSD by fla's chunk_gla on the whole sequence (the state transposed: fla's [K=N, V=P])."""
    from fla.ops.gla import chunk_gla

    heads = H // G
    q, k = (t.repeat_interleave(heads, dim=2) for t in (C, B))
    v = (dt.unsqueeze(-1) * x.float()).to(x.dtype)
    g = (dt * A).unsqueeze(-1).expand(*dt.shape, N)
    y, fin = chunk_gla(q, k, v, g, scale=1.0, initial_state=h0.transpose(-1, -2).contiguous(),
                       output_final_state=True, cu_seqlens=cu)
    return (y.float() + D[:, None] * x.float()).to(x.dtype), fin.transpose(-1, -2)


def _run(rank, world, dtype_name):
    if dtype_name == "float32":
        os.environ["TRITON_F32_DEFAULT"] = "ieee"  # before Triton compiles anything in this process
    torch.backends.cuda.matmul.allow_tf32 = False
    import torch.distributed as dist
    import torch.nn.functional as F

    from allscan.ops import LOCAL
    from allscan.ops.gla import fused_kernels_enabled, limit_fla_autotune
    from allscan.ops.ssd import zeco_ssd
    from allscan.ssd_reference import ssd_recurrence

    limit_fla_autotune("one")
    dtype, dev = getattr(torch, dtype_name), torch.device("cuda", torch.cuda.current_device())
    T = T_LOCAL * world
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    names = ("x", "dt", "A", "B", "C", "D", "initial_state")
    bad = {}
    # unpacked (batch 2); packed with starts inside both shards and one exactly on the rank boundary
    for b, cu_list in ((2, None), (1, [0, 300, T_LOCAL, T_LOCAL + 100, T])):
        gen = torch.Generator(device=dev).manual_seed(7)
        x = torch.randn(b, T, H, P, device=dev, generator=gen).to(dtype)
        dt = F.softplus(torch.randn(b, T, H, device=dev, generator=gen) - 3)
        A = -torch.exp(torch.randn(H, device=dev, generator=gen))
        B, C = (torch.randn(b, T, G, N, device=dev, generator=gen).to(dtype) / 8 for _ in range(2))
        D = torch.randn(H, device=dev, generator=gen)
        rows = b if cu_list is None else len(cu_list) - 1
        h0 = 0.1 * torch.randn(rows, H, P, N, device=dev, generator=gen)
        dy = torch.randn(b, T, H, P, device=dev, generator=gen).to(dtype)
        dfin = torch.randn(rows, H, P, N, device=dev, generator=gen)
        cu = None if cu_list is None else torch.tensor(cu_list, device=dev)
        ends = (list(range(rows)) if rank == world - 1 else []) if cu is None else \
            [i for i in range(rows) if rank * T_LOCAL < cu_list[i + 1] <= (rank + 1) * T_LOCAL]

        def run(fn, ins, grad_of_y, grad_of_final):
            ins = [t.clone().requires_grad_(True) for t in ins]
            y, fin = fn(*ins)
            loss = (y.double() * grad_of_y.double()).sum() + (fin.double() * grad_of_final.double()).sum()
            return y.detach(), fin.detach(), torch.autograd.grad(loss, ins)

        whole = (x, dt, A, B, C, D, h0)
        exact = run(lambda *a: ssd_recurrence(*a[:6], initial_state=a[6], cu_seqlens=cu_list), whole, dy, dfin)
        fla = run(lambda *a: _fla_ssd(*a, cu), whole, dy, dfin)
        one = run(lambda *a: zeco_ssd(*a[:6], LOCAL, initial_state=a[6], output_final_state=True, cu_seqlens=cu),
                  whole, dy, dfin)
        # two ranks: this rank's shard; the final state's gradient where its rows end (all rows of the last)
        dfin_here = torch.zeros_like(dfin)
        dfin_here[ends] = dfin[ends]
        shard = [t[:, sl] if t.dim() > 1 and t.shape[1] == T else t for t in whole]
        sp = run(lambda *a: zeco_ssd(*a[:6], dist.group.WORLD, initial_state=a[6], output_final_state=True,
                                     cu_seqlens=cu), shard, dy[:, sl], dfin_here)
        sp_grads = list(sp[2])
        for i in (2, 5, 6):  # A, D, initial_state: summed over the ranks (NCCL needs contiguous tensors)
            sp_grads[i] = sp_grads[i].contiguous()
            dist.all_reduce(sp_grads[i])
        tag = f"{dtype_name} batch {b} packed {cu_list is not None}"
        compare = {"y": (one[0], sp[0], exact[0], fla[0]),
                   "final": (one[1], sp[1][ends], exact[1], fla[1])}
        for n, o, s, e, f in zip(names, one[2], sp_grads, exact[2], fla[2]):
            compare[f"d{n}"] = (o, s, e, f)
        for what, (o, s, e, f) in compare.items():
            sharded = what in ("y", "dx", "ddt", "dB", "dC")
            e_sp, f_sp = (e[:, sl], f[:, sl]) if sharded else (e[ends], f[ends]) if what == "final" else (e, f)
            bound = max(TOL[dtype_name], 1.25 * _rms_ratio(f, e))
            if not _rms_ratio(o, e) <= bound:
                bad[f"{tag} one rank {what}"] = (_rms_ratio(o, e), bound)
            if what == "final" and not ends:
                continue
            bound_sp = max(TOL[dtype_name], 1.25 * _rms_ratio(f_sp, e_sp))
            if not _rms_ratio(s, e_sp) <= bound_sp:
                bad[f"{tag} two ranks {what}"] = (_rms_ratio(s, e_sp), bound_sp)
    assert fused_kernels_enabled(), "the fused Triton kernels failed and fell back to torch ops (see the warning)"
    assert not bad, f"rank {rank}: RMS error ratio above the bound ((error, bound)): {bad}"
    return True


@pytest.mark.timeout(RUN_TIMEOUT + 90)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_zeco_ssd_matches_exact_and_fla(dtype_name):
    skip_unless_nccl_ranks(2)
    pytest.importorskip("fla.ops.gla")
    assert run_distributed(_run, 2, dtype_name, timeout=RUN_TIMEOUT, backend="nccl") == [True, True]
