#!/usr/bin/env python3
"""Loss parity and throughput of a small GLA language model with ZeCO sequence parallelism.

    torchrun --nproc-per-node 2 bench/gla_train.py --out DIR             # on the GPU machine (~2-3 min)
    torchrun --nproc-per-node 2 bench/gla_train.py --device cpu --steps 3 --tlocal 128 --layers 1 \
        --hidden 64 --heads 2 --intermediate 128 --vocab 64 --tp-steps 1 --tp-repeats 2 --out DIR   # CPU smoke
    python3 bench/gla_train.py --plot DIR/gla_train.json --out DIR       # redraw on CPU

Model: token embedding, ``--layers`` blocks of [RMSNorm -> allscan.layers.GatedLinearAttention
(fla's GLA layer, ``--heads`` heads) -> residual, RMSNorm -> SwiGLU MLP -> residual], RMSNorm, LM head.
fp32 parameters, bf16 autocast, AdamW. Data: synthetic tokens from a fixed random Markov chain (every
token has 8 possible successors), fixed seed, one sequence of ``2 * T_local`` tokens per step.

(a) parity: ``--steps`` steps at SP = 2 (each rank holds one half of the sequence; the next-token
    labels are shifted over the global sequence; parameter gradients are summed over the two ranks)
    and, interleaved, the same model from the same initialisation on ONE GPU (rank 0) over the same
    sequences. Both loss curves are recorded; the max relative difference over all steps is reported
    (goal <= 1e-3).
(b) throughput: tokens per second per GPU at SP = 2 (one sequence of 2*T_local tokens over the two
    GPUs) against data parallelism on the same two GPUs (each GPU its own T_local-token sequence,
    gradients averaged), same model, interleaved timing blocks, median (goal: SP >= 97% of DP).
    ``--captured`` (CUDA): each mode's forward, backward and gradient all-reduce captured in one CUDA
    graph and replayed, the optimizer step eager: the same comparison without the host's issue time.

Runtime on 2 H200s with the defaults (~230M parameters, 200 parity steps of 2 x 4096 tokens plus the
single-GPU step of 8192 tokens on rank 0, ~0.1 s a step; 2 x 6 x 5 throughput steps): about 30-40 s of
steps, plus process start-up and the first-time Triton compilation of fla's kernels (about 1-2 min
with ``--fla-autotune one``, the default: one fixed config per fla kernel, ``limit_fla_autotune``;
``full`` is fla's own autotuning, 10+ minutes on a fresh machine). Progress lines go to stderr,
flushed (rank 0, and every rank at the stage boundaries).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from gla_common import add_fla_autotune_option, progress, pyplot, redraw


def build_model(args, group):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from allscan.layers import GatedLinearAttention

    class MLP(nn.Module):
        def __init__(self, d, inter):
            super().__init__()
            self.gate_proj = nn.Linear(d, inter, bias=False)
            self.up_proj = nn.Linear(d, inter, bias=False)
            self.down_proj = nn.Linear(inter, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.attn_norm = nn.RMSNorm(args.hidden, eps=1e-6)
            self.attn = GatedLinearAttention(hidden_size=args.hidden, num_heads=args.heads, layer_idx=i,
                                             group=group, method=args.method)
            self.mlp_norm = nn.RMSNorm(args.hidden, eps=1e-6)
            self.mlp = MLP(args.hidden, args.intermediate)

        def forward(self, x):
            x = x + self.attn(self.attn_norm(x))[0]
            return x + self.mlp(self.mlp_norm(x))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.hidden)
            self.layers = nn.ModuleList(Block(i) for i in range(args.layers))
            self.norm = nn.RMSNorm(args.hidden, eps=1e-6)
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
                elif isinstance(m, nn.Embedding):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

        def set_group(self, g):
            for layer in self.layers:
                layer.attn.group = g

    torch.manual_seed(args.seed)
    return LM()


def make_data(args, n_seqs, length, device):
    """n_seqs sequences of a fixed random Markov chain (same on every rank: seeded generator)."""
    import torch
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    succ = torch.randint(args.vocab, (args.vocab, 8), generator=gen, device=device)
    probs = torch.softmax(2.0 * torch.randn(args.vocab, 8, generator=gen, device=device), -1)
    x = torch.randint(args.vocab, (n_seqs,), generator=gen, device=device)
    out = torch.empty(n_seqs, length, dtype=torch.long, device=device)
    for t in range(length):
        out[:, t] = x
        j = torch.multinomial(probs[x], 1, generator=gen).squeeze(1)
        x = succ[x, j]
    return out


_say = progress("gla_train")


def run(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from allscan.ops.gla import LOCAL, fla_available, limit_fla_autotune

    if args.precision == "fp32":
        # IEEE fp32 dots in Triton (fla's kernels and ours), set before anything compiles; no tf32
        # matmuls either (below): the two runs then differ only by fp32 rounding.
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:  # a CPU smoke test of the script (gloo, torch GLA kernels)
        dev = torch.device("cpu")
        dist.init_process_group("gloo")

    def sync():
        if cuda:
            torch.cuda.synchronize()
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        if fla_available():
            nk = limit_fla_autotune(args.fla_autotune)
            _say(f"fla autotune {args.fla_autotune!r} ({nk} kernels)", rank)
        else:
            _say("fla-core not importable: the GLA layers use the (slow) torch kernels", rank)
    T = args.tlocal
    L = T * world
    torch.backends.cuda.matmul.allow_tf32 = False

    t0 = time.time()
    data = make_data(args, args.steps, L + 1, dev)  # +1: the label of the last token
    dist.broadcast(data, 0)
    _say(f"data: {args.steps} x {L + 1} tokens in {time.time() - t0:.1f} s", rank)

    def lm_loss(model, tokens, labels, denom):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda and args.precision == "bf16"):
            logits = model(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / denom

    def make_opt(model):
        return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)

    def lr_at(step):
        return args.lr * min(1.0, (step + 1) / args.warmup_steps)

    # ---------------- (a) loss parity: SP = world vs one GPU ----------------
    sp_model = build_model(args, group).to(dev)
    sp_opt = make_opt(sp_model)
    ref_model = ref_opt = None
    if rank == 0:
        ref_model = build_model(args, LOCAL).to(dev)  # one GPU, the whole sequence
        ref_model.load_state_dict(sp_model.state_dict())
        ref_opt = make_opt(ref_model)
    sp_losses, ref_losses = [], []
    sl = slice(rank * T, (rank + 1) * T)
    t0 = time.time()
    _say(f"(a) parity: {args.steps} steps; the first compiles the kernels", rank, True)
    for step in range(args.steps):
        seq = data[step]
        inputs, labels = seq[:-1].unsqueeze(0), seq[1:].unsqueeze(0)
        for opt in (sp_opt, ref_opt):
            if opt is not None:
                for pg in opt.param_groups:
                    pg["lr"] = lr_at(step)
        # SP step
        loss = lm_loss(sp_model, inputs[:, sl], labels[:, sl], L)
        loss.backward()
        grads = [p.grad for p in sp_model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)  # the model is replicated; its gradient is the sum over the shards
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        sp_opt.step()
        sp_opt.zero_grad(set_to_none=True)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        sp_losses.append(lt.item())
        # single-GPU step over the same sequence (rank 0)
        if rank == 0:
            rl = lm_loss(ref_model, inputs, labels, L)
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(rl.item())
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            _say(f"step {step:4d}  loss SP={sp_losses[-1]:.5f}  1GPU={ref_losses[-1]:.5f}  "
                 f"rel diff {abs(sp_losses[-1] - ref_losses[-1]) / abs(ref_losses[-1]):.2e}  "
                 f"({time.time() - t0:.0f} s)", rank)
    # the last step's loss would keep its autograd graph, and with it the parameters' gradient
    # accumulators (bound to the default stream), alive: a captured backward cannot use those
    del ref_model, ref_opt, sp_opt
    loss = lt = rl = None  # noqa: F841
    if cuda:
        torch.cuda.empty_cache()

    # ---------------- (b) throughput: SP vs data parallel ----------------
    model = sp_model
    opt = make_opt(model)
    my_seq = data[rank % args.steps, :T].unsqueeze(0)
    my_lab = data[rank % args.steps, 1:T + 1].unsqueeze(0)
    sp_in = data[0, :-1].unsqueeze(0)[:, sl]
    sp_lab = data[0, 1:].unsqueeze(0)[:, sl]

    def step_fn(mode):
        if mode == "sp":
            model.set_group(group)
            loss = lm_loss(model, sp_in, sp_lab, L)
        else:
            model.set_group(LOCAL)
            loss = lm_loss(model, my_seq, my_lab, T)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if mode == "sp" else dist.ReduceOp.AVG)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _say("(b) throughput: warm-up (2 steps of each mode)", rank, True)
    for _ in range(2 if args.tp_repeats > 0 else 0):
        step_fn("sp")
        step_fn("dp")
    if args.captured and args.tp_repeats > 0:
        step_fn = _captured_steps(step_fn, model, opt, dev)
    _say(f"(b) throughput: {args.tp_repeats} blocks x {args.tp_steps} steps per mode, interleaved", rank, True)
    times = {"sp": [], "dp": []}
    for r in range(args.tp_repeats):  # 0: no throughput part
        for mode in (("sp", "dp") if r % 2 == 0 else ("dp", "sp")):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.tp_steps):
                step_fn(mode)
            sync()  # the steps end with a blocking .item()-free all_reduce: wall time = GPU time here
            t = torch.tensor([(time.perf_counter() - t0) * 1e3 / args.tp_steps], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[mode].append(t.item())
        _say(f"(b) block {r + 1}/{args.tp_repeats}: sp {times['sp'][-1]:.1f} ms, dp {times['dp'][-1]:.1f} ms", rank)
    ms = {m: statistics.median(v) if v else float("nan") for m, v in times.items()}
    tps = {m: T / (ms[m] / 1e3) for m in ms}  # tokens per second per GPU (each GPU processes T tokens)

    if rank == 0:
        rel = [abs(a - b) / abs(b) for a, b in zip(sp_losses, ref_losses)]
        n_params = sum(p.numel() for p in model.parameters())
        out = dict(
            bench="gla_train", world=world, T_local=T, layers=args.layers, hidden=args.hidden, heads=args.heads,
            intermediate=args.intermediate, vocab=args.vocab, params=n_params, steps=args.steps, lr=args.lr,
            seed=args.seed, method=args.method, host=socket.gethostname(),
            device=torch.cuda.get_device_name(dev) if cuda else "cpu", torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"),
            command="torchrun --nproc-per-node %d bench/gla_train.py %s" % (world, " ".join(sys.argv[1:])),
            loss_sp=sp_losses, loss_single=ref_losses, rel_diff=rel, max_rel_diff=max(rel),
            step_ms=ms, step_ms_all=times, tokens_per_s_per_gpu=tps, sp_over_dp=tps["sp"] / tps["dp"],
            fla_autotune=args.fla_autotune if cuda else None, precision=args.precision,
            captured=bool(args.captured))
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"gla_train{_suffix(args.precision)}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        report(out)
        plot(out, args.out)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def _captured_steps(eager_step, model, opt, dev):
    """``step(mode)`` that replays ``mode``'s forward, backward and gradient all-reduce from a CUDA graph
    (captured here, after the eager warm-up; each graph writes its own gradient tensors, handed to the
    parameters before the eager optimizer step)."""
    import torch

    params = list(model.parameters())

    def body(mode):  # the eager step up to the optimizer (its step is taken outside the graph)
        opt.step = lambda *a, **k: None  # an instance attribute over the class's method, removed after
        try:
            eager_step(mode)
        finally:
            del opt.step

    graphs, grads = {}, {}
    for mode in ("sp", "dp"):
        opt.zero_grad = lambda *a, **k: None  # the replay must leave its gradients in place
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    for p in params:
                        p.grad = None
                    body(mode)
            torch.cuda.current_stream(dev).wait_stream(side)
            for p in params:
                p.grad = None
            graphs[mode] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[mode]):
                body(mode)
        finally:
            del opt.zero_grad
        grads[mode] = [p.grad for p in params]

    def step(mode):
        graphs[mode].replay()
        for p, g in zip(params, grads[mode]):
            p.grad = g
        opt.step()

    return step


def _suffix(precision):
    return "" if precision == "bf16" else f"_{precision}"


def report(out):
    print(f"\nGLA LM ({out['layers']} layers, hidden {out['hidden']}, {out['heads']} heads, "
          f"{out['params'] / 1e6:.0f}M params), T_local={out['T_local']}, P={out['world']}, "
          f"{out.get('precision', 'bf16')}")
    print(f"(a) loss parity over {out['steps']} steps: loss {out['loss_sp'][0]:.4f} -> {out['loss_sp'][-1]:.4f}; "
          f"max relative difference SP vs 1 GPU = {out['max_rel_diff']:.2e} "
          f"({'met' if out['max_rel_diff'] <= 1e-3 else 'MISSED'} <= 1e-3)")
    tps, ms = out["tokens_per_s_per_gpu"], out["step_ms"]
    if not out["sp_over_dp"] == out["sp_over_dp"]:  # NaN: run with --tp-repeats 0
        print("(b) throughput not measured (--tp-repeats 0)")
        return
    print(f"(b) {'mode':>4} {'step ms':>9} {'tokens/s/GPU':>13}"
          + ("   (fwd+bwd+all-reduce CUDA-graph captured, optimizer eager)" if out.get("captured") else ""))
    for m in ("sp", "dp"):
        print(f"    {m:>4} {ms[m]:>9.2f} {tps[m]:>13.0f}")
    print(f"    SP/DP throughput = {out['sp_over_dp']:.3f} ({'met' if out['sp_over_dp'] >= 0.97 else 'MISSED'} >= 0.97)")


def plot(out, outdir):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(len(out["loss_sp"]))
    axes[0].plot(steps, out["loss_single"], label="1 GPU (whole sequence)", lw=2)
    axes[0].plot(steps, out["loss_sp"], label=f"SP={out['world']} (ZeCO)", lw=1, ls="--")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].semilogy(steps, [max(r, 1e-12) for r in out["rel_diff"]])
    axes[1].axhline(1e-3, color="k", ls="--", lw=0.8)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("|loss_SP - loss_1GPU| / loss_1GPU")
    fig.suptitle(f"GLA LM {out['params'] / 1e6:.0f}M, T_local={out['T_local']}: SP/DP throughput "
                 f"{out['sp_over_dp']:.3f}")
    fig.tight_layout()
    path = os.path.join(outdir, f"gla_train{_suffix(out.get('precision', 'bf16'))}.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tlocal", type=int, default=4096, help="tokens per GPU")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", default="zeco", choices=["zeco", "lasp1", "lasp2"])
    ap.add_argument("--tp-steps", type=int, default=5, help="steps per throughput timing block")
    ap.add_argument("--tp-repeats", type=int, default=6, help="timing blocks per mode (interleaved)")
    ap.add_argument("--plot", default=None, help="redraw from this JSON (no GPU)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                    help="bf16: fp32 weights, bf16 autocast (default); fp32: no autocast, IEEE fp32 matmuls and "
                         "Triton dots (the loss-parity check without bf16 rounding), files gla_train_fp32.*")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke test of the script")
    ap.add_argument("--captured", action="store_true", help="(b) with each mode's fwd+bwd+all-reduce replayed from "
                    "a CUDA graph (CUDA only)")
    add_fla_autotune_option(ap)
    args = ap.parse_args()
    if args.plot:
        redraw(args.plot, args.out, report, plot)
        return
    if args.captured and args.device != "cuda":
        ap.error("--captured needs --device cuda")
    run(args)


if __name__ == "__main__":
    main()
