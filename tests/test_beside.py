"""``allscan.ops._beside.Beside``: work issued beside the calling stream (the delta layers' reverse scan
runs this way beside fla's recomputation of the chunk states), and ``FinalGrads``, through which the
local backward asks for the scan's result."""
import gc
import time
import weakref

import pytest
import torch

from allscan.ops._beside import Beside
from allscan.ops.delta.shard import FinalGrads


def test_off_cuda_the_work_runs_when_issued():
    calls = []
    kept = torch.ones(3)
    b = Beside(torch.device("cpu"), lambda: calls.append(1) or kept * 2, keep=(kept,))
    b.mark()
    assert calls == []  # marking issues nothing
    b.issue()
    b.issue()
    assert calls == [1]  # once
    assert torch.equal(b.result(), torch.full((3,), 2.0))
    b.join()
    assert calls == [1]


def test_result_issues_work_not_yet_issued():
    b = Beside(torch.device("cpu"), lambda: torch.zeros(2))
    assert torch.equal(b.result(), torch.zeros(2))


def test_the_inputs_are_held_until_joined_and_not_after():
    """``keep`` and the work's own closure: the only references left to an input once the caller drops
    its own are the handle's, until the join."""
    x = torch.ones(4)
    ref = weakref.ref(x)
    b = Beside(torch.device("cpu"), lambda x=x: x.sum().reshape(1), keep=(x,))
    del x
    b.issue()
    gc.collect()
    assert ref() is not None, "an input freed before the join"
    b.result()
    gc.collect()
    assert ref() is None, "an input still held after the join"


def test_a_failing_work_raises_once():
    def fail():
        raise ValueError("peer error")

    b = Beside(torch.device("cpu"), fail)
    with pytest.raises(ValueError, match="peer error"):
        b.issue()
    assert b.result() is None  # already issued: nothing runs again


def test_final_grads_adds_the_scan_result_on_the_crossing_segment_only():
    r = torch.full((1, 2), 3.0)
    for crossing, dhts, want in (
        (1, [None, torch.ones(1, 2)], [None, torch.full((1, 2), 4.0)]),
        (0, [None, None], [r, None]),
        (None, [torch.ones(1, 2), None], [torch.ones(1, 2), None]),  # a sequence ends at the shard's end
    ):
        ran = []
        f = FinalGrads(dhts, crossing, Beside(torch.device("cpu"), lambda: ran.append(1) or r))
        f.mark()
        f.start()
        got = f.get()
        again = f.get()
        assert ran == [1]
        for a, b, c in zip(got, want, again):
            assert (a is None and b is None) or torch.equal(a, b)
            assert a is c
    assert FinalGrads([None]).get() == [None]  # one rank: no scan


@pytest.mark.gpu
def test_on_cuda_the_work_overlaps_what_follows_the_mark_and_the_caller_waits_for_it():
    """The work starts after what the caller issued before ``mark`` (it sees its writes), not after what
    it issued between ``mark`` and ``issue`` (it finishes while that still runs), and the caller's work
    after ``result`` sees the work's result even when the work is slow."""
    dev = torch.device("cuda", torch.cuda.current_device())
    caller = torch.cuda.current_stream(dev)
    src = torch.empty(1 << 20, device=dev)
    torch.cuda._sleep(20_000_000)  # the caller is still busy when the write below is issued
    src.fill_(7.0)
    events = []

    def double():
        out = src * 2
        events.append(torch.cuda.current_stream(dev).record_event())  # on the second stream, after its work
        return out

    # once before the timed run: its kernels loaded and the second stream made (making a process's first
    # streams, or loading a kernel, can wait for the kernels running)
    Beside(dev, double).result()
    torch.cuda.synchronize(dev)
    events.clear()
    b = Beside(dev, double, keep=(src,))
    b.mark()
    torch.cuda._sleep(1_000_000_000)  # the kernel the work is to run beside (about half a second)
    behind = caller.record_event()
    b.issue()
    deadline = time.monotonic() + 0.2
    while not events[0].query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert events[0].query() and not behind.query(), "the work waited for the kernel it was to run beside"
    out = b.result()
    assert torch.equal(out, torch.full_like(src, 14.0))

    # a slow work: the caller's next kernel still reads its finished result
    def slow():
        torch.cuda._sleep(100_000_000)
        return src + 1

    b = Beside(dev, slow, keep=(src,))
    b.issue()
    total = b.result().sum()  # issued on the caller's stream right after the join
    assert total.item() == 8.0 * src.numel()


@pytest.mark.gpu
def test_on_cuda_an_input_dropped_by_the_caller_is_not_reused_before_the_join():
    """What the work reads stays out of the caching allocator's reach until the caller waits for it:
    a tensor the caller allocates after dropping its own reference does not get that memory while the
    (slow) work still reads it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.full((1 << 20,), 5.0, device=dev)
    ptr = x.data_ptr()

    def slow(x=x):
        torch.cuda._sleep(200_000_000)
        return x.sum().reshape(1)

    b = Beside(dev, slow, keep=(x,))
    del x
    b.issue()
    del slow  # the caller's reference to the closure: the handle holds the input
    y = torch.empty(1 << 20, device=dev)
    assert y.data_ptr() != ptr, "the input's memory was reused while the work still read it"
    y.fill_(-1.0)
    assert b.result().item() == 5.0 * (1 << 20)


@pytest.mark.gpu
def test_on_cuda_a_failing_work_is_joined_before_it_raises():
    """What a failing work issued before it raised is ordered before the caller's next work (the
    inputs it read are let go only then)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.zeros(1 << 20, device=dev)
    Beside(dev, lambda: x + 0).result()  # the second stream made, the kernels loaded
    torch.cuda.synchronize(dev)

    def fail():
        torch.cuda._sleep(200_000_000)
        x.fill_(3.0)
        raise ValueError("after issuing")

    with pytest.raises(ValueError, match="after issuing"):
        Beside(dev, fail, keep=(x,)).issue()
    assert x.sum().item() == 3.0 * x.numel(), "the caller's next kernel ran before the failed work's"


@pytest.mark.gpu
def test_on_cuda_the_result_is_not_reused_by_the_second_stream_while_the_caller_reads_it():
    """The result belongs to the second stream's memory pool: once the caller drops it, the second
    stream's next allocation must not get its memory while the caller's kernels still read it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 20
    Beside(dev, lambda: torch.ones(n, device=dev)).result()  # the second stream made, the kernels loaded
    torch.cuda.synchronize(dev)
    r = Beside(dev, lambda: torch.ones(n, device=dev)).result()
    later = Beside(dev, lambda: torch.full((n,), 5.0, device=dev))
    later.mark()  # it starts after what the caller issued so far, not after the reads below
    torch.cuda._sleep(200_000_000)
    total = r.sum()
    del r
    later.issue()
    assert total.item() == n, "the caller read the second stream's next result in place of its own"
    assert later.result().sum().item() == 5.0 * n
