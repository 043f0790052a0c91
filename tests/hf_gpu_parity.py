"""The GPU parity check the transformers hybrids' GPU tests share: at SP = 2 on NCCL, fp32, each family's model made
sequence-parallel against transformers' own model on the whole sequence on one GPU, with B = 2 rows and with a
packed row (a sequence start inside rank 0's shard, a sequence crossing the rank boundary) against each sequence
run alone: logits and loss against transformers' fp32 model; every parameter gradient against a float64 truth
(transformers' own model, the same weights, on CPU, its scan in float64; its norms and softmax still round to fp32,
as transformers writes them), within TOL or :data:`OWN_ERROR_FACTOR` times transformers' own fp32 error on the
GPU: where a gradient is a sum that cancels (the gates' ``A_log``, ``dt_bias``), two fp32 computations of it in
different orders are each that far from the truth, not equally far (on CPU, on torch's paths, Qwen3.5's
``dt_bias``: transformers' 5.9e-4, allscan's sharded 1.2e-3).

Where both models compute in IEEE fp32 (torch's paths, fla's Triton kernels with ``TRITON_F32_DEFAULT=ieee``, no
TF32 in cuBLAS and cuDNN), a gradient is also never more than :data:`GRAD_CAP` off (a reference that far off would
hide a wrong gradient: the test fails instead). Not so where fla hands the delta rule's backward to tilelang
(:func:`fla_backward_in_tilelang`: fla-core 0.6 does for the gated delta rule on Hopper with Triton 3.4 to 3.7.0,
and for KDA wherever tilelang and nvcc are there), whose fp32 matrix products are TF32. Measured on an H100
(fla-core 0.6.0, the op alone against a float64 recurrence, Qwen3-Next's gates): dq and dk 1.5e-3 relative, and
the gate gradients, sums that cancel, from 4e-2 up to several times their own size (an fp32 recurrence: 4e-7),
and transformers' own model there is just as far from the truth. On those kernels the check is that allscan's
gradients are within that factor of transformers' own error (``grad_cap=None``), which cannot tell a wrong gate gradient
from fla's rounding: the GPU tests hold every family to the cap on torch's paths beside it."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import pytest
import torch

TOL = 2e-4  # the hybrids' fp32 bound
GRAD_CAP = 1e-2  # the most a gradient may be off the truth in IEEE fp32, whatever transformers' own error
OWN_ERROR_FACTOR = 4  # how many times transformers' own fp32 error a gradient may be off (module docstring)
T = 256  # 128 tokens a rank: two of fla's 64-token chunks
BOUNDS = [0, 40, 150, T]  # 40 inside rank 0's shard; the sequence 40..150 crosses the boundary at 128


def _batch(packed, vocab):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1 if packed else 2, T), generator=gen)
    labels = ids.clone()
    if packed:
        labels[0, BOUNDS[1:-1]] = -100  # no label across a sequence start (as transformers' collator)
    else:
        labels[1, :3] = -100
    return ids.cuda(), labels.cuda()


def _rel(a, b):
    """Relative error, on the CPU (the truth is computed there, the rest on the GPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grad_bound(own, truth, cap):
    """How far a gradient may be from the truth: TOL, or OWN_ERROR_FACTOR times transformers' own fp32 error ``own``
    (None: its run left the parameter without a gradient), at most ``cap`` (None: no cap)."""
    bound = max(TOL, 0.0 if own is None else OWN_ERROR_FACTOR * _rel(own, truth))
    return bound if cap is None else min(cap, bound)


def fla_backward_in_tilelang(kda: bool) -> bool:
    """Whether fla hands the gated delta rule's (``kda``: KDA's) backward to its tilelang backend here."""
    try:
        if kda:
            from fla.ops.kda.backends import KDATileLangBackend as Backend
        else:
            from fla.ops.common.backends.tilelang import CommonTileLangBackend as Backend
    except ImportError:
        return False
    backend = Backend()
    return backend.is_available() and backend.is_enabled()


def _transformers_run(model, ids, labels, packed, sp):
    """transformers' own model on the whole sequence (each packed sequence alone): logits, loss, gradients."""
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX)
    pieces = list(zip(BOUNDS[:-1], BOUNDS[1:])) if packed else [(0, T)]
    logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in pieces], dim=1)
    loss = sp.causal_lm_loss(logits, sp.BatchShard(ids, None, shift, int((shift != sp.IGNORE_INDEX).sum())))
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def sp2_against_transformers(rank, world, families, model_of, vocab, prepare=lambda kind: None,
                             fp64_paths=lambda kind: contextlib.nullcontext(),
                             fp32_paths=lambda kind: contextlib.nullcontext(), grad_cap=GRAD_CAP):
    """Run on each rank of a spawned NCCL world: ``{(family, packed): errors}``. ``model_of(kind)``: a fresh seeded
    fp32 model on this rank's GPU; ``prepare(kind)``: what the family's reference needs first; ``fp64_paths(kind)``:
    a context in which transformers' torch paths of the family compute in float64 (the truth's);
    ``fp32_paths(kind)``: a context in which both fp32 models are built and run (the kernels they take);
    ``grad_cap``: :func:`_grad_bound`'s (the module docstring says what is compared and why)."""
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from allscan.integrations import hf_hybrids as sp
    from allscan.ops.gla import limit_fla_autotune

    # one config per fla kernel, transformers' own calls of them included: fla's full autotuning took each
    # spawned rank minutes (the whole call's time on the lent GPU); without fla-core (torch's paths) nothing to limit
    try:
        limit_fla_autotune("one")
    except ImportError:
        pass

    res = {}
    for kind in families:
        prepare(kind)
        for packed in (False, True):
            ids, labels = _batch(packed, vocab)
            with fp64_paths(kind):
                _, _, truth = _transformers_run(model_of(kind).double().cpu(), ids.cpu(), labels.cpu(), packed, sp)
            with fp32_paths(kind):
                ref_logits, ref_loss, ref_grads = _transformers_run(model_of(kind), ids, labels, packed, sp)
                model = sp.sequence_parallel(model_of(kind))
                pieces = list(zip(BOUNDS[:-1], BOUNDS[1:]))
                pos = torch.cat([torch.arange(b - a) for a, b in pieces])[None].cuda() if packed else None
                shard = sp.shard_batch(ids, labels, position_ids=pos)
                logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
                loss = sp.causal_lm_loss(logits, shard)
                loss.backward()
            sp.sync_gradients(model)
            Tl = T // world
            grads = {n: p.grad for n, p in model.named_parameters()}
            missing = sorted(n for n in truth if grads[n] is None)
            over = {n: _rel(grads[n], t) / _grad_bound(ref_grads.get(n), t, grad_cap) for n, t in truth.items()
                    if grads[n] is not None}
            over = {n: r if math.isfinite(r) else math.inf for n, r in over.items()}  # max() passes NaN over
            worst = max(over, key=over.get)
            res[(kind, packed)] = {
                "loss": abs(sp.reduce_loss(loss).item() - ref_loss.item()) / abs(ref_loss.item()),
                "logits": _rel(logits, ref_logits[:, rank * Tl:(rank + 1) * Tl]),
                "grads over bound": over[worst], "worst": worst,
                "its error": _rel(grads[worst], truth[worst]),
                "transformers' error": None if worst not in ref_grads else _rel(ref_grads[worst], truth[worst]),
                "missing": missing}
            print(f"rank {rank} {kind} packed={packed}: {res[(kind, packed)]}", flush=True)
    return res


def run_and_check(case, families, fla_module: Optional[str], timeout: int, *args) -> None:
    """``case(rank, world, *args)`` on two NCCL ranks (skipped without two ranks or without ``fla_module``, the
    fla-core kernels the families run on; None: none), then :func:`check` of what every rank returned."""
    import importlib

    from distributed import run_distributed, skip_unless_nccl_ranks

    skip_unless_nccl_ranks(2)
    try:
        if fla_module is not None:
            importlib.import_module(fla_module)
    except Exception as e:  # noqa: BLE001 - any failure to import: not usable here
        pytest.skip(f"needs fla-core (flash-linear-attention): {e}")
    check(run_distributed(case, 2, *args, backend="nccl", timeout=timeout), families)


def check(results, families) -> None:
    """Every rank saw every family, rows and packed, within :data:`TOL`, every gradient present."""
    for rank, res in enumerate(results):
        assert sorted(res) == sorted((k, p) for k in families for p in (False, True)), res
        for key, r in res.items():
            assert not r["missing"] and max(r["loss"], r["logits"]) <= TOL and r["grads over bound"] <= 1, \
                (rank, key, r)
