"""Which calls ``allscan.scan``'s eager fast path serves, on CPU: an entry with a stand-in core is put
in its cache (on GPUs the full path puts the real ones there: ``tests/test_scan_gpu.py``), and every
call that must not go straight to the core is checked to reach the full path, or its error, instead."""
from __future__ import annotations

import importlib
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

import allscan
from distributed import run_distributed

S = importlib.import_module("allscan.ops.scan")  # the module (allscan.ops.scan is also the function)
F = importlib.import_module("allscan.ops._scan_fast")
L = importlib.import_module("allscan.ops._launch")


class _Plan:
    """What the fast path reads of a plan: its group (weakly) and a communicator."""

    def __init__(self, group):
        self.group_ref = weakref.ref(group)
        self.comm = object()


def _install(group, x, g, async_op=False, num_blocks=None, plan_group=None, init=None):
    """A fast-path entry for ``scan(x, g, group, num_blocks=)`` whose core records its calls and
    returns ``x * 7`` (its plan made for ``plan_group``, default ``group``); returns (calls, the plan
    cache holding its plan)."""
    calls = []
    plans = L.plan_cache()
    plans["plan"] = _Plan(group if plan_group is None else plan_group)

    def core(plan, x, g, init, *options):
        assert plan is plans["plan"] and options == (False, False, 0)
        calls.append((x, g, init))
        return x * 7

    key = F.fast_key(group, x, g, None, init, False, False, num_blocks, "pipelined", async_op)
    F.eager_calls[key] = F.FastCall(plans["plan"], plans, "plan", core, (False, False, 0), async_op, x.get_device())
    return calls, plans


