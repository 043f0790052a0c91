"""The delta-rule modules with fla's parameters, GatedDeltaNet and KimiDeltaAttention, and their halo
exchange: each computes fla's layer's formula (one process, float64, against the formula written out
here), and sharded over 2 and 3 gloo ranks it equals the same module on one process over the whole
sequence (outputs, every gradient), with and without packed sequences."""
import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed, skip_unless_nccl_ranks

CFG = dict(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2, conv_size=4, conv_bias=True)
KINDS = ("GatedDeltaNet", "KimiDeltaAttention")

# fla 0.6.0's fla/layers/gated_deltanet.py and fla/layers/kda.py with CFG (key_dim 16, value_dim 4 * 16 =
# 64, head_v_dim 16; KDA's gate_dim 4 * 8 = 32): names and shapes written out by hand from their source
# (checked against fla's own layers where fla imports).
_CONVS = {"q_conv1d.weight": (16, 1, 4), "q_conv1d.bias": (16,), "k_conv1d.weight": (16, 1, 4),
          "k_conv1d.bias": (16,), "v_conv1d.weight": (64, 1, 4), "v_conv1d.bias": (64,)}
_QKV = {"q_proj.weight": (16, 16), "k_proj.weight": (16, 16), "v_proj.weight": (64, 16)}
FLA_STATE = {
    "GatedDeltaNet": {
        **_QKV, "a_proj.weight": (4, 16), "b_proj.weight": (4, 16), "A_log": (4,), "dt_bias": (4,), **_CONVS,
        "g_proj.weight": (64, 16), "o_norm.weight": (16,), "o_proj.weight": (16, 64)},
    "KimiDeltaAttention": {
        "A_log": (4,), "dt_bias": (32,), **_QKV, **_CONVS, "f_proj.0.weight": (16, 16), "f_proj.1.weight": (32, 16),
        "b_proj.weight": (4, 16), "g_proj.0.weight": (16, 16), "g_proj.1.weight": (64, 16), "g_proj.1.bias": (64,),
        "o_norm.weight": (16,), "o_proj.weight": (16, 64)},
}
# the projection a failing rank fails in after the halo exchange, before the delta rule
_GATE_PROJ = {"GatedDeltaNet": "a_proj", "KimiDeltaAttention": "f_proj"}


def _module(group, device="cpu", kind="GatedDeltaNet"):
    import allscan.layers
    torch.manual_seed(0)
    m = getattr(allscan.layers, kind)(**CFG, group=group).double().to(device)
    with torch.no_grad():  # norm weights away from 1, so their gradients are checked as well
        m.o_norm.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("kind", KINDS)
