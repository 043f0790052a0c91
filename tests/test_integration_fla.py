"""flash-linear-attention models made sequence-parallel by ``allscan.integrations.fla``, fp32.

CPU (gloo): fla's own layers run Triton kernels only, so the reference is the same swapped model on
one process; the model's other parts run fla's torch code (``fuse_*=False``) and the swapped layers
allscan's CPU kernels. GPU (``gpu``, NCCL, 2 GPUs): the reference is fla's model untouched, its own
kernels on the whole sequence (Triton dots in IEEE fp32). The hybrid model's softmax attention layer
(fla's ``Attention``) calls flash-attn, which neither test machine has: its functions are stood in for
by SDPA (:func:`sdpa_flash_attn_func`, :func:`sdpa_flash_attn_varlen_func`: the arithmetic flash-attn
documents for these arguments). Checked: the swap keeps fla's Parameter objects and options; at SP = 2
the loss, logits and every parameter gradient equal the reference's, for the hybrids with packed
sequences (``cu_seqlens``) too; a model with a layer allscan cannot run sequence-parallel raises naming
it, before anything is swapped. Skips where
flash-linear-attention 0.6 cannot be imported (it needs Triton and einops installed).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402

pytest.importorskip("fla.models", reason="needs flash-linear-attention 0.6 (with triton and einops)")

VOCAB = 61
# allscan's layers each model holds after the swap
LAYERS = {"gla": ["gla.GatedLinearAttention"], "gdn": ["gated_deltanet.GatedDeltaNet"],
          "kda": ["kda.KimiDeltaAttention"], "gdn_hybrid": ["attention.Attention", "gated_deltanet.GatedDeltaNet"],
          "kda_hybrid": ["attention.Attention", "kda.KimiDeltaAttention"]}
KINDS = sorted(LAYERS)
MIXERS = {"GatedLinearAttention", "GatedDeltaNet", "KimiDeltaAttention", "Attention"}  # fla's names and allscan's


def sdpa_flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softmax_scale=None):
    """flash-attn's ``flash_attn_func`` for what fla's ``Attention`` passes without a window: ``[B, T, H, D]``
    inputs, grouped k/v heads (query head h reads k/v head h // (H / H_kv)), causal or not."""
    assert tuple(window_size) == (-1, -1), window_size
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal, scale=softmax_scale)
    return o.transpose(1, 2)


