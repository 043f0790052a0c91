"""A mixture of experts' load-balancing loss (``aux_loss``, from ``output_router_logits``) under sequence parallelism,
fp64, CPU, gloo, SP = 2 (``allscan.integrations.hf_moe``).

Checked against transformers' model on one process and the whole sequence: the ranks' ``aux_loss`` shares add up to
its ``aux_loss``, and the gradients of ``cross-entropy + coef * aux_loss`` (summed over the group) equal its every
parameter gradient, for the hybrids made sequence-parallel (Qwen3.5-MoE and Qwen3-Next: B = 2 rows and one packed
row against each sequence run alone; Qwen3-Next under FSDP2 on a 1 x 2 mesh) and a softmax-attention MoE under
``register()`` (Mixtral); a NaN reaching the routers gives NaN. Refused by name on every rank: a model whose loss
is not the one mirrored (transformers' function changed), ``return_dict=False``, the base model made
sequence-parallel alone under a head that asks for the loss, ``torch.compile(model)`` (compiling ``model.forward``
runs it); ranks that disagree on asking raise ValueError. On the GPU: the all-reduce on NCCL.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.0")

COEF = 0.25  # large, so that the aux loss's part of the gradients shows


def _mixtral(attn):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM._from_config(cfg, attn_implementation=attn)
    model.set_experts_implementation("eager")  # grouped_mm has no fp64
    return model.double()


def _grads(model):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _fp64_loss_function(modeling):
    """transformers' load_balancing_loss_func of a modeling module (its installed source) accumulating in float64
    instead of float32: the reference's aux_loss to float64 precision."""
    import inspect

    src = inspect.getsource(modeling.load_balancing_loss_func)
    assert src.count("torch.float32") >= 2 and ".float()" in src, "the function changed: update the reference"
    namespace = dict(vars(modeling))
    exec(compile(src.replace("torch.float32", "torch.float64").replace(".float()", ".double()"), modeling.__file__,
                 "exec"), namespace)  # noqa: S102
    return namespace["load_balancing_loss_func"]


def _reference(model, ids, labels, bounds, sp):
    """One process, the whole sequence: cross-entropy + COEF * aux_loss (in float64), backward; (aux_loss,
    gradients). A packed row (``bounds``): each sequence run alone, the routers' rows concatenated, as one process
    attends them."""
    modeling = sys.modules[type(model).__module__]
    kept = modeling.load_balancing_loss_func
    modeling.load_balancing_loss_func = _fp64_loss_function(modeling)
    try:
        return _reference_fp64(model, ids, labels, bounds, sp)
    finally:
        modeling.load_balancing_loss_func = kept


def _reference_fp64(model, ids, labels, bounds, sp):
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX)
    if bounds is None:
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        logits, aux = out.logits, out.aux_loss
    else:
        outs = [model(input_ids=ids[:, a:b], use_cache=False, output_router_logits=True)
                for a, b in zip(bounds[:-1], bounds[1:])]
        logits = torch.cat([o.logits for o in outs], dim=1)
        routers = tuple(torch.cat(layer, dim=0) for layer in zip(*(o.router_logits for o in outs)))
        modeling = sys.modules[type(model).__module__]
        aux = modeling.load_balancing_loss_func(routers, model.num_experts, model.num_experts_per_tok, None)
    ce = sp.causal_lm_loss(logits, sp.BatchShard(ids, None, shift, int((shift != sp.IGNORE_INDEX).sum())))
    (ce + COEF * aux).backward()
    return aux.item(), _grads(model)


def _sharded(model, ids, labels, bounds, sp, group=None, **call):
    """SP: this rank's shard; (the whole aux_loss from the shares, gradients summed over the group)."""
    pos = None if bounds is None else torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
    shard = sp.shard_batch(ids, labels, group=group, position_ids=pos)
    out = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False, **call)
    (sp.causal_lm_loss(out.logits, shard) + COEF * out.aux_loss).backward()
    sp.sync_gradients(model, group)
    return sp.reduce_loss(out.aux_loss, group).item(), _grads(model)


