#!/usr/bin/env python3
"""Train a small Llama with sequence parallelism: allscan's Ulysses attention in a Hugging Face model.

    torchrun --nproc-per-node 2 examples/train_sp.py --steps 50               # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 examples/train_sp.py --steps 20 --compare     # and check against one process

Every rank holds the whole model and a contiguous slice of every sequence (T / P tokens); the data is
a synthetic next-token task (noisy counting sequences), so the loss falls. Each step prints the loss
(the single-process loss, reduced over the ranks), tokens per second and a progress bar on rank 0.
``--compare`` also trains the same model on the whole batch in one process (on every rank, no
communication) and reports the largest relative difference of the two losses over the run (fp32:
expected at the rounding level). Needs transformers 5.x (``pip install 'transformers>=5,<6'``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _model(args, attn, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, args.dtype))


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
    ap.add_argument("--compare", action="store_true", help="also train on one process and compare the losses")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from allscan.integrations import transformers as sp

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
    name = sp.register()
    model = _model(args, name, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if args.compare:
        ref = _model(args, "sdpa", device)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    worst = 0.0
    tokens = args.batch * args.seq
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        ids, labels = _batch(args, step, device)
        shard = sp.shard_batch(ids, labels)
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
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
            out = ref(input_ids=ids, labels=labels, use_cache=False)
            ref_opt.zero_grad(set_to_none=True)
            out.loss.backward()
            ref_opt.step()
            diff = abs(total - out.loss.item()) / abs(out.loss.item())
            worst = max(worst, diff)
            line += f"  one process {out.loss.item():.4f} (rel. diff {diff:.1e})"
        if rank == 0:
            done = (step + 1) * 30 // args.steps
            print(f"[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps}  {line}", flush=True)
    if rank == 0:
        print(f"done: P={world} ({'NCCL' if cuda else 'gloo'}), {args.steps} steps in "
              f"{time.perf_counter() - t_start:.1f} s" + (f"; largest relative loss difference against one "
                                                         f"process: {worst:.2e}" if args.compare else ""))
    dist.destroy_process_group()
    if args.compare and worst > (1e-4 if args.dtype == "float32" else 1e-1):
        sys.exit(1)


if __name__ == "__main__":
    main()