def sdpa_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                                window_size=(-1, -1), softmax_scale=None):
    """flash-attn's ``flash_attn_varlen_func`` for what fla's ``Attention`` passes with ``cu_seqlens``:
    packed ``[total, H, D]`` inputs, each sequence attended on its own."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k), (cu_seqlens_q, cu_seqlens_k)
    bounds = cu_seqlens_q.tolist()
    return torch.cat([sdpa_flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b], causal, window_size,
                                           softmax_scale)[0] for a, b in zip(bounds[:-1], bounds[1:]) if b > a])


def stand_in_for_flash_attn():
    import fla.layers.attn

    fla.layers.attn.flash_attn_func = sdpa_flash_attn_func
    fla.layers.attn.flash_attn_varlen_func = sdpa_flash_attn_varlen_func


def tiny_model(kind: str, device: str = "cpu"):
    """A 2-layer fla model of ``kind`` (gla, gdn, kda, deltanet; gdn_hybrid, kda_hybrid: that linear layer,
    then softmax attention with grouped k/v heads), seeded: the same weights on every rank. On CPU with fla's torch
    paths; fla's unfused SwiGLU still calls a Triton kernel, so there it is replaced by the same function
    in torch (per token, outside what ``sequence_parallel`` touches)."""
    import fla.models as m
    import fla.modules.mlp

    stand_in_for_flash_attn()
    if device == "cpu":
        fla.modules.mlp.swiglu = lambda gate, y: torch.nn.functional.silu(gate) * y
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=2, fuse_cross_entropy=False,
                  fuse_norm=device != "cpu", fuse_swiglu=device != "cpu")
    if kind == "gla":
        model = m.GLAForCausalLM(m.GLAConfig(**common))
    elif kind == "gdn":
        model = m.GatedDeltaNetForCausalLM(m.GatedDeltaNetConfig(head_dim=16, **common))
    elif kind.endswith("_hybrid"):
        attn = dict(layers=[1], num_heads=4, num_kv_heads=2, rope_theta=500.0)
        if kind == "gdn_hybrid":
            model = m.GatedDeltaNetForCausalLM(m.GatedDeltaNetConfig(head_dim=16, attn=attn, **common))
        else:
            model = m.KDAForCausalLM(m.KDAConfig(head_dim=16, attn=attn, **common))
    elif kind == "kda":
        model = m.KDAForCausalLM(m.KDAConfig(head_dim=16, **common))
    else:
        model = m.DeltaNetForCausalLM(m.DeltaNetConfig(**common))
    return model.float().to(device)


def _sp_equals_one_process(rank, world, kind, device="cpu", packed=False):
    """``packed``: one row of sequences packed with ``cu_seqlens`` (global offsets, passed to the model as
    fla's models take them), cut anywhere by the ranks; no label crosses a sequence's end."""
    from allscan.integrations import fla as sp
    from allscan.ops import LOCAL

    if device == "cuda":
        from allscan.ops.gla import limit_fla_autotune

        device = f"cuda:{torch.cuda.current_device()}"
        limit_fla_autotune("one")  # before fla's own model runs: one config per kernel, no benchmarking
    gen = torch.Generator().manual_seed(1)
    T = 128 if device != "cpu" else 24
    ids = torch.randint(0, VOCAB, (1 if packed else 2, T), generator=gen).to(device)
    labels = ids.clone()
    kw = {}
    if packed:  # sequences of 5, 10 and 9 tokens (CPU), a bound inside each rank's shard
        bounds = [0, 5, 15, T] if device == "cpu" else [0, 40, 100, T]
        kw["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
        labels[0, bounds[1:-1]] = sp.IGNORE_INDEX  # a sequence's first token is no label of the one before
    else:
        labels[1, :3] = sp.IGNORE_INDEX

    ref = tiny_model(kind, device)
    if device == "cpu":
        ref = sp.sequence_parallel(ref, LOCAL)  # allscan's layers, no sequence parallelism
    ref_shard = sp.BatchShard(ids, None, torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX),
                              int((labels[:, 1:] != sp.IGNORE_INDEX).sum()))
    ref_logits = ref(input_ids=ids, **kw).logits
    ref_loss = sp.causal_lm_loss(ref_logits, ref_shard)
    ref_loss.backward()

    model = tiny_model(kind, device)
    fla_params = dict(model.named_parameters())
    assert sp.sequence_parallel(model) is model
    res = {"same_objects": all(p is fla_params[n] for n, p in model.named_parameters()),
           "same_names": sorted(fla_params) == sorted(n for n, _ in model.named_parameters()),
           "layers": sorted({type(mod).__module__ + "." + type(mod).__name__ for mod in model.modules()
                             if type(mod).__name__ in MIXERS}),
           "use_cache": model.config.use_cache}
    shard = sp.shard_batch(ids, labels)
    logits = model(input_ids=shard.input_ids, **kw).logits
    loss = sp.causal_lm_loss(logits, shard)
    loss.backward()
    sp.sync_gradients(model)
    T = ids.shape[1] // world
    res["loss"] = (sp.reduce_loss(loss).item(), ref_loss.item())
    res["logits"] = ((logits - ref_logits[:, rank * T:(rank + 1) * T]).abs().max() / ref_logits.abs().max()).item()
    ref_grads = dict(ref.named_parameters())
    res["grads"] = max(((p.grad - ref_grads[n].grad).norm() / ref_grads[n].grad.norm().clamp_min(1e-30)).item()
                       for n, p in model.named_parameters())
    if not packed:  # what fla's model would apply per shard: refused on every rank, one rank's mistake included
        for key, extra in (("labels", dict(labels=shard.input_ids) if rank == 1 else {}),
                           ("logits_to_keep", dict(logits_to_keep=1))):
            try:
                model(input_ids=shard.input_ids, **extra)
                res[key] = "no error"
            except NotImplementedError as e:
                res[key] = str(e)
        if kind == "gla" and device == "cpu":  # compiled: the check runs beside the trace (one rank's labels too)
            compiled = torch.compile(model, backend="eager")
            with torch.no_grad():
                res["compiled"] = ((compiled(input_ids=shard.input_ids).logits - logits).abs().max()).item()
            try:
                compiled(input_ids=shard.input_ids, **(dict(labels=shard.input_ids) if rank == 1 else {}))
                res["compiled_labels"] = "no error"
            except NotImplementedError as e:
                res["compiled_labels"] = str(e)
            # arguments the forward cannot take, on rank 1 alone: its own TypeError there, the peers told
            try:
                model(shard.input_ids, *([None] * (40 if rank == 1 else 0)))
                res["unbound"] = "no error"
            except (TypeError, ValueError) as e:
                res["unbound"] = f"{type(e).__name__}: {e}"
            # only the base model made sequence-parallel: its head's labels (rank 1's) refused all the same
            head = tiny_model(kind, device)
            sp.sequence_parallel(head.model)
            try:
                head(input_ids=shard.input_ids, **(dict(labels=shard.input_ids) if rank == 1 else {}))
                res["head_labels"] = "no error"
            except NotImplementedError as e:
                res["head_labels"] = str(e)
            # the head itself made sequence-parallel, called without labels by a model that takes labels (a
            # custom loss): runs, the outer labels are not the head's
            from custom_loss import CustomLoss

            with torch.no_grad():
                outer = CustomLoss(model)(shard.input_ids, labels=shard.input_ids)
            res["custom_loss"] = (outer - logits).abs().max().item()
    return res


def _check(results, kind, tol):
    for rank, r in enumerate(results):
        assert r["same_objects"] and r["same_names"], r
        assert r["layers"] == [f"allscan.layers.{name}" for name in LAYERS[kind]], r
        assert r["use_cache"] is False, r
        got, want = r["loss"]
        assert abs(got - want) <= tol["loss"] * abs(want), r
        assert r["logits"] < tol["logits"], r
        assert r["grads"] < tol["grads"], r
        if "labels" in r:
            assert "labels are not supported" in r["labels"] and "(rank 1 of the group)" in r["labels"], r
            assert "logits_to_keep" in r["logits_to_keep"] and "(ranks 0, 1 of the group)" in r["logits_to_keep"], r
        if "compiled" in r:
            assert r["compiled"] <= 1e-5 and "labels are not supported" in r["compiled_labels"], r
            assert r["unbound"].startswith("TypeError") if rank == 1 else \
                "arguments its forward does not take (rank 1 of the group)" in r["unbound"], r
            assert "labels are not supported" in r["head_labels"] and "(rank 1 of the group)" in r["head_labels"], r
            assert r["custom_loss"] <= 1e-5, r


@pytest.mark.parametrize("kind", KINDS)
def test_fla_model_sequence_parallel_equals_one_process(kind):
    _check(run_distributed(_sp_equals_one_process, 2, kind, timeout=300), kind,
           {"loss": 1e-5, "logits": 1e-5, "grads": 1e-4})


@pytest.mark.parametrize("kind", ["gdn_hybrid", "kda_hybrid"])
def test_fla_hybrid_model_with_packed_sequences_equals_one_process(kind):
    _check(run_distributed(_sp_equals_one_process, 2, kind, "cpu", True, timeout=300), kind,
           {"loss": 1e-5, "logits": 1e-5, "grads": 1e-4})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_fla_model_sequence_parallel_equals_fla_on_gpus(kind):
    """Against fla's own model and kernels on the whole sequence (2 GPUs, NCCL). Gated DeltaNet's
    backward on Hopper needs tilelang (fla refuses Triton's there)."""
    skip_unless_nccl_ranks(2)
    if kind.startswith("gdn") and torch.cuda.get_device_capability() >= (9, 0):
        pytest.importorskip("tilelang", reason="fla's Gated DeltaNet backward on Hopper needs tilelang")
    os.environ["TRITON_F32_DEFAULT"] = "ieee"  # inherited by the spawned ranks: fla's fp32 dots exact
    _check(run_distributed(_sp_equals_one_process, 2, kind, "cuda", backend="nccl", timeout=400), kind,
           {"loss": 1e-5, "logits": 1e-4, "grads": 1e-3})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn_hybrid", "kda_hybrid"])
def test_fla_hybrid_model_with_packed_sequences_equals_fla_on_gpus(kind):
    """Packed sequences (``cu_seqlens``) through fla's hybrid model against fla's own on the whole row. A
    sequence crossing the rank boundary is chunked from the boundary on rank 1, from its start in fla's
    call: other roundings, so the logits' bound is looser than unpacked (both models' fp32 logits are
    about 1e-4 from the fp64 answer, allscan's no further than fla's: bench/README.md, "Accuracy against
    the fp64 answer")."""
    skip_unless_nccl_ranks(2)
    if kind.startswith("gdn") and torch.cuda.get_device_capability() >= (9, 0):
        pytest.importorskip("tilelang", reason="fla's Gated DeltaNet backward on Hopper needs tilelang")
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    _check(run_distributed(_sp_equals_one_process, 2, kind, "cuda", True, backend="nccl", timeout=400), kind,
           {"loss": 1e-5, "logits": 5e-4, "grads": 1e-3})


def test_unsupported_fla_layer_is_named():
    from allscan.integrations import fla as sp

    with pytest.raises(NotImplementedError, match=r"model.layers.0.attn \(DeltaNet\)"):
        sp.sequence_parallel(tiny_model("deltanet"))


def test_sliding_window_attention_is_refused_before_any_swap():
    import fla.models as m

    from allscan.integrations import fla as sp

    stand_in_for_flash_attn()
    config = m.GatedDeltaNetConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
                                   attn=dict(layers=[1], num_heads=4, window_size=32))
    model = m.GatedDeltaNetForCausalLM(config)
    with pytest.raises(NotImplementedError, match=r"window_size=32 \(sliding-window attention\)"):
        sp.sequence_parallel(model)
    assert not any(type(mod).__module__.startswith("allscan.") for mod in model.modules())


def test_parameters_that_do_not_match_leave_the_model_untouched():
    """A layer whose parameters differ from allscan's (another fla version, say) raises before any swap:
    the layers before it in the model stay fla's too."""
    from allscan.integrations import fla as sp

    model = tiny_model("gdn_hybrid")
    model.model.layers[1].attn.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="Attention's parameters do not match allscan's layer"):
        sp.sequence_parallel(model)
    assert not any(type(mod).__module__.startswith("allscan.") for mod in model.modules())


