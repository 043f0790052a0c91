"""allscan.scan's errors, the custom op (opcheck, torch.compile), the async handle on CPU, and the C
core's argument checks and block-count rule through the bindings (no GPU needed). A broken
``allscan._C`` fails every test here (``import allscan`` needs it)."""
import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import allscan
from allscan import _C as C
from allscan.ops import _scan_dist as _dist
from allscan.reference import scan_reference
from distributed import run_distributed
from grad_check import check_compiled


X = torch.randn(2, 3, 4)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(tensor=[1.0, 2.0]), TypeError, "tensor must be a torch.Tensor"),
        (dict(tensor=torch.ones(3, dtype=torch.int32)), TypeError, "tensor must be float32"),
        (dict(gamma=torch.ones(3)), ValueError, r"gamma's shape \[3\] must be a prefix"),
        (dict(gamma=torch.ones(2, 4)), ValueError, "must be a prefix"),
        (dict(gamma=torch.ones(2, 3, 4, 1)), ValueError, "must be a prefix"),
        (dict(gamma=torch.ones(2, dtype=torch.float64)), TypeError, "gamma must be float32 or the tensor's dtype"),
        (dict(gamma=[1.0]), TypeError, "gamma must be a torch.Tensor or None"),
        (dict(gamma=torch.ones(2, device="meta")), ValueError, "gamma is on meta"),
        (dict(init=torch.ones(2, 3)), ValueError, "init must have the tensor's shape and dtype"),
        (dict(init=torch.ones(2, 3, 4, dtype=torch.float64)), ValueError, "init must have the tensor's shape"),
        (dict(init=torch.ones(2, 3, 4, device="meta")), ValueError, "init is on meta"),
        (dict(method="ring"), ValueError, "method must be one of"),
        (dict(num_blocks=0), ValueError, "num_blocks must be None"),
        (dict(num_blocks=-2), ValueError, "num_blocks must be None"),
        (dict(num_blocks=True), ValueError, "num_blocks must be None"),
        (dict(num_blocks=2.0), ValueError, "num_blocks must be None"),
        # the README's bound: up to 64 blocks (allscanMaxBlocks), the device path's CTA count up to 128
        (dict(num_blocks=65), ValueError, r"allscan.scan: num_blocks must be at most 64 \(the pipeline's blocks, "
                                          r"from 1 to 64; .*got 65"),
        (dict(num_blocks=10 ** 6), ValueError, r"num_blocks must be at most 64 .*got 1000000"),
        (dict(num_blocks=2 ** 63), ValueError, r"num_blocks must be at most 64 .*got 9223372036854775808"),
        (dict(num_blocks=65, method="serial"), ValueError, "num_blocks must be at most 64"),
        (dict(num_blocks=65, method="allgather"), ValueError, "num_blocks must be at most 64"),
        (dict(num_blocks=129, method="device"), ValueError,
         r"num_blocks must be at most 128 with method='device' \(its CTA count, from 1 to 128; .*got 129"),
        (dict(transition=torch.ones(2, 3, 3), num_blocks=65), ValueError,
         r"allscan.scan: num_blocks must be at most 64 .*got 65"),
        (dict(transition=torch.ones(2, 3, 3), num_blocks=2 ** 31), ValueError, "num_blocks must be at most 64"),
        (dict(group=42), TypeError, "group must be a torch.distributed ProcessGroup"),
    ],
)
def test_bad_arguments(single_rank, kwargs, exc, match):
    args = dict(tensor=X)
    args.update(kwargs)
    tensor = args.pop("tensor")
    with pytest.raises(exc, match=match):
        allscan.scan(tensor, **args)


@pytest.mark.parametrize("kwargs", [dict(num_blocks=64), dict(num_blocks=64, method="serial"),
                                    dict(num_blocks=128, method="device"),
                                    dict(transition=torch.eye(3).expand(2, 3, 3), num_blocks=64)])
def test_largest_block_counts_are_taken(single_rank, kwargs):
    assert torch.equal(allscan.scan(X, **kwargs), torch.zeros_like(X))  # one rank: the exclusive scan is zero