def test_fla_state_dict_loads(kind):
    import allscan.layers
    m = getattr(allscan.layers, kind)(**CFG)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == FLA_STATE[kind]
    sd = {k: torch.randn(s) for k, s in FLA_STATE[kind].items()}
    m.load_state_dict(sd, strict=True)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    try:
        import fla.layers
    except ImportError:  # fla needs Triton to import; the hand-written shapes above stand
        return
    torch.manual_seed(7)
    theirs = getattr(fla.layers, kind)(**CFG).state_dict()
    assert {k: tuple(v.shape) for k, v in theirs.items()} == FLA_STATE[kind]
    m.load_state_dict(theirs, strict=True)
    # built in fla's order with fla's initialisation: one seed draws fla's initial values
    torch.manual_seed(7)
    ours = getattr(allscan.layers, kind)(**CFG).state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _fla_formula(m, x, recurrence="allscan", gate_activation="swish"):
    """fla 0.6.0's layer (``m``'s class, options and parameters) on one process, its formula written out
    in float64: projections, silu of the causal depthwise convolutions, the l2-normalised q and k, the
    gates as fla's kernels apply them (``lower_bound``, ``allow_neg_eigval``), the token-by-token delta
    rule (allscan's float64 reference, or ``recurrence="fla"``: fla's own naive one, in fp32), the
    output norm (Gated DeltaNet's gated by ``gate_activation``, the option the module was built with),
    the output projection."""
    B, T, _ = x.shape
    H, HV, K, V = m.num_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    kda = type(m).__name__ == "KimiDeltaAttention"

    def conv(proj, c):
        if not m.use_short_conv:
            return F.silu(proj(x))
        y = F.conv1d(proj(x).transpose(1, 2), c.weight, c.bias, padding=m.conv_size - 1, groups=c.weight.shape[0])
        return F.silu(y[..., :T].transpose(1, 2))

    q = conv(m.q_proj, getattr(m, "q_conv1d", None)).reshape(B, T, H, K)
    k = conv(m.k_proj, getattr(m, "k_conv1d", None)).reshape(B, T, H, K)
    v = conv(m.v_proj, getattr(m, "v_conv1d", None)).reshape(B, T, HV, V)
    q, k = (t / (t.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
    beta = torch.sigmoid(m.b_proj(x)) * (2 if m.allow_neg_eigval else 1)
    if kda:
        f = m.f_proj[1](m.f_proj[0](x)).reshape(B, T, HV, K) + m.dt_bias.reshape(HV, K)
        if m.lower_bound is None:
            g = -m.A_log.exp()[:, None] * F.softplus(f)
        else:
            g = m.lower_bound * torch.sigmoid(m.A_log.exp()[:, None] * f)
        gate = torch.sigmoid(m.g_proj[1](m.g_proj[0](x)).reshape(B, T, HV, V))
    else:
        g = -m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias)
        act = torch.sigmoid if gate_activation == "sigmoid" else F.silu  # fla: swish = silu
        gate = act(m.g_proj(x).reshape(B, T, HV, V)) if m.use_gate else 1
    if recurrence == "allscan":
        from allscan.ops.delta.naive import recurrent_delta_rule_reference

        o, _ = recurrent_delta_rule_reference(q, k, v, g, beta)
    elif kda:
        from fla.ops.kda.naive import naive_recurrent_kda

        o, _ = naive_recurrent_kda(q, k, v, g, beta)
    else:  # fla's naive Gated DeltaNet takes no grouped value heads: q and k repeated here
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
        o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    o = o.to(x.dtype)
    o = o * (o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps).rsqrt() * m.o_norm.weight * gate
    return m.o_proj(o.reshape(B, T, HV * V))


FORMULA_CASES = [
    ("GatedDeltaNet", {}), ("GatedDeltaNet", {"allow_neg_eigval": True}), ("GatedDeltaNet", {"use_short_conv": False}),
    ("GatedDeltaNet", {"num_v_heads": None, "use_gate": False, "conv_size": 3}),
    ("GatedDeltaNet", {"output_gate_activation": "sigmoid"}),
    ("KimiDeltaAttention", {}), ("KimiDeltaAttention", {"lower_bound": -3.0}),
    ("KimiDeltaAttention", {"safe_gate": True, "lower_bound": -5.0}),
    ("KimiDeltaAttention", {"allow_neg_eigval": True}), ("KimiDeltaAttention", {"use_short_conv": False}),
    ("KimiDeltaAttention", {"num_v_heads": None, "conv_size": 2}),
]


@pytest.mark.parametrize("kind, options", FORMULA_CASES, ids=[f"{k}-{o}" for k, o in FORMULA_CASES])
def test_module_computes_fla_layers_formula(kind, options):
    import warnings

    import allscan.layers
    from allscan.ops import LOCAL
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_short_conv=False warns, as fla's layer does
        m = getattr(allscan.layers, kind)(**{**CFG, **options}, group=LOCAL).double()
    with torch.no_grad():  # the gates away from their initial values, so a misplaced term shows
        m.A_log.uniform_(-1.0, 1.0)
        m.dt_bias.uniform_(-1.0, 1.0)
        m.o_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 13, CFG["hidden_size"], dtype=torch.float64)
    y, _, _ = m(x)
    act = options.get("output_gate_activation", "swish")
    torch.testing.assert_close(y, _fla_formula(m, x, gate_activation=act), rtol=1e-10, atol=1e-12)
    try:
        import fla.ops  # noqa: F401 - fla needs Triton to import; then its naive recurrences run on CPU
    except ImportError:
        return
    torch.testing.assert_close(y, _fla_formula(m, x, "fla", act), rtol=1e-4, atol=1e-6)