def test_fla_layer_options_carry_over():
    """A standalone fla layer with non-default options becomes allscan's layer with the same options."""
    import fla.layers

    from allscan.integrations import fla as sp
    from allscan.layers import Attention, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention

    old = fla.layers.GatedLinearAttention(hidden_size=48, expand_k=1.0, expand_v=0.5, num_heads=3, num_kv_heads=1,
                                          fuse_norm=False, gate_fn="sigmoid", norm_eps=1e-3, gate_logit_normalizer=8,
                                          gate_low_rank_dim=4, clamp_min=-5.0, layer_idx=3)
    new = sp.sequence_parallel(old)
    assert isinstance(new, GatedLinearAttention)
    for name in ("hidden_size", "num_heads", "num_kv_heads", "key_dim", "value_dim", "gate_logit_normalizer",
                 "clamp_min", "layer_idx", "fuse_norm_and_gate"):
        assert getattr(new, name) == getattr(old, name), name
    assert new.g_norm.eps == 1e-3 and new.gate_fn is torch.sigmoid
    old = fla.layers.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5,
                                   use_gate=False, conv_size=3, allow_neg_eigval=True, norm_eps=1e-4)
    new = sp.sequence_parallel(old)
    assert isinstance(new, GatedDeltaNet)
    for name in ("num_heads", "num_v_heads", "head_v_dim", "use_gate", "conv_size", "allow_neg_eigval"):
        assert getattr(new, name) == getattr(old, name), name
    assert new.o_norm.eps == 1e-4
    old = fla.layers.KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5,
                                        conv_size=3, conv_bias=True, allow_neg_eigval=True, safe_gate=True,
                                        lower_bound=-4.0, norm_eps=1e-4, layer_idx=2)
    new = sp.sequence_parallel(old)
    assert isinstance(new, KimiDeltaAttention)
    for name in ("num_heads", "num_v_heads", "head_v_dim", "conv_size", "conv_bias", "allow_neg_eigval", "safe_gate",
                 "lower_bound", "layer_idx"):
        assert getattr(new, name) == getattr(old, name), name
    assert new.o_norm.eps == 1e-4
    stand_in_for_flash_attn()
    old = fla.layers.Attention(hidden_size=48, num_heads=6, num_kv_heads=2, qkv_bias=True, qk_norm=True,
                               rope_theta=1e6, max_position_embeddings=4096, layer_idx=3)
    params = dict(old.named_parameters())
    new = sp.sequence_parallel(old)
    assert isinstance(new, Attention)
    for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "qk_norm", "rope_theta",
                 "max_position_embeddings", "layer_idx"):
        assert getattr(new, name) == getattr(old, name), name
    assert all(p is params[n] for n, p in new.named_parameters()) and sorted(params) == sorted(
        n for n, _ in new.named_parameters())
    assert new.rotary.inv_freq is old.rotary.inv_freq and torch.equal(new.rotary.inv_freq,
                                                                       new.rotary._compute_inv_freq())