def test_not_initialised_message():
    # A fresh interpreter: this one has a process group already.
    code = ("import torch, allscan\n"
            "try:\n    allscan.scan(torch.ones(3))\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "torch.distributed is not initialised" in out.stdout, out.stdout + out.stderr


def test_single_rank_results(single_rank):
    g = torch.rand(2, 3)
    init = torch.randn(2, 3, 4)
    assert torch.equal(allscan.scan(X, g), torch.zeros_like(X))
    assert torch.equal(allscan.scan(X, g, init=init), init)
    assert torch.equal(allscan.scan(X, g, inclusive=True), X)
    assert torch.equal(allscan.scan(X, g, init=init, inclusive=True), scan_reference([X], [g], init, inclusive=True)[0])
    h = allscan.scan(X, g, init=init, inclusive=True, async_op=True)
    assert isinstance(h, allscan.ScanHandle) and h.is_completed()
    assert torch.equal(h.wait(), scan_reference([X], [g], init, inclusive=True)[0])
    # Non-contiguous input is accepted (made contiguous).
    xt = torch.randn(4, 3, 2).transpose(0, 2)
    assert torch.equal(allscan.scan(xt, init=xt.contiguous()), xt.contiguous())


def test_opcheck_single_rank(single_rank):
    name = single_rank.group_name
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    init = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    for args in [(x, g, init, name, False, False, 0, "pipelined"), (x, None, None, name, True, False, 2, "serial"),
                 (x, g, None, name, False, False, 0, "allgather")]:
        # one rank heads the chain both ways: its init is the one read
        torch.library.opcheck(torch.ops.allscan.scan.default, args, {"chain_head": args[2] is not None})


def _opcheck_and_compile(rank, P):
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(P)]
    gs = [torch.rand(2, 3, generator=gen, dtype=torch.float64) for _ in range(P)]
    x = xs[rank].clone().requires_grad_()
    g = gs[rank].clone().requires_grad_()
    no_init = {"chain_head": False}
    torch.library.opcheck(torch.ops.allscan.scan.default, (x, g, None, name, False, False, 0, "pipelined"), no_init)
    torch.library.opcheck(torch.ops.allscan.scan.default, (x, g, None, name, True, False, 0, "allgather"), no_init)

    def f(x, g):
        return allscan.scan(x * 2, g, reverse=True, inclusive=True).sin()

    check_compiled(f, x, g, scan_reference([2 * t for t in xs], gs, reverse=True, inclusive=True)[rank].sin(), 0)


def test_opcheck_and_compile_two_ranks():
    run_distributed(_opcheck_and_compile, 2, timeout=300)


def _mismatch(rank, P, kind):
    shape = (2, 3, 4)
    x = torch.randn(shape)
    g = torch.rand(2, 3)
    kwargs = {}
    if kind == "shape" and rank == 1:
        x = torch.randn(2, 3, 5)
    elif kind == "dtype" and rank == 1:
        x = x.double()
    elif kind == "gamma" and rank == 1:
        g = None
    elif kind == "method" and rank == 1:
        kwargs["method"] = "allgather"
    elif kind == "blocks":
        kwargs["num_blocks"] = 2 + rank
    with pytest_raises(ValueError, "ranks passed different arguments") as r:
        allscan.scan(x, g, **kwargs)
    field = {"shape": "tensor numel (rank 0: 24, rank 1: 30)", "dtype": "tensor dtype (rank 0: float32, rank 1: float64)",
             "gamma": "gamma dtype (rank 0: float32, rank 1: none)", "method": "method (0 pipelined, 1 serial, 2 allgather, 3 device) "
             "(rank 0: 0, rank 1: 2)", "blocks": "num_blocks (0 auto) (rank 0: 2, rank 1: 3)"}[kind]
    assert field in r.message, r.message  # names the field and each rank's value
    return True


class pytest_raises:  # pytest.raises is not picklable into spawned ranks' frames; keep it tiny
    def __init__(self, exc, match):
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, tp, val, tb):
        assert tp is not None, f"expected {self.exc.__name__} matching {self.match!r}, nothing was raised"
        assert issubclass(tp, self.exc) and self.match in str(val), f"unexpected {tp.__name__}: {val}"
        self.message = str(val)
        return True


