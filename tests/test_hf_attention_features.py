"""Sliding windows, logit soft-caps and attention sinks on Ulysses: the op (window, soft-cap, sinks, packed, grouped
k/v heads, the sinks' gradient) against an independent reference, its window against transformers' own mask
functions, and tiny Mistral (sliding window, a packed row), Gemma2 (window, attention and final soft-caps) and
GPT-OSS (sinks, window, per-token MoE) through register() at SP = 2 on gloo, against transformers' own attention
on one process over the whole batch: loss, logits and every parameter gradient. All distributed checks in one
spawned world."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

VOCAB = 97


def reference(q, k, v, scale, *, window=None, cap=None, bounds=None, sinks=None):
    """Attention of [B, S, H, D] q (k, v: fewer heads repeated), each packed sequence alone, written apart from
    the library: the window as the band tril(0) minus tril(-window)."""
    B, S, H, _ = q.shape
    k, v = (t.repeat_interleave(H // k.shape[2], 2) for t in (k, v))
    bounds = bounds or [0, S]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, a:b], k[:, a:b]) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        band = torch.ones(n, n, dtype=torch.bool).tril()
        if window is not None:
            band &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        s = s.masked_fill(~band, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, n, 1)], -1)
        outs.append(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1)[..., :n], v[:, a:b]))
    return torch.cat(outs, 1)


def test_window_is_transformers_sliding_window():
    """The local attention's window is transformers' sliding_window_overlay (i - w < j <= i), and the math path
    equals the reference with every option and a packed row."""
    mu = pytest.importorskip("transformers.masking_utils")
    from allscan.ops.ulysses import MaskSpec
    from allscan.ops.ulysses.masked import masked_attention

    torch.manual_seed(0)
    S, w = 12, 3
    i = torch.arange(S)
    want = mu.sliding_window_causal_mask_function(w)(0, 0, i[:, None], i[None, :])
    q, k, v = (torch.randn(1, S, 2, 4, dtype=torch.float64) for _ in range(3))
    # one-hot values: output (i, j) is the weight query i gives key j, nonzero exactly where it may look
    eye = torch.eye(S, dtype=torch.float64)[None, :, None, :].expand(1, S, 2, S)
    got = masked_attention(q, k, eye.contiguous(), MaskSpec(scale=0.5, window=w), kernel="math")[0, :, 0] != 0
    assert torch.equal(got, want), (got.int(), want.int())
    sinks = torch.randn(2, dtype=torch.float64)
    spec = MaskSpec(scale=0.5, window=w, softcap=0.8, bounds=(0, 5, 12))
    out = masked_attention(q, k, v, spec, sinks, kernel="math")
    ref = reference(q, k, v, 0.5, window=w, cap=0.8, bounds=[0, 5, 12], sinks=sinks)
    assert (out - ref).abs().max().item() < 1e-12


def _op(rank, world, res):
    """ulysses_attention with every option at SP = 2 (head chunks, grouped k/v heads, a packed row whose middle
    sequence crosses the rank boundary) against the reference; the sinks' gradient summed over the group."""
    import torch.distributed as dist

    from allscan.ops.ulysses import ulysses_attention

    torch.manual_seed(0)
    S, T = 16, 16 // world
    q, k, v = (torch.randn(1, S, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64)
    w_out = torch.randn(1, S, 4, 8, dtype=torch.float64)
    opts = dict(window=3, softcap=0.7, bounds=[0, 5, 11, 16])
    whole = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference(*whole[:3], 0.3, cap=opts["softcap"], window=opts["window"], bounds=opts["bounds"],
                    sinks=whole[3])
    want = torch.autograd.grad((ref * w_out).sum(), whole)
    mine = [t[:, rank * T:(rank + 1) * T].clone().requires_grad_() for t in (q, k, v)] + \
        [sinks.clone().requires_grad_()]
    out = ulysses_attention(*mine[:3], None, causal=True, scale=0.3, num_chunks=2, cu_seqlens=opts["bounds"],
                            window=opts["window"], softcap=opts["softcap"], sinks=mine[3])
    got = torch.autograd.grad((out * w_out[:, rank * T:(rank + 1) * T]).sum(), mine)
    dsinks = got[3].clone()
    dist.all_reduce(dsinks)
    errs = [(out - ref[:, rank * T:(rank + 1) * T]).abs().max().item()]
    errs += [(g - r[:, rank * T:(rank + 1) * T]).abs().max().item() for g, r in zip(got[:3], want[:3])]
    res["op"] = max(errs + [(dsinks - want[3]).abs().max().item()])
    res["op_sinks_grad"] = want[3].abs().max().item()
    try:  # a window over bidirectional attention: refused on every rank
        ulysses_attention(*mine[:3], None, causal=False, window=3)
    except ValueError as e:
        res["op_bidirectional"] = str(e)


def _hybrid_attention(rank, world, res):
    """The hybrids' attention function (hf_attention), as transformers calls it from a layer: the mask's window
    (a WindowMask from its mask function) with the same sliding_window argument, a soft-cap and s_aux."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sliding_window_causal_mask_function

    from allscan.integrations.hf_attention import attention_implementation

    name = attention_implementation(None)
    window = AttentionMaskInterface._global_mapping[name](mask_function=sliding_window_causal_mask_function(3))
    fn = AttentionInterface._global_mapping[name]
    torch.manual_seed(1)
    S, T = 16, 16 // world
    q, k, v = (torch.randn(1, h, S, 8, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64)
    module = torch.nn.Module()
    out, _ = fn(module, *(t[:, :, rank * T:(rank + 1) * T] for t in (q, k, v)), window, scaling=0.3,
                sliding_window=3, softcap=0.7, s_aux=sinks)
    ref = reference(*(t.transpose(1, 2) for t in (q, k, v)), 0.3, window=3, cap=0.7, sinks=sinks)
    res["hybrid"] = (out - ref[:, rank * T:(rank + 1) * T]).abs().max().item()
    try:  # the argument and the mask disagree: refused
        fn(module, *(t[:, :, rank * T:(rank + 1) * T] for t in (q, k, v)), window, scaling=0.3, sliding_window=5)
    except NotImplementedError as e:
        res["hybrid_ambiguous"] = str(e)


def _auto(model_type, attn, dtype, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.3)
    if model_type == "gpt_oss":
        base.update(num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**base, **over})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)


def _compare(rank, sp, model, ref_model, ref_logits, ref_loss, shard):
    """Relative errors of ``model`` at SP on ``shard`` against the one-process run (already backward)."""
    logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, shard)
    loss.backward()
    sp.sync_gradients(model)
    T = shard.input_ids.shape[1]
    ref = dict(ref_model.named_parameters())
    got, want = sp.reduce_loss(loss).item(), ref_loss.item()
    return {"loss": abs(got - want) / abs(want),
            "logits": ((logits - ref_logits[:, rank * T:(rank + 1) * T]).abs().max() / ref_logits.abs().max()).item(),
            "grads": max(((p.grad - ref[n].grad).norm() / ref[n].grad.norm().clamp_min(1e-30)).item()
                         for n, p in model.named_parameters()),
            "grads_present": all(p.grad is not None for p in model.parameters())}


def _case(rank, sp, name, model_type, ref_attn, dtype, over, off, ids, labels, pos=None, alone=False):
    """One model at SP = 2 against one process, and how far the one-process logits move with the feature off
    (``off``: the config overrides that turn it off), so that a path dropping it would fail. ``alone``: the
    one-process logits are each packed sequence's run alone (for a model whose masks ignore position ids)."""
    from allscan.context import LOCAL

    ref = _auto(model_type, ref_attn, dtype, **over)
    if alone:
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
        logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits
                            for a, b in zip(starts[:-1], starts[1:])], dim=1)
    else:
        logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, sp.shard_batch(ids, labels, group=LOCAL, position_ids=pos))
    loss.backward()
    with torch.no_grad():
        plain = _auto(model_type, ref_attn, dtype, **{**over, **off})(input_ids=ids, position_ids=pos,
                                                                     use_cache=False).logits
    r = _compare(rank, sp, _auto(model_type, name, dtype, **over), ref, logits, loss,
                 sp.shard_batch(ids, labels, position_ids=pos))
    r["feature_effect"] = ((plain - logits).abs().max() / logits.abs().max()).item()
    return r


