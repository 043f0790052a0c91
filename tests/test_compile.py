"""torch.compile traces allscan without a graph break (CPU, gloo; ``fullgraph=True`` makes any graph
break an error), and the compiled call equals eager. ``zeco_gla`` and the delta-rule layers are traced
as custom ops (forward, backward; the delta rule's backward in two), so the compiled layer runs what
the eager one runs on every rank; the GPU paths (fla's kernels, allscan's Triton kernels, NCCL) run the same ops
(tests/test_gla_gpu.py, tests/test_delta_gpu.py).
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402


def _inputs(rank, op):
    gen = torch.Generator().manual_seed(rank)
    B, T, H, K = 1, 24, 2, 8
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    if op.startswith("gla"):
        return q, k, v, -torch.rand(B, T, H, K, generator=gen) * 0.2
    gshape = (B, T, H, K) if op.startswith("kda") else (B, T, H)
    ins = (q, torch.nn.functional.normalize(k, dim=-1), v, -torch.rand(*gshape, generator=gen) * 0.2,
           torch.rand(B, T, H, generator=gen))
    if op.endswith("varlen"):  # one initial state per packed sequence, the same on every rank
        ins += (torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(5)) * 0.3,)
    return ins


def _packed(world):
    """Four packed sequences cut inside shards and, with two ranks or more, exactly on a rank boundary."""
    return torch.tensor([0, 5, 10, 17, 24] if world == 1 else [0, 10, 24, 30, 24 * world])


def _step(op):
    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla, zeco_kda

    def scan(x, g):
        return allscan.scan(x, g, inclusive=True) * 2

    def layer(q, *rest):
        world = dist.get_world_size()
        if op == "gla-varlen":  # packed sequences cut inside both shards of two ranks
            cu = torch.tensor([0, 10, 30, 24 * world])
            return zeco_gla(q, *rest, output_final_state=True, cu_seqlens=cu)
        if op.endswith("varlen"):  # with initial states, l2norm and the beta sigmoid in the kernel
            fn = zeco_kda if op.startswith("kda") else zeco_gated_delta_rule
            *ins, h0 = rest
            return fn(q, *ins, initial_state=h0, output_final_state=True, cu_seqlens=_packed(world),
                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        fn = {"gla": zeco_gla, "gdn": zeco_gated_delta_rule, "kda": zeco_kda}[op]
        o, final = fn(q, *rest, output_final_state=True)
        return o, final

    return scan if op == "scan" else layer


def _compiled_equals_eager(rank, world, op):
    torch._dynamo.reset()
    fn = _step(op)
    if op == "scan":
        args = (torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)), torch.full((4, 8), 0.5))
    else:
        args = _inputs(rank, op)
    results = {}
    torch._dynamo.utils.counters.clear()
    for name, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True, backend="aot_eager"))):
        xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.square().sum() for o in outs).backward()
        results[name] = [o.detach() for o in outs] + [x.grad for x in xs if x.grad is not None]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert len(results["eager"]) == len(results["compiled"]), "a gradient is missing"
    return max((a - b).abs().max().item() for a, b in zip(results["eager"], results["compiled"]))


CASES = [("scan", 1), ("scan", 2), ("gla", 1), ("gla", 2), ("gla", 3), ("gla-varlen", 2), ("gdn", 1), ("gdn", 2),
         ("kda", 2), ("kda", 3), ("gdn-varlen", 1), ("gdn-varlen", 3), ("kda-varlen", 2)]


@pytest.mark.parametrize("op, world", CASES, ids=[f"{op}-P{w}" for op, w in CASES])
def test_fullgraph_compile_equals_eager(op, world):
    """Forward and backward of the scan, of zeco_gla and of the delta-rule layers (their custom ops) at
    P = 1..3, packed sequences with initial states and in-kernel activations included."""
    for diff in run_distributed(_compiled_equals_eager, world, op, timeout=300):
        assert diff <= 1e-5, diff


def _module_compiled(rank, world, kind):
    """The layer modules with packed sequences, forward and backward under torch.compile(fullgraph=True):
    the output and every gradient equal eager. GatedDeltaNet (fla's parameters: projections, short
    convolutions with their halo exchange, the delta rule with in-kernel gate, l2norm and beta sigmoid,
    gated RMSNorm), with opcheck of the halo's custom op; KimiDeltaAttention (the same with KDA's gate
    per key dimension, its lower bound); GatedLinearAttention (fla's parameters, zeco_gla's ops); Attention
    (fla's softmax attention layer: rotary at global positions, Ulysses' traced ops; one sequence per row:
    a packed call is left to eager, a graph break that fullgraph refuses)."""
    from allscan.layers import Attention, GatedDeltaNet, GatedLinearAttention, KimiDeltaAttention

    torch._dynamo.reset()
    torch.manual_seed(0)
    if kind == "gdn":
        m = GatedDeltaNet(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2, conv_size=4,
                          conv_bias=True)
    elif kind == "kda":
        m = KimiDeltaAttention(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2, conv_size=4,
                               lower_bound=-5.0)
    elif kind == "attention":
        m = Attention(hidden_size=16, num_heads=4, num_kv_heads=2, qkv_bias=True, qk_norm=True)
    else:
        m = GatedLinearAttention(hidden_size=16, num_heads=2, expand_k=1.0, expand_v=1.0, gate_low_rank_dim=4)
    x = torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(rank))
    cu = _packed(world)
    if kind == "attention":
        if world > 1:
            # packed sequences are left to eager: a graph break, which fullgraph refuses (torch.compile
            # reports the error raised while tracing as its own exception type)
            with pytest.raises(Exception, match=r"packed sequences \(cu_seqlens\) under torch.compile"):
                torch.compile(m, fullgraph=True, backend="aot_eager")(x, cu_seqlens=cu)
            with torch.no_grad():
                eager = m(x, cu_seqlens=cu)[0]
                broken = torch.compile(m, backend="aot_eager")(x, cu_seqlens=cu)[0]
            assert torch.equal(eager, broken)
            torch._dynamo.reset()  # what the graph break compiled must not serve the fullgraph compile below
        cu = None
    got = {}
    for name, f in (("eager", m), ("compiled", torch.compile(m, fullgraph=True, backend="aot_eager"))):
        m.zero_grad()
        xs = x.clone().requires_grad_(True)
        y = f(xs, cu_seqlens=cu)[0]
        y.square().sum().backward()
        got[name] = [y.detach(), xs.grad] + [p.grad.clone() for p in m.parameters()]
    if world > 1 and kind == "gdn":
        import torch.distributed as dist

        torch.library.opcheck(torch.ops.allscan.halo_shift.default,
                              (x[:, -3:].clone().requires_grad_(True), dist.group.WORLD.group_name, True,
                               x.shape[1]))
    return max((a - b).abs().max().item() for a, b in zip(got["eager"], got["compiled"]))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("kind", ["gdn", "kda", "gla", "attention"])
def test_layer_module_fullgraph_compile_equals_eager(kind, world):
    for diff in run_distributed(_module_compiled, world, kind, timeout=300):
        assert diff <= 1e-5, diff


def _compiled_invalid_arguments(rank, world):
    """Under torch.compile zeco_gla checks its arguments and cuts its shard inside the op, when it runs
    (the trace runs no collective, so a check failed there could not tell the peers): a rank whose
    cu_seqlens, or whose v, is wrong raises there and its peer's first exchange fails too (no hang)."""
    from allscan.layers import zeco_gla

    torch._dynamo.reset()
    q, k, v, g = _inputs(rank, "gla")
    step = torch.compile(lambda v, cu: zeco_gla(q, k, v, g, cu_seqlens=cu)[0], fullgraph=True, backend="aot_eager")
    good = torch.tensor([0, 10, 30, 24 * world])
    assert step(v, good).shape == v.shape
    peer = r"rank\(s\) \[1\] rejected their own arguments"
    with pytest.raises(ValueError, match="strictly increasing" if rank == 1 else peer):
        step(v, torch.tensor([0, 30, 10, 24 * world]) if rank == 1 else good)
    with pytest.raises(ValueError, match="v must be" if rank == 1 else peer):
        step(v[:, :23] if rank == 1 else v, good)
    # a wrong number of dimensions: the fake kernel must not fail this rank's trace alone
    flat = torch.compile(lambda qq: zeco_gla(qq, k, v, g)[0], fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="q must be a 4-D tensor" if rank == 1 else peer):
        flat(q.flatten(2) if rank == 1 else q)
    # a rank that traced without autograd would run no backward: the op's cross-rank check says so
    with pytest.raises(ValueError, match=r"inputs need gradients \(rank 0: 1, rank 1: 0\)"):
        step(v.clone().requires_grad_(rank == 0), good)
    assert step(v, good).shape == v.shape  # and the group still works
    return True


