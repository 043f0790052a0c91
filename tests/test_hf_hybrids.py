"""transformers' linear-attention hybrids made sequence-parallel by ``allscan.integrations.hf_hybrids``, fp64, CPU.

The reference is transformers' own model, untouched, on one process and the whole sequence, on its torch paths
(transformers falls back to them for CPU tensors even with fla installed). Its torch delta rule computes in fp32
whatever the inputs; for an fp64 reference the test runs that same function (its source, from the installed
modeling file) with the upcast made one to the inputs' dtype (:func:`fp64_delta_rule`). Checked, for each family
in one spawn of 3 gloo ranks: SP = 3 (the default group) and SP = 2 (a subgroup) give the reference's loss and
every parameter gradient (summed over the group) to 1e-6 relative, with B = 2 rows and with one packed row
(position ids that restart: a sequence inside a shard, one crossing a rank boundary, one starting at a rank's
first token) against each sequence run alone; the rewiring keeps every Parameter object; a cache asked for at
call time raises on every rank. Without a spawn: a model with a sequence mixer allscan does not know raises
naming it and is left as it was; the call-time refusals by name; on one process (``LOCAL``) the rewired model
equals the original, packed row included.
"""
import contextlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.0")

VOCAB = 61
T = 24  # divisible by 2 and 3; 8 tokens a rank at SP = 3 (the halo needs conv_size - 1 = 3)
FAMILIES = ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"]
# one packed row: a sequence inside rank 0's shard, one crossing a rank boundary (at SP = 2 and 3), one starting
# exactly at rank 2's first token (SP = 3)
BOUNDS = [0, 5, 16, T]
# the delta rule each family's linear layer calls, as a name in its modeling module
DELTA_RULE = {"qwen3_next": "torch_chunk_gated_delta_rule", "qwen3_5": "torch_chunk_gated_delta_rule",
              "qwen3_5_moe": "torch_chunk_gated_delta_rule",
              "olmo_hybrid": "torch_chunk_gated_delta_rule", "kimi_linear": "chunk_kimi_delta_attention"}
LINEAR = {"qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5": "Qwen3_5GatedDeltaNet",
          "olmo_hybrid": "OlmoHybridGatedDeltaNet", "kimi_linear": "KimiLinearDeltaAttention"}


def _modeling(kind):
    import importlib

    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def fp64_delta_rule(kind):
    """Point the family's modeling module at its own torch delta rule computing in the inputs' dtype: the
    function's source with ``torch.float32`` (and KDA's ``.float()``) made the inputs' dtype. Test only."""
    setattr(_modeling(kind), DELTA_RULE[kind], _torch_delta_rule(kind, in_inputs_dtype=True))


@contextlib.contextmanager
def torch_delta_rule_within(kind, in_inputs_dtype=True):
    """Inside the block only, the family's modeling module calls its own torch delta rule, never fla's kernels:
    computing in the inputs' dtype (:func:`fp64_delta_rule`'s) or, ``in_inputs_dtype=False``, in fp32 as
    transformers writes it. transformers' own binding after it (fla's kernels for CUDA tensors)."""
    mod, name = _modeling(kind), DELTA_RULE[kind]
    kept = getattr(mod, name)
    setattr(mod, name, _torch_delta_rule(kind, in_inputs_dtype))
    try:
        yield
    finally:
        setattr(mod, name, kept)


def _torch_delta_rule(kind, in_inputs_dtype):
    """The function from the installed modeling file's source, without the decorator that hands CUDA tensors to
    fla's kernels; ``in_inputs_dtype``: its upcast to fp32 made one to the inputs' dtype."""
    mod = _modeling(kind)
    name = DELTA_RULE[kind]
    src = open(mod.__file__).read()
    start = src.index(f"\ndef {name}(") + 1
    code = src[start:src.index("\n\n\n", start)]
    assert "initial_dtype = query.dtype" in code
    if in_inputs_dtype:
        code = code.replace("torch.float32", "initial_dtype").replace(".float()", ".to(initial_dtype)")
    namespace = dict(vars(mod))
    exec(compile(code, mod.__file__, "exec"), namespace)  # noqa: S102
    return namespace[name]