@pytest.mark.parametrize("kind", ["shape", "dtype", "gamma", "method", "blocks"])
def test_mismatch_across_ranks_raises(kind):
    # Must raise on every rank, not hang: the helper kills and fails the test after the timeout.
    assert run_distributed(_mismatch, 2, kind, timeout=90) == [True, True]


def _mismatch_after_cache(rank, P):
    x = torch.randn(4)
    allscan.scan(x)  # this signature is now checked and cached on both ranks
    allscan.set_check_every_call(True)
    try:
        bad = torch.randn(5) if rank == 1 else x
        with pytest_raises(ValueError, "ranks passed different arguments"):
            allscan.scan(bad)
    finally:
        allscan.set_check_every_call(False)
    return True


def test_check_every_call_catches_a_later_mismatch():
    assert run_distributed(_mismatch_after_cache, 3, timeout=90) == [True] * 3


def _async(rank, P):
    xs = [torch.full((5,), float(q + 1)) for q in range(P)]
    h = allscan.scan(xs[rank], torch.tensor(0.5), async_op=True)
    y = h.wait()
    assert torch.equal(y, scan_reference(xs, [torch.tensor(0.5)] * P)[rank])
    return True


def test_async_cpu():
    run_distributed(_async, 3)


# ------------------------------------------------------------------------------------------------
# The C core through the bindings (compiled and linked in CI; no GPU needed for these calls)
# ------------------------------------------------------------------------------------------------


def test_choose_num_blocks_python_equals_core():
    for P in (1, 2, 3, 4, 8, 64, 256):
        for nbytes in (0, 1, 4096, 65536, 2 << 20, 256 << 20):
            for a, b in ((10.0, 1 / 300e3), (2.0, 1 / 50e3), (50.0, 1e-7)):
                assert C.choose_num_blocks_model(P, nbytes, a, b) == _dist.choose_num_blocks_model(P, nbytes, a, b)


def test_choose_num_blocks_minimises_the_model():
    a, b = 10.0, 1 / 300e3
    for P in (3, 8, 64):
        for nbytes in (1 << 20, 64 << 20):
            k = C.choose_num_blocks_model(P, nbytes, a, b)
            cost = lambda K: (P - 2 + K) * (a + b * nbytes / K)  # noqa: E731
            kmax = min(C.MAX_BLOCKS, nbytes // C.MIN_BLOCK_BYTES)
            assert cost(k) == min(cost(K) for K in range(1, kmax + 1))
    assert C.choose_num_blocks_model(2, 1 << 30, a, b) == 1  # two ranks: one block whatever the size


@pytest.mark.parametrize("var,value,needle", [
    ("ALLSCAN_HEAD_FILL", "selff", "expected auto, self, side or series, got 'selff'"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "8M", "expected a byte count up to 1073741824, got '8M'"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "99999999999999999999999", "expected a byte count up to 1073741824"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "18446744073709551615", "expected a byte count up to 1073741824"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "1073741825", "expected a byte count up to 1073741824"),
    ("ALLSCAN_FILL_CTAS", "-1", "to 1024, got '-1'"),
    ("ALLSCAN_FILL_CTAS", "1025", "to 1024, got '1025'"),
    ("ALLSCAN_DEVICE_PATH", "on", "expected auto or off, got 'on'"),
    ("ALLSCAN_DEVICE_TIMEOUT_S", "0", "at most 1e6, got '0'"),
    ("ALLSCAN_DEVICE_TIMEOUT_S", "nan", "at most 1e6, got 'nan'"),
])
def test_core_rejects_what_the_settings_reject(monkeypatch, var, value, needle):
    # The core reads these itself when it makes a communicator, with the same rules as the settings.
    from allscan._settings import settings

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var) as e:
        C.comm_create_detached(0, 2)
    assert needle in str(e.value)
    with pytest.raises(ValueError, match=var):
        settings.reload()
    monkeypatch.delenv(var)
    settings.reload()