def test_short_conv_is_fla_conv_cut_at_sequence_starts():
    from allscan.ops import LOCAL
    m = _module(LOCAL)
    x = torch.randn(1, 11, 64 + 32, dtype=torch.float64)
    cu = torch.tensor([0, 2, 7, 11])
    convs = (m.q_conv1d, m.k_conv1d, m.v_conv1d)
    w = torch.cat([c.weight for c in convs])
    b = torch.cat([c.bias for c in convs])
    want = torch.cat([F.silu(F.conv1d(x[:, s:e].transpose(1, 2), w, b, padding=3, groups=96)[..., :e - s])
                      for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=2).transpose(1, 2)
    halo = torch.zeros(1, 3, 96, dtype=torch.float64)  # one process: no tokens before its first
    torch.testing.assert_close(m._short_conv(x, halo, 0, cu), want)
    whole = F.silu(F.conv1d(x.transpose(1, 2), w, b, padding=3, groups=96)[..., :11]).transpose(1, 2)
    torch.testing.assert_close(m._short_conv(x, halo, 0, None), whole)


def _check_ranks(rank, world, device="cpu", kind="GatedDeltaNet"):
    """gloo on CPU; with device="cuda", NCCL: the halo's and the matrix scan's C++ core."""
    import torch.distributed as dist

    from allscan.ops import LOCAL
    from allscan.ops.halo import halo_exchange

    T = 4 if world == 3 else 6
    N = world * T
    sl = slice(rank * T, (rank + 1) * T)

    # the halo alone: rank p receives rank p-1's last 3 tokens; gradients flow back to the sender
    torch.manual_seed(1)
    xg = torch.randn(2, N, 5, dtype=torch.float64).to(device)
    gg = torch.randn(2, 3, 5, dtype=torch.float64).to(device)
    xl = xg[:, sl].clone().requires_grad_()
    h = halo_exchange(xl, 3)
    want = xg[:, rank * T - 3:rank * T] if rank else torch.zeros(2, 3, 5, dtype=torch.float64, device=device)
    torch.testing.assert_close(h, want)
    (h * gg[:, :, :] * (rank + 1)).sum().backward()
    want_grad = torch.zeros(2, T, 5, dtype=torch.float64, device=device)
    if rank < world - 1:
        want_grad[:, T - 3:] = gg * (rank + 2)
    torch.testing.assert_close(xl.grad, want_grad)

    ref = _module(LOCAL, device, kind)
    mods = {"default": _module(None, device, kind), "world": _module(dist.group.WORLD, device, kind)}
    cases = [None, torch.tensor([0, T, T + 2, N])]  # a cut on a rank boundary, one inside rank 1's shard
    for cu in cases:
        torch.manual_seed(2)
        x = torch.randn(1, N, CFG["hidden_size"], dtype=torch.float64).to(device)
        dy = torch.randn(1, N, CFG["hidden_size"], dtype=torch.float64).to(device)
        xr = x.clone().requires_grad_()
        ref.zero_grad()
        yr, _, _ = ref(xr, cu_seqlens=cu)
        (yr * dy).sum().backward()
        for name, m in mods.items():
            m.zero_grad()
            xs = x[:, sl].clone().requires_grad_()
            y, _, _ = m(xs, cu_seqlens=cu)
            (y * dy[:, sl]).sum().backward()
            torch.testing.assert_close(y, yr[:, sl], msg=lambda s: f"{name} cu={cu} output: {s}")
            torch.testing.assert_close(xs.grad, xr.grad[:, sl], msg=lambda s: f"{name} cu={cu} dx: {s}")
            for (pn, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
                g = p.grad.clone()
                dist.all_reduce(g)  # each rank holds its shard's part of a parameter's gradient
                torch.testing.assert_close(g, pr.grad, msg=lambda s: f"{name} cu={cu} d{pn}: {s}")
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_equals_one_process(world, kind):
    assert run_distributed(_check_ranks, world, "cpu", kind, timeout=120) == [True] * world


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_sharded_equals_one_process_on_two_gpus(kind):
    """The same check on CUDA tensors over NCCL (the halo's and the matrix scan's C++ core, fp64
    states); the local work is the torch path (fla-core has no fp64 kernels)."""
    skip_unless_nccl_ranks(2)
    assert run_distributed(_check_ranks, 2, "cuda", kind, timeout=300, backend="nccl") == [True, True]


def _halo_on_nccl(rank, world):
    """On NCCL the halo goes through the core's watched neighbour exchange on allscan's communicator
    (torch's point-to-point is never called): exact values and gradients, bf16 bit patterns kept, and
    both directions replay in a CUDA graph equal to eager."""
    import torch.distributed as dist

    from allscan import _comm
    from allscan.ops.halo import halo_exchange, halo_shift
    from graph_replay import assert_replay_equals_eager

    def torch_p2p(*args, **kwargs):
        raise AssertionError("the halo on NCCL called torch's point-to-point")

    dist.batch_isend_irecv = torch_p2p
    dev = torch.device("cuda", torch.cuda.current_device())
    T, w = 5, 3
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, T, 7, device=dev) * (rank + 1)).to(dtype).requires_grad_()
        h = halo_exchange(x, w)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x.detach())
        want = everyone[rank - 1][:, T - w:] if rank else torch.zeros_like(h)
        assert torch.equal(h, want), (rank, dtype)
        g = torch.randn(2, w, 7, device=dev).to(dtype) + rank
        h.backward(g)
        grads = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(grads, g)
        want_grad = torch.zeros_like(x)
        if rank < world - 1:
            want_grad[:, T - w:] = grads[rank + 1]
        assert torch.equal(x.grad, want_grad), (rank, dtype)
    assert _comm.find_communicator(dist.group.WORLD, dev) is not None  # allscan's own communicator carried it

    xs = torch.randn(2, T, 7, device=dev)
    gs = torch.randn(2, w, 7, device=dev)
    name = dist.group.WORLD.group_name

    def step():
        return (halo_shift(xs[:, T - w:].contiguous(), name, True, T), halo_shift(gs, name, False, -1))

    def refill():
        xs.normal_()
        gs.normal_()

    assert_replay_equals_eager(step, refill, ["halo", "halo gradient"], rank, dev)
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_halo_on_nccl_is_the_cores_watched_exchange_and_captures(world):
    skip_unless_nccl_ranks(world)
    assert run_distributed(_halo_on_nccl, world, backend="nccl", timeout=300) == [True] * world


