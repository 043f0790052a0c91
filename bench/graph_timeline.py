"""The GPU timeline of one CUDA-graph replay of GLA fwd+bwd: ``ideal`` (fla's chunk_gla on the shard)
and ``zeco`` (zeco_gla), each kernel's start, duration and the idle gap before it (torch.profiler).

    torchrun --nproc-per-node 1 bench/graph_timeline.py [--tlocal 8192] [--method zeco|lasp1]
             [--side-fill] [--side-priority high|normal] [--all] [--fla-autotune one|full] [--stand-in middle|last|first]

With one rank zeco runs what a middle rank (``--stand-in middle``, rank 1 of 3), the last of two ranks
(``last``) or the first of two (``first``) runs (bench/gla_common.py's stand-in: both scans issued over the one-rank group). ``--method lasp1`` waits for each scan where it is issued (no side branch in the
graph). ``--side-fill`` replaces the scans by a fill of their output on a side stream of the given
priority (a side branch without allscan's core), to tell the branch from the collective. Prints the
kernels longer than 100 us and the gaps over 3 us (``--all``: every kernel), then the span.
B = 1, H = 16, K = V = 128, bf16. Used to find why captured zeco cost more than its kernels
(bench/README.md, graph_timeline.py).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gla_common import add_fla_autotune_option, add_stand_in_option, middle_rank_stand_in  # noqa: E402


class _FillHandle:
    """What ``allscan.scan(..., async_op=True)`` returns, for a fill of the output on ``side``."""

    def __init__(self, x, side):
        self.event = torch.cuda.Event()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.y = torch.zeros_like(x)
            self.event.record()
        self.y.record_stream(torch.cuda.current_stream())

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)
        return self.y


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tlocal", type=int, default=8192)
    ap.add_argument("--method", default="zeco", choices=["zeco", "lasp1"])
    ap.add_argument("--side-fill", action="store_true")
    ap.add_argument("--side-priority", default="high", choices=["high", "normal"])
    ap.add_argument("--all", action="store_true")
    add_fla_autotune_option(ap)
    add_stand_in_option(ap)
    args = ap.parse_args()

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", device_id=dev)
    if dist.get_world_size() != 1:
        raise SystemExit("graph_timeline.py runs on one GPU (torchrun --nproc-per-node 1): it stands in for a rank")
    from fla.ops.gla import chunk_gla

    from allscan.ops.gla import limit_fla_autotune, zeco_gla

    limit_fla_autotune(args.fla_autotune)
    if args.side_fill:
        side = torch.cuda.Stream(device=dev, priority=-100 if args.side_priority == "high" else 0)
        from allscan.ops.hooks import op_hooks

        def fill_scan(x, gamma, group, **kwargs):
            h = _FillHandle(x, side)
            return h if kwargs.get("async_op") else h.wait()

        op_hooks.gla_scan = fill_scan  # the op's documented hook: how zeco_gla issues its scans
    T, B, H, K = args.tlocal, 1, 16, 128
    gen = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(B, T, H, K, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev, generator=gen)) / 16)
    g = g.to(torch.bfloat16).requires_grad_(True)
    do = torch.randn(B, T, H, K, device=dev, generator=gen, dtype=torch.bfloat16)
    ins = [q, k, v, g]

    def fwd_bwd(name):
        o = chunk_gla(q, k, v, g)[0] if name == "ideal" else zeco_gla(q, k, v, g, method=args.method)[0]
        return (o,) + torch.autograd.grad(o, ins, do)

    with middle_rank_stand_in(1, "allscan.ops.gla.zeco", args.stand_in):
        for name in ("ideal", "zeco"):
            side_warm = torch.cuda.Stream(dev)
            side_warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_warm):
                for _ in range(3):
                    fwd_bwd(name)
            torch.cuda.current_stream().wait_stream(side_warm)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fwd_bwd(name)
            for _ in range(3):
                graph.replay()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                graph.replay()
            e1.record()
            torch.cuda.synchronize()
            print(f"== {args.method}{' side-fill ' + args.side_priority if args.side_fill else ''} {name} "
                  f"T={T}: replay {e0.elapsed_time(e1) / 10 * 1e3:.1f} us")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                            key=lambda e: e.time_range.start)
            if not events:
                print("  (no device events recorded)")
                continue
            t0 = last_end = events[0].time_range.start
            for e in events:
                start, end = e.time_range.start, e.time_range.end
                if args.all or end - start > 100 or start - last_end > 3:
                    print(f"  {start - t0:8.1f} +{end - start:7.1f} gap {start - last_end:7.1f} {e.name[:60]}")
                last_end = max(last_end, end)
            print(f"  span {last_end - t0:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