def _compiled_collectives_invalid_arguments(rank, world):
    """Under torch.compile a call of allscan.scan (diagonal and matrix, sync and async) or of the
    public all-to-alls whose local checks fail on one rank is traced as a refusal: when the graph
    runs it tells the peers, whose own graphs raise in the op's signature exchange (no hang, no
    trace failing on one rank alone); then the group still works."""
    import allscan
    from allscan import a2a

    torch._dynamo.reset()
    peer = r"rank\(s\) \[1\] rejected their own arguments"
    x, g = torch.randn(2, 4, 3), torch.rand(2, 4)
    m = torch.randn(2, 4, 4) / 4
    bad = rank == 1
    cases = [
        ("gamma's shape", lambda x, g: allscan.scan(x, g[:, :3] if bad else g),
         r"gamma's shape \[2, 3\] must be a prefix"),
        ("async", lambda x, g: allscan.scan(x, g, method="ring" if bad else "pipelined", async_op=True).wait(),
         "method must be one of"),
        ("transition", lambda x, g: allscan.scan(x, transition=m[..., :3] if bad else m), "K mismatch"),
        ("both", lambda x, g: allscan.scan(x, g if bad else None, transition=m), "mutually exclusive"),
        ("scatter_heads", lambda x, g: a2a.scatter_heads(x.reshape(1, 2, 4, 3)[:, :, :3] if bad else
                                                          x.reshape(1, 2, 4, 3), head_map=[(0, 2), (2, 4)]),
         "head_map"),
    ]
    for what, fn, mine in cases:
        step = torch.compile(fn, fullgraph=True, backend="aot_eager")
        with pytest.raises((ValueError, TypeError), match=mine if bad else peer):
            step(x, g)
        torch._dynamo.reset()
    ok = torch.compile(lambda x, g: allscan.scan(x, g), fullgraph=True, backend="aot_eager")
    assert ok(x, g).shape == x.shape  # and the group still works
    return True