def tiny_model(kind, seed=0, width=1):
    """A 2-layer model of ``kind`` (a linear-attention layer, then softmax attention), seeded, fp64; fewer key
    than value heads for Gated DeltaNet, MLA with a value head narrower than its query/key heads for Kimi.
    ``width`` multiplies the hidden and head sizes (fla's GPU kernels take head sizes of 16 and up)."""
    tf = transformers
    torch.manual_seed(seed)
    w = width
    common = dict(vocab_size=VOCAB, hidden_size=32 * w, intermediate_size=48 * w, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, layer_types=["linear_attention", "full_attention"],
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gdn = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8 * w,
               linear_value_head_dim=8 * w, linear_conv_kernel_dim=4)
    if kind == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            head_dim=8 * w, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16 * w,
            shared_expert_intermediate_size=16 * w, **gdn, **common))
    elif kind == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(head_dim=8 * w, **gdn, **common))
    elif kind == "qwen3_5_moe":  # (its MoE's load-balancing loss: tests/test_hf_moe_aux.py)
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
            head_dim=8 * w, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16 * w,
            shared_expert_intermediate_size=16 * w, **gdn, **common))
    elif kind == "olmo_hybrid":
        model = tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(**gdn, **common))
    elif kind == "kimi_linear":
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
            mlp_layer_types=["dense", "sparse"], kv_lora_rank=16 * w, q_lora_rank=None, qk_rope_head_dim=4 * w,
            qk_nope_head_dim=8 * w, v_head_dim=8 * w, linear_num_heads=2, linear_head_dim=8 * w,
            linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16 * w,
            n_group=1, topk_group=1, **{**common, "num_key_value_heads": 4}))
    else:
        raise ValueError(kind)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no fp64
    return model.double()


def _batch(B=2):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, T), generator=gen)
    labels = ids.clone()
    if B > 1:
        labels[1, :3] = -100
    else:  # one packed row: a sequence's first token is no label of the one before (as transformers' collator)
        labels[0, BOUNDS[1:-1]] = -100
    return ids, labels




def _packed_positions():
    return torch.cat([torch.arange(b - a) for a, b in zip(BOUNDS[:-1], BOUNDS[1:])])[None]


def _reference(kind, ids, labels, packed):
    """transformers' model on one process: the whole rows, or each packed sequence run alone (its logits
    concatenated; no label across a sequence's end)."""
    from allscan.integrations import hf_hybrids as sp

    ref = tiny_model(kind)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX)
    if packed:
        assert (shift[0, [b - 1 for b in BOUNDS[1:-1]]] == sp.IGNORE_INDEX).all()
        logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits
                            for a, b in zip(BOUNDS[:-1], BOUNDS[1:])], dim=1)
    else:
        logits = ref(input_ids=ids, use_cache=False).logits
    loss = sp.causal_lm_loss(logits, sp.BatchShard(ids, None, shift, int((shift != sp.IGNORE_INDEX).sum())))
    loss.backward()
    return logits, loss, _grads(ref)


