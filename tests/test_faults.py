"""Fault injection on CPU (gloo): a rank dies in the middle of a loop of allscan calls.

Every survivor must raise (never hang, never return a wrong value) within the group's timeout + 5 s,
and a new group of the survivors must work afterwards. P = 3; the dead rank is the middle one for
every collective and layer (scan by each method, the matrix scan, the chunked all-to-all, the short
convolutions' halo exchange, zeco_gla and zeco_gated_delta_rule fwd+bwd), and the head and the tail
for the scan. The victim leaves with ``os._exit`` (no clean-up, as a crashed process) while its peers
are calling. The same on 2 GPUs over NCCL (marked ``gpu``), where allscan's communicator watch turns
the hang into ``allscan.CommunicatorTimeout``.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed, skip_unless_nccl_ranks  # noqa: E402

WORLD = 3
PG_TIMEOUT = 3.0  # seconds: the fault group's timeout
SLACK = 5.0  # what the issue allows past the timeout


def _call(op, group, rank, device="cpu", step=0):
    """One collective (or layer fwd+bwd) on ``group``, on ``device`` (the layers with shapes fla's
    kernels take on CUDA); returns a value every rank can check. The scan alternates direction with
    ``step`` (either end of the chain then waits on a dead neighbour soon)."""
    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla

    world = group.size()
    x = torch.arange(1.0, 9.0, device=device) * (rank + 1)
    if op.startswith("scan"):
        method = op.partition(":")[2] or "pipelined"
        return allscan.scan(x, torch.full_like(x, 0.5), group, inclusive=True, method=method, reverse=bool(step % 2))
    if op == "matrix":
        return allscan.scan(x.view(1, 2, 4), group=group, transition=torch.eye(2, device=device).unsqueeze(0),
                            inclusive=True, reverse=bool(step % 2))
    if op == "a2a":
        return allscan.a2a.scatter_heads(torch.ones(1, 2, world, 4, device=device) * (rank + 1), group)
    if op == "halo":  # the short convolutions' exchange, forward and backward
        from allscan.ops.halo import halo_exchange

        xs = x.view(1, 4, 2).clone().requires_grad_()
        h = halo_exchange(xs, 2, group)
        h.sum().backward()
        return h.detach()
    T, K = (6, 4) if device == "cpu" else (64, 16)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, T, 2, K, generator=gen).to(device).requires_grad_() for _ in range(3))
    if op == "gla":
        o, _ = zeco_gla(q, k, v, torch.full((1, T, 2, K), -0.1, device=device), group)
    else:
        beta = torch.full((1, T, 2), 0.5, device=device)
        o, _ = zeco_gated_delta_rule(q, torch.nn.functional.normalize(k, dim=-1), v,
                                     torch.full((1, T, 2), -0.1, device=device), beta, group)
    o.sum().backward()
    return o.detach()


def _victim_dies(rank, world, op, victim, device="cpu", pg_timeout=PG_TIMEOUT):
    """The victim leaves after a warm-up call; each survivor calls until it raises (syncing every
    call, as a loop that logs its loss does), then (gloo) scans on a new group of the survivors. On
    NCCL torch's new_group splits the default group's communicator, which needs the dead rank too:
    the stuck-peer test checks a new group there."""
    import torch.distributed as dist

    import allscan

    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=pg_timeout))
    for step in (0, 1):  # every signature (both scan directions) checked once, the group warm
        _call(op, group, rank, device, step)
    dist.barrier(group)
    if rank == victim:
        time.sleep(0.3)  # the others are calling by now
        os._exit(0)
    t0 = time.monotonic()
    outcome = None
    for step in range(100000):
        try:
            _call(op, group, rank, device, step).cpu()
        except Exception as e:  # noqa: BLE001 - whatever the collective raises is the outcome
            outcome = (type(e).__name__, str(e).splitlines()[0][:160])
            break
    elapsed = time.monotonic() - t0
    if device != "cpu":
        return dict(outcome=outcome, elapsed=elapsed, fresh_ok=None)
    # the survivors carry on in a group of their own
    survivors = [r for r in range(world) if r != victim]
    fresh = dist.new_group(survivors, timeout=datetime.timedelta(seconds=30), use_local_synchronization=True)
    y = allscan.scan(torch.ones(4, device=device), torch.full((4,), 0.5, device=device), fresh, inclusive=True).cpu()
    want = sum(0.5 ** i for i in range(survivors.index(rank) + 1))
    return dict(outcome=outcome, elapsed=elapsed, fresh_ok=bool(torch.allclose(y, torch.full((4,), want))))


CASES = [("scan", 1), ("scan", 0), ("scan", 2), ("scan:serial", 1), ("scan:allgather", 1), ("matrix", 1),
         ("a2a", 1), ("halo", 1), ("gla", 1), ("gdn", 1)]


def check_survivors(results, op, victim, pg_timeout, expect=None):
    """Every survivor raised (``expect``: that exception type's name) within the timeout + SLACK, and
    a new group of the survivors worked."""
    assert results[victim] is None
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["outcome"] is not None, f"rank {rank} never raised ({op}, rank {victim} dead)"
        assert expect is None or r["outcome"][0] == expect, f"rank {rank}: {r}"
        assert r["elapsed"] <= pg_timeout + SLACK + 0.3, f"rank {rank} raised after {r['elapsed']:.1f} s: {r}"
        assert r["fresh_ok"] in (True, None), f"rank {rank}: a new group of the survivors did not work: {r}"


@pytest.mark.parametrize("op, victim", CASES, ids=[f"{op}-dies{v}" for op, v in CASES])
def test_a_dead_rank_makes_every_survivor_raise_in_time(op, victim):
    results = run_distributed(_victim_dies, WORLD, op, victim, timeout=120, may_exit=(victim,))
    check_survivors(results, op, victim, PG_TIMEOUT)


GPU_CASES = ["scan", "matrix", "a2a", "halo", "gla", "gdn"]
GPU_PG_TIMEOUT = 5.0


@pytest.mark.gpu
@pytest.mark.parametrize("op", GPU_CASES)
def test_a_dead_rank_on_nccl_makes_the_survivor_raise_in_time(op):
    """2 GPUs, NCCL: rank 1 dies; rank 0's collectives (allscan's own communicator, watched with
    the group's timeout) raise CommunicatorTimeout within the timeout + 5 s instead of hanging."""
    skip_unless_nccl_ranks(2)
    os.environ.setdefault("ALLSCAN_FLA_AUTOTUNE", "one")
    results = run_distributed(_victim_dies, 2, op, 1, "cuda", GPU_PG_TIMEOUT, backend="nccl", timeout=120,
                              may_exit=(1,))
    check_survivors(results, op, 1, GPU_PG_TIMEOUT, expect="CommunicatorTimeout")


def _peer_stalls(rank, world, pg_timeout):
    """Rank 1 stops calling for longer than the timeout (alive, stuck elsewhere); rank 0 must raise.
    Then both make a new group: allscan gives it a new communicator that works."""
    import torch.distributed as dist

    import allscan

    device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=pg_timeout))
    for step in (0, 1):
        _call("scan", group, rank, device, step)
    dist.barrier()
    outcome, elapsed = None, 0.0
    if rank == 1:
        time.sleep(pg_timeout + SLACK + 3)
    else:
        t0 = time.monotonic()
        for step in range(100000):
            try:
                _call("scan", group, rank, device, step).cpu()
            except allscan.CommunicatorTimeout as e:
                outcome = ("CommunicatorTimeout", str(e).splitlines()[0][:160])
                break
        elapsed = time.monotonic() - t0
        try:
            _call("scan", group, rank, device, 0)
            again = "no error"
        except allscan.CommunicatorTimeout:
            again = "CommunicatorTimeout"
    fresh = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    y = allscan.scan(torch.ones(4, device=device), torch.full((4,), 0.5, device=device), fresh, inclusive=True).cpu()
    want = sum(0.5 ** i for i in range(rank + 1))
    res = dict(outcome=outcome, elapsed=elapsed, fresh_ok=bool(torch.allclose(y, torch.full((4,), want))))
    if rank == 0:
        res["again"] = again
        # NCCL may have given the aborted communicator's address to the new one: the old group still
        # raises its own failure and never reaches the new communicator
        try:
            _call("scan", group, rank, device, 0)
            res["old_after_fresh"] = "no error"
        except allscan.CommunicatorTimeout:
            res["old_after_fresh"] = "CommunicatorTimeout"
        from allscan import _comm

        # whether NCCL reused the address this time (the retirement ran): shown with a failure, not asserted
        res["retired"] = _comm.find_communicator(group, torch.device(device)).failure is not None
    # and the new group still works after that
    y = allscan.scan(torch.ones(4, device=device), torch.full((4,), 0.5, device=device), fresh, inclusive=True)
    res["fresh_ok"] = res["fresh_ok"] and bool(torch.allclose(y.cpu(), torch.full((4,), want)))
    return res


