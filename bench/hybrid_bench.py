#!/usr/bin/env python3
"""A whole Qwen3-Next-shaped model, fwd+bwd: transformers' own against the same weights made sequence-parallel by
``allscan.integrations.transformers.sequence_parallel`` (issue 53's speed and memory check).

    python3 bench/hybrid_bench.py --out DIR                               # one GPU, bf16, 16K tokens
    python3 bench/hybrid_bench.py --device cpu --tiny --tokens 256        # CPU smoke run (fp32, torch paths)

``Qwen3NextForCausalLM``, about 0.5B parameters (``--tiny``: 0.2M), random weights: groups of 3 Gated DeltaNet
layers and 1 gated attention layer, a dense SwiGLU MLP in each (``num_experts=0``: experts are per token, untouched
by the swap, and time less steadily), a 32K vocabulary (Qwen3-Next's 152K would make the logits most of the
memory). B = 1, ``--tokens`` tokens, one fwd+bwd (``causal_lm_loss``, ``backward()``; no optimizer). Rows, side by
side in one process, each repeat runs every row (odd repeats reversed): one untimed step (its peak memory above
the inputs and models), then ``--inner`` timed (CUDA events); median time, largest peak:

    hf              transformers' own model, SDPA: on GPU its delta rule is fla's ``chunk_gated_delta_rule``,
                    its causal conv ``F.conv1d`` unless ``causal-conv1d`` is installed (the output says which)
    allscan         a deepcopy, ``sequence_parallel(model, group)`` over a one-rank group (SP = 1): allscan's Gated
                    DeltaNet on ``zeco_gated_delta_rule`` (fla's kernels), its conv with the halo, SDPA
    allscan_middle  the same under bench/gla_common.py's one-GPU stand-in for rank 1 of 3 (``--stand-in``): in
                    every layer the delta rule's scans issued over the one-rank group and the incoming state's
                    fold-in; no transfer (the scans', the conv halo's), and attention is the shard's own SDPA:
                    at one rank Ulysses is local attention (its all-to-alls and whole-sequence attention for H/P
                    heads are not in this row)

Ratios to ``hf`` at the same tokens a rank (``allscan_middle``: against transformers on the shard alone); issue 53
asks at most 1.02x (``allscan``) and 1.05x (``allscan_middle``) in time and in peak memory. First one step per row
from the same weights: the losses must agree, else it raises (the stand-in's incoming state over a one-rank group
is zero: it computes the shard's own loss). fla autotunes as its users run it (``--fla-autotune one``: one config
per kernel). fla's delta-rule backward on Hopper with Triton 3.6 needs tilelang (``../shared/tools/
device_tilelang.sh``). Writes DIR/hybrid_bench.json and prints a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gla_common import add_fla_autotune_option, add_stand_in_option, middle_rank_stand_in, progress  # noqa: E402

ROWS = ("hf", "allscan", "allscan_middle")
TARGET = {"allscan": 1.02, "allscan_middle": 1.05}  # issue 53's bounds on time and peak memory
_say = progress("hybrid_bench")


@dataclass(frozen=True)
class Shape:
    """A Qwen3-Next-shaped model: ``groups`` x (3 Gated DeltaNet layers + 1 gated attention layer)."""
    hidden: int
    groups: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    intermediate: int
    vocab: int


SHAPES = {"0.5B": Shape(hidden=1024, groups=6, heads=8, kv_heads=2, head_dim=128, linear_key_heads=8,
                        linear_value_heads=16, linear_head_dim=128, intermediate=3584, vocab=32768),
          "tiny": Shape(hidden=64, groups=1, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2,
                        linear_value_heads=4, linear_head_dim=16, intermediate=128, vocab=128)}


def build_model(shape: Shape, dtype, device):
    """transformers' Qwen3-Next of ``shape``, seeded, SDPA attention, no experts, in ``dtype`` on ``device``."""
    import torch
    import transformers as tf

    cfg = tf.Qwen3NextConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=4 * shape.groups, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * shape.groups,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_key_heads, linear_num_value_heads=shape.linear_value_heads,
        linear_key_head_dim=shape.linear_head_dim, linear_value_head_dim=shape.linear_head_dim,
        linear_conv_kernel_dim=4, num_experts=0, max_position_embeddings=1 << 20, attn_implementation="sdpa",
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen3NextForCausalLM(cfg)
    return model.to(dtype)


