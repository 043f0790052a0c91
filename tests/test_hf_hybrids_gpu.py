"""transformers' Gated DeltaNet and KDA hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear) made
sequence-parallel (``hf_hybrids.sequence_parallel``: the delta rule on fla-core's kernels through
``zeco_gated_delta_rule`` / ``zeco_kda``, the attention on Ulysses) at SP = 2 on NCCL, fp32, against transformers'
own model on the whole sequence on one GPU: logits, loss and every parameter gradient, with B = 2 rows and with a
packed row (a sequence start inside rank 0's shard, a sequence crossing the rank boundary) against each sequence
run alone.

    ALLSCAN_TEST_RANKS_PER_GPU=2 python3 -m pytest -s -q -m gpu tests/test_hf_hybrids_gpu.py -p no:cacheprovider

One spawn of two ranks for the four families (two NCCL ranks may share one GPU). fla's gated delta-rule backward
needs tilelang on Hopper with Triton < 3.7.1 (``../shared/tools/device_tilelang.sh``). fp32 runs with IEEE dots in
fla's kernels (``TRITON_F32_DEFAULT=ieee``); the bound is the hybrids' fp32 one, 2e-4 relative.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", minversion="5.0")

TOL = 2e-4
T = 256  # 128 tokens a rank: two of fla's 64-token chunks
BOUNDS = [0, 40, 150, T]  # 40 inside rank 0's shard; the sequence 40..150 crosses the boundary at 128
FAMILIES = ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"]


def _batch(packed):
    from test_hf_hybrids import VOCAB

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1 if packed else 2, T), generator=gen)
    labels = ids.clone()
    if packed:
        labels[0, BOUNDS[1:-1]] = -100  # no label across a sequence start (as transformers' collator)
    else:
        labels[1, :3] = -100
    return ids.cuda(), labels.cuda()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _gpu_case(rank, world):
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    from allscan.integrations import hf_hybrids as sp
    from test_hf_hybrids import tiny_model

    def model_of(kind):  # head sizes of 32 (fla's kernels take 16 and up), fp32 on this rank's GPU
        return tiny_model(kind, width=4).float().cuda()

    res = {}
    for kind in FAMILIES:
        for packed in (False, True):
            ids, labels = _batch(packed)
            ref = model_of(kind)
            shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX)
            pieces = list(zip(BOUNDS[:-1], BOUNDS[1:])) if packed else [(0, T)]
            ref_logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in pieces], dim=1)
            ref_loss = sp.causal_lm_loss(ref_logits, sp.BatchShard(ids, None, shift,
                                                                   int((shift != sp.IGNORE_INDEX).sum())))
            ref_loss.backward()

            model = sp.sequence_parallel(model_of(kind))
            pos = torch.cat([torch.arange(b - a) for a, b in pieces])[None].cuda() if packed else None
            shard = sp.shard_batch(ids, labels, position_ids=pos)
            logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
            loss = sp.causal_lm_loss(logits, shard)
            loss.backward()
            sp.sync_gradients(model)
            Tl = T // world
            grads = {n: p.grad for n, p in model.named_parameters()}
            res[(kind, packed)] = {
                "loss": abs(sp.reduce_loss(loss).item() - ref_loss.item()) / abs(ref_loss.item()),
                "logits": _rel(logits, ref_logits[:, rank * Tl:(rank + 1) * Tl]),
                "grads": max(_rel(grads[n], p.grad) for n, p in ref.named_parameters() if p.grad is not None),
                "missing": sorted(n for n, p in ref.named_parameters() if p.grad is not None and grads[n] is None)}
            print(f"rank {rank} {kind} packed={packed}: {res[(kind, packed)]}", flush=True)
    return res


def test_gdn_and_kda_hybrids_sp2_nccl_equal_transformers():
    skip_unless_nccl_ranks(2)
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"needs fla-core (flash-linear-attention): {e}")
    results = run_distributed(_gpu_case, 2, backend="nccl", timeout=900)
    for rank, res in enumerate(results):
        assert sorted(res) == sorted((k, p) for k in FAMILIES for p in (False, True)), res
        for key, r in res.items():
            assert not r["missing"] and max(r["loss"], r["logits"], r["grads"]) <= TOL, (rank, key, r)
