"""transformers' Mamba2 hybrids made sequence-parallel by ``allscan.integrations.hf_hybrids`` (the mixers by
``hf_mamba2``), fp64, CPU.

The reference is transformers' own model, untouched, on one process and the whole sequence, on its torch path
(mamba-ssm and causal-conv1d are CUDA-only: CPU tensors take it). Its torch scan computes in fp32 whatever the
inputs; for an fp64 reference the test runs that same function (its source, from the installed modeling file)
with the upcast made one to fp64 for fp64 inputs (:func:`fp64_ssd`). The mixers' parameters are redrawn
(:func:`sharpen`) so that the SSD recurrence carries the output: at transformers' init the ``D`` skip does, and a
wrong scan would hide below the tolerance.

Checked for every family in ONE spawn of 3 gloo ranks (transformers imported once per rank; the references made
once, in the parent): SP = 3 (the default group) and SP = 2 (a subgroup) give the reference's loss, logits and
every parameter gradient (summed over the group) to 1e-6 relative (``TOL``), with B = 2 rows and with one packed row
(position ids that restart: a sequence inside a shard, one crossing a rank boundary, one starting at a rank's
first token) against each sequence run alone; the rewiring keeps every Parameter object; a cache asked for at call
time raises on every rank. The 2 x 2 DP x SP mesh with FSDP2: ``tests/test_mesh.py`` (Nemotron-H).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

transformers = pytest.importorskip("transformers", minversion="5.0")

VOCAB = 61
T = 24  # divisible by 2 and 3; 8 tokens a rank at SP = 3 (the halo needs conv_kernel - 1 = 3)
# "falcon_h1:plain": Falcon-H1 without its mixer's norm (the gate multiplies the scan's output instead)
FAMILIES = ["mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1:plain", "zamba2"]
MIXER = {"mamba2": "Mamba2Mixer", "nemotron_h": "NemotronHMamba2Mixer", "bamba": "BambaMixer",
         "granitemoehybrid": "GraniteMoeHybridMambaLayer", "falcon_h1": "FalconH1Mixer", "zamba2": "Zamba2MambaMixer"}
# one packed row: a sequence inside rank 0's shard, one crossing a rank boundary (at SP = 2 and 3), one starting
# exactly at rank 2's first token (SP = 3)
BOUNDS = [0, 5, 16, T]
# fp64 throughout (zeco_ssd's torch backend runs float64 inputs in float64). A state or a halo that does not cross a
# rank boundary, or crosses a sequence start, is off by 1e-2 or more.
TOL = {"loss": 1e-6, "logits": 1e-6, "grads": 1e-6}


def _modeling(kind):
    import importlib

    kind = kind.split(":")[0]
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def fp64_ssd(kind):
    """Point the family's modeling module at its own torch chunked scan computing in fp64 for fp64 inputs (fp32
    otherwise, as it does): the function's source with ``.float()`` made ``.to(acc)``. Test only."""
    mod = _modeling(kind)
    if getattr(mod, "_allscan_fp64_scan", False):
        return
    src = open(mod.__file__).read()
    start = src.index("\ndef mamba2_chunk_scan(") + 1
    code = src[start:src.index("\n\n\n", start)]
    head = "    batch_size, sequence_length, num_heads, head_dim = hidden_states.shape\n"
    assert code.count(head) == 1 and code.count(".float()") == 5
    code = code.replace(".float()", ".to(acc)").replace(
        head, head + "    acc = torch.promote_types(hidden_states.dtype, torch.float32)\n")
    namespace = dict(vars(mod))
    exec(compile(code, mod.__file__, "exec"), namespace)  # noqa: S102
    mod.mamba2_chunk_scan = namespace["mamba2_chunk_scan"]
    mod._allscan_fp64_scan = True


def sharpen(model, seed=1):
    """Redraw each Mamba2 mixer's in_proj, conv, A_log, dt_bias and D so that the recurrence (not the D skip)
    carries its output; dt spans the time-step limits where a family has them."""
    gen = torch.Generator().manual_seed(seed)

    def draw(p, scale, shift=0.0, uniform=False):
        t = torch.rand(p.shape, generator=gen, dtype=torch.float64) if uniform else \
            torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.copy_(t * scale + shift)

    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ in MIXER.values():
                draw(m.in_proj.weight, 0.3)
                draw(m.conv1d.weight, 0.5)
                draw(m.A_log, 2.0, -1.5, uniform=True)
                draw(m.dt_bias, 1.0)
                draw(m.D, 0.3)
    return model