def _grads(model):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _sp_equals_one_process(rank, world, kind):
    import torch.distributed as dist

    from allscan.integrations import hf_hybrids as sp

    fp64_delta_rule(kind)
    rows, packed_row = _batch(), _batch(1)
    refs = {False: _reference(kind, *rows, False), True: _reference(kind, *packed_row, True)}

    pair = dist.new_group([0, 1])  # every rank takes part in making it
    res = {}
    for P, group, packed in ((world, None, False), (world, None, True), (2, pair, False), (2, pair, True)):
        if rank >= P:
            continue
        ids, labels = packed_row if packed else rows
        ref_logits, ref_loss, ref_grads = refs[packed]
        model = tiny_model(kind)
        before = dict(model.named_parameters())
        assert sp.sequence_parallel(model, group) is model
        r = {"same_objects": all(p is before[n] for n, p in model.named_parameters())
             and sorted(before) == sorted(n for n, _ in model.named_parameters()),
             "rewired": [type(m).__name__ for m in model.modules()
                         if isinstance(m.__dict__.get("forward"), sp.SequenceParallelForward)],
             "use_cache": model.config.use_cache}
        shard = sp.shard_batch(ids, labels, group=group, position_ids=_packed_positions() if packed else None)
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
        loss = sp.causal_lm_loss(logits, shard)
        loss.backward()
        sp.sync_gradients(model, group)
        Tl = T // P
        r["loss"] = abs(sp.reduce_loss(loss, group).item() - ref_loss.item()) / abs(ref_loss.item())
        r["logits"] = _rel(logits, ref_logits[:, rank * Tl:(rank + 1) * Tl])
        grads = _grads(model)
        r["grads"] = max(_rel(grads[n], ref_grads[n]) for n in ref_grads)
        r["worst"] = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
        if kind == "qwen3_5" and group is None and not packed:
            # a rewired layer called on its own with packed offsets that differ on one rank: every rank raises
            # (none waits in the halo or the scan)
            mine = torch.tensor([0, 5 + (rank == 1), T], dtype=torch.int32)
            try:
                model.model.layers[0].linear_attn(torch.randn(1, Tl, 32, dtype=torch.float64), cu_seq_lens_q=mine,
                                                  cu_seq_lens_k=mine)
                r["layer_differ"] = "no error"
            except ValueError as e:
                r["layer_differ"] = str(e)
            # every rank's ids 0 .. T_local - 1 (each rank made its own): refused; confirmed by the caller's
            # offsets (one sequence per rank): each rank's slice is a sequence alone
            local = torch.arange(Tl).unsqueeze(0)
            try:
                model(input_ids=shard.input_ids, position_ids=local.expand(2, Tl))
                r["local_positions"] = "no error"
            except ValueError as e:
                r["local_positions"] = str(e)
            mine = shard.input_ids[:1]
            with torch.no_grad():
                alone = tiny_model(kind)(input_ids=mine, use_cache=False).logits
                got = model(input_ids=mine, position_ids=local,
                            cu_seq_lens_q=torch.arange(0, T + 1, Tl, dtype=torch.int32)).logits
            r["one_sequence_a_rank"] = _rel(got, alone)
            # one rank calls with a keyword no forward takes: that rank's forward raises its TypeError, its peers
            # hear of it in the call's exchange (they waited in the first layer's collective before)
            try:
                model(shard.input_ids, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13) if rank == 1 else model(
                    input_ids=shard.input_ids, position_ids=shard.position_ids)
                r["unbound"] = "no error"
            except (TypeError, ValueError) as e:
                r["unbound"] = f"{type(e).__name__}: {e}"
            # rank 1's own work in a mixer (a projection) fails before the halo exchange: its peers are told there
            proj = model.model.layers[0].linear_attn.in_proj_qkv

            def fail(*_):
                raise RuntimeError("injected")

            handle = proj.register_forward_pre_hook(fail) if rank == 1 else None
            try:
                model(input_ids=shard.input_ids, position_ids=shard.position_ids)
                r["own_work"] = "no error"
            except (RuntimeError, ValueError) as e:
                r["own_work"] = f"{type(e).__name__}: {e}"
            if handle is not None:
                handle.remove()
            # attention dropout on rank 0 alone (left in train mode): refused there, its peers told in Ulysses
            drops = [m for m in model.modules() if hasattr(m, "attention_dropout")]
            for m in drops:
                m.attention_dropout = 0.1
            model.train(rank == 0)
            try:
                model(input_ids=shard.input_ids, position_ids=shard.position_ids)
                r["dropout_one_rank"] = "no error"
            except (NotImplementedError, ValueError) as e:
                r["dropout_one_rank"] = f"{type(e).__name__}: {e}"
            for m in drops:
                m.attention_dropout = 0.0
            model.train()
        # a cache asked for at call time: refused on every rank, by name
        try:
            model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=True)
            r["cache"] = "no error"
        except NotImplementedError as e:
            r["cache"] = str(e)
        res[(P, "packed" if packed else "rows")] = r
    return res