@pytest.mark.gpu
def test_a_stuck_peer_on_nccl_then_a_new_group_works():
    skip_unless_nccl_ranks(2)
    r0, r1 = run_distributed(_peer_stalls, 2, GPU_PG_TIMEOUT, backend="nccl", timeout=120)
    assert r0["outcome"] is not None and r0["outcome"][0] == "CommunicatorTimeout", r0
    assert r0["elapsed"] <= GPU_PG_TIMEOUT + SLACK, r0
    assert r0["again"] == "CommunicatorTimeout", r0  # the failed communicator stays failed
    assert r0["old_after_fresh"] == "CommunicatorTimeout", r0  # also once a new one exists
    assert r0["fresh_ok"] and r1["fresh_ok"], (r0, r1)


def _timeouts(rank, world):
    import torch.distributed as dist

    from allscan._comm import group_timeout

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=7))
    return group_timeout(group, torch.device("cpu")), group_timeout(dist.group.WORLD, torch.device("cpu"))


def test_the_watch_timeout_is_the_groups_own():
    """ALLSCAN_TIMEOUT=group (the default) reads each group's own timeout."""
    for mine, world_default in run_distributed(_timeouts, 2):
        assert mine == 7.0
        assert world_default == 1800.0  # torch's default for gloo (30 min), as init_process_group left it