def bound_kernels():
    """What transformers' Qwen3-Next bound for its delta rule and causal conv (the function it calls on GPU inputs:
    the package's when importable, else its torch fallback)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    def impl(fn):
        todo = [fn]
        for _ in range(4):  # transformers' wrappers (and the kernels package's) hold it in a closure cell
            nxt = []
            for f in todo:
                for c in (f, getattr(type(f), "forward", None), getattr(f, "__wrapped__", None)):
                    code = getattr(c, "__code__", None)
                    cells = dict(zip(code.co_freevars, (x.cell_contents for x in c.__closure__ or ()))) if code else {}
                    if "implementation" in cells:
                        return f"{cells['implementation'].__module__}.{cells['implementation'].__qualname__}"
                    nxt += [v for v in cells.values() if callable(v)]
            todo = nxt
        return "unknown"

    return {"delta_rule": impl(m.torch_chunk_gated_delta_rule), "causal_conv": impl(m.causal_conv1d_fn)}


class Clock:
    """A row's time (CUDA events on GPU, the host's clock on CPU) and peak memory (GPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def ms(self, calls) -> float:
        import torch

        if not self.cuda:
            t0 = time.perf_counter()
            calls()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        calls()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    def peak_mib(self, call) -> float:
        """MiB allocated at the peak of ``call()`` above what was allocated before it (GPU; 0 on CPU)."""
        import torch

        if not self.cuda:
            call()
            return 0.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the inputs and both models, no gradients
        call()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _one_rank_group(device):
    """A one-rank process group (the run's own unless one is up already): the swapped model's group."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise SystemExit("hybrid_bench runs on one rank (the stand-in is the middle rank's work)")
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    return True


def measure(args, device, dtype):
    """``(rows, agreement, info)``: every row's times and peak memory; the losses of the check step."""
    import torch
    import torch.distributed as dist

    from allscan.integrations import transformers as sp

    group = dist.group.WORLD
    shape = SHAPES["tiny" if args.tiny else "0.5B"]
    hf = build_model(shape, dtype, device)
    model = sp.sequence_parallel(copy.deepcopy(hf), group)
    n_params = sum(p.numel() for p in hf.parameters())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, shape.vocab, (1, args.tokens), generator=gen).to(device)
    batch = sp.shard_batch(ids, ids, group=group)  # one rank: the whole row, its labels shifted
    models = {"hf": hf, "allscan": model, "allscan_middle": model}

    def step(name):
        m = models[name]
        logits = m(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        loss = sp.causal_lm_loss(logits, batch)
        loss.backward()
        return loss.detach()

    def clear():
        for m in (hf, model):
            m.zero_grad(set_to_none=True)

    bound = bound_kernels()
    _say(f"{n_params / 1e6:.1f}M parameters, {args.tokens} tokens, {dtype}; transformers bound {bound}")
    losses = {}
    for name in ROWS:  # the check step (and the first compile / autotune of every row's kernels)
        with _row(name, args.stand_in):
            losses[name] = step(name).item()
        clear()
        _say(f"{name}: loss {losses[name]:.6f}")
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    rel = {n: abs(losses[n] - losses["hf"]) / abs(losses["hf"]) for n in ROWS[1:]}
    agreement = dict(checked=True, loss=losses, rel_err=rel, tol=tol)
    bad = {n: e for n, e in rel.items() if not e <= tol}
    if bad:
        raise RuntimeError(f"hybrid_bench: the rows' losses disagree with hf's beyond {tol}: {bad} ({losses})")
    clock = Clock(device)
    times, peaks = {n: [] for n in ROWS}, {n: [] for n in ROWS}
    for r in range(args.repeats):
        for name in ROWS if r % 2 == 0 else ROWS[::-1]:
            with _row(name, args.stand_in):
                peaks[name].append(clock.peak_mib(lambda: step(name)))  # untimed: entering or leaving the
                clear()                                                 # stand-in forgets the ops' plans

                def calls():
                    for _ in range(args.inner):
                        step(name)
                        clear()

                times[name].append(clock.ms(calls) / args.inner)
        _say(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {times[n][-1]:.1f} ms" for n in ROWS))
    rows = [dict(row=n, ms=statistics.median(times[n]), ms_all=times[n],
                 peak_mib=max(peaks[n]) if device.type == "cuda" else None) for n in ROWS]
    return rows, agreement, dict(params=n_params, shape=asdict(shape), transformers_bound=bound)


def _row(name, stand_in):
    """The context a row runs in: the stand-in for ``allscan_middle`` (entered and left around its calls, so the
    other rows run as one rank), nothing for the others."""
    import contextlib

    if name != "allscan_middle":
        return contextlib.nullcontext()
    return middle_rank_stand_in(1, "allscan.ops.delta.prepare", stand_in)


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        from allscan.ops.gla import limit_fla_autotune

        _say(f"fla autotune {args.fla_autotune!r} ({limit_fla_autotune(args.fla_autotune)} kernels)")
    dtype = torch.float32 if device.type == "cpu" else getattr(torch, args.dtype)
    made = _one_rank_group(device)
    try:
        rows, agreement, info = measure(args, device, dtype)
    finally:
        if made:
            dist.destroy_process_group()
    hf = rows[0]
    for r in rows:
        r["x_time"] = r["ms"] / hf["ms"]
        r["x_peak"] = r["peak_mib"] / hf["peak_mib"] if r["peak_mib"] is not None else None
    import transformers

    out = dict(bench="hybrid_bench", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               dtype=str(dtype).replace("torch.", ""), tokens=args.tokens, B=1, repeats=args.repeats, inner=args.inner,
               stand_in=args.stand_in, fla_autotune=args.fla_autotune, torch=torch.__version__,
               transformers=transformers.__version__, host=socket.gethostname(),
               time=time.strftime("%Y-%m-%d %H:%M:%S"), command="python3 bench/hybrid_bench.py " + " ".join(args.argv),
               targets=TARGET, agreement=agreement, rows=rows, **info)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hybrid_bench.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(report(out))
    return out


def report(out) -> str:
    place = {"middle": "rank 1 of 3", "last": "the last of 2", "first": "the first of 2"}[out["stand_in"]]
    lines = [f"\nhybrid_bench: Qwen3-Next-shaped, {out['params'] / 1e6:.1f}M parameters, B=1, {out['tokens']} tokens "
             f"(a rank), {out['dtype']}, fwd+bwd, median of {out['repeats']} (ms; peak MiB above inputs and models; "
             f"x = ratio to hf) on {out['device']}",
             f"transformers bound{' (for GPU inputs; CPU runs its torch fallbacks)' if out['device'] == 'cpu' else ''}: "
             f"{out['transformers_bound']}",
             f"allscan_middle: one device standing in for {place} (the scans over a one-rank group, no transfer; "
             "attention is the shard's own SDPA: Ulysses' all-to-alls and its whole-sequence attention are not in it)",
             "both convs run in torch unless transformers bound causal-conv1d: with it, hf's conv is faster than here",
             f"{'row':15s} {'ms':>9s} {'x':>6s} {'peak MiB':>9s} {'x':>6s}  target"]
    for r in out["rows"]:
        peak = f"{r['peak_mib']:9.0f} {r['x_peak']:6.3f}" if r["peak_mib"] is not None else f"{'-':>9s} {'-':>6s}"
        lines.append(f"{r['row']:15s} {r['ms']:9.2f} {r['x_time']:6.3f} {peak}  {out['targets'].get(r['row'], '')}")
    a = out["agreement"]
    lines.append("losses (check step): " + ", ".join(f"{n} {v:.6f}" for n, v in a["loss"].items())
                 + "; relative to hf: " + ", ".join(f"{n} {e:.1e}" for n, e in a["rel_err"].items())
                 + f" (at most {a['tol']:.0e})")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="hybrid_bench_out", help="folder for hybrid_bench.json ('' : none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of the row (a rank's, for allscan_middle)")
    ap.add_argument("--tiny", action="store_true", help="a model of a few thousand parameters (CPU smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="on GPU (CPU: float32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=1, help="timed fwd+bwd steps per repeat and row")
    add_fla_autotune_option(ap, default="full")  # fla's own autotuning: the baseline as its users run it
    add_stand_in_option(ap)
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return run(args)


if __name__ == "__main__":
    main()