def _compare(ref, got):
    (ref_aux, ref_grads), (aux, grads) = ref, got
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    return {"aux": abs(aux - ref_aux) / abs(ref_aux), "grads": _rel(grads[worst], ref_grads[worst]), "worst": worst}


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (NotImplementedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _batch(B, T=24):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 61, (B, T), generator=gen)
    return ids, ids.clone()


def _hybrid(rank, world):
    import test_hf_hybrids as hy

    from allscan.integrations import hf_hybrids as sp

    res = {}
    for kind in ("qwen3_5_moe", "qwen3_next"):
        hy.fp64_delta_rule(kind)
        for bounds, (ids, labels) in ((None, _batch(2)), (hy.BOUNDS, _batch(1))):
            if bounds is not None:
                labels[0, bounds[1:-1]] = sp.IGNORE_INDEX  # no label across a sequence's start (the collator's)
            ref = _reference(hy.tiny_model(kind), ids, labels, bounds, sp)
            model = sp.sequence_parallel(hy.tiny_model(kind))
            res[(kind, "rows" if bounds is None else "packed")] = _compare(
                ref, _sharded(model, ids, labels, bounds, sp, output_router_logits=True))
    ids, labels = _batch(2)
    # FSDP2 over a 1 x 2 DP x SP mesh (its class for the model is torch's, the transformers class one of its bases)
    from torch.distributed.device_mesh import init_device_mesh

    from allscan.integrations import mesh as spm

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    fsdp = spm.fully_shard(sp.sequence_parallel(hy.tiny_model("qwen3_next"), mesh["sp"]), mesh)
    shard = spm.shard_batch(ids, labels, mesh)
    out = fsdp(input_ids=shard.input_ids, position_ids=shard.position_ids, output_router_logits=True)
    (sp.causal_lm_loss(out.logits, shard) + COEF * out.aux_loss).backward()
    grads = {n: p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
             for n, p in fsdp.named_parameters()}
    res["fsdp"] = _compare(_reference(hy.tiny_model("qwen3_next"), ids, labels, None, sp),
                           (spm.reduce_loss(out.aux_loss, mesh).item(), grads))
    shard = sp.shard_batch(ids, labels)
    call = dict(input_ids=shard.input_ids, position_ids=shard.position_ids)
    # a NaN reaching the routers on one rank (an overflow upstream): the loss is NaN, as one process's, not refused
    spoil = model.model.embed_tokens.register_forward_hook(
        lambda m, a, o: o.index_fill(1, torch.tensor([0]), float("nan")) if rank == 0 else None)
    try:
        with torch.no_grad():
            res["nan"] = repr(sp.reduce_loss(model(**call, output_router_logits=True).aux_loss).item())
    except (NotImplementedError, ValueError) as e:
        res["nan"] = str(e)
    spoil.remove()
    # the config's output_router_logits counts as the call's
    model.config.output_router_logits = True
    res["by_config"] = model(**call).aux_loss is not None
    model.config.output_router_logits = False
    res["tuple"] = _raised(model, **call, output_router_logits=True, return_dict=False)
    res["one_rank_asks"] = _raised(model, **call, output_router_logits=rank == 1)
    # the base model made sequence-parallel alone: its head would take the shard's loss
    base_alone = hy.tiny_model("qwen3_next")
    sp.sequence_parallel(base_alone.model)
    res["base_alone"] = _raised(base_alone, **call, output_router_logits=True)
    # torch.compile: of the model, refused (the hook that makes the loss whole runs after the call); of its forward
    # (transformers' recipe), the hooks stay eager and the loss is the eager one
    eager = model(**call, output_router_logits=True).aux_loss
    res["compiled_model"] = _raised(torch.compile(model, backend="eager"), **call, output_router_logits=True)
    model.forward = torch.compile(model.forward, backend="eager")
    res["compiled_forward"] = abs(model(**call, output_router_logits=True).aux_loss.item() - eager.item())
    del model.forward
    # a family whose loss is another function than the one mirrored
    modeling = sys.modules[type(model).__module__]
    kept = modeling.load_balancing_loss_func
    modeling.load_balancing_loss_func = lambda *a: 2 * kept(*a)
    try:
        res["other_function"] = _raised(model, **call, output_router_logits=True)
    finally:
        modeling.load_balancing_loss_func = kept
    return res