def test_core_argument_checks():
    h = C.comm_create_detached(1, 4)
    try:
        assert C.comm_rank(h) == 1 and C.comm_size(h) == 4
        f32, bf16 = C.FLOAT32, C.BFLOAT16
        # count, dtype, g, g_count, g_dtype, init, reverse, inclusive, num_blocks, method
        assert C.workspace_size(h, 100, f32, 0, 0, f32, 0, False, False, 0, C.PIPELINED) == 512
        assert C.workspace_size(h, 100, f32, 1, 10, f32, 0, False, False, 0, C.ALLGATHER) == 2048
        # Pipelined/serial workspace follows the rank's place in the chain (4 ranks).
        # args after the comm: count, dtype, g, g_count, g_dtype, init, reverse, inclusive, K, method
        def ws(rank, init=0, reverse=False, inclusive=False, method=C.PIPELINED):
            c = C.comm_create_detached(rank, 4)
            try:
                return C.workspace_size(c, 100, f32, 0, 0, f32, init, reverse, inclusive, 0, method)
            finally:
                C.comm_destroy(c)

        assert ws(3) == 0 and ws(3, inclusive=True) == 512  # tail: receives straight into y
        assert ws(0) == 0 and ws(0, init=1) == 512 and ws(0, init=1, inclusive=True) == 0  # head
        assert ws(1) == 512 and ws(2, inclusive=True) == 512  # inner ranks stage what they send
        # reverse: rank 3 heads the chain, rank 0 is its tail
        assert ws(0, reverse=True) == 0 and ws(3, reverse=True) == 0 and ws(3, init=1, reverse=True) == 512
        assert ws(1, reverse=True) == 512 and ws(0, init=1) == 512
        assert ws(1, method=C.SERIAL) == 512 and ws(3, method=C.SERIAL) == 0
        # the device path needs none of its own; its fallback (pipelined) what pipelined needs
        assert [ws(r, method=C.DEVICE) for r in range(4)] == [ws(r) for r in range(4)]
        assert C.device_path(h) == (0, "")  # not tried: no device call on this communicator
        with pytest.raises(ValueError, match="g_count: 7 must divide count 100"):
            C.workspace_size(h, 100, f32, 1, 7, f32, 0, False, False, 0, C.PIPELINED)
        with pytest.raises(ValueError, match="g_dtype: expected float32 or the state's dtype"):
            C.workspace_size(h, 100, bf16, 1, 10, C.FLOAT16, 0, False, False, 0, C.PIPELINED)
        with pytest.raises(ValueError, match="dtype: expected"):
            C.workspace_size(h, 100, 9, 0, 0, f32, 0, False, False, 0, C.PIPELINED)
        with pytest.raises(ValueError, match="method: expected"):
            C.workspace_size(h, 100, f32, 0, 0, f32, 0, False, False, 0, 7)
        with pytest.raises(ValueError, match="num_blocks: expected"):
            C.workspace_size(h, 100, f32, 0, 0, f32, 0, False, False, -1, C.PIPELINED)
        with pytest.raises(ValueError, match="detached communicator"):
            C.neighbor_exchange(h, 16, 32, 8, False, True, 0)
        with pytest.raises(ValueError, match="latency_us"):
            C.set_link_model(h, -1.0, 1e-6)
        assert C.get_link_model(h) == (0.0, 0.0, False)
        assert C.choose_num_blocks(h, 1 << 20) == 1  # no model: one block
        C.set_link_model(h, 10.0, 1 / 300e3)
        assert C.choose_num_blocks(h, 64 << 20) == C.choose_num_blocks_model(4, 64 << 20, 10.0, 1 / 300e3) > 1
    finally:
        C.comm_destroy(h)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < nranks"):
        C.comm_create_detached(4, 4)
    with pytest.raises(ValueError, match="nccl: null NCCL communicator"):
        C.comm_create(0)


def test_block_partition_matches_core_rule():
    # The Python path's partition is the core's: ceil(count/K) rounded up to 16 bytes of elements.
    assert _dist.block_elems(210, 4, 4) == 56
    assert _dist.block_elems(210, 1000, 4) == 4
    assert _dist.block_elems(210, 3, 2) == 72
    assert _dist.block_elems(1, 64, 8) == 2