def test_fla_mamba2_swaps_with_its_options_or_is_refused_by_name():
    """fla's Mamba2 becomes allscan's (the same Parameter objects and options: transformers' mixer, whose
    arithmetic tests/test_mamba2_layer.py checks); the options allscan's layer cannot run are refused by name."""
    import fla.layers

    from allscan.integrations import fla as sp
    from allscan.layers import Mamba2

    options = dict(hidden_size=32, head_dim=8, state_size=4, n_groups=2, conv_kernel=3, use_conv_bias=False,
                   use_bias=True, dt_limit=(0.01, 3.0), norm_eps=1e-4, layer_idx=2)
    old = fla.layers.Mamba2(**options)
    params = dict(old.named_parameters())
    new = sp.sequence_parallel(old)
    assert isinstance(new, Mamba2)
    assert all(p is params[n] for n, p in new.named_parameters()) and sorted(params) == sorted(
        n for n, _ in new.named_parameters())
    for name in ("hidden_size", "num_heads", "head_dim", "ssm_state_size", "n_groups", "conv_kernel_size",
                 "use_conv_bias", "use_bias", "layer_idx"):
        assert getattr(new, name) == getattr(old, name), name
    assert new.time_step_limit == (0.01, 3.0) and new.norm.variance_epsilon == 1e-4
    assert new.norm.group_size == old.norm.group_size
    for option in (dict(D_has_hdim=True), dict(rmsnorm=False), dict(norm_before_gate=True)):
        with pytest.raises(NotImplementedError, match=f"Mamba2 with {next(iter(option))}="):
            sp.sequence_parallel(fla.layers.Mamba2(**options, **option))
