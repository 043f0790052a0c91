#!/usr/bin/env python3
"""Train a small model with sequence parallelism: a Hugging Face Llama with allscan's Ulysses attention, one of
transformers' linear-attention hybrids made sequence-parallel in place, or a flash-linear-attention GLA / Gated
DeltaNet / KDA model with allscan's layers swapped in.

    torchrun --nproc-per-node 2 examples/train_sp.py --steps 50               # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/train_sp.py --steps 20 --compare     # and check against one process
    torchrun --nproc-per-node 4 examples/train_sp.py --model qwen3_next --dp 2 --sp 2 --compare   # a hybrid, FSDP2
    torchrun --nproc-per-node 2 examples/train_sp.py --model gla              # fla's GLAForCausalLM (GPU, fla)

``--model qwen3_next|qwen3_5|kimi_linear|olmo_hybrid``: a tiny random config of that transformers family (no
download; linear-attention and softmax layers alternating), made sequence-parallel by
``allscan.integrations.transformers.sequence_parallel``. ``--dp D --sp S`` (D x S = the ranks): a DP x SP device
mesh (``allscan.integrations.mesh``), each DP row its own batch, FSDP2 over the mesh when D > 1; ``--compare``
then runs one process on the global batch (every row's).

Every rank holds the whole model and a contiguous slice of every sequence (T / P tokens); the data is
a synthetic next-token task (noisy counting sequences), so the loss falls. Each step prints the loss
(the single-process loss, reduced over the ranks), tokens per second and a progress bar on rank 0.
``--compare`` also runs, at every step and on every rank without communication, the same model in one
process on the whole batch from the sequence-parallel model's current weights, and reports the largest
relative difference of the loss and of the parameter gradients (norm of the difference over the norm)
over the run. Each step is compared from the same weights: training alone makes two runs drift apart
(the optimizer amplifies rounding), which says nothing of the sequence-parallel arithmetic. Exits 1,
saying why, when a difference exceeds 1e-5 (fp32; 2e-4 for the hybrids, whose delta rule allscan computes
with other chunked arithmetic than transformers) or 5e-2 (bf16). Needs transformers 5.x (``pip install
'transformers>=5,<6'``); ``--model gla|gdn|kda`` needs flash-linear-attention 0.6 and a GPU (Triton).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


HYBRIDS = ("qwen3_next", "qwen3_5", "kimi_linear", "olmo_hybrid")


def _hybrid(args):
    """A tiny random model of a transformers hybrid family (linear attention, then softmax attention, repeated)."""
    import transformers as tf

    h, heads = args.hidden, args.heads
    common = dict(vocab_size=args.vocab, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=args.layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  layer_types=["linear_attention", "full_attention"] * (args.layers // 2) + ["linear_attention"] *
                  (args.layers % 2), max_position_embeddings=args.seq,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)  # within the tiny vocabulary
    gdn = dict(linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=h // heads,
               linear_value_head_dim=h // heads, linear_conv_kernel_dim=4)
    if args.model == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            head_dim=h // heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=h // 2,
            shared_expert_intermediate_size=h // 2, **gdn, **common))
    if args.model == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(head_dim=h // heads, **gdn, **common))
    if args.model == "olmo_hybrid":
        return tf.OlmoHybridForCausalLM(tf.OlmoHybridConfig(**gdn, **common))
    d = h // heads
    return tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
        mlp_layer_types=["dense", "sparse"] * (args.layers // 2) + ["dense"] * (args.layers % 2), kv_lora_rank=h // 2,
        q_lora_rank=None, qk_rope_head_dim=d // 2, qk_nope_head_dim=d, v_head_dim=d, linear_num_heads=heads,
        linear_head_dim=d, linear_conv_kernel_dim=4, num_local_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=h // 2, n_group=1, topk_group=1, **{**common, "num_key_value_heads": heads}))


def _model(args, device, sequence_parallel=False, group=None):
    """The model of ``args.model``, seeded (the same weights on every rank and for every copy), made
    sequence-parallel over ``group`` (None: the default group) when ``sequence_parallel``; and its parameters by
    their names before that (the swapped layers hold the same Parameter objects under names of their own)."""
    import torch

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    if args.model in HYBRIDS:
        from allscan.integrations import transformers as sp_hf

        model = _hybrid(args)
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("eager")  # the same expert arithmetic in both runs, on any device
        model = model.to(device=device, dtype=dtype)
        params = dict(model.named_parameters())
        if sequence_parallel:
            sp_hf.sequence_parallel(model, group)
        return model, params
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from allscan.integrations import transformers as sp_hf

        attn = sp_hf.register(group) if sequence_parallel else "sdpa"
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                          attn_implementation=attn)
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
        return model, dict(model.named_parameters())
    if args.model == "gla":
        from fla.models import GLAConfig, GLAForCausalLM

        model = GLAForCausalLM(GLAConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads,
                                         num_hidden_layers=args.layers, fuse_cross_entropy=False))
    elif args.model == "gdn":
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads, head_dim=args.hidden // args.heads,
            num_hidden_layers=args.layers, fuse_cross_entropy=False))
    else:
        from fla.models import KDAConfig, KDAForCausalLM

        model = KDAForCausalLM(KDAConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads, head_dim=args.hidden // args.heads,
            num_hidden_layers=args.layers, fuse_cross_entropy=False))
    model = model.to(device=device, dtype=dtype)
    params = dict(model.named_parameters())
    if sequence_parallel:
        from allscan.integrations import fla as sp_fla

        sp_fla.sequence_parallel(model, group)
    return model, params


def _batch(args, step, device):
    """Counting sequences with 10% noise (each row from a random start, +1 mod vocab each token), the
    same on every rank: seeded by the step."""
    import torch

    gen = torch.Generator().manual_seed(args.seed * 100003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    ids = (start + torch.arange(args.seq)) % args.vocab
    noise = torch.rand(ids.shape, generator=gen) < 0.1
    ids = torch.where(noise, torch.randint(0, args.vocab, ids.shape, generator=gen), ids)
    return ids.to(device), ids.clone().to(device)


def _full(t):
    """A tensor whole on every rank: an FSDP2 shard (DTensor) gathered (collective), else itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _one_process_step(ref, params, ids, labels, args) -> float:
    """The whole (global) batch's loss and gradients in one process (into ``ref``'s own ``.grad``), from the
    sequence-parallel model's current weights (``params``, by name; FSDP2 shards gathered)."""
    import torch

    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(_full(params[name].detach()))
    ref.zero_grad(set_to_none=True)
    items = ids.shape[0] * (args.seq - 1)  # every label counts: the synthetic batch ignores none
    out = ref(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False)
    out.loss.backward()
    return out.loss.item()