# ------------------------------------------------------------------------------------------------
# NCCL in the default mode (`first`): what the host check cannot see once a signature is cached
# ------------------------------------------------------------------------------------------------
def _until_error(call, limit=20.0, naming=None):
    """Calls until allscan raises CommunicatorError (or `limit` s): (type name, message), seconds.
    With ``naming``, until one whose message holds it (a call in flight when a peer's communicator
    aborted may first raise CommunicatorError with NCCL's remote error; any other exception escapes)."""
    import allscan

    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            call().cpu()
        except allscan.CommunicatorError as e:
            if naming is None or naming in str(e):
                return (type(e).__name__, str(e)), time.monotonic() - t0
    return None, time.monotonic() - t0


def _switch(rank, world, case):
    """Both ranks check two signatures whose transfers have the same bytes; then rank 1 calls with
    the other one. Its result must be NaN (never a wrong number) and both ranks must raise soon.
    ``ulysses``: the two signatures differ in Ulysses' own arguments only (causal or not; the same
    all-to-alls), which its all-to-alls' in-band signature carries."""
    import torch.distributed as dist

    import allscan

    device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    x = torch.arange(1.0, 17.0, device=device) * (rank + 1)
    shapes = {"matrix": ((1, 4, 4), (4, 2, 2)), "a2a": ((1, 2, 2, 4), (1, 4, 2, 2)),
              "ulysses": (True, False)}.get(case, ((2, 8), (4, 4)))

    def call(shape):
        if case == "ulysses":  # shape: causal or not; [1, S_local 4, 2 heads, D 2]
            from allscan.layers import UlyssesAttention

            q = x.view(1, 4, 2, 2)
            return UlyssesAttention(group, num_chunks=1)(q, q, q, causal=shape)
        if case == "a2a":  # the same bytes to each peer: [1, S_local, 2 heads, D] with S_local * D = 8
            return allscan.a2a.scatter_heads(x.view(shape), group)
        if case == "matrix":
            m = torch.eye(shape[1], device=device).expand(shape[0], shape[1], shape[1]).contiguous()
            return allscan.scan(x.view(shape), group=group, transition=m, inclusive=True)
        return allscan.scan(x.view(shape), torch.full(shape, 0.5, device=device), group,
                            inclusive=case == "inclusive")

    for shape in shapes:
        call(shape)  # both signatures checked across ranks (and cached)
    torch.cuda.synchronize()
    dist.barrier(group)
    mine = shapes[rank]
    try:
        y = call(mine).cpu()
    except allscan.CommunicatorError as e:  # Ulysses: its second all-to-all may already refuse
        return dict(returned=False, nan=False, finite=False, outcome=(type(e).__name__, str(e)), elapsed=0.0)
    outcome, elapsed = _until_error(lambda: call(mine))
    return dict(returned=True, nan=bool(torch.isnan(y).all()), finite=bool(torch.isfinite(y).all()), outcome=outcome,
                elapsed=elapsed)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["exclusive", "inclusive", "matrix", "a2a", "ulysses"])
