"""Sequence-parallel GLA on 2 GPUs (NCCL) against fla's single-GPU ``chunk_gla`` on the whole sequence.

    python3 -m pytest -s -q -m gpu tests/test_gla_gpu.py -p no:cacheprovider   # 2 processes, one per GPU

Every rank computes fla's ``chunk_gla`` on the whole sequence (the reference) and ``zeco_gla`` on its
shard, then compares output, final state and the gradients of q, k, v, g and the initial state.
Metric: RMS error ratio ``rms(ours - ref) / rms(ref)``; at most 3e-3 in bf16 and 1e-5 in fp32 (for
fp32, Triton's dots are switched to IEEE fp32 with TRITON_F32_DEFAULT=ieee, else fla itself runs in
tf32 and the reference is not an fp32 one).

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
from distributed import run_distributed  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 3e-3, "float32": 1e-5}
RUN_TIMEOUT = 300  # seconds for the 2 ranks of one dtype, compilation included
METHODS = ["zeco", "lasp1", "lasp2"]


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

    from allscan.layers._gla_local import _fused_ok, limit_fla_autotune
    from allscan.layers.gla import zeco_gla

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

        sl = slice(rank * T_local, (rank + 1) * T_local)
        off = rank * T_local
        if cu_list is None:
            rows = list(range(N)) if rank == world - 1 else []
        else:
            rows = [i for i in range(N) if off < cu_list[i + 1] <= off + T_local]
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
            got = {"o": (o, ref["o"][:, sl]), "dq": (mq.grad, ref["dq"][:, sl]), "dk": (mk.grad, ref["dk"][:, sl]),
                   "dv": (mv.grad, ref["dv"][:, sl]), "dh0": (dh0, ref["dh0"])}
            if mg is not None:
                got["dg"] = (mg.grad, ref["dg"][:, sl])
            if rows:
                got["final"] = (fin[rows], rht[rows])
            worst = 0.0
            for name, (a, b) in got.items():
                assert a.shape == b.shape, f"{case['name']} {method} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
                err = _rms_ratio(a, b)
                errors[f"{case['name']}/{method}/{name}"] = err
                worst = max(worst, err)
            say(f"{case['name']}/{method}: done, worst RMS error ratio on this rank {worst:.2e}")
    assert _fused_ok(), "the fused Triton correction kernels failed and fell back to torch ops (see the warning)"
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
    print(f"\nzeco_gla vs fla chunk_gla (whole sequence), {dtype_name}, RMS error ratio (max over ranks), "
          f"{time.monotonic() - t0:.0f} s:", flush=True)
    for key in sorted(worst):
        print(f"  {key:40s} {worst[key]:.2e}")
    expected = {f"{c['name']}/{m}/o" for c in _cases() for m in METHODS}
    assert expected <= set(worst), f"missing results: {sorted(expected - set(worst))}"
    bad = {k: v for k, v in worst.items() if not v <= tol}
    assert not bad, f"RMS error ratio above {tol} ({dtype_name}): {bad}"