def _check(results, kind):
    for rank, res in enumerate(results):
        for P, r in res.items():
            assert r["same_objects"] and r["rewired"] == [LINEAR[kind]] and r["use_cache"] is False, (rank, P, r)
            assert r["loss"] <= 1e-6 and r["grads"] <= 1e-6 and r["logits"] <= 1e-6, (rank, P, r)
            assert "use_cache=True is not supported" in r["cache"], (rank, P, r)
            if kind == "qwen3_5" and P == (3, "rows"):
                assert "the ranks passed different cu_seq_lens_q / cu_seq_lens_k (rank 1 differ" in r["layer_differ"], r
                assert "every rank's position ids are 0 .. S_local - 1" in r["local_positions"], r
                assert r["one_sequence_a_rank"] <= 1e-6, r
                assert r["unbound"].startswith("TypeError") if rank == 1 else \
                    "arguments its forward does not take, or without input_ids" in r["unbound"], r
                assert r["own_work"] == "RuntimeError: injected" if rank == 1 else (
                    r["own_work"].startswith("ValueError") and "rank(s) [1]" in r["own_work"]
                    and "failed before this call" in r["own_work"]), r
                assert "attention dropout is not supported" in r["dropout_one_rank"] if rank == 0 else (
                    "rank(s) [0]" in r["dropout_one_rank"] and "failed before this call" in r["dropout_one_rank"]), r
    assert len(results[0]) == 4 and sorted(results[2]) == [(3, "packed"), (3, "rows")]


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_sequence_parallel_equals_one_process(kind):
    results = run_distributed(_sp_equals_one_process, 3, kind, timeout=900)
    print(kind, [{P: {k: r[k] for k in ("loss", "grads", "logits", "worst")} for P, r in res.items()}
                 for res in results])  # shown with -s: the errors seen
    _check(results, kind)


def _compiled(rank, world):
    from allscan.integrations import hf_hybrids as sp

    fp64_delta_rule("qwen3_5")
    ids, _ = _batch()
    with torch.no_grad():
        ref = tiny_model("qwen3_5")
        want = ref(input_ids=ids, use_cache=False).logits
        want_packed = torch.cat([ref(input_ids=ids[:1, a:b], use_cache=False).logits
                                 for a, b in zip(BOUNDS[:-1], BOUNDS[1:])], dim=1)
    model = torch.compile(sp.sequence_parallel(tiny_model("qwen3_5")), backend="eager")
    shard = sp.shard_batch(ids)
    Tl = T // world
    res = {}
    with torch.no_grad():
        res["rows"] = _rel(model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits,
                           want[:, rank * Tl:(rank + 1) * Tl])
        packed = sp.shard_batch(ids[:1], position_ids=_packed_positions())
        for key, kwargs in (("packed", dict(input_ids=packed.input_ids, position_ids=packed.position_ids)),
                            ("labels", dict(input_ids=shard.input_ids, position_ids=shard.position_ids,
                                            labels=shard.input_ids)),
                            ("positions_on_one_rank", dict(input_ids=shard.input_ids,
                                                           position_ids=shard.position_ids if rank else None))):
            try:
                model(**kwargs)
                res[key] = "no error"
            except (NotImplementedError, ValueError) as e:
                res[key] = str(e)
        # rank 0 compiled, rank 1 eager: the packed row is refused on both (the eager rank alone went on)
        try:
            (model if rank == 0 else model._orig_mod)(input_ids=packed.input_ids, position_ids=packed.position_ids)
            res["packed_mixed"] = "no error"
        except NotImplementedError as e:
            res["packed_mixed"] = str(e)
        # transformers' own recipe, the forward compiled: the hooks stay eager and hand the context in
        inner = sp.sequence_parallel(tiny_model("qwen3_5"))
        inner.forward = torch.compile(inner.forward, backend="eager")
        res["forward_packed"] = _rel(inner(input_ids=packed.input_ids, position_ids=packed.position_ids).logits,
                                     want_packed[:, rank * Tl:(rank + 1) * Tl])
    return res