def _registered(rank, world):
    from allscan.integrations import transformers as sp

    name = sp.register(None)
    ids, labels = _batch(2)
    ref = _reference(_mixtral("eager"), ids, labels, None, sp)
    model = _mixtral(name)
    res = {"rows": _compare(ref, _sharded(model, ids, labels, None, sp, output_router_logits=True))}
    shard = sp.shard_batch(ids, labels)
    call = dict(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
    res["without"] = model(**call).aux_loss is None
    res["tuple"] = _raised(model, **call, output_router_logits=True, return_dict=False)
    res["one_rank_asks"] = _raised(model, **call, output_router_logits=rank == 0)
    return res


def _check_parity(r):
    # (the gradients to 1e-6, as the hybrids' other parity tests: the models' own float32 routing softmax)
    assert r["aux"] <= 1e-9 and r["grads"] <= 1e-6, r


def test_hybrid_aux_loss_is_the_whole_sequences():
    results = run_distributed(_hybrid, 2, timeout=600)
    for rank, r in enumerate(results):
        for kind in ("qwen3_5_moe", "qwen3_next"):
            _check_parity(r[(kind, "rows")])
            _check_parity(r[(kind, "packed")])
        _check_parity(r["fsdp"])
        assert r["nan"] == "nan", r
        assert r["by_config"], r
        assert "return_dict=False is not supported" in r["tuple"], r
        assert r["one_rank_asks"].startswith("ValueError") and "(rank 1 of the group)" in r["one_rank_asks"], r
        assert "made sequence-parallel alone" in r["base_alone"], r
        assert "is not transformers' load_balancing_loss_func" in r["other_function"], r
        assert "output_router_logits under torch.compile(model) is not supported" in r["compiled_model"], r
        assert r["compiled_forward"] <= 1e-12, r


def test_registered_aux_loss_is_the_whole_sequences():
    results = run_distributed(_registered, 2, timeout=600)
    for rank, r in enumerate(results):
        _check_parity(r["rows"])
        assert r["without"], r
        assert "return_dict=False is not supported" in r["tuple"], r
        assert r["one_rank_asks"].startswith("ValueError") and "(rank 0 of the group)" in r["one_rank_asks"], r


def _on_nccl(rank, world):
    from allscan.integrations import transformers as sp

    torch.backends.cuda.matmul.allow_tf32 = False
    name = sp.register(None)
    ids, labels = (t.cuda() for t in _batch(2))
    ref = _mixtral("sdpa").float().cuda()
    out = ref(input_ids=ids, use_cache=False, output_router_logits=True)
    out.aux_loss.backward()
    model = _mixtral(name).float().cuda()
    shard = sp.shard_batch(ids, labels)
    got = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                output_router_logits=True).aux_loss
    got.backward()
    sp.sync_gradients(model)
    gates = [n for n, _ in model.named_parameters() if n.endswith("gate.weight")]
    want = dict(ref.named_parameters())
    grads = dict(model.named_parameters())
    return {"aux": abs(sp.reduce_loss(got).item() - out.aux_loss.item()) / out.aux_loss.item(),
            "gates": max(_rel(grads[n].grad, want[n].grad) for n in gates), "device": str(got.device)}


@pytest.mark.gpu
def test_aux_loss_on_nccl():
    """Two NCCL ranks (they may share one GPU), fp32, Mixtral under register(): the shares add up to transformers'
    aux_loss on the whole sequence, and the routers' gradients of aux_loss alone agree (the all-reduce of the
    counts runs on the GPU)."""
    from distributed import skip_unless_nccl_ranks

    skip_unless_nccl_ranks(2)
    for r in run_distributed(_on_nccl, 2, backend="nccl", timeout=300):
        assert r["device"].startswith("cuda") and r["aux"] <= 1e-5 and r["gates"] <= 1e-4, r
