"""torch.compile traces allscan without a graph break (CPU, gloo; ``fullgraph=True`` makes any graph
break an error), and the compiled call equals eager. The GPU paths (fla's kernels, allscan's Triton
kernels, NCCL) are issue 14's: not covered here.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402


def _inputs(rank, op):
    gen = torch.Generator().manual_seed(rank)
    B, T, H, K = 1, 24, 2, 8
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    if op == "gla":
        return q, k, v, -torch.rand(B, T, H, K, generator=gen) * 0.2
    return (q, torch.nn.functional.normalize(k, dim=-1), v, -torch.rand(B, T, H, generator=gen) * 0.2,
            torch.rand(B, T, H, generator=gen))


def _step(op):
    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla

    def scan(x, g):
        return allscan.scan(x, g, inclusive=True) * 2

    def layer(q, *rest):
        fn = zeco_gla if op == "gla" else zeco_gated_delta_rule
        o, final = fn(q, *rest, output_final_state=True)
        return o, final

    return scan if op == "scan" else layer


def _compiled_equals_eager(rank, world, op, backward=True):
    torch._dynamo.reset()
    fn = _step(op)
    if op == "scan":
        args = (torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)), torch.full((4, 8), 0.5))
    else:
        args = _inputs(rank, op)
    results = {}
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True, backend="aot_eager"))):
        xs = [a.clone().requires_grad_(backward and a.is_floating_point()) for a in args]
        out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        if backward:
            sum(o.square().sum() for o in outs).backward()
        results[name] = [o.detach() for o in outs] + [x.grad for x in xs if x.grad is not None]
    return max((a - b).abs().max().item() for a, b in zip(results["eager"], results["compiled"]))


CASES = [("scan", 1), ("scan", 2), ("gla", 1), ("gdn", 1)]


@pytest.mark.parametrize("op, world", CASES, ids=[f"{op}-P{w}" for op, w in CASES])
def test_fullgraph_compile_equals_eager(op, world):
    """The scan forward and backward at P = 1 and 2; the layers' forward at P = 1. Not yet (issue
    14): the layers' backward (their torch backends recompute with torch.autograd.grad inside
    autograd.Function.backward, which Dynamo does not trace) and the layers at P = 2 (the compiled
    run hangs: the layer's Python, its cross-rank check included, runs inside the trace)."""
    for diff in run_distributed(_compiled_equals_eager, world, op, op == "scan", timeout=300):
        assert diff <= 1e-5, diff