def test_compiled_collectives_invalid_arguments_reach_every_rank():
    assert run_distributed(_compiled_collectives_invalid_arguments, 2, timeout=300) == [True, True]


def test_compiled_zeco_gla_invalid_arguments_reach_every_rank():
    assert run_distributed(_compiled_invalid_arguments, 2, timeout=300) == [True, True]


def _opcheck_zeco_gla(rank, world):
    """torch.library.opcheck of zeco_gla's custom ops (schema, fake kernel against the real outputs,
    autograd registration, AOT dispatch with static and dynamic shapes), on every rank alike."""
    import allscan.ops.gla  # noqa: F401 - registers the ops

    name = dist.group.WORLD.group_name
    q, k, v, g = (t.double().requires_grad_() for t in _inputs(rank, "gla"))
    h0 = torch.randn(1, 2, 8, 8, dtype=torch.float32, generator=torch.Generator().manual_seed(7))
    plain = dict(group_name=name, group_size=world, scale=0.35, method="zeco", want_final=True, needs_grad=True)
    for args, kwargs in (((q, k, v, g, None, None), plain),
                         ((q, k, v, g[..., 0].detach().clone().requires_grad_(), None, None),
                          dict(plain, method="lasp2", want_final=False)),
                         ((q.float(), k.float(), v.float(), None, h0.requires_grad_(), None), plain),
                         ((q, k, v, g, None, torch.tensor([0, 10, 30, 24 * world])), plain),
                         # strided inputs: the ops' results are contiguous, as their fake kernels say
                         ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                           g.transpose(1, 2).contiguous().transpose(1, 2), None, None), plain)):
        torch.library.opcheck(torch.ops.allscan.zeco_gla.default, args, kwargs)
    return True


def test_zeco_gla_opcheck_two_ranks():
    assert run_distributed(_opcheck_zeco_gla, 2, timeout=300) == [True, True]