def _fast_path_routes(rank, P):
    group = dist.group.WORLD
    F.current_device = lambda: -1  # a CPU tensor's get_device(), the entries' device: the stand-in core runs on CPU
    x, g = torch.arange(6.0).reshape(2, 3), torch.full((2,), 0.5)
    calls, plans = _install(group, x, g)
    full = S.full_path

    def full_path(*args):
        full_path.calls += 1
        return full(*args)

    full_path.calls = 0
    S.full_path = full_path

    # served: group=None and the group itself, a fresh tensor of the keyed shape; the full path is not reached
    for grp in (None, group):
        y = allscan.scan(x.clone(), g.clone(), grp)
        assert torch.equal(y, x * 7)
    assert len(calls) == 2 and full_path.calls == 0

    # not served, each answered by the full path (a one-rank scan: zeros, exclusive):
    def reaches_full_path(call, what):
        before, n = full_path.calls, len(calls)
        y = call()
        assert full_path.calls == before + 1 and len(calls) == n, what
        return y

    # a gradient to take,
    xr = x.clone().requires_grad_(True)
    y = reaches_full_path(lambda: allscan.scan(xr, g), "requires_grad")
    assert y.grad_fn is not None
    # (but a tensor that requires grad under no_grad is served)
    with torch.no_grad():
        assert torch.equal(allscan.scan(xr, g), x * 7)
    gr = g.clone().requires_grad_(True)
    y = reaches_full_path(lambda: allscan.scan(x, gr), "gamma requires_grad")
    assert y.grad_fn is not None
    # a non-contiguous tensor or gamma of the keyed shape,
    xt = torch.arange(6.0).reshape(3, 2).t()
    assert xt.shape == x.shape and not xt.is_contiguous()
    reaches_full_path(lambda: allscan.scan(xt, g), "non-contiguous")
    gt = torch.full((2, 2), 0.5).t()[0]
    assert gt.shape == g.shape and not gt.is_contiguous()
    reaches_full_path(lambda: allscan.scan(x, gt), "non-contiguous gamma")
    # another dtype, shape or device index than the key's,
    reaches_full_path(lambda: allscan.scan(x.double(), g.double()), "dtype")
    reaches_full_path(lambda: allscan.scan(x[:1], g[:1]), "shape")
    F.current_device = lambda: 0
    reaches_full_path(lambda: allscan.scan(x, g), "current device")
    F.current_device = lambda: -1
    # every-call checks,
    allscan.set_check_every_call(True)
    try:
        reaches_full_path(lambda: allscan.scan(x, g), "ALLSCAN_CHECK=always")
    finally:
        allscan.set_check_every_call(False)
    # a plan evicted from its cache (the full path prepares, and checks, it again on every rank),
    plan = plans.pop("plan")
    reaches_full_path(lambda: allscan.scan(x, g), "evicted plan")
    plans["plan"] = plan
    # a tensor subclass, options the full path reads otherwise, an unhashable option,
    reaches_full_path(lambda: allscan.scan(torch.nn.Parameter(x, requires_grad=False), g), "subclass")
    reaches_full_path(lambda: allscan.scan(x, torch.nn.Parameter(g, requires_grad=False)), "gamma subclass")
    reaches_full_path(lambda: allscan.scan(x, g, init=torch.zeros_like(x)), "init")
    reaches_full_path(lambda: allscan.scan(x, g, reverse=True), "reverse")
    with pytest.raises(ValueError, match="method must be one of"):
        allscan.scan(x, g, method=["pipelined"])
    # flags keyed only as bools: another type (here a list, unhashable) takes the full path and adds
    # no entry
    n = len(F.eager_calls)
    h = reaches_full_path(lambda: allscan.scan(x, g, async_op=[True]), "async_op as a list")
    assert torch.equal(h.wait(), torch.zeros_like(x)) and len(F.eager_calls) == n
    reaches_full_path(lambda: allscan.scan(x, g, reverse=0), "reverse as an int")
    # a plan made for another group object under this group's id (a freed group's id reused, a
    # default group destroyed and made again)
    F.eager_calls.clear()
    other_calls, _ = _install(group, x, g, plan_group=dist.new_group([0], backend="gloo"))
    reaches_full_path(lambda: allscan.scan(x, g), "another group's plan")
    assert other_calls == []
    calls, plans = _install(group, x, g)
    # num_blocks keyed as an int only: True equals 1 as a key, but the full path refuses a bool
    _install(group, x, g, num_blocks=1)
    assert torch.equal(allscan.scan(x, g, num_blocks=1), x * 7)
    with pytest.raises(ValueError, match="num_blocks must be None"):
        allscan.scan(x, g, num_blocks=True)
    # an init of the keyed shape that needs a gradient, is not contiguous or is a subclass
    init = torch.ones_like(x)
    init_calls, _ = _install(group, x, g, init=init)
    assert torch.equal(allscan.scan(x, g, init=init.clone()), x * 7) and len(init_calls) == 1
    y = reaches_full_path(lambda: allscan.scan(x, g, init=init.clone().requires_grad_(True)), "init requires_grad")
    assert y.grad_fn is not None
    it = torch.ones(3, 2).t()
    assert it.shape == x.shape and not it.is_contiguous()
    reaches_full_path(lambda: allscan.scan(x, g, init=it), "non-contiguous init")
    reaches_full_path(lambda: allscan.scan(x, g, init=torch.nn.Parameter(init, requires_grad=False)), "init subclass")
    assert len(init_calls) == 1
    # gamma and transition both given: the full path's error
    with pytest.raises((TypeError, ValueError), match="transition"):
        allscan.scan(x, g, transition=torch.eye(2))
    # another thread in a collective on the group: refused before the core, as on the full path
    held, release = threading.Event(), threading.Event()

    def holder():
        entry = allscan._threads.enter(group, "a2a")
        held.set()
        release.wait(30)
        allscan._threads.leave(group, entry)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    try:
        n = len(calls)
        with pytest.raises(RuntimeError, match=r"allscan.scan: group .* is in allscan.a2a on another host thread"):
            allscan.scan(x, g)
        assert len(calls) == n
    finally:
        release.set()
        t.join(30)
    assert torch.equal(allscan.scan(x, g), x * 7) and len(calls) == n + 1  # the group free again after the refusal
    assert not allscan._threads._busy
    S.full_path = full
    F.eager_calls.clear()
    return "ok"


def test_fast_path_serves_only_calls_the_core_can_take_as_given():
    assert run_distributed(_fast_path_routes, 1) == ["ok"]
