"""The async scan handle's memory rules (``allscan.ScanHandle`` on the side-stream path): which
tensors get ``record_stream`` and when the handle lets go of them. On CPU with stand-ins for the core's
event calls and for tensors; the GPU test ``test_async_handles_and_memory`` checks the same rules against
the caching allocator."""
import importlib
from types import SimpleNamespace

import pytest

H = importlib.import_module("allscan.ops._scan_handle")  # the handle and the side streams

CALLER, OTHER, EVENT = 11, 22, 99


class Tensor:
    """Records the streams recorded on it."""

    device = "cuda:0"

    def __init__(self):
        self.recorded = []

    def get_device(self):
        return 0

    def record_stream(self, stream):
        self.recorded.append(stream)


@pytest.fixture
def core(monkeypatch):
    """The core's event calls: ``done`` says whether the scan has finished; the calls are logged."""
    log = SimpleNamespace(done=False, calls=[], current=CALLER)
    fake = SimpleNamespace(
        event_query=lambda e: log.done,
        event_wait=lambda stream, e: log.calls.append(("wait", stream, e)),
        event_release=lambda dev, e: log.calls.append(("release", e)),
    )
    monkeypatch.setattr(H, "_C", fake)
    monkeypatch.setattr(H, "stream_ptr", lambda device: log.current)
    monkeypatch.setattr(H.torch.cuda, "current_stream", lambda device=None: "current stream object")
    return log


def _handle(keep):
    y = Tensor()
    return H.ScanHandle(y, raw=(0, EVENT), caller_stream=CALLER, side="side", keep=keep), y


def test_wait_on_the_calling_stream_records_nothing_and_lets_go(core):
    x, g = Tensor(), Tensor()
    h, y = _handle((x, g, None))
    assert h.wait() is y
    assert core.calls == [("wait", CALLER, EVENT)]
    assert x.recorded == g.recorded == y.recorded == [] and h._keep is None
    h.wait()  # a second wait is harmless
    del h
    assert core.calls[-1] == ("release", EVENT) and x.recorded == []


def test_wait_on_another_stream_records_the_side_stream(core):
    x, g = Tensor(), Tensor()
    h, y = _handle((x, g, None))
    core.current = OTHER
    h.wait()
    assert core.calls == [("wait", OTHER, EVENT)]
    # the calling stream is not ordered after the scan: the side stream is recorded on what it used,
    # and the stream now using the result on it
    assert x.recorded == g.recorded == ["side"] and y.recorded == ["current stream object", "side"]


def test_a_dropped_handle_records_the_side_stream_unless_the_scan_is_done(core):
    x = Tensor()
    h, y = _handle((x, None, None))
    del h
    assert x.recorded == y.recorded == ["side"] and core.calls == [("release", EVENT)]
    x = Tensor()
    h, y = _handle((x, None, None))
    core.done = True
    del h
    assert x.recorded == y.recorded == []


def test_a_completed_handle_lets_go_at_once(core):
    x = Tensor()
    h, y = _handle((x, None, None))
    assert not h.is_completed() and h._keep is not None
    core.done = True
    assert h.is_completed() and h._keep is None
    core.done = False  # (a query answered before the drop decides)
    del h
    assert x.recorded == y.recorded == []


def test_the_result_is_protected_without_inputs(core):
    h, y = _handle(())
    del h
    assert y.recorded == ["side"]
