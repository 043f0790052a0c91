"""UlyssesAttention (HCMS) on CPU with gloo against SDPA on the whole sequence in one process."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

from distributed import run_distributed  # noqa: E402

from allscan.layers import UlyssesAttention  # noqa: E402
from allscan.ops import ulysses as U  # noqa: E402
from allscan.ops.ulysses import passes as X, pipeline as P  # noqa: E402  (what the tests below replace)


def _inputs(B, S, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, S, h, D, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def reference(q, k, v, w, causal, scale):
    """Single-process SDPA on the whole sequence: output and gradients of sum(out * w)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                       is_causal=causal, scale=scale).transpose(1, 2)
    (o * w).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def _check_layer(rank, world, B, Sl, Hq, Hkv, D, causal, chunks_list, scale):
    S = Sl * world
    q, k, v, w = _inputs(B, S, Hq, Hkv, D, torch.float64)
    ro, rq, rk, rv = reference(q, k, v, w, causal, scale)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    for C in chunks_list:
        layer = UlyssesAttention(num_chunks=C)
        ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
        out = layer(ql, kl, vl, causal=causal, scale=scale)
        assert out.shape == (B, Sl, Hq, D)
        torch.testing.assert_close(out, ro[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"output, C={C}: {m}")
        (out * w[:, sl]).sum().backward()
        for name, got, ref in (("dq", ql.grad, rq), ("dk", kl.grad, rk), ("dv", vl.grad, rv)):
            torch.testing.assert_close(got, ref[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}, C={C}: {m}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_even_heads(world, causal):
    H = 2 * world
    run_distributed(_check_layer, world, 2, 3, H, H, 8, causal, list(range(1, H + 1)), None)


@pytest.mark.parametrize("world,H", [(2, 5), (4, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_uneven_heads(world, H, causal):
    run_distributed(_check_layer, world, 1, 4, H, H, 8, causal, list(range(1, H + 1)), 0.3)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_fewer_kv_heads_than_ranks(causal):
    # 8 query heads, 2 k/v heads, P = 4: every k/v head is replicated on two ranks
    run_distributed(_check_layer, 4, 2, 3, 8, 2, 8, causal, list(range(1, 9)), None)


@pytest.mark.parametrize("world,Hq,Hkv", [(2, 8, 4), (3, 8, 4), (3, 6, 2)])
def test_gqa_more_kv_heads(world, Hq, Hkv):
    # k/v heads split alongside their query heads (unaligned splits included)
    run_distributed(_check_layer, world, 1, 3, Hq, Hkv, 4, True, list(range(1, Hq + 1)), None)


def packed_reference(q, k, v, w, causal, bounds):
    """:func:`reference` of each packed sequence on its own, joined (B = 1)."""
    parts = [reference(q[:, a:b], k[:, a:b], v[:, a:b], w[:, a:b], causal, None)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return tuple(torch.cat(p, 1) for p in zip(*parts))


def _check_packed(rank, world, Sl, Hq, Hkv, causal, bounds, as_tensor):
    S = Sl * world
    q, k, v, w = _inputs(1, S, Hq, Hkv, 8, torch.float64, seed=7)
    ro, rq, rk, rv = packed_reference(q, k, v, w, causal, bounds)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    cu = torch.tensor(bounds) if as_tensor else list(bounds)
    for C in (1, 2):
        ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
        out = UlyssesAttention(num_chunks=C)(ql, kl, vl, causal=causal, cu_seqlens=cu)
        torch.testing.assert_close(out, ro[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"output, C={C}: {m}")
        (out * w[:, sl]).sum().backward()
        for name, got, ref in (("dq", ql.grad, rq), ("dk", kl.grad, rk), ("dv", vl.grad, rv)):
            torch.testing.assert_close(got, ref[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}, C={C}: {m}")
    with torch.no_grad():  # inference: no graph kept (another path through the chunks)
        out = UlyssesAttention(num_chunks=2)(q[:, sl], k[:, sl], v[:, sl], causal=causal, cu_seqlens=cu)
        torch.testing.assert_close(out, ro[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"no grad: {m}")
        # without cu_seqlens the same shard attends across the bounds: the test can tell the two apart
        whole = UlyssesAttention(num_chunks=1)(q[:, sl], k[:, sl], v[:, sl], causal=causal)
    return bool((whole - ro[:, sl]).abs().max() > 1e-3)


@pytest.mark.parametrize("world,bounds", [(2, (0, 5, 12)), (3, (0, 4, 4, 9, 10, 12)), (4, (0, 3, 6, 9, 16))])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_sequences_attend_each_on_its_own(world, bounds, causal):
    """Sequences packed in one row (``cu_seqlens``), cut anywhere (on rank boundaries too, and an empty one)."""
    Sl = bounds[-1] // world
    differs = run_distributed(_check_packed, world, Sl, 2 * world, world, causal, bounds, world % 2 == 0)
    assert any(differs)


def _packed_errors(rank, world):
    x = torch.zeros(1, 3, 2, 4)
    layer = UlyssesAttention(num_chunks=1)
    for cu, match in (([0, 4], r"rise from 0 to the whole sequence's length 6"),
                      ([0, 4, 2, 6], "rise from 0"), (torch.tensor([0.0, 6.0]), "1-D integer tensor"),
                      ([0, 2.5, 6], "must hold integers")):
        with pytest.raises(ValueError, match=match):
            layer(x, x, x, causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch size must be 1"):
        layer(torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 4), cu_seqlens=[0, 6])
    # ranks passing different bounds: every rank raises, naming the field
    with pytest.raises(ValueError, match="ranks disagree on cu_seqlens checksum"):
        layer(x, x, x, causal=True, cu_seqlens=[0, 2 + rank, 6])
    # one rank's bad bounds reach the other
    with pytest.raises(ValueError, match=r"rise from 0" if rank == 1 else r"rank\(s\) \[1\] rejected their own"):
        layer(x, x, x, causal=True, cu_seqlens=[0, 6] if rank == 0 else [0, 5])
    return True


def test_packed_sequences_errors_name_the_argument_on_every_rank():
    assert run_distributed(_packed_errors, 2, timeout=60) == [True, True]


def _packed_checked_every_call(rank, world):
    """Where signatures are checked once (NCCL in ``first`` mode, emulated here on gloo), packed calls still
    exchange on every call: ranks switching to different bounds each checked before raise, and a rank's
    bad bounds reach its peers in that exchange instead of leaving them waiting."""
    import allscan._agreement as contract

    contract._on_nccl = lambda group, device: True  # check once per signature, as on NCCL
    x = torch.zeros(1, 3, 2, 4)
    layer = UlyssesAttention(num_chunks=1)
    for cu in ([0, 2, 6], [0, 4, 6]):  # both signatures checked, on both ranks
        layer(x, x, x, causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="ranks disagree on cu_seqlens checksum"):
        layer(x, x, x, causal=True, cu_seqlens=[0, 2, 6] if rank == 0 else [0, 4, 6])
    with pytest.raises(ValueError, match=r"rise from 0" if rank == 1 else r"rank\(s\) \[1\] rejected their own"):
        layer(x, x, x, causal=True, cu_seqlens=[0, 2, 6] if rank == 0 else [0, 2, 5])
    return True


def test_packed_sequences_checked_on_every_call_where_signatures_are_checked_once():
    assert run_distributed(_packed_checked_every_call, 2, timeout=60) == [True, True]


def _weights_and_nograd(rank, world):
    B, Sl, H, D = 1, 4, 6, 4
    S = Sl * world
    q, k, v, w = _inputs(B, S, H, H, D, torch.float64, seed=3)
    ro, rq, rk, rv = reference(q, k, v, w, True, None)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    layer = UlyssesAttention(num_chunks=3, chunk_weights=[1, 2, 1])
    ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    out = layer(ql, kl, vl, causal=True)
    (out * w[:, sl]).sum().backward()
    torch.testing.assert_close(out, ro[:, sl], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl.grad, rk[:, sl], rtol=1e-10, atol=1e-10)
    # inference: no graph kept, same numbers; auto on CPU is C = 1
    with torch.no_grad():
        out2 = UlyssesAttention()(q[:, sl], k[:, sl], v[:, sl], causal=True)
    torch.testing.assert_close(out2, ro[:, sl], rtol=1e-10, atol=1e-10)
    # only k needs a gradient
    kl2 = k[:, sl].clone().requires_grad_(True)
    out3 = UlyssesAttention(num_chunks=2)(q[:, sl], kl2, v[:, sl], causal=True)
    (out3 * w[:, sl]).sum().backward()
    torch.testing.assert_close(kl2.grad, rk[:, sl], rtol=1e-10, atol=1e-10)


def test_chunk_weights_nograd_partial_grads():
    run_distributed(_weights_and_nograd, 2)


def _float32(rank, world):
    B, Sl, H, D = 2, 8, 4, 16
    S = Sl * world
    q, k, v, w = _inputs(B, S, H, 2, D, torch.float32, seed=5)
    ro, rq, rk, rv = reference(q.double(), k.double(), v.double(), w.double(), True, None)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    out = UlyssesAttention(num_chunks=2)(ql, kl, vl, causal=True)
    (out * w[:, sl]).sum().backward()
    for got, ref in ((out, ro), (ql.grad, rq), (kl.grad, rk), (vl.grad, rv)):
        ref = ref[:, sl]
        rms = (got.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
        assert rms <= 1e-5, rms


def test_float32_rms():
    run_distributed(_float32, 2)


# ------------------------------------------------------------------------------------------------
# Auto C: the model (pure functions)
# ------------------------------------------------------------------------------------------------

def test_choose_num_chunks_model():
    # communication 2.2 ms and attention 17.7 ms over 20 heads, tiny per-chunk overheads: overlap pays
    att = (0.05, 17.7 / 20)
    comm = (0.06, 2.2 / 20)
    C = U.choose_num_chunks(20, att, comm)
    assert C > 1
    assert U.model_time(C, 20, att, comm) < U.model_time(1, 20, att, comm)
    # no communication to hide: C = 1
    assert U.choose_num_chunks(20, (0.05, 1.0), (0.0, 0.0)) == 1
    # per-chunk overhead larger than the communication: C = 1
    assert U.choose_num_chunks(20, (5.0, 1.0), (1.0, 0.01)) == 1
    assert U.choose_num_chunks(20, att, comm, max_chunks=3) <= 3
    assert U.choose_num_chunks(1, att, comm) == 1


def test_pick_measured():
    # the model's C is kept only when the layer measured at least min_gain faster than C = 1
    assert U.pick_measured({1: 10.0, 4: 9.0}) == 4
    assert U.pick_measured({1: 10.0, 4: 9.95}) == 1          # 0.5% faster: noise, keep C = 1
    assert U.pick_measured({1: 10.0, 4: 10.5}) == 1          # slower
    assert U.pick_measured({1: 10.0, 2: 9.5, 4: 9.0}) == 4   # the fastest of several
    assert U.pick_measured({1: 10.0, 4: 9.95}, min_gain=0.0) == 4
    assert U.pick_measured({1: 10.0}) == 1
    with pytest.raises(ValueError, match="C = 1"):
        U.pick_measured({2: 1.0, 4: 2.0})


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def _errors_local(rank, world):
    layer = UlyssesAttention(num_chunks=1)
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4-D"):
        layer(torch.zeros(2, 4, 8), x, x)
    with pytest.raises(ValueError, match="multiple of the k/v heads"):
        layer(x, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        layer(x, x, torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match="must match q"):
        layer(x, torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8))
    with pytest.raises(TypeError, match="one dtype"):
        layer(x, x.double(), x.double())
    with pytest.raises(TypeError, match="UlyssesAttention: q must be float32, float16, bfloat16 or float64, got torch.int32"):
        layer(x.int(), x.int(), x.int())
    with pytest.raises(ValueError, match="at least one query head per rank"):
        layer(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="num_chunks"):
        UlyssesAttention(num_chunks=5)(x, x, x)
    with pytest.raises(ValueError, match="num_chunks"):
        UlyssesAttention(num_chunks="fast")(x, x, x)
    with pytest.raises(ValueError, match="chunk_weights"):
        UlyssesAttention(num_chunks=2, chunk_weights=[1.0])(x, x, x)


def test_errors_local():
    run_distributed(_errors_local, 2)


def _errors_cross_rank(rank, world, what):
    layer = UlyssesAttention(num_chunks=1)
    if what == "seq":
        x = torch.zeros(1, 2 + rank, 4, 8)
        with pytest.raises(ValueError, match=r"ranks disagree on local sequence length S_local \(rank 0: 2, rank 1: 3\)"):
            layer(x, x, x)
    elif what == "causal":
        x = torch.zeros(1, 2, 4, 8)
        with pytest.raises(ValueError, match=r"ranks disagree on causal \(rank 0: 0, rank 1: 1\)"):
            layer(x, x, x, causal=bool(rank))
    elif what == "one_rank_bad":
        x = torch.zeros(1, 2, 4, 8)
        kv = x if rank == 0 else torch.zeros(1, 2, 3, 8)
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] rejected their own arguments" if rank == 0 else "multiple of the k/v heads"):
            layer(x, kv, kv)


@pytest.mark.parametrize("what", ["seq", "causal", "one_rank_bad"])
def test_errors_cross_rank(what):
    run_distributed(_errors_cross_rank, 2, what, timeout=60)


def _compiled(rank, world, Hq, Hkv, causal):
    """UlyssesAttention under torch.compile(fullgraph=True): plain Ulysses through allscan's all-to-all
    custom ops and SDPA (allscan.ops.ulysses.traced), forward and backward, against SDPA on the whole
    sequence; with grouped-query attention (k/v heads replicated over ranks when there are fewer than
    ranks); and opcheck of the scatter op."""
    import torch.distributed as dist

    torch._dynamo.reset()
    B, Sl, D = 2, 3, 8
    q, k, v, w = _inputs(B, Sl * world, Hq, Hkv, D, torch.float64)
    ro, rq, rk, rv = reference(q, k, v, w, causal, 0.3)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    layer = UlyssesAttention(num_chunks="auto")
    step = torch.compile(lambda a, b, c: layer(a, b, c, causal=causal, scale=0.3), fullgraph=True, backend="aot_eager")
    ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    out = step(ql, kl, vl)
    torch.testing.assert_close(out, ro[:, sl], rtol=1e-10, atol=1e-10)
    (out * w[:, sl]).sum().backward()
    for name, got, ref in (("dq", ql.grad, rq), ("dk", kl.grad, rk), ("dv", vl.grad, rv)):
        torch.testing.assert_close(got, ref[:, sl], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert layer.last_info == {"num_chunks": 1, "auto": None}
    import allscan.ops.ulysses.traced  # noqa: F401 - registers the ops

    torch.library.opcheck(torch.ops.allscan.ulysses_scatter.default,
                          (ql, kl, vl, dist.group.WORLD.group_name, world, rank, causal, 0.3, 0, True))
    return True


@pytest.mark.parametrize("world,Hq,Hkv,causal", [(2, 4, 4, True), (3, 5, 5, False), (3, 6, 2, True), (4, 8, 2, False)])
def test_torch_compile_fullgraph_equals_reference(world, Hq, Hkv, causal):
    assert run_distributed(_compiled, world, Hq, Hkv, causal, timeout=300) == [True] * world


def _compiled_errors(rank, world):
    """Under torch.compile the call's checks run inside the op, when it runs: a rank whose causal flag
    or k/v heads differ raises there and so do its peers (no hang)."""
    torch._dynamo.reset()
    layer = UlyssesAttention()
    step = torch.compile(lambda a, b, c, causal: layer(a, b, c, causal=causal), fullgraph=True, backend="aot_eager")
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"ranks disagree on causal \(rank 0: 0, rank 1: 1\)"):
        step(x, x, x, bool(rank))
    kv = x if rank == 0 else torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] rejected their own arguments" if rank == 0
                       else "multiple of the k/v heads"):
        step(x, kv, kv, False)
    assert step(x, x, x, False).shape == x.shape  # and the group still works
    return True


def test_torch_compile_errors_reach_every_rank():
    assert run_distributed(_compiled_errors, 2, timeout=300) == [True, True]


# ------------------------------------------------------------------------------------------------
# The two-stream schedule, checked on CPU with simulated streams (vector clocks)
# ------------------------------------------------------------------------------------------------

class _FakeStream:
    """A stream as a vector clock: an op enqueued here happens after everything this stream has
    waited for; record/wait move snapshots between streams like CUDA events."""

    def __init__(self, name, names):
        self.name, self.clock = name, {n: 0 for n in names}

    def op(self, log, what):
        self.clock[self.name] += 1
        log.append((what, self.name, dict(self.clock)))

    def wait_stream(self, other):
        for n, t in other.clock.items():
            self.clock[n] = max(self.clock[n], t)

    def wait_event(self, ev):
        assert ev.snap is not None, "wait on an event that was never recorded (a no-op on CUDA)"
        for n, t in ev.snap.items():
            self.clock[n] = max(self.clock[n], t)


class _FakeEvent:
    def __init__(self):
        self.snap = None

    def record(self, stream):
        self.snap = dict(stream.clock)


class _FakeSync:
    def __init__(self):
        self.main, self.comm = _FakeStream("main", ("main", "comm")), _FakeStream("comm", ("main", "comm"))

    @staticmethod
    def event():
        return _FakeEvent()


def _happens_before(a, b):
    """a's op (stream s, index i) is visible to b when b's clock has seen index i of s."""
    _, sa, ca = a
    _, _, cb = b
    return cb[sa] >= ca[sa]


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_pipeline_cross_stream_dependencies(n):
    sync, log = _FakeSync(), []
    sync.main.op(log, ("inputs",))
    P.run_pipeline(
        n,
        lambda c, stream: stream.op(log, ("scatter", c)),
        lambda c: sync.main.op(log, ("attend", c)) or c,
        lambda c, res, stream: stream.op(log, ("gather", c)),
        None, sync=sync)
    sync.main.op(log, ("after",))
    ops = {entry[0]: entry for entry in log}
    assert all(ops[("scatter", c)][1] == "comm" and ops[("gather", c)][1] == "comm" for c in range(n))
    for c in range(n):
        assert _happens_before(ops[("inputs",)], ops[("scatter", c)]), f"scatter {c} may read inputs before they are ready"
        for d in range(c + 1):  # GQA: attend(c) may read k/v that scatter(d <= c) brought
            assert _happens_before(ops[("scatter", d)], ops[("attend", c)]), f"attend {c} may read scatter {d}'s buffers early"
        assert _happens_before(ops[("attend", c)], ops[("gather", c)]), f"gather {c} may read attend {c}'s output early"
        assert _happens_before(ops[("gather", c)], ops[("after",)]), f"gather {c} may land after the caller reads the output"


def test_pipeline_sequential_order():
    log = []
    P.run_pipeline(3, lambda c, s: log.append(("s", c, s)), lambda c: log.append(("a", c)) or c,
                    lambda c, r, s: log.append(("g", c, r, s)), None)
    assert log == [("s", 0, None), ("a", 0), ("g", 0, 0, None), ("s", 1, None), ("a", 1), ("g", 1, 1, None),
                   ("s", 2, None), ("a", 2), ("g", 2, 2, None)]


@pytest.mark.parametrize("step, failing", [("attend", 0), ("attend", 3), ("scatter", 0), ("scatter", 2),
                                           ("gather", 1)])
def test_pipeline_failure_reports_and_still_joins_the_streams(step, failing):
    """A step of chunk ``failing`` raising: ``failed(chunk, error, step)`` runs once, the error propagates,
    nothing after it is issued, and (two streams) main has waited for everything the comm stream was
    given; the same on one stream."""
    for two_streams in (True, False):
        sync, log, told = _FakeSync(), [], []

        def run(name, c, stream):
            (stream or sync.main).op(log, (name, c))
            if (name, c) == (step, failing):
                raise RuntimeError("injected out of memory")

        with pytest.raises(RuntimeError, match="injected"):
            P.run_pipeline(4, lambda c, s: run("scatter", c, s), lambda c: run("attend", c, None) or c,
                            lambda c, res, s: run("gather", c, s), None, sync=sync if two_streams else None,
                            failed=lambda c, e, where: told.append((c, str(e), where)))
        assert told == [(failing, "injected out of memory", step)], (two_streams, told)
        issued = [entry[0] for entry in log]
        assert issued[-1] == (step, failing), (two_streams, issued)
        if two_streams:
            assert sync.main.clock["comm"] == sync.comm.clock["comm"], "main did not wait for the comm stream"


def _attention_fails(rank, world, where):
    """Every rank's attention raises (its buffers, or at a head chunk, forward or backward): each
    reports the failure on the fault board (recorded here: on gloo the report is for the core's
    all-to-all only) naming the step, where it stopped and the error, and raises it."""
    from allscan import _comm

    q, k, v, w = _inputs(1, 4 * world, 4, 4, 8, torch.float64)
    sl = slice(rank * 4, (rank + 1) * 4)
    ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    reports, calls = [], []
    saved = _comm.report_local_error, P._use_cpp, F.scaled_dot_product_attention, X._forward_buffers
    real_sdpa, real_buffers = F.scaled_dot_product_attention, X._forward_buffers

    def failing_sdpa(*args, **kwargs):
        calls.append(1)
        if where == "forward" and len(calls) == 2:
            raise RuntimeError("injected out of memory")
        out = real_sdpa(*args, **kwargs)
        if where == "backward":
            out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected out of memory")))
        return out

    def failing_buffers(*args):
        raise RuntimeError("injected out of memory")

    _comm.report_local_error = lambda group, device, reason: reports.append((group, device, reason))
    P._use_cpp = lambda group, x: True  # as on NCCL with the core's all-to-all
    F.scaled_dot_product_attention = failing_sdpa
    if where == "buffers":
        X._forward_buffers = failing_buffers
    try:
        with pytest.raises(RuntimeError, match="injected out of memory"):
            out = U.ulysses_attention(ql, kl, vl, num_chunks=2)
            (out * w[:, sl]).sum().backward()
    finally:
        _comm.report_local_error, P._use_cpp, F.scaled_dot_product_attention, X._forward_buffers = saved
    (group, device, reason), = reports
    want = {"forward": "its forward failed at head chunk 1",
            "backward": "its backward failed at head chunk 0",
            "buffers": "its forward failed before its first all-to-all"}[where]
    assert group is torch.distributed.group.WORLD and device == ql.device
    assert reason.startswith(f"UlyssesAttention: {want}: RuntimeError: injected out of memory"), reason
    return True


@pytest.mark.parametrize("where", ["buffers", "forward", "backward"])
def test_attention_failing_between_all_to_alls_is_reported(where):
    assert run_distributed(_attention_fails, 2, where, timeout=120) == [True, True]


def test_failure_reports_by_path():
    """Where a failure goes: the fault board for the core's all-to-all (any step), the next all-to-all's
    check for torch's all-to-all with every chunk checked (gloo), and only for the rank's own work (its
    buffers, a chunk's attention: an all-to-all's failure reached the peers already); nothing for a
    communicator that failed (the board spreads that already), where the chunks are not checked, or
    alone."""
    from allscan import _C, _comm

    plan = type("Plan", (), {"group": object(), "world": 2})()
    x = torch.zeros(1)
    board, announced = [], []
    saved = _comm.report_local_error, P._use_cpp, P.announce_invalid, P.peers_exchange
    _comm.report_local_error = lambda group, device, reason: board.append(reason)
    P.announce_invalid = lambda group, device, op, reason: announced.append((op, reason))
    try:
        P._use_cpp, P.peers_exchange = (lambda group, t: True), (lambda group, device: True)
        P.report_failure(plan, x, "forward")(0, _C.CommunicatorError("the communicator failed"), "gather")
        assert board == [] and announced == []
        for step in ("scatter", "attend", "gather", None):
            P.report_failure(plan, x, "forward")(0, RuntimeError("out of memory"), step)
        assert len(board) == 4 and announced == []
        P._use_cpp = lambda group, t: False  # torch's all-to-all, every chunk checked (gloo)
        for step in ("scatter", "gather"):
            P.report_failure(plan, x, "forward")(1, RuntimeError("connection reset"), step)
        assert announced == []
        P.report_failure(plan, x, "backward")(1, RuntimeError("out of memory"), "attend")
        P.report_failure(plan, x, "forward")(None, RuntimeError("out of memory"))
        assert announced == [("UlyssesAttention", "UlyssesAttention: its backward failed at head chunk 1: "
                                                  "RuntimeError: out of memory"),
                             ("UlyssesAttention", "UlyssesAttention: its forward failed before its first "
                                                  "all-to-all: RuntimeError: out of memory")]
        P.peers_exchange = lambda group, device: False  # torch's all-to-all on NCCL, checked once per signature
        P.report_failure(plan, x, "forward")(0, RuntimeError("out of memory"), "attend")
        P._use_cpp, P.peers_exchange, plan.world = (lambda group, t: True), (lambda group, device: True), 1
        P.report_failure(plan, x, "forward")(0, RuntimeError("out of memory"), "attend")  # alone
        assert len(board) == 4 and len(announced) == 2
    finally:
        _comm.report_local_error, P._use_cpp, P.announce_invalid, P.peers_exchange = saved


def _bf16_grouped_kv_empty_chunk(rank, world, device="cpu"):
    """bf16 with grouped k/v heads (their gradients summed in fp32) and more head chunks than the last
    rank has query heads (8 over 3 ranks: 3, 3, 2; C = 3): forward and backward against the fp64
    reference within bf16's error, and against one chunk (``device``: "cuda" on NCCL, the core's
    all-to-all; tests/test_ulysses_gpu.py)."""
    S, Sl = 3 * world, 3
    q, k, v, w = _inputs(1, S, 8, 4, 8, torch.float64, seed=5)
    ro, rq, rk, rv = reference(q, k, v, w, True, None)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    got = {}
    for C in (1, 3):
        ql, kl, vl = (t[:, sl].to(device, torch.bfloat16).requires_grad_(True) for t in (q, k, v))
        out = U.ulysses_attention(ql, kl, vl, num_chunks=C, causal=True)
        (out.float() * w[:, sl].to(device, torch.float32)).sum().backward()
        got[C] = [t.double().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]
    for name, a, one, ref in zip(("out", "dq", "dk", "dv"), got[3], got[1], (ro, rq, rk, rv)):
        ref = ref[:, sl]
        assert (a - ref).abs().max().item() <= 0.05 * ref.abs().max().item(), name
        assert (a - one).abs().max().item() <= 0.02 * ref.abs().max().item(), name
    return True


def test_bf16_grouped_kv_with_a_chunk_empty_on_one_rank():
    assert run_distributed(_bf16_grouped_kv_empty_chunk, 3, timeout=120) == [True, True, True]


def _one_rank_fails_on_gloo(rank, world, where):
    """Rank 1's attention raises (its buffers, or at a head chunk, forward or backward; or the buffers
    of its backward's fp32 k/v gradient gather, inside the all-to-all) on gloo: it raises its own
    error, and every peer raises at once, told in that or the next all-to-all's check (no timeout),
    naming rank 1; the group is usable afterwards."""
    import torch.distributed as dist
    from allscan.ops import a2a as A

    q, k, v, w = _inputs(1, 4 * world, 6, 3, 8, torch.float64)
    sl = slice(rank * 4, (rank + 1) * 4)
    ql, kl, vl = (t[:, sl].clone().requires_grad_(True) for t in (q, k, v))
    real_sdpa, real_buffers = F.scaled_dot_product_attention, X._forward_buffers
    calls = []

    def sdpa(*args, **kwargs):
        calls.append(1)
        if rank == 1 and where == "forward" and len(calls) == 2:
            raise RuntimeError("injected out of memory")
        out = real_sdpa(*args, **kwargs)
        if rank == 1 and where == "backward" and len(calls) == 1:
            out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("injected out of memory")))
        return out

    def buffers(*args):
        if rank == 1:
            raise RuntimeError("injected out of memory")
        return real_buffers(*args)

    real_prepare, prepared = A._a2a_dist.prepare, []

    def prepare(*args):
        prepared.append(args[6])  # accumulate: the k/v gradients' gather sums in fp32
        if rank == 1 and where == "all-to-all" and any(args[6]):
            raise RuntimeError("injected out of memory")
        return real_prepare(*args)

    F.scaled_dot_product_attention = sdpa
    A._a2a_dist.prepare = prepare
    if where == "buffers":
        X._forward_buffers = buffers
    try:
        out = U.ulysses_attention(ql, kl, vl, num_chunks=2)
        (out * w[:, sl]).sum().backward()
        outcome = "done"
    except RuntimeError as e:
        assert rank == 1 and "injected out of memory" in str(e), (rank, e)
        outcome = "raised"
    except ValueError as e:
        assert rank != 1 and "rank(s) [1]" in str(e) and "failed before this call" in str(e), (rank, e)
        outcome = "told"
    finally:
        F.scaled_dot_product_attention, X._forward_buffers = real_sdpa, real_buffers
        A._a2a_dist.prepare = real_prepare
    assert where != "all-to-all" or any(any(acc) for acc in prepared)  # the summed gather was reached
    ro, rq, rk, rv = reference(q, k, v, w, False, None)
    out = U.ulysses_attention(ql.detach(), kl.detach(), vl.detach(), num_chunks=2)  # the group carries on
    assert torch.allclose(out, ro[:, sl], rtol=1e-10, atol=1e-10)
    dist.barrier()
    return outcome


@pytest.mark.parametrize("where", ["buffers", "forward", "backward", "all-to-all"])
def test_one_rank_failing_between_all_to_alls_on_gloo_tells_its_peers(where):
    assert run_distributed(_one_rank_fails_on_gloo, 3, where, timeout=90) == ["told", "raised", "told"]


# ------------------------------------------------------------------------------------------------
# Autograd uses beyond one backward: double backward refused, a retained graph backpropagated twice
# ------------------------------------------------------------------------------------------------

def _double_backward_refused(rank, world, who, device="cpu"):
    """A gradient penalty (``create_graph=True``, then a backward of the gradients) through Ulysses: its
    backward is not differentiable, so the ``create_graph`` backward raises, naming it, on every rank that
    asks for one (``who``: "all"), and a rank alone asking for one (``who``: "one", rank 1) tells its peers
    in their backward's first all-to-all instead of leaving them waiting; the group works afterwards
    (``device``: "cuda" on NCCL, the core's all-to-all, fp32; tests/test_ulysses_gpu.py)."""
    import torch.distributed as dist

    Sl, H = 3, 2 * world
    dtype, tol = (torch.float64, 1e-10) if device == "cpu" else (torch.float32, 1e-4)
    q, k, v, w = _inputs(1, Sl * world, H, H, 4, torch.float64, seed=11)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    ql, kl, vl = (t[:, sl].to(device, dtype, copy=True).requires_grad_(True) for t in (q, k, v))
    wl = w[:, sl].to(device, dtype)
    out = U.ulysses_attention(ql, kl, vl, num_chunks=2, causal=True)
    loss = (out * wl).sum()
    if who == "all" or rank == 1:
        with pytest.raises(RuntimeError, match="UlyssesAttention: double backward .*create_graph=True.* not supported"):
            torch.autograd.grad(loss, (ql, kl, vl), create_graph=True)
        outcome = "refused"
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):
            torch.autograd.grad(loss, (ql, kl, vl))
        outcome = "told"
    ro, rq, rk, rv = reference(q, k, v, w, True, None)
    ql, kl, vl = (t[:, sl].to(device, dtype, copy=True).requires_grad_(True) for t in (q, k, v))
    out = U.ulysses_attention(ql, kl, vl, num_chunks=2, causal=True)  # the group carries on
    (out * wl).sum().backward()
    torch.testing.assert_close(ql.grad.cpu().double(), rq[:, sl], rtol=tol, atol=tol)
    dist.barrier()
    return outcome


@pytest.mark.parametrize("who", ["all", "one"])
def test_double_backward_is_refused_on_every_rank(who):
    want = ["refused"] * 2 if who == "all" else ["told", "refused"]
    assert run_distributed(_double_backward_refused, 2, who, timeout=120) == want


def _retained_twice(rank, world, Hq, Hkv, device="cpu"):
    """``backward(retain_graph=True)`` then a second backward of the same graph: the same gradients both
    times, as with SDPA in one process, and the reference's; a third, after a backward that did not retain
    the graph, raises torch's error (``device``: "cuda" on NCCL, two streams, fp32, where the attention
    backward need not be bitwise repeatable; tests/test_ulysses_gpu.py)."""
    Sl = 3
    dtype, tol, again = (torch.float64, 1e-10, 0.0) if device == "cpu" else (torch.float32, 1e-4, 1e-6)
    q, k, v, w = _inputs(1, Sl * world, Hq, Hkv, 4, torch.float64, seed=13)
    ro, rq, rk, rv = reference(q, k, v, w, True, None)
    sl = slice(rank * Sl, (rank + 1) * Sl)
    ql, kl, vl = (t[:, sl].to(device, dtype, copy=True).requires_grad_(True) for t in (q, k, v))
    loss = (UlyssesAttention(num_chunks=2)(ql, kl, vl, causal=True) * w[:, sl].to(device, dtype)).sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (ql, kl, vl)]
    for t in (ql, kl, vl):
        t.grad = None
    loss.backward()
    for name, a, b, ref in zip(("dq", "dk", "dv"), first, (ql.grad, kl.grad, vl.grad), (rq, rk, rv)):
        torch.testing.assert_close(b, a, rtol=again, atol=again, msg=lambda m: f"{name}, second backward: {m}")
        torch.testing.assert_close(b.cpu().double(), ref[:, sl], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # not retained the second time: freed, as anywhere in torch
    return True


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2)])
def test_retained_graph_backpropagates_twice(Hq, Hkv):
    assert run_distributed(_retained_twice, 2, Hq, Hkv, timeout=120) == [True, True]
