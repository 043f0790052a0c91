"""Fault injection on CPU (gloo): a rank dies in the middle of a loop of allscan calls.

Every survivor must raise (never hang, never return a wrong value) within the group's timeout + 5 s,
and a new group of the survivors must work afterwards. P = 3; the dead rank is the middle one for
every collective and layer (scan by each method, the matrix scan, the chunked all-to-all, zeco_gla
and zeco_gated_delta_rule fwd+bwd), and the head and the tail for the scan. The victim leaves with
``os._exit`` (no clean-up, as a crashed process) while its peers are calling.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

WORLD = 3
PG_TIMEOUT = 3.0  # seconds: the fault group's timeout
SLACK = 5.0  # what the issue allows past the timeout


def _call(op, group, rank):
    """One collective (or layer fwd+bwd) on ``group``; returns a value every rank can check."""
    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla

    x = torch.arange(1.0, 9.0) * (rank + 1)
    if op.startswith("scan"):
        method = op.partition(":")[2] or "pipelined"
        return allscan.scan(x, torch.full_like(x, 0.5), group, inclusive=True, method=method)
    if op == "matrix":
        return allscan.scan(x.view(1, 2, 4), group=group, transition=torch.eye(2).unsqueeze(0), inclusive=True)
    if op == "a2a":
        return allscan.a2a.scatter_heads(torch.ones(1, 2, WORLD, 4) * (rank + 1), group)
    gen = torch.Generator().manual_seed(rank)
    q, k = (torch.randn(1, 6, 2, 4, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 6, 2, 4, generator=gen, requires_grad=True)
    if op == "gla":
        o, _ = zeco_gla(q, k, v, torch.full((1, 6, 2, 4), -0.1), group)
    else:
        beta = torch.full((1, 6, 2), 0.5)
        o, _ = zeco_gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v, torch.full((1, 6, 2), -0.1),
                                     beta, group)
    o.sum().backward()
    return o.detach()


def _victim_dies(rank, world, op, victim):
    import torch.distributed as dist

    import allscan

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    _call(op, group, rank)  # every signature checked once, the group warm
    dist.barrier(group)
    if rank == victim:
        time.sleep(0.3)  # the others are calling by now
        os._exit(0)
    t0 = time.monotonic()
    outcome = None
    for _ in range(100000):
        try:
            _call(op, group, rank)
        except Exception as e:  # noqa: BLE001 - whatever the collective raises is the outcome
            outcome = (type(e).__name__, str(e).splitlines()[0][:160])
            break
    elapsed = time.monotonic() - t0
    # the survivors carry on in a group of their own
    survivors = [r for r in range(world) if r != victim]
    fresh = dist.new_group(survivors, timeout=datetime.timedelta(seconds=30), use_local_synchronization=True)
    y = allscan.scan(torch.ones(4), torch.full((4,), 0.5), fresh, inclusive=True)
    want = sum(0.5 ** i for i in range(survivors.index(rank) + 1))
    return dict(outcome=outcome, elapsed=elapsed, fresh_ok=bool(torch.allclose(y, torch.full((4,), want))))


CASES = [("scan", 1), ("scan", 0), ("scan", 2), ("scan:serial", 1), ("scan:allgather", 1), ("matrix", 1),
         ("a2a", 1), ("gla", 1), ("gdn", 1)]


@pytest.mark.parametrize("op, victim", CASES, ids=[f"{op}-dies{v}" for op, v in CASES])
def test_a_dead_rank_makes_every_survivor_raise_in_time(op, victim):
    results = run_distributed(_victim_dies, WORLD, op, victim, timeout=120, may_exit=(victim,))
    assert results[victim] is None
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["outcome"] is not None, f"rank {rank} never raised ({op}, rank {victim} dead)"
        assert r["elapsed"] <= PG_TIMEOUT + SLACK + 0.3, f"rank {rank} raised after {r['elapsed']:.1f} s: {r}"
        assert r["fresh_ok"], f"rank {rank}: a new group of the survivors did not work: {r}"
