"""transformers' Gated DeltaNet and KDA hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear) made
sequence-parallel (``hf_hybrids.sequence_parallel``: the delta rule on fla-core's kernels through
``zeco_gated_delta_rule`` / ``zeco_kda``, the attention on Ulysses) at SP = 2 on NCCL, fp32, against transformers'
own model on the whole sequence on one GPU, with B = 2 rows and with a packed row (a sequence start inside rank 0's
shard, a sequence crossing the rank boundary) against each sequence run alone: logits and loss, and every
parameter gradient against a float64 truth (``tests/hf_gpu_parity.py`` says the bounds and why).

    ALLSCAN_TEST_RANKS_PER_GPU=2 python3 -m pytest -s -q -m gpu tests/test_hf_hybrids_gpu.py -p no:cacheprovider

One spawn of two ranks per family (two NCCL ranks may share one GPU), each bounded and reported on its own. fla's
gated delta-rule backward needs tilelang on Hopper with Triton < 3.7.1 (``../shared/tools/device_tilelang.sh``).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", minversion="5.0")

FAMILIES = ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"]


def _model_of(kind):
    """Head sizes of 32 (fla's kernels take 16 and up), fp32 on this rank's GPU."""
    from test_hf_hybrids import tiny_model

    return tiny_model(kind, width=4).float().cuda()


def _gpu_case(rank, world, family):
    from hf_gpu_parity import sp2_against_transformers
    from test_hf_hybrids import VOCAB, fp64_delta_rule_within

    return sp2_against_transformers(rank, world, [family], _model_of, VOCAB, fp64_paths=fp64_delta_rule_within)


@pytest.mark.parametrize("family", FAMILIES)
def test_gdn_and_kda_hybrids_sp2_nccl_equal_transformers(family):
    from hf_gpu_parity import run_and_check

    run_and_check(_gpu_case, [family], "fla.ops.gated_delta_rule", 600, family)