def test_compiled_model_checks_its_call_and_refuses_packed_rows():
    """Under torch.compile the call's checks run beside the trace (a graph break before the forward), so what is
    refused eagerly is refused compiled; the batch's context cannot enter the trace, so packed rows are refused
    (they came out wrong there, no error: the layers took whole sequences) and whole rows equal one process. With
    the forward compiled instead (the hooks outside it), packed rows run and equal each sequence alone."""
    for r in run_distributed(_compiled, 2, timeout=600):
        assert r["rows"] <= 1e-6 and r["forward_packed"] <= 1e-6, r
        assert "packed rows (position ids that restart) are not supported under torch.compile" in r["packed"], r
        assert "labels are not supported" in r["labels"], r
        assert "some ranks passed position_ids and others none" in r["positions_on_one_rank"], r
        mixed = r["packed_mixed"]
        assert "not supported under torch.compile" in mixed and "(rank 0 of the group)" in mixed, r


def test_unknown_sequence_mixer_is_named_and_nothing_changes():
    from allscan.integrations import hf_hybrids as sp

    tf = transformers
    # Mamba-1 (its selective scan has no sequence-parallel form here; Mamba2's does: test_hf_mamba2.py)
    model = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, state_size=8,
                                               expand=1, conv_kernel=4))
    impl = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=r"backbone.layers.0.mixer \(MambaMixer\)"):
        sp.sequence_parallel(model)
    assert model.config._attn_implementation == impl and not model._forward_pre_hooks

    # a supported family with one module it does not know: refused, the known layers left as they were
    model = tiny_model("qwen3_5")
    impl = model.config._attn_implementation
    model.model.layers[1].mlp.extra = torch.nn.Conv1d(4, 4, kernel_size=3, groups=4)
    with pytest.raises(NotImplementedError, match=r"model.layers.1.mlp \(Qwen3_5MLP: a Conv1d of kernel \(3,\)\)"):
        sp.sequence_parallel(model)
    assert not sp.is_sequence_parallel(model) and model.config._attn_implementation == impl
    assert not model._forward_pre_hooks and model.config.use_cache is True

    # a head that pools each row at its last token (sequence classification): each rank would pool its own
    model = tf.Qwen3NextForSequenceClassification(tiny_model("qwen3_next").config)
    with pytest.raises(NotImplementedError, match=r"<model> \(Qwen3NextForSequenceClassification\) pools each row"):
        sp.sequence_parallel(model)
    assert not sp.is_sequence_parallel(model) and not model._forward_pre_hooks


