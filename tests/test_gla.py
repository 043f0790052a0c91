"""Sequence-parallel GLA (ZeCO) on CPU: gloo ranks against a single-process float64 recurrent reference.

Checks the whole algorithm (local chunked GLA from a zero state, All-Scan of the final states with the
shard decays, the incoming-state correction, the reverse All-Scan of the state gradient and the local
backward) at P = 1..4, for GLA, simple GLA and plain linear attention, with packed sequences whose
boundaries fall inside ranks, on rank boundaries and across several ranks; the three methods (zeco,
lasp1, lasp2) give the same answer; the layer has fla's parameter names and shapes; ``group=None`` is
the default group (``LOCAL`` is one process); the settings, switches and the benchmark hook of
``allscan.ops.gla``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from failing_rank import outcome_when_rank_1_fails  # noqa: E402

import allscan.ops.gla as G  # noqa: E402
from allscan._settings import settings  # noqa: E402
from allscan.layers import GatedLinearAttention  # noqa: E402
from allscan.ops.gla import LOCAL, recurrent_gla_reference, torch_chunk_gla, zeco_gla  # noqa: E402
from allscan.ops.gla import fla as fla_glue  # noqa: E402

H, K, V = 2, 8, 4
TOL = 2e-4  # fp32 chunked math against float64 token-by-token, relative to the largest magnitude


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _data(seed, B, T, decay, h0_rows):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    if decay == "gla":
        g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)
    elif decay == "simple":
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    else:
        g = None
    h0 = torch.randn(h0_rows, H, K, V, generator=gen)
    do = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, g, h0, do


def _reference(q, k, v, g, h0, do, cu, T_local, world, dfinals):
    """float64 reference: output, loss gradients for the loss sum(o*do) + sum_p <final_p, dfinal_p>."""
    ins = [x.double().requires_grad_(True) if x is not None else None for x in (q, k, v, g, h0)]
    o, fin = recurrent_gla_reference(*ins[:4], initial_state=ins[4], cu_seqlens=cu)
    loss = (o * do.double()).sum()
    finals = []
    if cu is None:
        # the state after each rank's last token: the reference on the prefix
        for p in range(world):
            e = (p + 1) * T_local
            _, f = recurrent_gla_reference(ins[0][:, :e], ins[1][:, :e], ins[2][:, :e],
                                           None if ins[3] is None else ins[3][:, :e], initial_state=ins[4])
            finals.append(f)
            loss = loss + (f * dfinals[p].double()).sum()
    else:
        finals = [fin] * world
        loss = loss + sum((fin * d.double()).sum() for d in dfinals)
    wrt = [x for x in ins if x is not None]
    grads = torch.autograd.grad(loss, wrt)
    it = iter(grads)
    full = [next(it) if x is not None else None for x in ins]
    return o, finals, full


def _final_rows(cu, rank, T_local):
    off = rank * T_local
    return [i for i in range(len(cu) - 1) if off < cu[i + 1] <= off + T_local]


def _check_rank(rank, world, cases):
    """Runs every case on this rank; returns nothing, asserts."""
    group = dist.group.WORLD if world > 1 else None
    for case in cases:
        decay, cu_list, T_local, B, methods = case["decay"], case["cu"], case["T_local"], case["B"], case["methods"]
        cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long)
        T = T_local * world
        n_h0 = B if cu is None else len(cu_list) - 1
        q, k, v, g, h0, do = _data(1234 + T, B, T, decay, n_h0)
        gen = torch.Generator().manual_seed(99)
        dfinals = [torch.randn(n_h0, H, K, V, generator=gen) for _ in range(world)]
        if cu is not None:  # each row's gradient is given by the rank where that sequence ends
            masked = []
            for p in range(world):
                m = torch.zeros_like(dfinals[p])
                for i in _final_rows(cu_list, p, T_local):
                    m[i] = dfinals[p][i]
                masked.append(m)
            dfinals = masked
        ref_o, ref_finals, ref_grads = _reference(q, k, v, g, h0, do, cu_list, T_local, world, dfinals)
        sl = slice(rank * T_local, (rank + 1) * T_local)
        results = {}
        for method in methods:
            ins = [x[:, sl].clone().requires_grad_(True) if x is not None else None for x in (q, k, v, g)]
            h0_in = h0.clone().requires_grad_(True)
            o, fin = zeco_gla(*ins, group, initial_state=h0_in, output_final_state=True, cu_seqlens=cu,
                              method=method)
            tag = f"{method} decay={decay} cu={cu_list} B={B} P={world} rank={rank}"
            assert o.shape == (B, T_local, H, V) and o.dtype == torch.float32, tag
            assert _rel(o, ref_o[:, sl]) < TOL, f"output: {tag}: {_rel(o, ref_o[:, sl])}"
            if cu is None:
                assert fin.shape == (B, H, K, V), tag
                assert _rel(fin, ref_finals[rank]) < TOL, f"final state: {tag}"
            else:
                assert fin.shape == (len(cu_list) - 1, H, K, V), tag
                rows = _final_rows(cu_list, rank, T_local)
                for i in range(len(cu_list) - 1):
                    if i in rows:
                        assert _rel(fin[i], ref_finals[0][i]) < TOL, f"final state row {i}: {tag}"
                    else:
                        assert torch.count_nonzero(fin[i]) == 0, f"final row {i} not ending here is nonzero: {tag}"
            loss = (o * do[:, sl]).sum() + (fin * dfinals[rank]).sum()
            wrt = [x for x in ins if x is not None] + [h0_in]
            grads = torch.autograd.grad(loss, wrt)
            it = iter(grads)
            got = [next(it) if x is not None else None for x in ins] + [next(it)]
            names = ["dq", "dk", "dv", "dg", "dh0"]
            for name, gr, rf in zip(names[:4], got[:4], ref_grads[:4]):
                if rf is None:
                    continue
                assert gr.shape == rf[:, sl].shape, f"{name} shape: {tag}"
                err = _rel(gr, rf[:, sl])
                assert err < TOL, f"{name}: {tag}: {err}"
            dh0 = got[4].clone()
            if world > 1:  # each rank returns the gradient of the rows it used: sum over ranks
                dist.all_reduce(dh0)
            err = _rel(dh0, ref_grads[4])
            assert err < TOL, f"dh0: {tag}: {err}"
            results[method] = [o.detach(), fin.detach()] + [x for x in got if x is not None]
        base = results[methods[0]]
        for m in methods[1:]:
            for a, b in zip(base, results[m]):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"method {m} differs from {methods[0]}"


def _cases(world):
    T_local = 80  # more than one 64-token chunk per rank, and a partial one
    T = T_local * world
    cases = []
    for decay in ("gla", "simple", "none"):
        cases.append(dict(decay=decay, cu=None, T_local=T_local, B=2, methods=["zeco", "lasp1", "lasp2"]))
    # packed sequences: cuts inside ranks, exactly on rank boundaries, and sequences spanning ranks
    cus = [[0, 17, T_local, T_local + 3 if world > 1 else 70, T] if world > 1 else [0, 17, 70, T],
           [0, 5, T - 7, T],  # one sequence across every rank boundary (middle ranks have no start)
           [0, T]]
    if world >= 3:
        cus.append([0, 30, T_local + 50, 2 * T_local, 2 * T_local + 1, T])
    for decay in ("gla", "simple", "none"):
        for cu in cus:
            cases.append(dict(decay=decay, cu=sorted(set(cu)), T_local=T_local, B=1,
                              methods=["zeco", "lasp2"] if decay != "gla" else ["zeco", "lasp1", "lasp2"]))
    return cases


def _run_world(rank, world, state_backward_first=None):
    torch.manual_seed(0)
    if state_backward_first is not None:  # the order the fla backend takes, on the torch backend
        from allscan.ops.gla.chunk import TorchGLA
        TorchGLA.state_backward_first = state_backward_first
    _check_rank(rank, world, _cases(world))
    # the zeros a chain end passes to its scans are shared between calls: nothing may write them
    from allscan.ops.gla import body as zeco_module
    assert world == 1 or zeco_module._SHARED_ZEROS, "the chain's ends pass shared zeros"
    for key, zeros in zeco_module._SHARED_ZEROS.items():
        assert torch.count_nonzero(zeros) == 0, f"shared zeros {key} were written"


@pytest.mark.parametrize("world", [2, 3])
def test_zeco_gla_distributed_last_rank_state_backward_first(world):
    """The last rank's state backward before its reverse scan, its initial-state gradient sent back
    (what the fla backend does) against float64: packed sequences with the last rank's first segment
    ending inside its shard, B > 1, every decay form and method, final-state gradients given."""
    run_distributed(_run_world, world, True, timeout=600)


def test_chunked_matches_recurrent_single_process():
    torch.manual_seed(0)
    for decay in ("gla", "simple", "none"):
        for T in (1, 63, 64, 130):
            q, k, v, g, h0, do = _data(7, 2, T, decay, 2)
            gf = torch.zeros(2, T, H, K) if g is None else (g.unsqueeze(-1).expand(2, T, H, K) if g.dim() == 3 else g)
            o, ht = torch_chunk_gla(q, k, v, gf, K ** -0.5, h0)
            ro, rh = recurrent_gla_reference(q, k, v, g, initial_state=h0)
            assert _rel(o, ro) < TOL and _rel(ht, rh) < TOL, (decay, T)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zeco_gla_distributed(world):
    if world == 1:
        _run_world(0, 1)  # no group: no communication
    else:
        run_distributed(_run_world, world, timeout=600)


def _run_layer(rank, world):
    torch.manual_seed(0)
    hidden, heads, T_local = 64, 4, 40
    layer = GatedLinearAttention(hidden_size=hidden, num_heads=heads, group=dist.group.WORLD)
    ref = GatedLinearAttention(hidden_size=hidden, num_heads=heads, group=LOCAL)  # the whole sequence here
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, T_local * world, hidden, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(2, T_local * world, hidden, generator=torch.Generator().manual_seed(6))
    sl = slice(rank * T_local, (rank + 1) * T_local)
    y_ref = ref(x)[0]
    (y_ref * dy).sum().backward()
    y = layer(x[:, sl])[0]
    assert _rel(y, y_ref[:, sl]) < TOL
    (y * dy[:, sl]).sum().backward()
    for (name, p), (_, pr) in zip(layer.named_parameters(), ref.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # parameters are replicated: their gradient is the sum over shards
        assert _rel(grad, pr.grad) < TOL, name


def test_layer_sequence_parallel_matches_single():
    run_distributed(_run_layer, 2, timeout=300)


# fla.layers.gla.GatedLinearAttention's parameters for hidden_size=64, num_heads=4 and fla's defaults
# (expand_k=0.5, expand_v=1.0, gate_low_rank_dim=16, use_output_gate, fused swish-gated RMSNorm)
FLA_PARAMS = {
    "q_proj.weight": (32, 64),
    "k_proj.weight": (32, 64),
    "v_proj.weight": (64, 64),
    "g_proj.weight": (64, 64),
    "gk_proj.0.weight": (16, 64),
    "gk_proj.1.weight": (32, 16),
    "gk_proj.1.bias": (32,),
    "o_proj.weight": (64, 64),
    "g_norm_swish_gate.weight": (16,),
}


def test_layer_parameters_match_fla():
    layer = GatedLinearAttention(hidden_size=64, num_heads=4)
    got = {n: tuple(p.shape) for n, p in layer.state_dict().items()}
    assert got == FLA_PARAMS
    sd = {n: torch.randn(s) for n, s in FLA_PARAMS.items()}
    layer.load_state_dict(sd, strict=True)
    for n, t in layer.state_dict().items():
        assert torch.equal(t, sd[n]), n
    # the unfused norm (gate_fn != swish or fuse_norm=False) is fla's g_norm
    layer2 = GatedLinearAttention(hidden_size=64, num_heads=4, fuse_norm=False)
    names = set(layer2.state_dict())
    assert "g_norm.weight" in names and "g_norm_swish_gate.weight" not in names
    # grouped keys/values (num_kv_heads): k/v/gk projections shrink as in fla
    layer3 = GatedLinearAttention(hidden_size=64, num_heads=4, num_kv_heads=2)
    shapes = {n: tuple(p.shape) for n, p in layer3.state_dict().items()}
    assert shapes["k_proj.weight"] == (16, 64) and shapes["v_proj.weight"] == (32, 64)
    assert shapes["gk_proj.1.weight"] == (16, 16)
    y = layer3(torch.randn(1, 10, 64))[0]
    assert y.shape == (1, 10, 64)


def test_errors():
    q = torch.randn(1, 8, H, K)
    v = torch.randn(1, 8, H, V)
    with pytest.raises(ValueError, match="method"):
        zeco_gla(q, q, v, None, method="ring")
    with pytest.raises(ValueError, match="g must be"):
        zeco_gla(q, q, v, torch.zeros(1, 8, H, K + 1))
    with pytest.raises(ValueError, match="k must"):
        zeco_gla(q, torch.randn(1, 8, H, K + 1), v, None)
    with pytest.raises(ValueError, match="v must"):
        zeco_gla(q, q, torch.randn(1, 9, H, V), None)
    with pytest.raises(ValueError, match="initial_state must be float32"):
        zeco_gla(q, q, v, None, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64))
    with pytest.raises(ValueError, match="initial_state must be"):
        zeco_gla(q, q, v, None, initial_state=torch.zeros(2, H, K, V))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at"):
        zeco_gla(q, q, v, None, cu_seqlens=torch.tensor([0, 3, 9]))
    with pytest.raises(ValueError, match="strictly increasing"):
        zeco_gla(q, q, v, None, cu_seqlens=torch.tensor([0, 3, 3, 8]))
    with pytest.raises(ValueError, match="batch size must be 1"):
        zeco_gla(torch.randn(2, 8, H, K), torch.randn(2, 8, H, K), torch.randn(2, 8, H, V), None,
                 cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match="g must be a floating-point tensor"):
        zeco_gla(q, q, v, torch.zeros(1, 8, H, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="every rank needs at least one token"):
        zeco_gla(q[:, :0], q[:, :0], v[:, :0], None)
    with pytest.raises(NotImplementedError, match="use_short_conv"):
        GatedLinearAttention(hidden_size=64, num_heads=4, use_short_conv=True)
    with pytest.raises(ValueError, match="GatedLinearAttention: method must be one of"):
        GatedLinearAttention(hidden_size=64, num_heads=4, method="ring")


def _run_mismatch(rank, world):
    # ranks disagreeing on the state shape must raise (in the layer's cross-rank check), not hang
    q = torch.randn(1, 8, H, K + rank)
    v = torch.randn(1, 8, H, V)
    with pytest.raises(ValueError, match=r"ranks passed different arguments.*K \(rank 0: 8, rank 1: 9\)"):
        zeco_gla(q, q, v, None, dist.group.WORLD)
    # a rank whose inputs need no gradient would run no backward (its peer would wait in the reverse scan)
    q = torch.randn(1, 8, H, K, requires_grad=rank == 0)
    with pytest.raises(ValueError, match=r"inputs need gradients \(rank 0: 1, rank 1: 0\)"):
        zeco_gla(q, q, v, None)
    with torch.no_grad():  # the same inputs without autograd: no backward anywhere, no mismatch
        o, _ = zeco_gla(q, q, v, None)
    assert o.shape == v.shape


def test_mismatched_shapes_across_ranks_raise():
    run_distributed(_run_mismatch, 2, timeout=120)


def _run_one_rank_invalid(rank, world):
    # one rank's own bad argument (here a cu_seqlens that does not cover the global sequence, then a
    # wrong v) raises there and reaches its peers at once: their first exchange carries its marker
    q = torch.randn(1, 8, H, K)
    v = torch.randn(1, 8, H, V)
    cu = torch.tensor([0, 5, 8 * world - (rank == 1)])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at" if rank == 1 else
                       r"rank\(s\) \[1\] rejected their own arguments"):
        zeco_gla(q, q, v, None, cu_seqlens=cu)
    with pytest.raises(ValueError, match="v must be" if rank == 1 else r"rank\(s\) \[1\] rejected their own"):
        zeco_gla(q, q, v[:, :7] if rank == 1 else v, None, output_final_state=True)
    o, _ = zeco_gla(q, q, v, None)  # and the group still works
    assert o.shape == v.shape


def test_one_rank_invalid_arguments_reach_every_rank():
    run_distributed(_run_one_rank_invalid, 2, timeout=120)


def _run_default_group(rank, world):
    """``group=None`` in an initialised group is the default group (torch.distributed's convention):
    the same as passing it, and the single-process answer on the whole sequence; ``LOCAL`` is one
    process holding the whole sequence, even here. The module follows the same convention."""
    T_local = 40
    q, k, v, g, _, do = _data(321, 1, T_local * world, "gla", 1)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    ref, ref_fin = recurrent_gla_reference(q, k, v, g)
    whole, _ = zeco_gla(q, k, v, g, LOCAL)
    assert _rel(whole, ref) < TOL
    outs = {}
    for name, group in (("None", None), ("WORLD", dist.group.WORLD), ("omitted", "omitted")):
        ins = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, g)]
        if group == "omitted":
            o, _ = zeco_gla(*ins)
            fin = None
        else:
            o, fin = zeco_gla(*ins, group, output_final_state=True)
        grads = torch.autograd.grad((o * do[:, sl]).sum(), ins)
        outs[name] = (o.detach(), fin, grads)
    assert _rel(outs["None"][0], ref[:, sl]) < TOL
    if rank == world - 1:
        assert _rel(outs["None"][1], ref_fin) < TOL
    for name in ("WORLD", "omitted"):
        assert torch.equal(outs[name][0], outs["None"][0]), name
        for a, b in zip(outs[name][2], outs["None"][2]):
            assert torch.equal(a, b), name
    assert torch.equal(outs["WORLD"][1], outs["None"][1])

    torch.manual_seed(0)
    layer = GatedLinearAttention(hidden_size=64, num_heads=4)  # group=None
    whole_layer = GatedLinearAttention(hidden_size=64, num_heads=4, group=LOCAL)
    whole_layer.load_state_dict(layer.state_dict())
    x = torch.randn(1, T_local * world, 64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert _rel(layer(x[:, sl])[0], whole_layer(x)[0][:, sl]) < TOL


def test_group_none_is_the_default_group():
    run_distributed(_run_default_group, 2, timeout=300)


def test_group_without_distributed():
    """Without torch.distributed, None (and LOCAL) is one process; an explicit group is an error."""
    q, k, v, g, _, _ = _data(5, 1, 70, "simple", 1)
    ref, _ = recurrent_gla_reference(q, k, v, g)
    for group in (None, LOCAL):
        o, _ = zeco_gla(q, k, v, g, group)
        assert _rel(o, ref) < TOL, group
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        zeco_gla(q, k, v, g, "a_group_name")


@pytest.fixture
def env(monkeypatch):
    """Environment variables for one test, the settings re-read before and after it."""
    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


def test_backend_setting(env):
    q, k, v, g, _, _ = _data(6, 1, 20, "gla", 1)
    env.setenv("ALLSCAN_GLA_BACKEND", "triton")
    with pytest.raises(ValueError, match="ALLSCAN_GLA_BACKEND"):
        settings.reload()
    env.setenv("ALLSCAN_GLA_BACKEND", "fla")
    settings.reload()
    with pytest.raises(RuntimeError, match="ALLSCAN_GLA_BACKEND=fla needs CUDA tensors"):
        zeco_gla(q, k, v, g)
    env.setenv("ALLSCAN_GLA_BACKEND", "torch")
    settings.reload()
    o, _ = zeco_gla(q, k, v, g)
    assert _rel(o, recurrent_gla_reference(q, k, v, g)[0]) < TOL


def test_fused_kernel_switches(env):
    """``ALLSCAN_GLA_FUSED(_OUTPUT)`` through the settings; ``set_fused_output`` and a failing kernel
    override them (the kernels themselves run in tests/test_gla_gpu.py)."""
    saved = dict(fla_glue._FUSED_OVERRIDE)
    try:
        fla_glue._FUSED_OVERRIDE.clear()
        settings.reload()
        assert G.fused_kernels_enabled() and fla_glue._fused_output_enabled()
        env.setenv("ALLSCAN_GLA_FUSED", "0")
        env.setenv("ALLSCAN_GLA_FUSED_OUTPUT", "0")
        settings.reload()
        assert not G.fused_kernels_enabled() and not fla_glue._fused_output_enabled()
        G.set_fused_output(True)
        assert fla_glue._fused_output_enabled()
        env.setenv("ALLSCAN_GLA_FUSED", "yes")
        with pytest.raises(ValueError, match="ALLSCAN_GLA_FUSED"):
            settings.reload()
        env.delenv("ALLSCAN_GLA_FUSED")
        settings.reload()
        assert G.fused_kernels_enabled()
        with pytest.warns(UserWarning, match="the fused Triton correction failed .*using torch ops"):
            fla_glue._fused_failed(RuntimeError("no GPU"))
        assert not G.fused_kernels_enabled()
    finally:
        fla_glue._FUSED_OVERRIDE.clear()
        fla_glue._FUSED_OVERRIDE.update(saved)


def _run_stage_times(rank, world):
    q, k, v, g, _, do = _data(11, 1, 48 * world, "gla", 1)
    sl = slice(rank * 48, (rank + 1) * 48)
    ins = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, g)]
    with G.host_stage_times() as t:
        o, _ = zeco_gla(*ins)
        (o * do[:, sl]).sum().backward()
    expected = ["fwd_states", "fwd_output", "bwd_begin", "bwd_prepare", "bwd_dh", "bwd_finish",
                "scan issue", "scan wait", "forward body", "backward body"]
    if rank > 0:  # the ranks that receive a state apply it
        expected += ["correct", "xgrad"]
    if 0 < rank < world - 1:  # only the inner ranks' decays are read by the scans
        expected += ["shard_gamma"]
    assert set(t) == set(expected), sorted(t)
    assert all(t[key] > 0 for key in expected), t
    assert t["forward body"] >= t["fwd_states"] + t["fwd_output"]
    before = dict(t)
    zeco_gla(*ins)[0].sum().backward()  # outside the block: not recorded
    assert t == before


def test_host_stage_times_hook():
    run_distributed(_run_stage_times, 3, timeout=120)


def _run_last_rank_state_backward_fails(rank, world, times):
    """The last rank runs its state backward before it issues the reverse scan; if that raises, it
    issues the scan from X instead, so the other ranks are never left waiting in it: raising once, the
    backward runs the state backward again after the scan and every rank's gradients are as usual;
    raising every time, the last rank raises and the others finish."""
    from allscan.ops.gla.chunk import TorchGLA

    TorchGLA.state_backward_first = True  # the fla backend's order, on the torch backend
    q, k, v, g, _, do = _data(13, 1, 48 * world, "gla", 1)
    sl = slice(rank * 48, (rank + 1) * 48)

    def grads():
        ins = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, g)]
        o, _ = zeco_gla(*ins)
        (o * do[:, sl]).sum().backward()
        return [t.grad for t in ins]

    expected = grads()
    real = TorchGLA.bwd_dh
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if rank == world - 1 and len(calls) <= times:
            raise RuntimeError("injected failure of the state backward")
        return real(*args, **kwargs)

    TorchGLA.bwd_dh = staticmethod(failing)
    try:
        got = grads()
    except RuntimeError as e:
        assert rank == world - 1 and times > 1 and "injected" in str(e), (rank, e)
        return "raised"
    finally:
        TorchGLA.bwd_dh = staticmethod(real)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return len(calls)


@pytest.mark.parametrize("times", [1, 99])
def test_last_rank_state_backward_failure_leaves_no_peer_waiting(times):
    world = 3
    out = run_distributed(_run_last_rank_state_backward_fails, world, times, timeout=120)
    if times == 1:
        assert out == [1, 1, 2]  # the last rank's state backward ran twice: before the scan, failing, and after
    else:
        assert out == [1, 1, "raised"]


def _run_part_fails(rank, world, where):
    """Rank 1 of 3 fails in its own work before one of its scans (out of memory, say) and raises: in its
    forward's first allocation (the full decay) or its states, or in its backward's first step or its
    part of the reverse scan (``X``). It tells
    its peers, which raise naming it instead of waiting in the scan; then every rank's next call gives
    the gradients of a call before the failure (the group stays usable)."""
    from allscan.ops.gla.chunk import TorchGLA

    q, k, v, g, _, do = _data(17, 1, 32 * world, "gla", 1)
    sl = slice(rank * 32, (rank + 1) * 32)

    def grads():
        ins = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, g)]
        o, _ = zeco_gla(*ins)
        return torch.autograd.grad(o, ins, do[:, sl])

    expected = grads()
    outcome = outcome_when_rank_1_fails(G.body if where == "_full_decay" else TorchGLA, where, grads)
    assert all(torch.equal(a, b) for a, b in zip(grads(), expected)), (rank, where)
    return outcome


@pytest.mark.parametrize("where", ["_full_decay", "fwd_states", "bwd_begin", "xgrad"])
def test_a_rank_failing_before_its_scan_leaves_no_peer_waiting(where):
    assert run_distributed(_run_part_fails, 3, where, timeout=120) == ["told", "raised", "told"]


def _module_fails(rank, world, where):
    """Rank 1 of 3 fails in the module's own work before its first collective (its inputs, its q
    projection): it raises its error, its peers raise naming it, and then the group gives every rank
    the gradients of a call before the failure."""
    import datetime

    from failing_rank import outcome_when_a_layer_fails_on_rank_1

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))  # a hang fails, not waits
    torch.manual_seed(0)
    layer = GatedLinearAttention(hidden_size=64, num_heads=4, group=group).double()
    torch.manual_seed(5)
    x = torch.randn(1, 8 * world, 64, dtype=torch.float64)[:, rank * 8:(rank + 1) * 8]

    def grads():
        layer.zero_grad()
        xs = x.clone().requires_grad_()
        y, _, _ = layer(xs)
        y.sum().backward()
        return [xs.grad] + [p.grad.clone() for p in layer.parameters()]

    before = grads()
    outcome = outcome_when_a_layer_fails_on_rank_1(layer, x.clone().requires_grad_(), where)
    assert all(torch.equal(a, b) for a, b in zip(grads(), before)), (rank, where)
    return outcome


@pytest.mark.parametrize("where", ["attention_mask", "q_proj"])
def test_a_rank_failing_in_the_modules_own_work_leaves_no_peer_waiting(where):
    assert run_distributed(_module_fails, 3, where, timeout=120) == ["told", "raised", "told"]


def test_fla_autotune_one_config_choice():
    """``limit_fla_autotune("one")``'s chooser: fla's own pruning first, then the config closest to
    BK = BV = 64, 4 warps, 2 stages (checked with stand-in configs: no Triton on CPU)."""
    from types import SimpleNamespace as C

    from allscan.ops import fla_autotune

    configs = [C(kwargs={"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
               for bk in (32, 64) for bv in (64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]
    (best,) = fla_autotune._prune_to_one(None, configs, {})
    assert (best.kwargs, best.num_warps, best.num_stages) == ({"BK": 64, "BV": 64}, 4, 2)

    # fla's pruning is applied first (e.g. its rule "a tile must be smaller than the dimension", and the
    # Hopper exclusion of BK=32 with 4 warps): the choice comes from what survives it
    def fla_prune(cfgs, nargs, **kw):
        return [c for c in cfgs if c.kwargs["BK"] < nargs["K"] and not (c.kwargs["BK"] == 32 and c.num_warps == 4)]

    (best,) = fla_autotune._prune_to_one(fla_prune, configs, {"K": 64})
    assert best.kwargs["BK"] == 32 and best.num_warps != 4 and best.kwargs["BV"] == 64 and best.num_stages == 2
    # warps-only configs (no block kwargs): 4 warps
    (best,) = fla_autotune._prune_to_one(None, [C(kwargs={}, num_warps=w, num_stages=3) for w in (1, 2, 4, 8)], {})
    assert best.num_warps == 4
    with pytest.raises(ValueError, match="mode must be one of"):
        G.limit_fla_autotune("fast")


def test_limit_fla_autotune_without_fla_names_the_extra():
    try:
        import fla  # noqa: F401
        pytest.skip("fla-core is installed here")
    except ImportError:
        pass
    from allscan.ops.gla import limit_fla_autotune

    with pytest.raises(ImportError, match=r"limit_fla_autotune needs fla-core >= 0.6 \(pip install allscan\[gla\]\)"):
        limit_fla_autotune("one")


def test_state_gradient_splits_fill_the_gpu():
    """The state gradient's chunks per partial sum: 16 where the grid fills the GPU already, fewer
    (more partials) where a short shard would leave SMs idle, never below one chunk."""
    pytest.importorskip("triton")
    from allscan.ops.gla.incoming_state import MAX_CHUNKS_PER_SPLIT, chunks_per_split

    heads, sms = 16, 132  # bf16, H = 16, one K x V tile per head, on an H200
    assert [chunks_per_split(T // 64, heads, sms) for T in (2048, 4096, 8192, 16384)] == [4, 8, 16, 16]
    assert chunks_per_split(1, 1, sms) == 1  # nothing can fill it: one chunk per split
    for nt in range(1, 300, 7):
        for tiles in (1, 2, 16, 64, 512):
            cps = chunks_per_split(nt, tiles, sms)
            assert 1 <= cps <= MAX_CHUNKS_PER_SPLIT and cps & (cps - 1) == 0
            # halved while, and only while, the grid was short of the SMs
            assert cps == MAX_CHUNKS_PER_SPLIT or -(-nt // (2 * cps)) * tiles * 10 < sms * 9
            assert cps == 1 or -(-nt // cps) * tiles * 10 >= sms * 9


def _second_order(rank, world):
    q, k, v, g, h0, do = _data(3, 1, 12 * world, "gla", 1)
    sl = slice(rank * 12, (rank + 1) * 12)
    mine = [x[:, sl].clone().requires_grad_(True) for x in (q, k, v, g)]
    for residual in (False, True):  # a residual gives the inputs another path (the test's docstring)
        o, _ = zeco_gla(*mine, dist.group.WORLD)
        out = o + mine[2] if residual else o
        with pytest.raises(RuntimeError, match="zeco_gla: double backward .*create_graph=True"):
            torch.autograd.grad(out, mine, do[:, sl], create_graph=True)
    # one rank alone asks for it: it raises, and tells its peer waiting in the reverse scan, which raises too
    o, _ = zeco_gla(*mine, dist.group.WORLD)
    if rank == 1:
        with pytest.raises(RuntimeError, match="zeco_gla: double backward"):
            torch.autograd.grad(o, mine, do[:, sl], create_graph=True)
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] rejected their own arguments or failed"):
            torch.autograd.grad(o, mine, do[:, sl])
    o, _ = zeco_gla(*mine, dist.group.WORLD)  # and every rank goes on to the next call
    return torch.autograd.grad(o, mine[0], do[:, sl])[0].shape == mine[0].shape


def test_second_order_gradients_raise_on_every_rank():
    """zeco_gla is differentiable once: its backward holds the incoming state as a constant, so a
    second-order gradient would lack the terms through the other ranks. A backward that would build a graph
    of the gradients raises on every rank, also where a residual reaches the inputs by another path (torch's
    once_differentiable raised only when its node was reached, which autograd.grad skipped there, returning
    second-order gradients without the op's terms); every rank goes on to the next call (none left waiting in a
    collective)."""
    assert run_distributed(_second_order, 2, timeout=300) == [True, True]
