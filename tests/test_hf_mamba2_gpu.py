"""transformers' Nemotron-H and Bamba made sequence-parallel (``hf_hybrids.sequence_parallel``, the Mamba2 mixers on
``zeco_ssd`` with fla-core's kernels) at SP = 2 on NCCL, fp32, against transformers' own model on the whole
sequence on one GPU (its torch path: mamba-ssm is not a dependency), with B = 2 rows and with a packed row (a
sequence start inside rank 0's shard, a sequence crossing the rank boundary) against each sequence run alone:
logits and loss, and every parameter gradient against a float64 truth.

    ALLSCAN_TEST_RANKS_PER_GPU=2 python3 -m pytest -s -q -m gpu tests/test_hf_mamba2_gpu.py -p no:cacheprovider

One spawn of two ranks for both families (two NCCL ranks may share one GPU); the bounds and why:
``tests/hf_gpu_parity.py``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", minversion="5.0")

FAMILIES = ["nemotron_h", "bamba"]


def _model(kind):
    """Nemotron-H / Bamba with head and state sizes fla's kernels take (16 and up), mixer parameters redrawn so
    that the recurrence carries the output (test_hf_mamba2.sharpen), fp32 on this rank's GPU."""
    from test_hf_mamba2 import VOCAB, sharpen

    tf = transformers
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "nemotron_h":
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(
            layers_block_type=["mamba", "attention", "mlp"], head_dim=16, intermediate_size=96, ssm_state_size=16,
            mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=1, chunk_size=64, **small))
    else:
        model = tf.BambaForCausalLM(tf.BambaConfig(
            num_hidden_layers=2, attn_layer_indices=[1], intermediate_size=96, mamba_n_heads=4, mamba_d_head=32,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, **small))
    return sharpen(model.double()).float().cuda()


def _gpu_case(rank, world):
    from hf_gpu_parity import sp2_against_transformers
    from test_hf_mamba2 import VOCAB, fp64_ssd

    # fp32 inputs: fp64_ssd leaves the scan as transformers computes it (fp32)
    return sp2_against_transformers(rank, world, FAMILIES, _model, VOCAB, prepare=fp64_ssd)


def test_nemotron_h_and_bamba_sp2_nccl_equal_transformers():
    from hf_gpu_parity import run_and_check

    run_and_check(_gpu_case, FAMILIES, "fla.ops.gla.chunk", timeout=600)