def _invalid_local_args(rank, P):
    allscan.set_check_every_call(True)
    try:
        x = torch.randn(4)
        if rank == 1:
            with pytest_raises(ValueError, "must be a prefix"):
                allscan.scan(x, torch.ones(3))  # a local error on rank 1 only
        else:
            with pytest_raises(ValueError, "rejected their own arguments"):
                allscan.scan(x)
    finally:
        allscan.set_check_every_call(False)
    return True


def test_check_every_call_a_local_error_on_one_rank_raises_everywhere():
    assert run_distributed(_invalid_local_args, 3, timeout=90) == [True] * 3


def _allgather_takes_the_heads_init(rank, P):
    # init is read on the chain head only, whatever the method: ranks may pass different ones.
    xs = [torch.full((6,), float(q + 1)) for q in range(P)]
    g = torch.tensor(0.5)
    inits = [torch.full((6,), 10.0 * (q + 1)) for q in range(P)]
    for reverse in (False, True):
        head = P - 1 if reverse else 0
        ref = scan_reference(xs, [g] * P, inits[head], reverse=reverse)[rank]
        for method in ("pipelined", "serial", "allgather"):
            y = allscan.scan(xs[rank], g, init=inits[rank], reverse=reverse, method=method)
            assert torch.equal(y, ref), (method, reverse, y, ref)
    return True


def test_init_is_read_on_the_head_only_in_every_method():
    run_distributed(_allgather_takes_the_heads_init, 3)


def _reinit(rank, P):
    x = torch.randn(5)
    y0 = allscan.scan(x, inclusive=True)
    allscan.destroy_communicators()  # forgets plans and checked signatures too
    assert torch.equal(allscan.scan(x, inclusive=True), y0)
    return True


def test_destroy_communicators_then_scan_again():
    assert len(run_distributed(_reinit, 2)) == 2


def test_group_recreated_under_the_same_name(single_rank):
    x = torch.randn(3)
    assert torch.equal(allscan.scan(x, inclusive=True), x)
    dist.destroy_process_group()
    from distributed import _free_port

    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    # The new default group may carry the old name; the prepared plan must not be reused.
    assert torch.equal(allscan.scan(x, inclusive=True), x)
    assert torch.equal(allscan.scan(x), torch.zeros_like(x))


def _invalid_local_args_default_mode_on_gloo(rank, P):
    # Off NCCL the default mode exchanges every call, so a rank that fails locally joins it too.
    x = torch.randn(4)
    if rank == 1:
        with pytest_raises(TypeError, "allscan.scan: tensor must be float32, float16, bfloat16 or float64"):
            allscan.scan(x.int())
    else:
        with pytest_raises(ValueError, "rank(s) [1] rejected their own arguments"):
            allscan.scan(x)
    # every rank saw the error: the group is in step, the next call works
    y = allscan.scan(torch.ones(4), inclusive=True)
    assert torch.equal(y, torch.full((4,), float(rank + 1))), y
    return True


def test_a_local_error_on_one_rank_raises_everywhere_on_gloo():
    assert run_distributed(_invalid_local_args_default_mode_on_gloo, 2, timeout=90) == [True] * 2


def test_explicit_block_count_is_capped():
    assert _dist.effective_blocks(None, 10**6, 4, 10**6, "pipelined") == _dist.MAX_BLOCKS


def _edge_cases(rank, world):
    """What the issue-13 probe found: the head's inclusive result with an inf decay must not depend on
    whether autograd is on; a rank outside a group is told so."""
    out = {}
    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    g = torch.tensor([float("inf"), 1.0]) if rank == 0 else torch.tensor([0.5, 0.5])
    for method in ("pipelined", "serial", "allgather"):
        plain = allscan.scan(x, g, inclusive=True, method=method)
        xr = x.clone().requires_grad_(True)
        graded = allscan.scan(xr, g, inclusive=True, method=method)
        graded.sum().backward()
        out[method] = (plain.tolist(), graded.tolist(), xr.grad.tolist())
    sub = dist.new_group([0])
    if rank == 1:
        try:
            allscan.scan(x, group=sub)
            out["outside"] = "no error"
        except ValueError as e:
            out["outside"] = str(e)
    return out


