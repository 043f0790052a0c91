"""transformers' Gated DeltaNet and KDA hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear) made
sequence-parallel (``hf_hybrids.sequence_parallel``: the delta rule through ``zeco_gated_delta_rule`` /
``zeco_kda``, the attention on Ulysses) at SP = 2 on NCCL, fp32, against transformers' own model on the whole
sequence on one GPU, with B = 2 rows and with a packed row (a sequence start inside rank 0's shard, a sequence
crossing the rank boundary) against each sequence run alone: logits and loss, and every parameter gradient against
a float64 truth (``tests/hf_gpu_parity.py`` says the bounds and why). Two ways:

- on fla-core's kernels, as users run them, both models: allscan's gradients within a few times transformers'
  own error, uncapped where fla's delta-rule backward runs in tilelang (TF32 products);
- on torch's paths, both models (allscan's torch delta rule, transformers' own torch function): IEEE fp32, every
  gradient within the cap as well: the sequence-parallel algorithm on NCCL, each family's gates included, held
  tight.

    ALLSCAN_TEST_RANKS_PER_GPU=2 python3 -m pytest -s -q -m gpu tests/test_hf_hybrids_gpu.py -p no:cacheprovider

One spawn of two ranks per case (two NCCL ranks may share one GPU), each bounded and reported on its own. fla's
gated delta-rule backward needs tilelang on Hopper with Triton < 3.7.1 (``../shared/tools/device_tilelang.sh``);
its kernels compile on first use, about half a minute each.
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _torch_paths(kind):
    """Both fp32 models on torch's delta rule: transformers' own function, allscan's torch backend (whose
    warning that fla-core is not importable would mislead here)."""
    import warnings
    from unittest import mock

    from test_hf_hybrids import torch_delta_rule_within

    import allscan.ops.delta.prepare as prepare

    with torch_delta_rule_within(kind, in_inputs_dtype=False), \
            mock.patch.object(prepare, "fla_usable", lambda q: False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fla-core is not importable.*")
        yield


def _gpu_case(rank, world, family, kernels):
    from hf_gpu_parity import GRAD_CAP, fla_backward_in_tilelang, sp2_against_transformers
    from test_hf_hybrids import VOCAB, torch_delta_rule_within

    if kernels == "fla":  # no cap where fla's backward runs in tilelang (TF32 products: hf_gpu_parity says why)
        fp32_paths = lambda kind: contextlib.nullcontext()  # noqa: E731
        grad_cap = None if fla_backward_in_tilelang(kda=family == "kimi_linear") else GRAD_CAP
    else:
        fp32_paths, grad_cap = _torch_paths, GRAD_CAP
    return sp2_against_transformers(rank, world, [family], _model_of, VOCAB, fp64_paths=torch_delta_rule_within,
                                    fp32_paths=fp32_paths, grad_cap=grad_cap)


@pytest.mark.parametrize("family", FAMILIES)
def test_gdn_and_kda_hybrids_sp2_nccl_on_fla_as_close_as_transformers(family):
    from hf_gpu_parity import run_and_check

    run_and_check(_gpu_case, [family], "fla.ops.gated_delta_rule", 600, family, "fla")


@pytest.mark.parametrize("family", FAMILIES)
def test_gdn_and_kda_hybrids_sp2_nccl_on_torch_paths_equal_transformers(family):
    from hf_gpu_parity import run_and_check

    run_and_check(_gpu_case, [family], None, 600, family, "torch")
