"""Hugging Face transformers with allscan's Ulysses attention: a tiny random Llama at SP = 2 (gloo, CPU,
fp32) equals the same model on one process over the whole batch: loss, logits and every parameter
gradient. Skips without transformers 5.x."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.0")


def _model(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions count in neither loss
    return ids, labels


def _sp_equals_one_process(rank, world):
    import torch.distributed as dist

    from allscan.integrations import transformers as sp

    ids, labels = _batch()
    ref = _model("sdpa")
    out = ref(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()

    name = sp.register(None)
    model = _model(name)
    shard = sp.shard_batch(ids, labels)
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, shard)
    loss.backward()
    sp.sync_gradients(model)
    T = ids.shape[1] // world
    res = {"loss": (sp.reduce_loss(loss).item(), out.loss.item()),
           "logits": (logits - out.logits[:, rank * T:(rank + 1) * T]).abs().max().item() /
           out.logits.abs().max().item()}
    ref_grads = dict(ref.named_parameters())
    res["grads"] = max(((p.grad - ref_grads[n].grad).norm() / ref_grads[n].grad.norm().clamp_min(1e-30)).item()
                       for n, p in model.named_parameters())
    res["params"] = len(ref_grads)
    try:
        sp.shard_batch(ids[:, :23], labels[:, :23])
    except ValueError as e:
        res["bad_T"] = str(e)
    # padding on the last rank only: every rank raises (none waits in the all-to-all)
    mask = torch.ones_like(shard.input_ids)
    if rank == world - 1:
        mask[0, -3:] = 0
    try:
        model(input_ids=shard.input_ids, position_ids=shard.position_ids, attention_mask=mask, use_cache=False)
    except NotImplementedError as e:
        res["padding"] = str(e)
    dist.barrier()
    return res


def test_tiny_llama_sequence_parallel_equals_one_process():
    for r in run_distributed(_sp_equals_one_process, 2, timeout=300):
        got, want = r["loss"]
        assert abs(got - want) <= 1e-5 * abs(want), r
        assert r["logits"] < 1e-5, r
        assert r["grads"] < 1e-4, r
        assert "T = 23 must be a multiple of the group size 2" in r["bad_T"], r
        assert "padding attention masks are not supported" in r.get("padding", ""), r
