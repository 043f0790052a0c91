"""The fault board (``allscan._faults``) on CPU: three gloo ranks, the real torch.distributed store,
fake communicators (targets that record how they were failed). On GPUs the targets are NCCL
communicators with watches (tests/test_faults.py, marked gpu)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

WORLD = 3
POLL = 0.05
GRACE = 0.6


def _board_case(rank, world, case):
    import torch.distributed as dist

    from allscan import _C
    from allscan._faults import FaultBoard, Target

    store = dist.distributed_c10d._get_default_store()
    board = FaultBoard(poll_s=POLL, skip_grace_s=GRACE)
    failed = []
    local = []
    calls = [5]  # calls issued on the communicator so far: a skip names the next one
    target = Target(rank=rank, size=world, calls=lambda: calls[0], local_failure=lambda: local[0] if local else None,
                    fail=lambda code, reason: failed.append((code, reason)))
    key = f"test/{case}"
    board.register(key, target, store)
    dist.barrier()
    t0 = time.monotonic()

    def wait_failed(limit):
        while not failed and time.monotonic() - t0 < limit:
            time.sleep(0.01)
        return time.monotonic() - t0

    if case == "fatal":
        if rank == 0:
            local.append((_C.MISMATCH, "boom: signatures differ"))
        elapsed = wait_failed(3.0)
    elif case == "everyone-skips":
        board.report_skip(key, "gamma: bad")
        board.wait_skip(key, GRACE + 3.0)
        elapsed = time.monotonic() - t0
        assert elapsed < GRACE, f"every rank skipped: resolved in {elapsed:.2f} s, not at the grace"
        time.sleep(GRACE * 1.5)
    elif case == "one-skips":
        if rank == 1:
            board.report_skip(key, "gamma: bad on rank 1")
            board.wait_skip(key, GRACE + 3.0)  # the skipping rank holds its next call until resolved
            assert failed, "wait_skip returned before the skip was resolved or the communicator failed"
        elapsed = wait_failed(GRACE + 3.0)
    elif case == "everyone-then-one":
        board.report_skip(key, "round 1")
        time.sleep(GRACE * 2.5)
        assert not failed, failed  # round 1 resolved: every rank skipped
        dist.barrier()
        t0 = time.monotonic()
        if rank == 2:
            board.report_skip(key, "round 2 on rank 2")
        elapsed = wait_failed(GRACE + 3.0)
    elif case == "different-calls":
        # Rank 0 skips call 5; ranks 1 and 2 make call 5, then skip call 6: as many skips each, but
        # not of the same call, so the group is out of step and every rank must fail.
        if rank != 0:
            calls[0] = 6
        board.report_skip(key, f"bad on rank {rank}")
        elapsed = wait_failed(GRACE + 3.0)
    board.stop()
    dist.barrier()
    return dict(failed=failed, elapsed=elapsed)


def test_a_fatal_report_fails_every_rank_within_a_second():
    from allscan import _C

    results = run_distributed(_board_case, WORLD, "fatal", timeout=60)
    assert results[0]["failed"] == [(_C.MISMATCH, "boom: signatures differ")]
    for r in results[1:]:
        assert len(r["failed"]) == 1, r
        code, reason = r["failed"][0]
        assert code == _C.REMOTE_ERROR and reason == "rank 0 reported: boom: signatures differ", r
        assert r["elapsed"] < 1.0, r


def test_a_skip_every_rank_made_leaves_the_group_alone():
    results = run_distributed(_board_case, WORLD, "everyone-skips", timeout=60)
    assert all(r["failed"] == [] for r in results), results


def test_a_skip_one_rank_made_fails_every_rank_after_the_grace():
    from allscan import _C

    results = run_distributed(_board_case, WORLD, "one-skips", timeout=60)
    code, reason = results[1]["failed"][0]
    assert code == _C.REMOTE_ERROR and "gamma: bad on rank 1" in reason and "rank(s) [0, 2] did not" in reason
    for r in (results[0], results[2]):
        code, reason = r["failed"][0]
        assert code == _C.REMOTE_ERROR and reason.startswith("rank 1 reported: gamma: bad on rank 1"), r
    for r in results:
        assert len(r["failed"]) == 1 and GRACE <= r["elapsed"] < GRACE + 1.0, r


def test_skip_rounds_stay_aligned_after_a_round_every_rank_made():
    results = run_distributed(_board_case, WORLD, "everyone-then-one", timeout=60)
    assert "round 2 on rank 2" in results[2]["failed"][0][1] and "rank(s) [0, 1] did not" in results[2]["failed"][0][1]
    for r in results[:2]:
        assert r["failed"][0][1].startswith("rank 2 reported: round 2 on rank 2"), r


def test_skips_of_different_calls_fail_every_rank():
    """As many skips on every rank, but not of the same call: counting skips would pair rank 0's
    next call with the others' skipped one and carry on out of step."""
    results = run_distributed(_board_case, WORLD, "different-calls", timeout=60)
    for r in results:
        assert len(r["failed"]) == 1 and "did not within" in r["failed"][0][1], r


def test_a_report_numbered_but_never_written_does_not_hide_the_next():
    """A poster that dies between numbering its report and writing it leaves a gap; the reports
    after it still arrive (the gap is passed over after a while)."""
    import torch.distributed as dist

    from allscan import _C
    from allscan._faults import FaultBoard, Target

    store = dist.HashStore()
    failed = []
    board = FaultBoard(poll_s=0.05, skip_grace_s=GRACE)
    board.register("test/gap", Target(rank=0, size=2, calls=lambda: 0, local_failure=lambda: None,
                                      fail=lambda code, reason: failed.append((code, reason))), store)
    store.add("test/gap/n", 1)  # numbered by a poster that died before writing it
    n = store.add("test/gap/n", 1)
    store.set(f"test/gap/{n}", "1\nfatal\n0\nboom")
    t0 = time.monotonic()
    while not failed and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    board.stop()
    assert failed == [(_C.REMOTE_ERROR, "rank 1 reported: boom")], failed