def _opcheck_delta_rule(rank, world):
    """torch.library.opcheck of the delta-rule layers' custom op (schema, fake kernel against the real
    outputs, autograd registration, AOT dispatch): Gated DeltaNet and KDA, packed sequences with
    initial states, the in-kernel activations and gate, strided inputs."""
    import allscan.ops.delta.compiled  # noqa: F401 - registers the ops

    name = dist.group.WORLD.group_name
    q, k, v, g, beta, h0 = (t.double().requires_grad_() for t in _inputs(rank, "gdn-varlen"))
    _, _, _, gk, _ = (t.double().requires_grad_() for t in _inputs(rank, "kda"))
    A_log = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    dt_bias = torch.full((2,), 0.1, dtype=torch.float64, requires_grad=True)
    plain = dict(group_name=name, group_size=world, per_key=False, scale=0.35, l2norm=False, gate=False,
                 beta_sigmoid=False, neg_eigval=False, safe_gate=False, lower_bound=None, method="zeco",
                 want_final=True, needs_grad=True)
    cu = _packed(world)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    for args, kwargs in (((q, k, v, g, beta, None, None, None, None), plain),
                         ((q, k, v, gk, beta, None, None, h0, cu), dict(plain, per_key=True)),
                         ((q, k, v, g, beta, A_log, dt_bias, h0, cu),
                          dict(plain, l2norm=True, gate=True, beta_sigmoid=True, neg_eigval=True, method="allgather")),
                         ((strided, k, v, g, beta, None, None, None, None), dict(plain, want_final=False))):
        torch.library.opcheck(torch.ops.allscan.zeco_delta_rule.default, args, kwargs)
    # the backward's first op (Q'^T do), whole shard and packed (the first segment's rows)
    q_eff, do = torch.randn_like(q), torch.randn_like(v)  # no gradient: it runs inside the backward
    for cut in (None, cu):
        torch.library.opcheck(torch.ops.allscan.zeco_delta_rule_state_grad.default,
                              (q_eff, do, q.detach(), cut, name, world, False))
    return True


def test_delta_rule_opcheck_two_ranks():
    assert run_distributed(_opcheck_delta_rule, 2, timeout=300) == [True, True]


def _compiled_delta_invalid_arguments(rank, world):
    """Under torch.compile the delta-rule layers check their arguments inside the op, when it runs: a
    rank whose cu_seqlens, or whose beta, is wrong raises there and its peer's exchange fails too."""
    from allscan.layers import zeco_gated_delta_rule

    torch._dynamo.reset()
    q, k, v, g, beta = _inputs(rank, "gdn")
    step = torch.compile(lambda b, cu: zeco_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu)[0], fullgraph=True,
                         backend="aot_eager")
    good = _packed(world)
    assert step(beta, good).shape == v.shape
    peer = r"rank\(s\) \[1\] rejected their own arguments"
    with pytest.raises(ValueError, match="strictly increasing" if rank == 1 else peer):
        step(beta, torch.tensor([0, 30, 10, 24, 24 * world]) if rank == 1 else good)
    with pytest.raises(ValueError, match="beta must be" if rank == 1 else peer):
        step(beta[:, :23] if rank == 1 else beta, good)
    # a wrong number of dimensions: the fake kernel must not fail this rank's trace alone
    flat = torch.compile(lambda vv: zeco_gated_delta_rule(q, k, vv, g, beta)[0], fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="v must be a 4-D tensor" if rank == 1 else peer):
        flat(v.flatten(2) if rank == 1 else v)
    assert step(beta, good).shape == v.shape  # and the group still works
    return True


def test_compiled_delta_rule_invalid_arguments_reach_every_rank():
    assert run_distributed(_compiled_delta_invalid_arguments, 2, timeout=300) == [True, True]