def test_a_cached_signature_switch_on_nccl_gives_nan_and_raises_on_both_ranks(case):
    skip_unless_nccl_ranks(2)
    r0, r1 = run_distributed(_switch, 2, case, backend="nccl", timeout=120)
    if case in ("a2a", "ulysses"):  # both ranks receive: both find the other signature
        for r in (r0, r1):
            assert (r["nan"] or not r["returned"]) and r["outcome"] and r["outcome"][0] == "CommunicatorError", r
            assert "different arguments" in r["outcome"][1] and r["elapsed"] < 3.0, r
        return
    assert r0["finite"], r0  # the head received nothing: its result is its own
    assert r1["nan"], r1     # the receiver found the other signature: NaN, not a wrong number
    assert r1["outcome"] and r1["outcome"][0] == "CommunicatorError" and "different arguments" in r1["outcome"][1], r1
    assert r0["outcome"] and r0["outcome"][0] == "CommunicatorError" and "rank 1 reported" in r0["outcome"][1], r0
    assert r1["elapsed"] < 1.0 and r0["elapsed"] < 3.0, (r0, r1)


def _halo_after_a_mismatch(rank, world):
    """Rank 1's scan finds rank 0's signature differs (a cached one, same bytes); then rank 1's halo
    exchange on the same communicator must refuse with that mismatch before it receives anything. The
    fault board is stopped first, so only the core's own check can refuse (the board would fail the
    communicator within a poll anyway). Without that check rank 1 would receive from rank 0's halo,
    which rank 0 sends, and carry on."""
    import torch.distributed as dist

    import allscan
    from allscan import _faults
    from allscan.ops.halo import halo_exchange

    device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    x = torch.arange(1.0, 17.0, device=device) * (rank + 1)
    shapes = ((2, 8), (4, 4))
    for shape in shapes:  # both scan signatures and the halo's checked across ranks (and cached)
        allscan.scan(x.view(shape), torch.full(shape, 0.5, device=device), group)
    halo_exchange(x.view(1, 16, 1), 2, group)
    torch.cuda.synchronize()
    dist.barrier(group)
    _faults.board().stop()
    mine = shapes[rank]
    y = allscan.scan(x.view(mine), torch.full(mine, 0.5, device=device), group).cpu()
    try:
        h = halo_exchange(x.view(1, 16, 1), 2, group).cpu()
        halo = ("returned", str(h.flatten().tolist()))
    except allscan.CommunicatorError as e:
        halo = (type(e).__name__, str(e))
    torch.cuda.synchronize()
    dist.barrier(group)  # rank 0's halo send completed into rank 1's receive, or NCCL's buffers
    return dict(nan=bool(torch.isnan(y).all()), halo=halo)