def tiny_model(kind, seed=0):
    """A small model of ``kind`` with a Mamba2 mixer and (but for mamba2) softmax attention, seeded, fp64;
    several B/C groups, the family's conv width, dt limits, multipliers and shared blocks."""
    tf = transformers
    torch.manual_seed(seed)
    small = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                 mamba_chunk_size=8)
    if kind == "mamba2":
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, state_size=8, n_groups=2,
            expand=2, conv_kernel=4, chunk_size=8, time_step_limit=(0.05, 2.0), tie_word_embeddings=False))
    elif kind == "nemotron_h":
        model = tf.NemotronHForCausalLM(tf.NemotronHConfig(
            layers_block_type=["mamba", "attention", "mlp"], head_dim=8, intermediate_size=48, ssm_state_size=8,
            mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=4, expand=1, chunk_size=8, **small))
    elif kind == "bamba":
        model = tf.BambaForCausalLM(tf.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], intermediate_size=48,
                                                   **mamba, **small))
    elif kind == "granitemoehybrid":
        model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
            num_hidden_layers=2, layer_types=["mamba", "attention"], intermediate_size=48, shared_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
            logits_scaling=2.0, attention_multiplier=0.3, **{**mamba, "mamba_d_conv": 3}, **small))
    elif kind in ("falcon_h1", "falcon_h1:plain"):
        model = tf.FalconH1ForCausalLM(tf.FalconH1Config(
            num_hidden_layers=2, head_dim=8, intermediate_size=48, mamba_d_ssm=32, mamba_rms_norm=kind == "falcon_h1",
            mamba_norm_before_gate=False, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.8, attention_in_multiplier=0.9, attention_out_multiplier=1.1, key_multiplier=0.7,
            embedding_multiplier=1.5, lm_head_multiplier=0.6, mlp_multipliers=[0.8, 1.2],
            **{**mamba, "mamba_d_head": 8, "mamba_expand": 1}, **small))
    elif kind == "zamba2":  # one shared attention block used by two hybrid layers, with adapters
        model = tf.Zamba2ForCausalLM(tf.Zamba2Config(
            num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], num_mem_blocks=1,
            intermediate_size=48, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_headdim=8, mamba_ngroups=2,
            chunk_size=8, adapter_rank=4, use_shared_attention_adapter=True, use_mem_rope=True,
            **{**small, "num_key_value_heads": 4}))
    else:
        raise ValueError(kind)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no fp64
    return sharpen(model.double())


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


def _reference(kind, packed):
    """transformers' model on one process: the whole rows, or each packed sequence run alone (its logits
    concatenated; no label across a sequence's end). (logits, loss, {name: grad})."""
    from allscan.integrations import hf_hybrids as sp

    fp64_ssd(kind)
    ids, labels = _batch(1 if packed else 2)
    ref = tiny_model(kind)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=sp.IGNORE_INDEX)
    pieces = list(zip(BOUNDS[:-1], BOUNDS[1:])) if packed else [(0, T)]
    logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in pieces], dim=1)
    loss = sp.causal_lm_loss(logits, sp.BatchShard(ids, None, shift, int((shift != sp.IGNORE_INDEX).sum())))
    loss.backward()
    return logits.detach(), loss.item(), _grads(ref)


def _grads(model):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def _plain(tensors):
    """numpy copies: tensors a rank returns would travel as shared memory that dies with the rank."""
    return {n: t.numpy().copy() for n, t in tensors.items()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _all_families(rank, world):
    """Every family at SP = world (the default group) and SP = 2 (ranks 0 and 1), rows and a packed row: this
    rank's loss (reduced), logits, and (rank 0) the gradients summed over the group."""
    import torch.distributed as dist

    from allscan.integrations import hf_hybrids as sp

    pair = dist.new_group([0, 1])  # every rank takes part in making it
    res = {}
    for kind in FAMILIES:
        fp64_ssd(kind)
        for P, group, packed in ((world, None, False), (world, None, True), (2, pair, False), (2, pair, True)):
            if rank >= P:
                continue
            ids, labels = _batch(1 if packed else 2)
            model = tiny_model(kind)
            before = dict(model.named_parameters())
            assert sp.sequence_parallel(model, group) is model
            r = {"same_objects": all(p is before[n] for n, p in model.named_parameters())
                 and sorted(before) == sorted(n for n, _ in model.named_parameters()),
                 "rewired": sorted({type(m).__name__ for m in model.modules()
                                    if isinstance(m.__dict__.get("forward"), sp.SequenceParallelForward)})}
            shard = sp.shard_batch(ids, labels, group=group, position_ids=_packed_positions() if packed else None)
            logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
            loss = sp.causal_lm_loss(logits, shard)
            loss.backward()
            sp.sync_gradients(model, group)
            r["loss"] = sp.reduce_loss(loss, group).item()
            r["logits"] = logits.detach().numpy().copy()
            if rank == 0:
                r["grads"] = _plain(_grads(model))
            if kind == "mamba2" and group is None and not packed:  # refused by name on every rank, no hang
                try:
                    model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=True)
                    r["cache"] = "no error"
                except NotImplementedError as e:
                    r["cache"] = str(e)
            res[(kind, P, packed)] = r
    return res


def test_mamba2_families_sequence_parallel_equal_one_process():
    results = run_distributed(_all_families, 3, timeout=900)
    assert sorted(results[2]) == sorted((k, 3, p) for k in FAMILIES for p in (False, True))
    errors = {}
    for kind in FAMILIES:
        for packed in (False, True):
            ref_logits, ref_loss, ref_grads = _reference(kind, packed)
            for P in (3, 2):
                Tl = T // P
                for rank in range(P):
                    r = results[rank][(kind, P, packed)]
                    assert r["same_objects"] and r["rewired"] == [MIXER[kind.split(":")[0]]], (kind, P, rank,
                                                                                              r["rewired"])
                    err = {"loss": abs(r["loss"] - ref_loss) / abs(ref_loss),
                           "logits": _rel(torch.from_numpy(r["logits"]), ref_logits[:, rank * Tl:(rank + 1) * Tl])}
                    if rank == 0:
                        grads = {n: torch.from_numpy(g) for n, g in r["grads"].items()}
                        assert sorted(grads) == sorted(ref_grads)
                        err["grads"] = max(_rel(grads[n], g) for n, g in ref_grads.items())
                        err["worst"] = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
                    errors[(kind, P, packed, rank)] = err
    print(errors)  # shown with -s: the errors seen
    for key, err in errors.items():
        assert all(err.get(k, 0.0) <= bound for k, bound in TOL.items()), (key, err)
    for rank in range(3):
        assert "use_cache=True is not supported" in results[rank][("mamba2", 3, False)]["cache"]