def test_one_process_equals_original_and_call_time_refusals():
    """``LOCAL``: the rewired model (convolution, delta rule, attention all of this process) equals transformers'
    own, on whole rows and on a packed row (each sequence alone); what sequence parallelism cannot run is refused
    by name at the call; the routers' load-balancing loss is transformers' own."""
    from allscan.integrations import hf_hybrids as sp
    from allscan.integrations import transformers as tsp
    from allscan.ops import LOCAL

    assert tsp.sequence_parallel is sp.sequence_parallel  # the name register()'s refusals point to
    kind = "qwen3_5"
    fp64_delta_rule(kind)
    ids, _ = _batch()
    ref = tiny_model(kind)
    want = ref(input_ids=ids, use_cache=False).logits
    model = tiny_model(kind)
    sp.sequence_parallel(model, LOCAL)
    assert _rel(model(input_ids=ids).logits, want) <= 1e-12
    row = ids[:1]
    want_packed = torch.cat([ref(input_ids=row[:, a:b], use_cache=False).logits
                             for a, b in zip(BOUNDS[:-1], BOUNDS[1:])], dim=1)
    assert _rel(model(input_ids=row, position_ids=_packed_positions()).logits, want_packed) <= 1e-12
    restart = torch.tensor([list(range(10)) + list(range(T - 10))] * 2)
    for kwargs, match in [(dict(use_cache=True), "use_cache=True"),
                          (dict(past_key_values=transformers.DynamicCache(config=model.config)), "a KV or recurrent"),
                          (dict(output_attentions=True), "output_attentions=True"),
                          (dict(labels=ids), "labels are not supported"),
                          (dict(attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)), "padding"),
                          (dict(position_ids=restart), "packed rows .* in a batch of 2 rows"),
                          (dict(seq_idx=torch.zeros(2, T, dtype=torch.int32)), "seq_idx"),
                          (dict(position_ids=torch.arange(3 * T).view(3, 1, T)), r"position ids other than"),
                          (dict(logits_to_keep=1), "logits_to_keep"),
                          (dict(logits_to_keep=torch.tensor([T - 1])), "logits_to_keep")]:
        with pytest.raises(NotImplementedError, match=match):
            model(input_ids=ids, **kwargs)
    # a mixture of experts' load-balancing loss asked for by the config (Qwen3-Next's MoE): transformers' own, on
    # one process (SP 2: tests/test_hf_moe_aux.py)
    fp64_delta_rule("qwen3_next")
    own = tiny_model("qwen3_next")(input_ids=ids, use_cache=False, output_router_logits=True).aux_loss
    moe = sp.sequence_parallel(tiny_model("qwen3_next"), LOCAL)
    moe.config.output_router_logits = True
    assert abs(moe(input_ids=ids).aux_loss.item() - own.item()) <= 1e-6 * own.item()
    with pytest.raises(NotImplementedError, match="generation is not supported"):
        model.generate(ids, max_new_tokens=2)
    # what undoes sequence_parallel() afterwards is refused (each rank's layer would see its shard alone)
    ours = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match=r"attention implementation was changed after sequence_parallel\(\)"):
        model(input_ids=ids)
    model.set_attn_implementation(ours)
    mixer = model.model.layers[0].linear_attn
    mixer.forward = type(mixer).forward.__get__(mixer)
    with pytest.raises(RuntimeError, match="sequence mixer's forward was replaced"):
        model(input_ids=ids)
    del mixer.forward
    sp.sequence_parallel(model, LOCAL)
    # the base model alone made sequence-parallel: its head's labels and logits_to_keep refused all the same
    head = tiny_model(kind)
    sp.sequence_parallel(head.model, LOCAL)
    assert _rel(head(input_ids=ids).logits, want) <= 1e-12
    for kwargs, match in [(dict(labels=ids), "labels are not supported"), (dict(logits_to_keep=1), "logits_to_keep")]:
        with pytest.raises(NotImplementedError, match=match):
            head(input_ids=ids, **kwargs)

    # a head made sequence-parallel, called without labels by a model of the user's that takes labels (a custom
    # loss): runs, the outer labels are not the head's
    from custom_loss import CustomLoss

    assert _rel(CustomLoss(model)(ids, labels=ids), want) <= 1e-12
    assert _rel(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, want) <= 1e-12  # checks reset
    assert _rel(model(input_ids=ids, logits_to_keep=0).logits, want) <= 1e-12  # 0: every token's logits
    # the caller's packed offsets: taken where they match the position ids (and dropped), else refused
    offsets = torch.tensor(BOUNDS, dtype=torch.int32)
    assert _rel(model(input_ids=row, position_ids=_packed_positions(), cu_seq_lens_q=offsets).logits,
                want_packed) <= 1e-12
    with pytest.raises(ValueError, match=r"cu_seq_lens_q/k \[0, 5, 16, 24\] do not match .*\(\[0, 24\]"):
        model(input_ids=row, cu_seq_lens_q=offsets)