@pytest.mark.gpu
def test_the_halo_exchange_refuses_after_a_mismatch_on_its_communicator():
    skip_unless_nccl_ranks(2)
    r0, r1 = run_distributed(_halo_after_a_mismatch, 2, backend="nccl", timeout=120)
    assert r1["nan"], r1
    assert r1["halo"][0] == "CommunicatorError" and "different arguments" in r1["halo"][1], r1
    assert r0["halo"][0] == "returned", r0  # the head receives nothing and found no mismatch


def _bad_argument(rank, world, who, op="scan"):
    """After a warm-up, the ranks in `who` pass a bad argument (the scan: a gamma of the wrong size;
    the halo exchange: a shard shorter than the halo): each raises ValueError; when every rank did, the
    group carries on; when only some did, every rank raises CommunicatorError soon."""
    import torch.distributed as dist

    import allscan
    from allscan.ops.halo import halo_exchange

    device = f"cuda:{torch.cuda.current_device()}"
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    x = torch.ones(16, device=device) * (rank + 1)
    g = torch.full((16,), 0.5, device=device)

    def good():
        if op == "halo":
            return halo_exchange(x.view(1, 16, 1), 2, group)
        return allscan.scan(x, g, group, inclusive=True)

    def bad():
        if op == "halo":
            return halo_exchange(x.view(1, 16, 1)[:, :1], 2, group)
        return allscan.scan(x, torch.full((3,), 0.5, device=device), group)

    good()
    torch.cuda.synchronize()
    dist.barrier(group)
    t0 = time.monotonic()
    first = None
    if rank in who:
        try:
            bad()
        except ValueError as e:
            first = ("ValueError", str(e)[:200], time.monotonic() - t0)
    if len(who) == world:
        y = good().cpu()
        if op == "halo":
            want = torch.full((1, 2, 1), float(rank)).cpu()  # rank 0's ones on rank 1, zeros on rank 0
            return dict(first=first, carried_on=bool(torch.equal(y, want)))
        want = sum((q + 1) * 0.5 ** (rank - q) for q in range(rank + 1))
        return dict(first=first, carried_on=bool(torch.allclose(y, torch.full((16,), want))))
    outcome, elapsed = _until_error(good, naming=BAD[op])
    return dict(first=first, outcome=outcome, elapsed=time.monotonic() - t0)


BAD = {"scan": "gamma", "halo": "shorter than the halo"}  # what each call's bad argument raises


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(BAD))
def test_a_bad_argument_on_every_rank_leaves_the_nccl_group_usable(op):
    skip_unless_nccl_ranks(2)
    for r in run_distributed(_bad_argument, 2, (0, 1), op, backend="nccl", timeout=120):
        assert r["first"] and r["first"][0] == "ValueError" and BAD[op] in r["first"][1], r
        assert r["first"][2] < 1.5, r  # resolved on the board: every rank skipped the same call
        assert r["carried_on"], r


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(BAD))
def test_a_bad_argument_on_one_rank_reaches_the_other_on_nccl(op):
    skip_unless_nccl_ranks(2)
    r0, r1 = run_distributed(_bad_argument, 2, (1,), op, backend="nccl", timeout=120)
    assert r1["first"] and r1["first"][0] == "ValueError", r1
    for r in (r0, r1):
        assert r["outcome"] and r["outcome"][0] == "CommunicatorError" and BAD[op] in r["outcome"][1], r
        assert r["elapsed"] < 6.0, r