def _compiled_q_eff_release(rank, world):
    """Under inductor the delta rule's backward reads Q' in its first op, and Q' is gone (freed by
    the compiled backward) before the second op's local backward runs: the memory the eager backward
    saves by freeing it (tests/test_delta.py), under torch.compile."""
    import weakref

    from allscan.layers import zeco_gated_delta_rule
    from allscan.ops.delta.chunk import TorchDelta

    torch._dynamo.reset()
    seen = {}
    fold_state_grad, backward = TorchDelta.fold_state_grad, TorchDelta.backward

    def watched_fold(q_eff, do):
        assert q_eff._base is not None, "the op reads Q' through a slice of its input"
        seen["q_eff"] = weakref.ref(q_eff._base)  # the op's input: what the compiled backward holds
        return fold_state_grad(q_eff, do)

    def watched_backward(*args):
        seen["alive at backward"] = seen["q_eff"]() is not None
        return backward(*args)

    q, k, v, g, beta = (t.clone().requires_grad_() for t in _inputs(rank, "gdn"))
    step = torch.compile(lambda *xs: zeco_gated_delta_rule(*xs)[0], fullgraph=True)
    TorchDelta.fold_state_grad, TorchDelta.backward = staticmethod(watched_fold), staticmethod(watched_backward)
    try:
        step(q, k, v, g, beta).square().sum().backward()
    finally:
        TorchDelta.fold_state_grad, TorchDelta.backward = staticmethod(fold_state_grad), staticmethod(backward)
    assert "q_eff" in seen and not seen["alive at backward"], seen
    return True


def test_compiled_backward_frees_q_eff():
    assert run_distributed(_compiled_q_eff_release, 2, timeout=300) == [True, True]


def _inductor_strided(rank, world):
    """The default backend (inductor), which checks every op result against its fake kernel's
    strides, on strided inputs: zeco_gla's gradients come back contiguous, as its fake says."""
    import torch._inductor.config as inductor_config

    from allscan.layers import zeco_gla

    torch._dynamo.reset()
    inductor_config.force_disable_caches = True  # a cached graph would not see a changed fake kernel
    q, k, v, g = _inputs(rank, "gla")
    q, g = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, g))  # [B, T, H, K] views, strided
    do = torch.randn(q.shape[:3] + v.shape[-1:], generator=torch.Generator().manual_seed(9 + rank))
    got = {}
    for name, fn in (("eager", zeco_gla), ("inductor", torch.compile(zeco_gla, fullgraph=True))):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g)]
        o, _ = fn(*xs)
        got[name] = [o.detach()] + list(torch.autograd.grad(o, xs, do))
    return max((a - b).abs().max().item() for a, b in zip(got["eager"], got["inductor"]))


def test_inductor_with_strided_inputs():
    for diff in run_distributed(_inductor_strided, 2, timeout=300):
        assert diff <= 1e-5, diff


def _compiled_contexts(rank, world):
    """The ops under torch.compile take a new batch's SequenceContext without a new graph: its offsets were
    made when it was built (outside the trace), so the compiled graph takes them as an input, as it takes
    cu_seqlens, instead of baking each batch's cut in as a constant. One recompile (the number of sequences
    changes) at most; every call equals eager. And, as eager, the custom ops do not compare a context's cut
    again (it was agreed when the context was built): under NCCL's rule a new batch's context costs no
    exchange, where its offsets given as cu_seqlens cost one per call."""
    from torch._dynamo.utils import counters

    import allscan._agreement as agreement
    from allscan import SequenceContext
    from allscan.layers import zeco_gated_delta_rule, zeco_gla

    torch._dynamo.reset()
    counters.clear()
    q, k, v, g, beta = _inputs(rank, "gdn")
    ops = {"zeco_gla": lambda ctx: zeco_gla(q, k, v, g[..., None].expand(*q.shape).contiguous(), context=ctx)[0],
           "zeco_gated_delta_rule": lambda ctx: zeco_gated_delta_rule(q, k, v, g, beta, context=ctx)[0]}
    T = q.shape[1] * world
    for name, op in ops.items():
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
        for cu in ([0, 5, T], [0, 9, T], [0, 3, 20, T], [0, 7, 13, T], [0, 2, 11, T]):
            ctx = SequenceContext(dist.group.WORLD, cu_seqlens=cu)
            torch.testing.assert_close(compiled(ctx), op(ctx), rtol=0, atol=0)
        assert counters["stats"]["unique_graphs"] <= 2, (name, dict(counters["stats"]))
        exchanges = []
        real_on_nccl, real_gather = agreement._on_nccl, agreement._gather_rows
        agreement._on_nccl = lambda group, device: True
        agreement._gather_rows = lambda *a: exchanges.append(1) or real_gather(*a)
        try:
            compiled(SequenceContext(dist.group.WORLD, cu_seqlens=[0, 4, 9, T]))  # these shapes: checked once
            before = len(exchanges)
            compiled(SequenceContext(dist.group.WORLD, cu_seqlens=[0, 6, 15, T]))
            assert len(exchanges) == before, f"{name}: a context's cut was compared again under torch.compile"
        finally:
            agreement._on_nccl, agreement._gather_rows = real_on_nccl, real_gather
    return True


