#!/usr/bin/env python3
"""Train a small model with sequence parallelism: a Hugging Face Llama with allscan's Ulysses attention,
or a flash-linear-attention GLA / Gated DeltaNet model with allscan's layers swapped in.

    torchrun --nproc-per-node 2 examples/train_sp.py --steps 50               # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/train_sp.py --steps 20 --compare     # and check against one process
    torchrun --nproc-per-node 2 examples/train_sp.py --model gla              # fla's GLAForCausalLM (GPU, fla)

Every rank holds the whole model and a contiguous slice of every sequence (T / P tokens); the data is
a synthetic next-token task (noisy counting sequences), so the loss falls. Each step prints the loss
(the single-process loss, reduced over the ranks), tokens per second and a progress bar on rank 0.
``--compare`` also trains, on every rank without communication, the same model on the whole batch in
one process (the reference) and once more in two micro-batches of half the batch (the same training
with another summation order: the noise floor of the dtype), and reports the largest relative loss
difference of each against the reference over the run. Exits 1 when the sequence-parallel run is
off by more than 1e-4 (fp32) or 1e-1 (bf16) and by more than twice the noise floor. Needs transformers 5.x (``pip install
'transformers>=5,<6'``); ``--model gla|gdn|kda`` needs flash-linear-attention 0.6 and a GPU (Triton).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _model(args, device, sequence_parallel=False):
    """The model of ``args.model``, seeded (the same weights on every rank and for every copy), made
    sequence-parallel over the default group when ``sequence_parallel``."""
    import torch

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        from allscan.integrations import transformers as sp_hf

        attn = sp_hf.register() if sequence_parallel else "sdpa"
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                          attn_implementation=attn)
        return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
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
    if sequence_parallel:
        from allscan.integrations import fla as sp_fla

        sp_fla.sequence_parallel(model)
    return model


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
    ap.add_argument("--model", default="llama", choices=["llama", "gla", "gdn", "kda"],
                    help="llama: transformers' Llama with Ulysses attention; gla / gdn / kda: fla's GLA / Gated "
                         "DeltaNet / KDA model with allscan's layers")
    ap.add_argument("--compare", action="store_true",
                    help="also train on one process (whole batch, and two half-batch micro-batches) and compare")
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
    if args.compare and args.batch % 2:
        ap.error("--compare needs an even --batch (the micro-batch run halves it)")
    model = _model(args, device, sequence_parallel=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.compare:
        refs = [_model(args, device) for _ in range(2)]  # the whole batch; two micro-batches
        ref_opts = [torch.optim.AdamW(r.parameters(), lr=args.lr) for r in refs]
    worst, floor = 0.0, 0.0
    tokens = args.batch * args.seq
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids, labels = _batch(args, step, device)
        shard = sp.shard_batch(ids, labels)
        positions = {"position_ids": shard.position_ids} if args.model == "llama" else {}  # fla's need none
        logits = model(input_ids=shard.input_ids, use_cache=False, **positions).logits
        loss = sp.causal_lm_loss(logits, shard)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sp.sync_gradients(model)
        opt.step()
        total = sp.reduce_loss(loss).item()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        line = f"loss {total:.4f}  {tokens / dt:,.0f} tokens/s"
        if args.compare:
            ref_losses = []
            items = args.batch * (args.seq - 1)  # every label counts: the synthetic batch ignores none
            for r, r_opt, parts in zip(refs, ref_opts, (1, 2)):
                r_opt.zero_grad(set_to_none=True)
                got = 0.0
                for mb in torch.arange(args.batch, device=device).chunk(parts):
                    out = r(input_ids=ids[mb], labels=labels[mb], num_items_in_batch=items, use_cache=False)
                    out.loss.backward()
                    got += out.loss.item()
                r_opt.step()
                ref_losses.append(got)
            diff = abs(total - ref_losses[0]) / abs(ref_losses[0])
            worst = max(worst, diff)
            floor = max(floor, abs(ref_losses[1] - ref_losses[0]) / abs(ref_losses[0]))
            line += f"  one process {ref_losses[0]:.4f} (rel. diff {diff:.1e})"
        if rank == 0:
            done = (step + 1) * 30 // args.steps
            print(f"[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps}  {line}", flush=True)
    if rank == 0:
        print(f"done: {args.model}, {args.dtype}, P={world} ({'NCCL' if cuda else 'gloo'}), {args.steps} steps in "
              f"{time.perf_counter() - t_start:.1f} s", flush=True)
        if args.compare:
            print(f"largest relative loss difference against one process: {worst:.2e}; "
                  f"between two one-process runs (whole batch vs two micro-batches, the noise floor): {floor:.2e}",
                  flush=True)
    dist.destroy_process_group()
    # Fail when sequence parallelism is further from one process than the dtype allows, and further
    # than twice what another summation order alone gives (a long, fast-learning run amplifies
    # rounding: two equivalent one-process runs then drift apart too).
    if args.compare and worst > max(1e-4 if args.dtype == "float32" else 1e-1, 2 * floor):
        sys.exit(1)


if __name__ == "__main__":
    main()