def _own_work_fails(rank, world, op):
    """After a warm-up call (the signature checked and cached: in ``first`` mode no later call exchanges
    on the host), rank 1 fails in its own work before its part of a layer's collective: the shard's
    states before the forward scan (GLA, Gated DeltaNet), the buffers of Ulysses' all-to-alls, or a delta
    module's q projection before its halo exchange (GatedDeltaNet, KimiDeltaAttention). It
    raises its own error and reports the call it skips on the fault board, which fails every rank's
    communicator within seconds, not the group's timeout: the next call on every rank raises
    ``CommunicatorError`` naming rank 1's error. A new group works afterwards."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla
    from allscan.ops import ulysses as U
    from allscan.ops.delta.chunk import TorchDelta
    from allscan.ops.ulysses import passes as ulysses_passes
    from allscan.ops.gla.chunk import TorchGLA

    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K = 32, 2, 16
    gen = torch.Generator().manual_seed(rank)
    dtype = torch.float32 if op == "ulysses" else torch.float64  # fp32: the core's all-to-all
    q, k, v = (torch.randn(1, T, H, K, generator=gen, dtype=dtype).to(dev) for _ in range(3))
    k = F.normalize(k, dim=-1)

    modules = {}

    def module(group):  # fp64: the torch backend; one module per group, the same weights on every rank
        if group not in modules:
            import allscan.layers

            torch.manual_seed(0)
            modules[group] = getattr(allscan.layers, op)(hidden_size=16, head_dim=8, num_heads=2, conv_size=4,
                                                         group=group).double().to(dev)
        return modules[group]

    def call(group):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        if op in ("GatedDeltaNet", "KimiDeltaAttention"):
            x = torch.randn(1, T, 16, generator=gen, dtype=torch.float64).to(dev).requires_grad_(True)
            module(group)(x)[0].sum().backward()
            torch.cuda.synchronize()
            return
        if op == "gla":  # fp64: the torch backend (ALLSCAN_GLA_BACKEND=torch, set by the test)
            o, _ = zeco_gla(*ins, torch.full((1, T, H, K), -0.1, dtype=torch.float64, device=dev), group)
        elif op == "gdn":  # fp64: the torch backend
            o, _ = zeco_gated_delta_rule(*ins, torch.full((1, T, H), -0.1, dtype=torch.float64, device=dev),
                                         torch.full((1, T, H), 0.5, dtype=torch.float64, device=dev), group)
        else:
            o = U.ulysses_attention(*ins, group=group, num_chunks=2)
        o.sum().backward()
        torch.cuda.synchronize()

    call(dist.group.WORLD)
    owner, name = {"gla": (TorchGLA, "fwd_states"), "gdn": (TorchDelta, "states"),
                   "ulysses": (ulysses_passes, "_forward_buffers")}.get(op, (None, "forward"))
    if owner is None:  # a module's projection: its forward replaced on this instance, then removed
        owner = module(dist.group.WORLD).q_proj
        real, original = owner.forward, None
    else:
        real, original = getattr(owner, name), vars(owner)[name]

    def failing(*args, **kwargs):
        if rank == 1:
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    def outcome():
        try:
            call(dist.group.WORLD)
            return ("done", "")
        except Exception as e:  # noqa: BLE001 - the test asserts which
            return (type(e).__name__, str(e))

    setattr(owner, name, staticmethod(failing) if isinstance(owner, type) else failing)
    t0 = time.monotonic()
    try:
        first = outcome()
    finally:
        if original is None:
            del owner.forward
        else:
            setattr(owner, name, original)
    second = outcome()
    elapsed = time.monotonic() - t0
    fresh = dist.new_group(list(range(world)), backend="nccl")
    call(fresh)
    return dict(first=first, second=second, elapsed=elapsed)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gla", "gdn", "ulysses", "GatedDeltaNet", "KimiDeltaAttention"])
def test_a_rank_failing_in_its_own_work_on_nccl_tells_its_peers(op, monkeypatch):
    skip_unless_nccl_ranks(2)
    monkeypatch.setenv("ALLSCAN_GLA_BACKEND", "torch")
    r0, r1 = run_distributed(_own_work_fails, 2, op, backend="nccl", timeout=150)
    assert r1["first"][0] == "RuntimeError" and "injected failure" in r1["first"][1], r1
    # the peer's call in flight returns once the board aborted the communicator (its result undefined,
    # as NCCL's after an abort), or raises if it issued after that; its next call raises
    assert r0["first"][0] in ("done", "CommunicatorError"), r0
    for r in (r0, r1):
        assert r["second"][0] == "CommunicatorError" and "injected failure" in r["second"][1], r
    assert r0["elapsed"] < 10.0, r0  # the board's grace (3 s) and polls, not the group's timeout


def test_a_failed_core_communicator_reports_its_failure():
    """allscanCommFail: every later call that needs NCCL, and its status, return the failure given (a
    retired communicator's calls report why, not that it has no NCCL)."""
    from allscan import _C, CommunicatorError, CommunicatorTimeout

    h = _C.comm_create_detached(0, 2)
    try:
        # comm, x, y, count, dtype, g, g_count, g_dtype, init, reverse, inclusive, K, method, ws, ws_bytes, stream, sig
        args = (h, 4096, 8192, 100, _C.FLOAT32, 0, 0, _C.FLOAT32, 0, False, False, 0, _C.PIPELINED, 0, 0, 0, 0)
        with pytest.raises(ValueError, match="a detached communicator has no NCCL communicator"):
            _C.scan(*args)
        _C.comm_fail(h, _C.TIMEOUT, "pending without progress (stub)")
        with pytest.raises(CommunicatorTimeout, match=r"^allscan: pending without progress \(stub\)$"):
            _C.scan(*args)
        _C.comm_fail(h, _C.REMOTE_ERROR, "rank 1 reported (stub)")  # the first failure stays
        with pytest.raises(CommunicatorTimeout, match=r"pending without progress \(stub\)"):
            _C.neighbor_exchange(h, 4096, 8192, 64, False, True, 0)
        # its status, a calibration and an all-to-all checked with it report the failure too (the
        # all-to-all before it looks at its NCCL communicator: a retired one's is gone)
        for call in (lambda: _C.comm_status(h), lambda: _C.calibrate(h, 0),
                     lambda: _C.a2a(0, 2, 0, 1, 4, 8, _C.FLOAT32, [(4096, 8192, 2, [0, 1], [1, 2], 0)], 0, 0, 0,
                                    check_comm=h, signature=0)):
            with pytest.raises(CommunicatorTimeout, match=r"pending without progress \(stub\)"):
                call()
        h2 = _C.comm_create_detached(1, 2)
        try:
            _C.comm_fail(h2, _C.REMOTE_ERROR, "rank 1 reported (stub)")
            with pytest.raises(CommunicatorError, match=r"rank 1 reported \(stub\)") as e:
                _C.neighbor_exchange(h2, 4096, 8192, 64, False, True, 0)
            assert not isinstance(e.value, CommunicatorTimeout)
        finally:
            _C.comm_destroy(h2)
        with pytest.raises(ValueError, match="code: expected allscanTimeout, allscanMismatch or allscanRemoteError"):
            _C.comm_fail(h, 1, "not a failure code")
    finally:
        _C.comm_destroy(h)


def test_a_retired_communicator_is_not_reported_to_the_board_as_a_mismatch(monkeypatch):
    """The board asks each watched communicator for this rank's own failure; a retired one's status is
    the failure it was given (allscanCommFail), which a board round between that and its unregistering
    must not post to the peers as a mismatch. A real mismatch still is."""
    from allscan import _C, _comm
    from allscan._comm_watch import local_failure

    def mismatch(handle):
        raise _C.CommunicatorError("allscan: ranks passed different arguments (stub)")

    status = _C.comm_status
    monkeypatch.setattr(_C, "watch_status", lambda w: None)  # its watch healthy: the "gone" case
    h = _C.comm_create_detached(0, 2)
    try:
        comm = _comm.Communicator("g", torch.device("cpu"), 0, 2, 0, h, True)
        assert local_failure(comm) is None
        monkeypatch.setattr(_C, "comm_status", mismatch)
        assert local_failure(comm) == (_C.MISMATCH, "allscan: ranks passed different arguments (stub)")
        monkeypatch.setattr(_C, "comm_status", status)
        comm.failure = _C.CommunicatorError("allscan: the NCCL communicator of group 'g' is gone")
        _C.comm_fail(h, _C.REMOTE_ERROR, "the NCCL communicator of group 'g' is gone")
        with pytest.raises(_C.CommunicatorError, match="is gone"):
            _C.comm_status(h)
        assert local_failure(comm) is None
    finally:
        _C.comm_destroy(h)


def test_a_communicator_whose_address_nccl_reused_is_retired(monkeypatch, single_rank):
    """After a watch aborted a communicator, NCCL may give its address to the next one created: the
    cached communicator still holding it is retired when that one is made (its watch destroyed so the
    new one can be watched, its handle detached from NCCL and failed with its watch's failure, which
    get_communicator raises for its group). NCCL and the core are stubbed: the GPU case is
    test_a_stuck_peer_on_nccl_then_a_new_group_works."""
    import torch.distributed as dist

    import allscan
    from allscan import _C, _comm

    calls = []
    addresses = iter([(1234, ""), (1234, "")])  # the second communicator gets the first one's address
    handles = iter([77, 78])
    monkeypatch.setattr(_comm, "_comms", {})
    monkeypatch.setattr(_comm, "_create_owned_comm", lambda group, device: next(addresses))
    monkeypatch.setattr(_C, "comm_create", lambda nccl: calls.append(("comm_create", nccl)) or next(handles))
    monkeypatch.setattr(_C, "set_link_model", lambda *args: None)
    monkeypatch.setattr(_C, "comm_rank", lambda h: 0)
    monkeypatch.setattr(_C, "comm_size", lambda h: 1)
    monkeypatch.setattr(_C, "get_link_model", lambda h: (0.0, 0.0, False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA

    def status(watch):
        raise _C.CommunicatorTimeout("allscan: pending without progress (stub)")

    monkeypatch.setattr(_C, "watch_status", status)
    monkeypatch.setattr(_C, "watch_destroy", lambda w: calls.append(("watch_destroy", w)) or True)
    monkeypatch.setattr(_C, "comm_forget_nccl", lambda h: calls.append(("forget", h)))
    monkeypatch.setattr(_C, "comm_fail", lambda h, code, reason: calls.append(("fail", h, code, reason)))
    cuda0 = torch.device("cuda", 0)
    first = _comm.get_communicator(single_rank, cuda0)
    first.watch = 5  # as if watched; its watch failed and aborted it
    other = dist.new_group([0])
    second = _comm.get_communicator(other, cuda0)
    assert (first.nccl, first.watch, second.nccl, second.handle) == (0, 0, 1234, 78)
    # retired before the new communicator's handle (and watch) exist; failed before its watch goes
    assert calls == [("comm_create", 1234), ("fail", 77, _C.TIMEOUT, "pending without progress (stub)"),
                     ("forget", 77), ("watch_destroy", 5), ("comm_create", 1234)]
    with pytest.raises(allscan.CommunicatorTimeout, match=r"pending without progress \(stub\)"):
        _comm.get_communicator(single_rank, cuda0)
    assert _comm.get_communicator(other, cuda0) is second and second.failure is None