def _gradient_difference(ref, params) -> float:
    """The largest relative difference (norm of the difference over the reference's norm) between the
    sequence-parallel model's gradients (``params``, synced) and the one-process ``ref``'s."""
    worst = 0.0
    for name, p in ref.named_parameters():
        mine = params[name].grad
        mine = None if mine is None else _full(mine)
        if p.grad is None or mine is None:
            if (p.grad is None) != (mine is None):
                raise RuntimeError(f"train_sp.py: {name} has a gradient in one run only")
            continue
        worst = max(worst, float((mine.float() - p.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-30)))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256, help="whole sequence length T (a multiple of the ranks)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="llama", choices=["llama", *HYBRIDS, "gla", "gdn", "kda"],
                    help="llama: transformers' Llama with Ulysses attention; qwen3_next / qwen3_5 / kimi_linear / "
                         "olmo_hybrid: a transformers hybrid made sequence-parallel in place; gla / gdn / kda: fla's "
                         "GLA / Gated DeltaNet / KDA model with allscan's layers")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel rows of the DP x SP mesh (FSDP2 when > 1)")
    ap.add_argument("--sp", type=int, default=None, help="sequence-parallel ranks per row (default: ranks / dp)")
    ap.add_argument("--compare", action="store_true",
                    help="also run each step in one process on the whole batch from the same weights and compare")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from allscan.integrations import batch as sp

    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sp_size = args.sp if args.sp is not None else world // max(args.dp, 1)
    if args.dp < 1 or sp_size < 1 or args.dp * sp_size != world:
        raise SystemExit(f"train_sp.py: --dp {args.dp} x --sp {sp_size} must be the number of ranks, {world}")
    mesh, group, d = None, None, 0
    if args.dp > 1:  # a DP x SP mesh: each row its own batch, FSDP2 over every rank
        from torch.distributed.device_mesh import init_device_mesh

        from allscan.integrations import mesh as spm

        mesh = init_device_mesh(device.type, (args.dp, sp_size), mesh_dim_names=("dp", "sp"))
        group, d = mesh["sp"], mesh.get_coordinate()[0]
    model, params = _model(args, device, sequence_parallel=True, group=group)
    if mesh is not None:
        spm.fully_shard(model, mesh)
        params = dict(model.named_parameters())  # FSDP2's sharded Parameters, under the same names
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref = _model(args, device)[0] if args.compare else None  # one process, the whole (global) batch
    worst_loss, worst_grad = 0.0, 0.0
    tokens = args.dp * args.batch * args.seq
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        rows = [_batch(args, step * args.dp + r, device) for r in range(args.dp)]  # every DP row's batch
        ids, labels = rows[d]
        if ref is not None:
            ref_loss = _one_process_step(ref, params, torch.cat([r[0] for r in rows]),
                                         torch.cat([r[1] for r in rows]), args)
        shard = sp.shard_batch(ids, labels) if mesh is None else spm.shard_batch(ids, labels, mesh)
        positions = {"position_ids": shard.position_ids} if args.model in ("llama", *HYBRIDS) else {}  # fla's: none
        logits = model(input_ids=shard.input_ids, use_cache=False, **positions).logits
        loss = sp.causal_lm_loss(logits, shard)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if mesh is None:
            sp.sync_gradients(model)  # (FSDP2 sums the gradients over the mesh itself)
        opt.step()
        total = (sp.reduce_loss(loss) if mesh is None else spm.reduce_loss(loss, mesh)).item()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        line = f"loss {total:.4f}  {tokens / dt:,.0f} tokens/s"
        if ref is not None:
            loss_diff = abs(total - ref_loss) / abs(ref_loss)
            grad_diff = _gradient_difference(ref, params)
            worst_loss, worst_grad = max(worst_loss, loss_diff), max(worst_grad, grad_diff)
            line += f"  one process {ref_loss:.4f} (rel. diff: loss {loss_diff:.1e}, gradients {grad_diff:.1e})"
        if rank == 0:
            done = (step + 1) * 30 // args.steps
            print(f"[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps}  {line}", flush=True)
    if rank == 0:
        print(f"done: {args.model}, {args.dtype}, DP={args.dp} x SP={sp_size} ({'NCCL' if cuda else 'gloo'}), "
              f"{args.steps} steps in "
              f"{time.perf_counter() - t_start:.1f} s", flush=True)
    bound = (2e-4 if args.model in HYBRIDS else 1e-5) if args.dtype == "float32" else 5e-2
    failed = args.compare and max(worst_loss, worst_grad) > bound
    if rank == 0 and args.compare:
        print(f"largest relative difference against one process on the same weights: loss {worst_loss:.2e}, "
              f"gradients {worst_grad:.2e} (bound {bound:.0e}): {'FAILED' if failed else 'ok'}", flush=True)
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
