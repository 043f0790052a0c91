"""The matrix All-Scan's combine kernel, ``out = M @ y + x``, on one GPU, side by side with torch's batched
GEMM (cuBLAS) on the same values.

    torchrun --nproc-per-node 1 bench/combine_bench.py [--out DIR]

An inner rank of the matrix All-Scan runs this kernel on every block it receives, between receiving
the block and sending the result on, so its time adds to every hop of the chain (P > 2, or with
``init``). At P = 1 an inclusive matrix scan with ``init`` is exactly one combine (``M @ init + x``), so
the op is timed through ``torch.ops.allscan.matrix_scan`` on a group of one. Each row: ``--calls``
calls captured in one CUDA graph (no launch gaps beyond the GPU's own), replayed, the median per call
over ``--repeats`` rounds; within a state the three timed columns alternate. Beside it:
``torch.baddbmm`` in fp32 without TF32 (cuBLAS, the same arithmetic class: the named floor), with TF32
(a speed reference only: 10-bit mantissas miss the 1e-6 the scan must meet), and the bytes moved (M, y
and x read, out written) at the copy bandwidth. cuBLAS always gets fp32 operands (for a bf16 state,
fp32 copies of its values: twice the bytes of x and y). Accuracy: the kernel's relative error (norm) against float64 of the operands as
stored.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics

COPY_BANDWIDTH = 4.1e12  # bytes read + written per second, device-to-device copy on one H200 (GPU.md)
# (batch, K, V, state dtype, transposed): the delta layers' [16, 128, 128] state whole and as one of
# four pipeline blocks, four times the heads, head dimension 256 and 64, a bf16 state, the backward's M^T
SHAPES = [(16, 128, 128, "float32", False), (4, 128, 128, "float32", False), (64, 128, 128, "float32", False),
          (16, 256, 256, "float32", False), (16, 64, 64, "float32", False), (16, 128, 128, "bfloat16", False),
          (16, 128, 128, "float32", True)]


def graph_time_us(torch, fn, calls: int, replays: int) -> float:
    """Median time per call (us) of ``fn`` captured ``calls`` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    importlib.import_module("allscan.ops.matrix_scan")  # registers torch.ops.allscan.matrix_scan

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    if dist.get_world_size() != 1:
        raise SystemExit("combine_bench.py: run it as one process (torchrun --nproc-per-node 1): with more ranks the "
                         "op is a whole chain, not one combine")
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(7)
    rows = []
    for batch, K, V, dtype_name, transpose in SHAPES:
        dtype = getattr(torch, dtype_name)
        x64 = torch.randn(batch, K, V, generator=gen, dtype=torch.float64)
        m64 = torch.randn(batch, K, K, generator=gen, dtype=torch.float64) / K ** 0.5
        y64 = torch.randn(batch, K, V, generator=gen, dtype=torch.float64)
        x, y = x64.to(dev, dtype), y64.to(dev, dtype)
        m = m64.to(dev, torch.float32)
        # the exact answer of the operands as stored
        exact = ((m.double().transpose(-1, -2) if transpose else m.double()) @ y.double() + x.double())
        mt = m.transpose(-1, -2).contiguous() if transpose else m
        xf, yf = x.float(), y.float()

        def combine():
            return torch.ops.allscan.matrix_scan(x, m, y, name, False, True, transpose, 0, "pipelined", chain_head=True)

        def bmm_fp32():
            return torch.baddbmm(xf, mt, yf)

        times = {k: [] for k in ("allscan", "baddbmm fp32", "baddbmm tf32")}
        error = ((combine().double() - exact).norm() / exact.norm()).item()
        for _ in range(args.repeats):
            times["allscan"].append(graph_time_us(torch, combine, args.calls, args.replays))
            for tf32, key in ((False, "baddbmm fp32"), (True, "baddbmm tf32")):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                times[key].append(graph_time_us(torch, bmm_fp32, args.calls, args.replays))
            torch.backends.cuda.matmul.allow_tf32 = False
        es = torch.empty((), dtype=dtype).element_size()
        moved = batch * K * K * 4 + 3 * batch * K * V * es
        row = dict(batch=batch, K=K, V=V, dtype=dtype_name, transpose=transpose,
                   bytes_floor_us=moved / COPY_BANDWIDTH * 1e6,
                   us={k: statistics.median(v) for k, v in times.items()}, rel_error=error)
        rows.append(row)
        print(f"[{batch}, {K}, {V}] {dtype_name}{' M^T' if transpose else ''}: "
              + "  ".join(f"{k} {t:.2f}" for k, t in row["us"].items())
              + f"  bytes {row['bytes_floor_us']:.2f} us;  error {error:.1e}", flush=True)
    print()
    print("| state | allscan | baddbmm fp32 | baddbmm tf32 | bytes at copy speed | allscan / baddbmm fp32 | error |")
    print("|" + "---|" * 7)
    for r in rows:
        us = r["us"]
        print(f"| [{r['batch']}, {r['K']}, {r['V']}] {r['dtype']}{' M^T' if r['transpose'] else ''} | "
              + f"{us['allscan']:.2f} | {us['baddbmm fp32']:.2f} | {us['baddbmm tf32']:.2f} | {r['bytes_floor_us']:.2f} | "
              + f"{us['allscan'] / us['baddbmm fp32']:.2f} | {r['rel_error']:.1e} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "combine_bench.json"), "w") as f:
            json.dump(dict(calls=args.calls, replays=args.replays, repeats=args.repeats, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