def test_head_inclusive_with_inf_decay_and_a_rank_outside_the_group():
    r0, r1 = run_distributed(_edge_cases, 2, timeout=90)
    for method in ("pipelined", "serial", "allgather"):
        assert r0[method][0] == r0[method][1] == [1.0, 2.0], (method, r0[method])
        assert r1[method][0] == r1[method][1] == [2.5, 5.0], (method, r1[method])
        # d(sum of every rank's inclusive result)/dx on the head: 1 + 0.5 (through rank 1)
        assert r0[method][2] == [1.5, 1.5] and r1[method][2] == [1.0, 1.0], (method, r0[method], r1[method])
    assert "is not a member of the group it was given" in r1["outside"], r1["outside"]


def test_plan_caches_are_bounded(single_rank, monkeypatch):
    """Every shape a process ever scans leaves a plan; the caches evict the least recently used past
    MAX_PLANS instead of growing for ever (the issue-13 probe: 3,000 shapes, +7 MB, never evicted)."""
    import importlib

    from allscan.ops import _launch

    from allscan.ops import diagonal_scan

    monkeypatch.setattr(_launch, "MAX_PLANS", 16)
    for n in range(1, 41):
        allscan.scan(torch.ones(n))
        assert len(diagonal_scan.plans) <= 16
    recent = next(reversed(diagonal_scan.plans))
    assert recent[3] == torch.Size([40]), "the most recent signature is kept"
    cache = _launch.PlanCache()
    for i in range(20):
        cache[i] = i
        cache.get(0)  # used every time: never evicted
    assert len(cache) == 16 and 0 in cache and 1 not in cache


def test_a_second_thread_in_a_busy_group_raises(single_rank):
    """While one thread is inside a collective on a group, another thread's call on that group (a scan,
    an all-to-all) raises
    (it would pair with the wrong calls of the other ranks); the same thread may nest; the group is
    usable again once the first call is done."""
    import threading

    from allscan._threads import one_thread

    inside, release, seen = threading.Event(), threading.Event(), {}

    def holder():
        with one_thread(None, "scan"):  # the default group, as the call below
            seen["nested"] = allscan.scan(torch.ones(3), inclusive=True).tolist()  # the same thread nests
            inside.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match=r"allscan.scan: group .* is in allscan.scan on another host thread"):
            allscan.scan(torch.ones(3))
        with pytest.raises(RuntimeError, match=r"allscan.a2a: group .* is in allscan.scan on another host thread"):
            allscan.a2a.scatter_heads(torch.ones(1, 2, 1, 4))
    finally:
        release.set()
        t.join(30)
    assert seen["nested"] == [1.0, 1.0, 1.0]
    assert allscan.scan(torch.ones(3), inclusive=True).tolist() == [1.0, 1.0, 1.0]


def _device_path_query(rank, P):
    # a query on one rank alone, with no NCCL communicator: no collective, "not tried"
    if rank == 0:
        assert allscan.device_path() == "not tried"
    y = allscan.scan(torch.ones(4) * (rank + 1), method="device")  # gloo: the pipelined method
    assert torch.equal(y, torch.full((4,), float(rank * (rank + 1) // 2)))
    return allscan.device_path()


def test_device_path_query_and_device_method_on_gloo():
    assert run_distributed(_device_path_query, 3) == ["not tried"] * 3


def test_saved_tensor_hooks_are_seen():
    """An async call whose output autograd saves leaves the side-stream-by-handle path while a
    saved-tensor hook (offloading, checkpointing) is active: the hook would read the output on the
    caller's stream before the scan wrote it."""
    from torch.utils.checkpoint import checkpoint

    H = importlib.import_module("allscan.ops._scan_handle")
    assert not H.saved_tensor_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert H.saved_tensor_hooks_active()
    seen = []
    checkpoint(lambda t: seen.append(H.saved_tensor_hooks_active()) or t * 2, torch.ones(2, requires_grad=True),
               use_reentrant=False)
    assert seen == [True]