def _module_fails(rank, world, where, kind):
    """Rank 1 of 3 fails in the module's own work before its halo exchange (its inputs, its q
    projection) or between the halo and the delta rule (its gate projection, after the convolutions): it
    raises its error, its peers raise naming it (in the collective they wait in), and then the group
    gives every rank the gradients of a call before the failure."""
    import datetime

    import torch.distributed as dist
    from failing_rank import outcome_when_a_layer_fails_on_rank_1

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))  # a hang fails, not waits
    m = _module(group, kind=kind)
    torch.manual_seed(5)
    x = torch.randn(1, 4 * world, CFG["hidden_size"], dtype=torch.float64)[:, rank * 4:(rank + 1) * 4]

    def grads():
        m.zero_grad()
        xs = x.clone().requires_grad_()
        y, _, _ = m(xs)
        y.sum().backward()
        return [xs.grad] + [p.grad.clone() for p in m.parameters()]

    before = grads()
    outcome = outcome_when_a_layer_fails_on_rank_1(m, x.clone().requires_grad_(),
                                                   _GATE_PROJ[kind] if where == "gate_proj" else where)
    assert all(torch.equal(a, b) for a, b in zip(grads(), before)), (rank, where)
    return outcome


@pytest.mark.parametrize("where", ["attention_mask", "q_proj", "gate_proj"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_failing_in_the_modules_own_work_leaves_no_peer_waiting(where, kind):
    assert run_distributed(_module_fails, 3, where, kind, timeout=120) == ["told", "raised", "told"]


def _halo_misuse(rank, world):
    """One rank's shard shorter than the halo, or a halo of another shape or dtype, raises on every
    rank (the halo's cross-rank check, inside its op: eager and under torch.compile; gloo, where the
    peers exchange on every call), never a hang; then the group still works."""
    from allscan.ops.halo import halo_exchange

    torch._dynamo.reset()
    peer = r"rank\(s\) \[1\] rejected their own arguments"
    for name, fn in (("eager", halo_exchange),
                     ("compiled", torch.compile(halo_exchange, fullgraph=True, backend="aot_eager", dynamic=False))):
        x = torch.randn(2, 2 if rank == 1 else 6, 5)
        with pytest.raises(ValueError, match="T_local=2 is shorter than the halo w=3" if rank == 1 else peer):
            fn(x, 3)
        x = torch.randn(2, 6, 5 + rank)
        with pytest.raises(ValueError, match=r"values per token \(x.shape\[2:\]\) \(rank 0: 5, rank 1: 6\)"):
            fn(x, 3)
        x = torch.randn(2, 6, 5, dtype=torch.float16 if rank else torch.bfloat16)  # same bytes, other values
        with pytest.raises(ValueError, match=r"x's dtype \(code\)"):
            fn(x, 3)
        x = torch.arange(12.0).reshape(1, 6, 2) + 100 * rank
        h = fn(x, 3)
        assert torch.equal(h, x[:, 3:] - 100 if rank else torch.zeros(1, 3, 2)), name
    return True


def test_halo_misuse_raises_on_every_rank():
    assert run_distributed(_halo_misuse, 2, timeout=120) == [True, True]


def test_halo_one_process_is_zeros():
    from allscan.ops.halo import halo_exchange
    x = torch.randn(2, 5, 3, requires_grad=True)
    h = halo_exchange(x, 3)
    assert torch.equal(h, torch.zeros(2, 3, 3))
    h.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    with pytest.raises(ValueError, match="w must be"):
        halo_exchange(x, -1)


@pytest.mark.parametrize("layer", KINDS + ("GatedLinearAttention",))
def test_unsupported_inputs_are_clear_errors(layer):
    import allscan.layers as L
    from allscan.ops import LOCAL
    m = (getattr(L, layer)(**CFG, group=LOCAL) if layer in KINDS
         else L.GatedLinearAttention(hidden_size=16, num_heads=2, group=LOCAL))
    x = torch.randn(1, 8, 16)
    with pytest.raises(NotImplementedError, match=f"{layer}: attention_mask is not supported"):
        m(x, attention_mask=torch.ones(1, 8))
    with pytest.raises(NotImplementedError, match=f"{layer}: caching"):
        m(x, use_cache=True)
    with pytest.raises(ValueError, match=rf"{layer}: hidden_states must be \[B, T_local, 16\], got \(1, 8, 15\)"):
        m(torch.randn(1, 8, 15))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_options_are_clear_errors(kind):
    import allscan.layers as L
    cls = getattr(L, kind)
    with pytest.raises(ValueError, match=f"{kind}: num_v_heads=3 must be a multiple of num_heads=2"):
        cls(**{**CFG, "num_v_heads": 3})
    with pytest.raises(ValueError, match=f"{kind}: method must be one of"):
        cls(**CFG, method="ring")
    with pytest.raises(ValueError, match=f"{kind}: conv_size must be a positive int, got 0"):
        cls(**{**CFG, "conv_size": 0})
    if kind == "KimiDeltaAttention":
        with pytest.raises(ValueError, match=r"KimiDeltaAttention: safe_gate=True needs lower_bound in \[-5, 0\), "
                                             "got None"):
            cls(**CFG, safe_gate=True)
        m = cls(**CFG, safe_gate=True, lower_bound=-5.0)
        assert torch.equal(m.A_log, torch.zeros(4)) and m.lower_bound == -5.0