def _models(rank, world):
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening

    from allscan.integrations import transformers as sp

    res = {}
    _op(rank, world, res)
    _hybrid_attention(rank, world, res)
    name = sp.register(None)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    # Mistral: a window of 4 on every layer (the argument and the mask), fp64
    res["mistral"] = _case(rank, sp, name, "mistral", "sdpa", torch.float64, dict(sliding_window=4),
                           dict(sliding_window=64), ids, labels)
    # ... and a packed row (5 + 10 + 9: starts inside both shards, the middle sequence across the boundary):
    # the window never crosses a sequence start
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 10, 9)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s.tolist()} for s in seqs])
    res["mistral_packed"] = _case(rank, sp, name, "mistral", "sdpa", torch.float64, dict(sliding_window=4),
                                  dict(sliding_window=64), batch["input_ids"], batch["labels"],
                                  batch["position_ids"])
    # Gemma2: sliding and full layers, attention and final logit soft-caps (its eager softmax runs in fp32)
    gemma = dict(sliding_window=4, attn_logit_softcapping=1.0, final_logit_softcapping=3.0, query_pre_attn_scalar=8)
    res["gemma2"] = _case(rank, sp, name, "gemma2", "eager", torch.float32, gemma,
                          dict(attn_logit_softcapping=None, sliding_window=64), ids, labels)
    # GPT-OSS: sinks (a Parameter with a gradient) on sliding and full layers, per-token MoE (fp32: its experts'
    # grouped matmul takes no fp64)
    res["gpt_oss"] = _case(rank, sp, name, "gpt_oss", "eager", torch.float32, dict(sliding_window=4),
                           dict(sliding_window=64), ids, labels)
    # ... whose masks are built without the position ids (transformers' eager attention would attend across the
    # packed sequences): a packed row attends each sequence alone, as the packing asks
    res["gpt_oss_packed"] = _case(rank, sp, name, "gpt_oss", "eager", torch.float32, dict(sliding_window=4),
                                  dict(sliding_window=64), batch["input_ids"], batch["labels"],
                                  batch["position_ids"], alone=True)
    dist.barrier()
    return res


def test_windows_softcaps_sinks_at_sp2_equal_one_process():
    pytest.importorskip("transformers", minversion="5.0")
    for r in run_distributed(_models, 2, timeout=300):
        assert r["op"] < 1e-12 and r["op_sinks_grad"] > 1e-3, r
        assert "a sliding window needs causal=True" in r["op_bidirectional"], r
        assert r["hybrid"] < 1e-12, r
        assert "sliding_window=5 but the model's mask has a window of 3" in r["hybrid_ambiguous"], r
        for key, tol in (("mistral", 1e-10), ("mistral_packed", 1e-10), ("gemma2", 2e-4), ("gpt_oss", 2e-4),
                         ("gpt_oss_packed", 2e-4)):
            c = r[key]
            assert c["grads_present"], (key, c)
            assert c["loss"] < tol and c["logits"] < tol and c["grads"] < tol, (key, c)
            assert c["feature_effect"] > 1e-2, (key, c)  # the features change the result: dropping them would fail