def test_compiled_ops_take_each_batch_context_without_recompiling():
    assert run_distributed(_compiled_contexts, 2) == [True, True]


def _cached_graph_calls(rank, world):
    """Every allscan custom op whose fake or traced gradient depends on the group's size or this rank's
    place, compiled by inductor with its caches on: each call (forward and every gradient) equals eager.
    Run at one world size and then another, and twice at two ranks, on one cache directory: a graph cached
    at another size or by the other rank (the default group is named "0" whatever its size) must not be
    served here. Returns what differed and how many graphs came from the caches."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    import allscan
    from allscan.layers import zeco_gated_delta_rule, zeco_gla
    from allscan.ops.ulysses import ulysses_attention

    torch._dynamo.reset()
    counters.clear()
    inductor_config.force_disable_caches = False
    inductor_config.fx_graph_cache = True
    gen = torch.Generator().manual_seed(3)  # the same on every rank and in every run: the graphs' inputs match
    q, k, v, g = _inputs(0, "gla")
    _, kn, _, gd, beta = _inputs(0, "gdn")
    x, init = torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)
    gamma = torch.rand(2, 3, generator=gen)
    xm, im = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    mm = torch.randn(2, 3, 3, generator=gen) / 2
    heads = torch.randn(1, 4, 3, 8, generator=gen)  # 3 heads over 2 ranks: 2 and 1, by rank
    calls = {
        "zeco_gla": (lambda a, b, c, d: zeco_gla(a, b, c, d, output_final_state=True), (q, k, v, g)),
        "zeco_gated_delta_rule": (lambda a, b, c, d, e: zeco_gated_delta_rule(a, b, c, d, e, output_final_state=True),
                                  (q, kn, v, gd, beta)),
        "scan with init": (lambda a, b, c: allscan.scan(a, b, init=c), (x, gamma, init)),
        "matrix scan with init": (lambda a, b, c: allscan.scan(a, transition=b, init=c), (xm, mm, im)),
        "ulysses_attention": (lambda a, b, c: ulysses_attention(a, b, c, causal=True), (heads, heads * 0.5, heads + 1)),
        "scatter_heads": (lambda a: allscan.a2a.scatter_heads(a), (heads,)),
    }
    wrong = []
    for name, (fn, args) in calls.items():
        got = {}
        for how, f in (("eager", fn), ("inductor", torch.compile(fn, fullgraph=True))):
            xs = [t.clone().requires_grad_() for t in args]
            outs = f(*xs)
            outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if o is not None]
            grads = torch.autograd.grad(outs, xs, [torch.ones_like(o) for o in outs], allow_unused=True)
            got[how] = outs + [torch.zeros(0) if d is None else d for d in grads]
        for i, (a, b) in enumerate(zip(got["eager"], got["inductor"])):
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                wrong.append(f"{name} result {i}: {tuple(b.shape)} against eager's {tuple(a.shape)}")
    return wrong, counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def test_compiled_graphs_cached_at_another_world_size_or_rank_are_not_reused(tmp_path, monkeypatch):
    """Inductor's graph caches (on by default, shared by every process of a machine, kept across runs) key
    a graph by its ops and their arguments: the ops take the group's size and this rank's place where
    their shapes or gradients depend on them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    hits = []
    for world in (1, 2, 2):
        results = run_distributed(_cached_graph_calls, world, timeout=600)
        assert [wrong for wrong, _ in results] == [[]] * world, f"world {world}: {results}"
        hits.append(sum(hit for _, hit in results))
    assert hits[2] > 0, f"the last run took no graph from the caches (hits per run {hits}): nothing was tested"
