"""Sequence-parallel Gated DeltaNet and KDA on CPU: gloo ranks against a float64 token-by-token delta
rule on the whole sequence.

Checks the whole algorithm (local chunked delta rule from the local initial states, the shard's
transition, the matrix All-Scan of the states crossing rank boundaries, the incoming state folded into
the outputs and final states; the backward: the reverse scan, then the shard's backward from its whole
incoming state) at
P = 1..5 for both layers: outputs, every gradient (q, k, v, g, beta, initial_state, and A_log /
dt_bias with the in-kernel gates), initial and final states, B > 1, T_local not a multiple of the
chunk size, packed sequences cut inside ranks, exactly on rank boundaries and across several ranks,
grouped value heads, fla's l2norm and gate options; methods zeco and allgather agree; ``group=None``
is the default group; bad arguments raise naming the argument. Everything in float64, compared to
1e-9 relative.
"""
from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from failing_rank import outcome_when_rank_1_fails  # noqa: E402

from allscan.layers import zeco_gated_delta_rule, zeco_kda  # noqa: E402
from allscan.ops.delta import chunk_delta_rule, recurrent_delta_rule_reference  # noqa: E402
from allscan.ops.delta.chunk import DeltaInputs, chunk_outputs, incoming_map  # noqa: E402
from allscan.ops.delta.shard import FinalGrads  # noqa: E402
from allscan.ops.gla import LOCAL  # noqa: E402

H, K, V = 2, 6, 4
TOL = 1e-9  # float64 chunked and sequence-parallel math against float64 token by token
LAYERS = {"gdn": zeco_gated_delta_rule, "kda": zeco_kda}


def _run(opts, scale, bounds, wide):
    """What a local backend reads of a shard's plan (:class:`allscan.ops.delta.shard.ShardRun`)."""
    return SimpleNamespace(opts=opts, scale=scale, bounds=tuple(bounds), wide=wide)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _data(seed, layer, B, T, HV, n_h0, gated):
    """Raw inputs in float64 (the in-kernel gates' inputs when ``gated``), and the output gradient."""
    gen = torch.Generator().manual_seed(seed)
    d = dict(q=torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
             k=F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1),
             v=torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64))
    gshape = (B, T, HV, K) if layer == "kda" else (B, T, HV)
    if gated:  # raw gate inputs, raw beta logits
        d["g"] = torch.randn(*gshape, generator=gen, dtype=torch.float64)
        d["beta"] = torch.randn(B, T, HV, generator=gen, dtype=torch.float64)
        d["A_log"] = torch.rand(HV, generator=gen, dtype=torch.float64) - 1.5
        d["dt_bias"] = 0.5 * torch.randn(HV * K if layer == "kda" else HV, generator=gen, dtype=torch.float64)
    else:
        d["g"] = F.logsigmoid(torch.randn(*gshape, generator=gen, dtype=torch.float64) + 3.0)
        d["beta"] = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    d["h0"] = torch.randn(n_h0, HV, K, V, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    return d, do


def _activate(layer, d, gated):
    """fla's in-kernel l2norm and gates, written out here as the oracle (float64)."""
    if not gated:
        return d["q"], d["k"], d["g"], d["beta"]
    l2 = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    if layer == "kda":
        HV = d["v"].shape[2]
        g = -d["A_log"].exp().view(HV, 1) * F.softplus(d["g"] + d["dt_bias"].view(HV, K))
    else:
        g = -d["A_log"].exp() * F.softplus(d["g"] + d["dt_bias"])
    return l2(d["q"]), l2(d["k"]), g, 2 * torch.sigmoid(d["beta"])


def _names(gated):
    return ["q", "k", "v", "g", "beta", "h0"] + (["A_log", "dt_bias"] if gated else [])


def _reference(layer, d, do, gated, cu, T_local, world, dfinals):
    """float64 reference: output, final states (per rank), and the gradients of
    sum(o * do) + sum_p <final_p, dfinal_p> for every input."""
    ins = {n: d[n].clone().requires_grad_(True) for n in _names(gated)}
    q, k, g, beta = _activate(layer, ins, gated)
    v, h0 = ins["v"], ins["h0"]
    o, fin = recurrent_delta_rule_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    loss = (o * do).sum()
    if cu is None:  # the state after each rank's last token: the reference on the prefix
        finals = []
        for p in range(world):
            e = (p + 1) * T_local
            _, f = recurrent_delta_rule_reference(q[:, :e], k[:, :e], v[:, :e], g[:, :e], beta[:, :e],
                                                  initial_state=h0)
            finals.append(f)
            loss = loss + (f * dfinals[p]).sum()
    else:
        finals = [fin] * world
        loss = loss + sum((fin * dd).sum() for dd in dfinals)
    grads = torch.autograd.grad(loss, list(ins.values()))
    return o.detach(), [f.detach() for f in finals], dict(zip(ins, grads))


def _final_rows(cu, rank, T_local):
    off = rank * T_local
    return [i for i in range(len(cu) - 1) if off < cu[i + 1] <= off + T_local]


def _options(gated):
    if not gated:
        return {}
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True)


def _prepare(world, case):
    """A case's inputs and its float64 reference on the whole sequence (computed once, in the parent)."""
    layer, cu_list, T_local, B, HV, gated = (case[n] for n in ("layer", "cu", "T_local", "B", "HV", "gated"))
    T = T_local * world
    n_h0 = B if cu_list is None else len(cu_list) - 1
    d, do = _data(1000 + T + HV + 7 * gated, layer, B, T, HV, n_h0, gated)
    gen = torch.Generator().manual_seed(99)
    dfinals = [torch.randn(n_h0, HV, K, V, generator=gen, dtype=torch.float64) for _ in range(world)]
    if cu_list is not None:  # each row's gradient is given by the rank where that sequence ends
        for p in range(world):
            keep = torch.zeros(n_h0, 1, 1, 1, dtype=torch.float64)
            keep[_final_rows(cu_list, p, T_local)] = 1
            dfinals[p] = dfinals[p] * keep
    return dict(case, d=d, do=do, dfinals=dfinals,
                ref=_reference(layer, d, do, gated, cu_list, T_local, world, dfinals))


def _check_case(rank, world, group, case):
    layer, cu_list, T_local, B, HV, gated = (case[n] for n in ("layer", "cu", "T_local", "B", "HV", "gated"))
    fn = LAYERS[layer]
    cu = None if cu_list is None else torch.tensor(cu_list, dtype=torch.long)
    n_h0 = B if cu is None else len(cu_list) - 1
    d, do, dfinals = case["d"], case["do"], case["dfinals"]
    ref_o, ref_finals, ref_grads = case["ref"]
    sl = slice(rank * T_local, (rank + 1) * T_local)
    results = {}
    for method in case["methods"]:
        ins = {n: (d[n][:, sl] if n in ("q", "k", "v", "g", "beta") else d[n]).clone().requires_grad_(True)
               for n in _names(gated)}
        extra = {"A_log": ins["A_log"], "dt_bias": ins["dt_bias"]} if gated else {}
        o, fin = fn(ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], group, initial_state=ins["h0"],
                    output_final_state=True, cu_seqlens=cu, method=method, **_options(gated), **extra)
        tag = f"{layer} {method} cu={cu_list} B={B} HV={HV} gated={gated} P={world} rank={rank}"
        assert o.shape == (B, T_local, HV, V) and o.dtype == torch.float64, tag
        assert _rel(o, ref_o[:, sl]) < TOL, f"output: {tag}: {_rel(o, ref_o[:, sl])}"
        if cu is None:
            assert fin.shape == (B, HV, K, V), tag
            assert _rel(fin, ref_finals[rank]) < TOL, f"final state: {tag}"
        else:
            assert fin.shape == (n_h0, HV, K, V), tag
            rows = _final_rows(cu_list, rank, T_local)
            for i in range(n_h0):
                if i in rows:
                    assert _rel(fin[i], ref_finals[0][i]) < TOL, f"final state row {i}: {tag}"
                else:
                    assert torch.count_nonzero(fin[i]) == 0, f"final row {i} not ending here is nonzero: {tag}"
        loss = (o * do[:, sl]).sum() + (fin * dfinals[rank]).sum()
        grads = dict(zip(ins, torch.autograd.grad(loss, list(ins.values()))))
        for name, gr in grads.items():
            if name in ("q", "k", "v", "g", "beta"):
                err = _rel(gr, ref_grads[name][:, sl])
            else:  # used on some ranks (initial states) or replicated (gate parameters): sum over ranks
                gr = gr.clone()
                if world > 1:
                    dist.all_reduce(gr)
                err = _rel(gr, ref_grads[name])
            assert err < TOL, f"d{name}: {tag}: {err}"
        if cu is None and rank > 0:
            assert torch.count_nonzero(grads["h0"]) == 0, f"dh0 on a rank after the first: {tag}"
        results[method] = [o.detach(), fin.detach()] + list(grads.values())
    base = results[case["methods"][0]]
    for m in case["methods"][1:]:
        for a, b in zip(base, results[m]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"method {m} differs from {case['methods'][0]}"


def _cases(world):
    T_local = 70  # one whole 64-token chunk and a partial one per rank
    T = T_local * world
    both = ["zeco", "allgather"]
    cus = [[0, 17, T_local, T_local + 3, T] if world > 1 else [0, 17, 64, T],  # a cut on a rank boundary
           [0, 5, T - 7, T],  # one sequence across every rank boundary (middle ranks have no start)
           [0, T]]
    if world >= 3:
        cus.append([0, 30, T_local + 50, 2 * T_local, 2 * T_local + 1, T])
    cases = []
    for layer in LAYERS:
        cases.append(dict(layer=layer, cu=None, T_local=T_local, B=2, HV=H, gated=False, methods=both))
        cases.append(dict(layer=layer, cu=None, T_local=T_local, B=1, HV=2 * H, gated=True, methods=["zeco"]))
        for i, cu in enumerate(cus):
            cases.append(dict(layer=layer, cu=sorted(set(cu)), T_local=T_local, B=1, HV=H, gated=False,
                              methods=both if i == 0 else ["zeco"]))
    return cases


def _run_world(rank, world, cases):
    group = dist.group.WORLD if world > 1 else None
    for case in cases:
        _check_case(rank, world, group, case)
    if world == 2:  # one spawn for the checks that need a group but no particular size
        _check_default_group(rank, world)
        _check_mismatch(rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_zeco_delta_distributed(world):
    cases = [_prepare(world, c) for c in _cases(world)]
    if world == 1:
        _run_world(0, 1, cases)  # no group: one process, no communication
    else:
        run_distributed(_run_world, world, cases, timeout=600)


def _partial_loss_case(rank, world, group, layer, cu, use_o, use_f, wrt):
    """One loss that uses only part of the outputs (the output, the final state, or both) and asks only
    some gradients: every rank still joins the reverse scan, and what it returns is the float64 answer."""
    T_local = 37
    T = T_local * world
    n_h0 = 1 if cu is None else len(cu) - 1
    d, do = _data(5 + world, layer, 1, T, H, n_h0, gated=False)
    dfin = torch.randn(n_h0, H, K, V, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    names = ("q", "k", "v", "g", "beta", "h0")
    cut = None if cu is None else torch.tensor(cu)

    def loss_of(o, finals):  # finals[p]: the final state rank p returns
        loss = (o * do).sum() if use_o else 0
        for p, f in enumerate(finals if use_f else []):
            loss = loss + (f * dfin * (p + 1)).sum()  # a different weight per rank
        return loss

    ref_in = {n: d[n].clone().requires_grad_(n in wrt) for n in names}
    o, fin = recurrent_delta_rule_reference(*(ref_in[n] for n in names[:5]), initial_state=ref_in["h0"],
                                            cu_seqlens=cut)
    if cu is None:
        finals = [recurrent_delta_rule_reference(*(ref_in[n][:, :(p + 1) * T_local] for n in names[:5]),
                                                 initial_state=ref_in["h0"])[1] for p in range(world)]
    else:
        finals = [fin * torch.tensor([float(i in _final_rows(cu, p, T_local)) for i in range(n_h0)],
                                     dtype=torch.float64).view(-1, 1, 1, 1) for p in range(world)]
    want = torch.autograd.grad(loss_of(o, finals), [ref_in[n] for n in wrt], allow_unused=True)

    sl = slice(rank * T_local, (rank + 1) * T_local)
    mine = {n: (d[n] if n == "h0" else d[n][:, sl]).clone().requires_grad_(n in wrt) for n in names}
    o, fin = LAYERS[layer](*(mine[n] for n in names[:5]), group, initial_state=mine["h0"],
                           output_final_state=use_f, cu_seqlens=cut)
    loss = (o * do[:, sl]).sum() if use_o else 0
    if use_f:
        loss = loss + (fin * dfin * (rank + 1)).sum()
    got = torch.autograd.grad(loss, [mine[n] for n in wrt], allow_unused=True)
    tag = f"{layer} cu={cu} output used={use_o} final used={use_f} grads of {wrt} rank={rank}"
    for n, a, b in zip(wrt, got, want):
        a = torch.zeros_like(mine[n]) if a is None else a
        b = torch.zeros_like(ref_in[n]) if b is None else b
        if n == "h0":
            a = a.clone()
            dist.all_reduce(a)  # used where its sequence starts: summed over the ranks
        else:
            b = b[:, sl]
        assert _rel(a, b) < TOL, f"d{n}: {tag}: {_rel(a, b)}"


def _partial_losses(rank, world):
    group = dist.group.WORLD
    T = 37 * world
    for layer in LAYERS:
        for cu in (None, [0, 10, 37, 41, T], [0, 5, T - 6, T]):
            _partial_loss_case(rank, world, group, layer, cu, True, False, ("q", "k", "v", "g", "beta", "h0"))
            _partial_loss_case(rank, world, group, layer, cu, True, True, ("h0",))
            _partial_loss_case(rank, world, group, layer, cu, True, True, ("v",))
            if cu is None:  # with packed sequences a rank where none ends would have no loss at all
                _partial_loss_case(rank, world, group, layer, cu, False, True, ("q", "k", "v", "g", "beta", "h0"))


def test_partial_losses_and_gradients_three_ranks():
    """The layer's backward when the loss uses only the outputs (no final state asked), only the final
    states (no output gradient), or asks the gradient of one input alone: float64 answers, P = 3."""
    run_distributed(_partial_losses, 3, timeout=600)


def _q_eff_release(rank, world):
    """Watches Q' through the backend: read once by the reverse scan's work, then freed where the local
    backward takes its final states' gradients (the scan joined); kept when the caller retains the graph for a second backward, and never
    freed under what still holds it (a saved-tensor hook's buffer). A backward that builds a graph
    gives the same gradients, which cannot be differentiated again (a clear error on every rank)."""
    import weakref

    from allscan.ops.delta.chunk import TorchDelta

    seen = {}
    fold_state_grad, backward = TorchDelta.fold_state_grad, TorchDelta.backward

    def watched_fold(q_eff, do):
        seen["q_eff"] = weakref.ref(q_eff if q_eff._base is None else q_eff._base)
        return fold_state_grad(q_eff, do)

    def watched_backward(*args):
        *rest, finals = args
        joined = finals.get

        def watched_get():  # where the local backward takes the final states' gradients: the scan joined
            out = joined()
            seen["alive at backward"] = "q_eff" in seen and seen["q_eff"]() is not None
            return out

        finals.get = watched_get
        return backward(*rest, finals)

    d, do = _data(11, "gdn", 1, 50 * world, H, 1, gated=False)  # 50: not a multiple of the chunk
    sl = slice(rank * 50, (rank + 1) * 50)

    def layer():
        mine = [d[n][:, sl].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        return mine, zeco_gated_delta_rule(*mine, dist.group.WORLD)[0]

    TorchDelta.fold_state_grad, TorchDelta.backward = staticmethod(watched_fold), staticmethod(watched_backward)
    try:
        mine, o = layer()
        kept = [torch.autograd.grad(o, mine, do[:, sl], retain_graph=True) for _ in range(2)]
        # the chain head starts from its initial state: it makes no Q' at all
        assert seen["alive at backward"] == (rank > 0), "freed although the graph is kept"
        last = torch.autograd.grad(o, mine, do[:, sl])
        assert not seen["alive at backward"], "Q' still alive after the reverse scan was joined"
        assert ("q_eff" in seen) == (rank > 0)
        for grads in (kept[1], last):
            assert all(torch.equal(a, b) for a, b in zip(kept[0], grads)), "one backward, one answer"

        # a backward that would build a graph of the gradients (a gradient penalty) raises on every rank (the
        # layer is differentiable once), also where a residual gives the inputs another path (there torch's
        # once_differentiable let autograd.grad return second-order gradients without the layer's terms), and
        # no rank is left waiting
        for residual in (False, True):
            mine, o = layer()
            out = o + mine[2] if residual else o
            with pytest.raises(RuntimeError, match="zeco_gated_delta_rule: double backward .*create_graph=True"):
                torch.autograd.grad(out, mine, do[:, sl], create_graph=True)
        # one rank alone asks for it: it raises and tells its peers waiting in the reverse scan
        mine, o = layer()
        if rank == world - 1:
            with pytest.raises(RuntimeError, match="zeco_gated_delta_rule: double backward"):
                torch.autograd.grad(o, mine, do[:, sl], create_graph=True)
        else:
            with pytest.raises(ValueError, match=rf"rank\(s\) \[{world - 1}\] rejected their own arguments or failed"):
                torch.autograd.grad(o, mine, do[:, sl])

        # a saved-tensor hook that unpacks into buffers it keeps and reuses (as offloading does)
        buffers, count = {}, [0]

        def pack(t):
            count[0] += 1
            return count[0], t

        def unpack(packed):
            i, t = packed
            return buffers.setdefault(i, torch.empty_like(t)).copy_(t)

        for _ in range(2):
            count[0] = 0
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                mine, o = layer()
            grads = torch.autograd.grad(o, mine, do[:, sl])
            assert all(torch.equal(a, b) for a, b in zip(kept[0], grads)), "through a saved-tensor hook"
    finally:
        TorchDelta.fold_state_grad, TorchDelta.backward = staticmethod(fold_state_grad), staticmethod(backward)


def test_backward_frees_q_eff_when_nothing_else_holds_it():
    """The backward's memory: Q' (a tensor of q's size) is gone once the reverse scan that reads it is
    joined, where the shard's local backward takes its final states' gradients; a graph kept with
    ``retain_graph=True`` and a saved-tensor hook's buffers keep what they hold, and every backward gives
    one answer; second-order gradients raise."""
    run_distributed(_q_eff_release, 2)


def _part_fails(rank, world, where, compiled):
    """Rank 1 of 3 fails in its own work and raises, and no peer is left waiting in a scan: failing in its
    forward before the scan (the shard's states) or in computing ``Q'^T do`` (the reverse scan's part,
    beside the local backward; under torch.compile an op of its own), it tells its peers, which raise
    naming it; failing in the local backward before it takes the scan's result, it still issues the scan
    with its part, and the peers finish. Then every rank's next call gives the gradients of a call
    before the failure (the group stays usable)."""
    from allscan.ops.delta.chunk import TorchDelta

    d, do = _data(11, "gdn", 1, 40 * world, H, 1, gated=False)
    sl = slice(rank * 40, (rank + 1) * 40)
    layer = lambda *xs: zeco_gated_delta_rule(*xs, dist.group.WORLD)[0]  # noqa: E731
    if compiled:
        layer = torch.compile(layer, fullgraph=True, backend="aot_eager")

    def grads():
        mine = [d[n][:, sl].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        return torch.autograd.grad(layer(*mine), mine, do[:, sl])

    expected = grads()
    name = {"states": "states", "fold": "fold_state_grad", "local": "backward"}[where]
    outcome = outcome_when_rank_1_fails(TorchDelta, name, grads)
    assert all(torch.equal(a, b) for a, b in zip(grads(), expected)), (rank, where)
    return outcome


@pytest.mark.parametrize("where, outcome, compiled", [("states", ["told", "raised", "told"], False),
                                                      ("fold", ["told", "raised", "told"], False),
                                                      ("fold", ["told", "raised", "told"], True),
                                                      ("local", ["done", "raised", "done"], False)])
def test_a_rank_failing_in_its_own_work_leaves_no_peer_waiting(where, outcome, compiled):
    assert run_distributed(_part_fails, 3, where, compiled, timeout=180) == outcome


def test_chunked_matches_recurrent_single_process():
    """The local chunk kernels (stage by stage) against the token loop: outputs and final states from an
    initial state, the same through the incoming-state fold-in, and the transition against the product
    of the per-token transitions; fp32 inputs within fp32 accuracy."""
    gen = torch.Generator().manual_seed(3)
    for per_key in (False, True):
        for T in (1, 63, 64, 130):
            q = torch.randn(2, T, H, K, generator=gen, dtype=torch.float64)
            k = F.normalize(torch.randn(2, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
            v = torch.randn(2, T, H, V, generator=gen, dtype=torch.float64)
            g = F.logsigmoid(torch.randn(2, T, H, K if per_key else 1, generator=gen, dtype=torch.float64) + 2)
            beta = torch.rand(2, T, H, generator=gen, dtype=torch.float64)
            h0 = torch.randn(2, H, K, V, generator=gen, dtype=torch.float64)
            ro, rf = recurrent_delta_rule_reference(q, k, v, g if per_key else g[..., 0], beta, initial_state=h0)
            cp = chunk_delta_rule(q, k, v, g, beta, K ** -0.5, h0)
            assert _rel(chunk_outputs(cp), ro) < TOL and _rel(cp.final, rf) < TOL, (per_key, T)
            cp0 = chunk_delta_rule(q, k, v, g, beta, K ** -0.5)
            o = chunk_outputs(cp0) + torch.einsum("bthk,bhkv->bthv", incoming_map(cp0), h0)
            assert _rel(o, ro) < TOL and _rel(cp0.final + cp0.transition @ h0, rf) < TOL, (per_key, T)
            M = torch.eye(K, dtype=torch.float64).expand(2, H, K, K)
            for t in range(T):
                kt, bt = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]
                A = (torch.eye(K, dtype=torch.float64) - bt * kt @ kt.transpose(-1, -2)) @ torch.diag_embed(
                    g[:, t].exp().expand(2, H, K))
                M = A @ M
            assert _rel(cp0.transition, M) < TOL, (per_key, T)
            cp32 = chunk_delta_rule(*(x.float() for x in (q, k, v, g, beta)), K ** -0.5, h0.float())
            assert cp32.final.dtype == torch.float32
            assert _rel(chunk_outputs(cp32), ro) < 1e-5 and _rel(cp32.final, rf) < 1e-5, (per_key, T)


def test_kda_lower_bound_gate_and_fp32():
    """KDA's lower-bound gate (A_log optional) and fp32 inputs with an fp32 initial state, one process."""
    d, do = _data(11, "kda", 1, 90, H, 1, True)
    for A_log in (d["A_log"], None):
        a = 1 if A_log is None else A_log.exp().view(H, 1)
        g_ref = -5.0 * torch.sigmoid((d["g"] + d["dt_bias"].view(H, K)) * a)
        o, fin = zeco_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_gate_in_kernel=True, A_log=A_log,
                          dt_bias=d["dt_bias"], lower_bound=-5.0, safe_gate=True, initial_state=d["h0"],
                          output_final_state=True)
        ro, rf = recurrent_delta_rule_reference(d["q"], d["k"], d["v"], g_ref, d["beta"], initial_state=d["h0"])
        assert _rel(o, ro) < TOL and _rel(fin, rf) < TOL
    g = F.logsigmoid(d["g"] + 3)
    beta = torch.sigmoid(d["beta"])
    o, fin = zeco_kda(d["q"].float(), d["k"].float(), d["v"].float(), g.float(), beta.float(),
                      initial_state=d["h0"].float(), output_final_state=True)
    ro, rf = recurrent_delta_rule_reference(d["q"], d["k"], d["v"], g, beta, initial_state=d["h0"])
    assert o.dtype == torch.float32 and fin.dtype == torch.float32
    assert _rel(o, ro) < 1e-5 and _rel(fin, rf) < 1e-5
    ob, _ = zeco_kda(*(x.bfloat16() for x in (d["q"], d["k"], d["v"])), g.bfloat16(), beta.bfloat16())
    ro, _ = recurrent_delta_rule_reference(d["q"], d["k"], d["v"], g, beta)
    assert ob.dtype == torch.bfloat16 and _rel(ob, ro) < 3e-2


def _check_default_group(rank, world):
    """``group=None`` in an initialised group is the default group: the same as passing it; ``LOCAL``
    is one process holding the whole sequence."""
    T_local = 40
    d, do = _data(321, "gdn", 1, T_local * world, H, 1, False)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    ref, _ = recurrent_delta_rule_reference(d["q"], d["k"], d["v"], d["g"], d["beta"])
    whole, _ = zeco_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], LOCAL)
    assert _rel(whole, ref) < TOL
    outs = {}
    for name, group in (("None", None), ("WORLD", dist.group.WORLD)):
        ins = [d[n][:, sl].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
        o, fin = zeco_gated_delta_rule(*ins, group, output_final_state=True)
        outs[name] = (o.detach(), fin.detach(), torch.autograd.grad((o * do[:, sl]).sum(), ins))
    assert _rel(outs["None"][0], ref[:, sl]) < TOL
    assert torch.equal(outs["WORLD"][0], outs["None"][0]) and torch.equal(outs["WORLD"][1], outs["None"][1])
    for a, b in zip(outs["WORLD"][2], outs["None"][2]):
        assert torch.equal(a, b)


def _check_mismatch(rank):
    # ranks disagreeing on an option must raise on every rank (the op's cross-rank check), not hang
    d, _ = _data(5, "kda", 1, 16, H, 1, False)
    with pytest.raises(ValueError, match=r"options .*\(rank 0: 0, rank 1: 1\)"):
        zeco_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_qk_l2norm_in_kernel=bool(rank))
    # the gate's bound: another bound on one rank gates its shard differently (a silent wrong answer)
    A_log = torch.zeros(H)
    with pytest.raises(ValueError, match=r"lower_bound \(float64 bits; none: -1\) \(rank 0: -1, rank 1: "):
        zeco_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_gate_in_kernel=True, A_log=A_log,
                 lower_bound=-3.0 if rank else None)
    with pytest.raises(ValueError, match=r"lower_bound \(float64 bits; none: -1\)"):
        zeco_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_gate_in_kernel=True, A_log=A_log,
                 lower_bound=-3.0 - rank)
    with pytest.raises(ValueError, match=r"options .*\(rank 0: 2, rank 1: 18\)"):
        zeco_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_gate_in_kernel=True, A_log=A_log, lower_bound=-3.0,
                 safe_gate=bool(rank))
    # a rank whose inputs need no gradient would run no backward (its peer would wait in the reverse scan)
    with pytest.raises(ValueError, match=r"inputs need gradients \(rank 0: 1, rank 1: 0\)"):
        zeco_kda(d["q"].requires_grad_(rank == 0), d["k"], d["v"], d["g"], d["beta"])
    d["q"].requires_grad_(False)
    # one rank's own bad argument reaches its peer at once (its exchange carries the failure marker)
    beta = d["beta"][:, :, :1] if rank == 1 else d["beta"]
    want = (r"zeco_kda: beta must be" if rank == 1 else r"rank\(s\) \[1\] rejected their own arguments")
    with pytest.raises(ValueError, match=want):
        zeco_kda(d["q"], d["k"], d["v"], d["g"], beta)


def test_errors():
    q = torch.randn(1, 8, H, K)
    v = torch.randn(1, 8, H, V)
    g3, g4, beta = torch.zeros(1, 8, H), torch.zeros(1, 8, H, K), torch.rand(1, 8, H)
    gdn, kda = zeco_gated_delta_rule, zeco_kda
    with pytest.raises(ValueError, match="zeco_kda: method must be one of"):
        kda(q, q, v, g4, beta, method="ring")
    with pytest.raises(ValueError, match=r"zeco_gated_delta_rule: q, k and v need at least one batch row \(B = 0\)"):
        gdn(q[:0], q[:0], v[:0], g3[:0], beta[:0])
    with pytest.raises(NotImplementedError, match="fla_cp.*fla-core's GPU kernels"):
        gdn(q, q, v, g3, beta, method="fla_cp")
    with pytest.raises(ValueError, match=r"zeco_kda: g must be \[B, T_local, HV, K\]"):
        kda(q, q, v, g3, beta)
    with pytest.raises(ValueError, match=r"zeco_gated_delta_rule: g must be \[B, T_local, HV\]"):
        gdn(q, q, v, g4, beta)
    with pytest.raises(ValueError, match="beta must be"):
        gdn(q, q, v, g3, beta[..., :1])
    with pytest.raises(ValueError, match="k must have q's shape"):
        gdn(q, torch.randn(1, 8, H, K + 1), v, g3, beta)
    with pytest.raises(ValueError, match="v must be"):
        gdn(q, q, torch.randn(1, 8, H + 1, V), g3, beta)
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        gdn(q[0], q, v, g3, beta)
    with pytest.raises(TypeError, match="zeco_gated_delta_rule: q must be float32, float16, bfloat16 or float64, got torch.int32"):
        gdn(q.int(), q, v, g3, beta)
    with pytest.raises(TypeError, match="q, k and v must have one dtype"):
        gdn(q, q, v.double(), g3, beta)
    with pytest.raises(TypeError, match="beta must be a floating-point tensor"):
        gdn(q, q, v, g3, beta.int())
    with pytest.raises(ValueError, match="every rank needs at least one token"):
        gdn(q[:, :0], q[:, :0], v[:, :0], g3[:, :0], beta[:, :0])
    with pytest.raises(TypeError, match="initial_state must be torch.float32"):
        gdn(q, q, v, g3, beta, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"initial_state must be \[B, HV, K, V\]"):
        gdn(q, q, v, g3, beta, initial_state=torch.zeros(2, H, K, V))
    with pytest.raises(ValueError, match=r"zeco_kda: cu_seqlens must start at 0 and end at"):
        kda(q, q, v, g4, beta, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="zeco_gated_delta_rule: cu_seqlens must be strictly increasing"):
        gdn(q, q, v, g3, beta, cu_seqlens=torch.tensor([0, 3, 3, 8]))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        gdn(q, q, v, g3, beta, cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="zeco_gated_delta_rule: with cu_seqlens the batch size must be 1"):
        gdn(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), g3.expand(2, -1, -1),
            beta.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
        gdn(q, q, v, g3, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="use_gate_in_kernel=True needs A_log"):
        gdn(q, q, v, g3, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log and dt_bias are read only with use_gate_in_kernel=True"):
        kda(q, q, v, g4, beta, A_log=torch.zeros(H))
    with pytest.raises(ValueError, match=r"dt_bias must be \[HV \* K\]"):
        kda(q, q, v, g4, beta, use_gate_in_kernel=True, A_log=torch.zeros(H), dt_bias=torch.zeros(H))
    with pytest.raises(ValueError, match=r"safe_gate=True .* needs lower_bound in \[-5, 0\)"):
        kda(q, q, v, g4, beta, use_gate_in_kernel=True, A_log=torch.zeros(H), safe_gate=True)
    with pytest.raises(RuntimeError, match="zeco_kda: group given but torch.distributed is not initialised"):
        kda(q, q, v, g4, beta, object())


def test_fla_backend_widened_forward_with_a_reference_kernel(monkeypatch):
    """FlaDelta's algebra on CPU: fla's forward steps replaced by the float64 token-by-token reference
    (same convention). The first segment's forward on ``[v | 0]`` from ``[h0 | I]`` must give its local
    outputs, Q', its final state and its transition, so that folding an incoming state in equals running
    the segment from it; the packed segments after it run in one varlen call on the V columns; with no
    incoming state (``wide=False``) every segment runs in that one call. fla's factors of both calls are
    joined per token (the backward is one call over the shard)."""
    import allscan.ops.delta.fla as fla_backend
    from allscan.ops.delta.gates import DeltaOptions

    widths, steps = [], []

    def state_steps(x, opts, scale, h0, width, varlen=(None, None)):
        widths.append(width)  # fla's steps widen the values to the state's columns
        q, k, v, g, beta = x
        v_wide = torch.cat([v, v.new_zeros(*v.shape[:-1], width - v.shape[-1])], -1)
        o, final = recurrent_delta_rule_reference(q, k, v_wide, g, beta, scale, h0, varlen[0])
        return final, (o, q.shape[1])

    def output_step(staged):
        o, T = staged
        steps.append("outputs")
        return o, (torch.full((1, T), float(T)),)  # a per-token factor that says which call made it

    def head_output_step(staged, S_in):  # allscan's kernel (tests/test_fold_in.py): [o | Q'], then the fold
        steps.append("head outputs")
        (o_wide, factors), V = (staged[0], (torch.full((1, staged[1]), float(staged[1])),)), S_in.shape[-1]
        o, q_eff = o_wide[..., :V], o_wide[..., V:]
        return (o + torch.einsum("bthk,bhkv->bthv", q_eff, S_in), q_eff), factors

    monkeypatch.setattr(fla_backend, "_state_steps", state_steps)
    monkeypatch.setattr(fla_backend, "_output_step", output_step)
    monkeypatch.setattr(fla_backend, "_head_output_step", head_output_step)
    monkeypatch.setattr(fla_backend, "local_varlen",
                        lambda bounds, device: (None, None) if len(bounds) == 2 else (torch.tensor(bounds), None))
    monkeypatch.setattr(fla_backend, "on_device", lambda t: contextlib.nullcontext())  # the stubs stage ints
    be, scale = fla_backend.FlaDelta, K ** -0.5
    for layer in ("gdn", "kda"):
        d, _ = _data(11, layer, 1, 40, H, 3, gated=False)
        opts = DeltaOptions(per_key=layer == "kda")
        args = DeltaInputs(d["q"], d["k"], d["v"], d["g"], d["beta"])
        S_in = torch.randn(1, H, K, V, dtype=torch.float64)
        for h0 in (None, d["h0"][:1]):
            widths.clear()
            finals, M, staged = be.states(args, _run(opts, scale, [0, 40], True), [h0])
            o_head, q_eff, o_tail, _ = be.outputs(staged, lambda: S_in)
            assert widths == [V + K] and o_tail is None, f"{layer}: one forward on the widened values; got {widths}"
            start = S_in if h0 is None else S_in + h0
            want_o, want_f = recurrent_delta_rule_reference(*args, scale, start)
            assert _rel(o_head, want_o) < TOL and _rel(finals[0] + M @ S_in, want_f) < TOL, (layer, h0 is None)
            o_zero, _, _, _ = be.outputs(staged, lambda: torch.zeros_like(S_in))
            assert _rel(o_zero + torch.einsum("bthk,bhkv->bthv", q_eff, S_in), want_o) < TOL, f"{layer}: Q'"
        bounds, h0s = [0, 15, 31, 40], [d["h0"][:1], d["h0"][1:2], None]
        inits = torch.cat([S_in + h0s[0], h0s[1], torch.zeros(1, H, K, V, dtype=torch.float64)])
        want_o, want_f = recurrent_delta_rule_reference(*args, scale, inits, torch.tensor(bounds))
        widths.clear()
        finals, M, staged = be.states(args, _run(opts, scale, bounds, True), h0s)
        steps.clear()

        def incoming():  # the scan's wait
            steps.append("wait")
            return S_in

        o_head, q_eff, o_tail, saved = be.outputs(staged, incoming)
        assert widths == [V + K, V], f"{layer}: the first segment widened, the others in one call: {widths}"
        # the other segments' outputs are issued beside the scan, then its result is waited for once
        assert steps == ["outputs", "wait", "head outputs"], f"{layer}: {steps}"
        assert _rel(o_head, want_o[:, :15]) < TOL, layer
        assert _rel(o_tail, want_o[:, 15:]) < TOL and len(finals) == 3, layer
        assert _rel(finals[0] + M @ S_in, want_f[:1]) < TOL, layer
        for j in (1, 2):
            assert _rel(finals[j][0], want_f[j]) < TOL, f"{layer}: final state of segment {j}"
        assert torch.equal(saved[-1], torch.tensor([[15.0] * 15 + [25.0] * 25])), "the factors joined per token"
        widths.clear()
        finals, M, staged = be.states(args, _run(opts, scale, bounds, False), [None] + h0s[1:])
        o_head, q_eff, o_tail, _ = be.outputs(staged)
        assert widths == [V] and M is None and o_head is None and q_eff is None, layer
        inits[0] = 0
        want_o, want_f = recurrent_delta_rule_reference(*args, scale, inits, torch.tensor(bounds))
        assert _rel(o_tail, want_o) < TOL and all(_rel(f[0], w) < TOL for f, w in zip(finals, want_f)), layer


def _reference_fla_steps(monkeypatch):
    """FlaDelta's fla steps and l2norm / beta-sigmoid kernels replaced by float64 torch equivalents with fla's
    conventions (the steps see the activated q, k and beta, and the raw g with the in-kernel gate; packed
    sequences through fla's ``(cu_seqlens, chunk_indices)``; the backward returns dq, dk, dv, dbeta, dg, dh0,
    dA_log, ddt_bias): FlaDelta's own code runs on CPU. ``monkeypatch``: a pytest fixture, or anything with its
    ``setattr`` (a spawned rank's :class:`_Patch`). Returns the backend's module."""
    from allscan.ops.delta.gates import gdn_gate, kda_gate

    import allscan.ops.delta.fla as fla_backend

    def l2_fwd(x):
        rstd = torch.rsqrt((x * x).sum(-1) + 1e-6)
        return x * rstd[..., None], rstd

    def l2_bwd(y, rstd, dy):
        return (dy - y * (dy * y).sum(-1, keepdim=True)) * rstd[..., None]

    def sig_bwd(x, dy, scale=1.0):
        s = torch.sigmoid(x)
        return dy * scale * s * (1 - s)

    def gate(g, opts, A_log, dt_bias):
        if not opts.use_gate_in_kernel:
            return g
        return kda_gate(g, A_log, dt_bias, opts.lower_bound) if opts.per_key else gdn_gate(g, A_log, dt_bias)

    def run(x, opts, scale, h0, width, varlen, A_log, dt_bias):
        q, k, v, g, beta = x
        v_wide = torch.cat([v, v.new_zeros(*v.shape[:-1], width - v.shape[-1])], -1)
        return recurrent_delta_rule_reference(q, k, v_wide, gate(g, opts, A_log, dt_bias), beta, scale, h0,
                                              cu_seqlens=varlen[0])

    calls = []  # (step, widened, packed) of every call, for the tests to see which paths ran

    def state_steps(x, opts, scale, h0, width, varlen=(None, None)):
        calls.append(("forward", width > x.v.shape[-1], varlen[0] is not None))
        o, final = run(x, opts, scale, h0, width, varlen, opts.A_log, opts.dt_bias)
        return final, (o, x.q)

    def backward_steps(x, factors, opts, scale, h0, do, finals, varlen=(None, None)):
        calls.append(("backward", False, varlen[0] is not None))
        B, _, HV, Vv = x.v.shape
        rows = B if varlen[0] is None else len(varlen[0]) - 1
        dht = fla_backend._stacked(finals.get(), torch.float64)
        h0 = x.v.new_zeros(rows, HV, x.q.shape[-1], Vv) if h0 is None else h0
        params = [t for t in (opts.A_log, opts.dt_bias) if opts.use_gate_in_kernel and t is not None]
        with torch.enable_grad():  # (an autograd Function's backward runs without grad mode)
            xs = [t.detach().requires_grad_(True) for t in (*x, h0, *params)]
            A_log, dt_bias = (xs[6:] + [None, None])[:2] if params else (None, None)
            o, fin = run(DeltaInputs(*xs[:5]), opts, scale, xs[5], Vv, varlen, A_log, dt_bias)
            grads = torch.autograd.grad([o, fin], xs, [do, torch.zeros_like(fin) if dht is None else dht])
        dq, dk, dv, dg, db, dh0, *dparams = grads
        dA_log, ddt_bias = (dparams + [None, None])[:2] if params else (None, None)
        return dq, dk, dv, db, dg, dh0, dA_log, ddt_bias  # fla's order

    # the activations FlaDelta takes from fla (looked up once per process, through fla_functions)
    fakes = SimpleNamespace(l2norm_fwd=l2_fwd, l2norm_bwd=l2_bwd, fused_beta_sigmoid_bwd=sig_bwd,
                            fused_beta_sigmoid_fwd=lambda x, scale=1.0: scale * torch.sigmoid(x),
                            prepare_chunk_indices=lambda cu, chunk, cu_seqlens_cpu=None: None,
                            fold_state_grad=lambda q_eff, do: torch.einsum("bthk,bthv->bhkv", q_eff, do),
                            calls=calls)
    monkeypatch.setattr(fla_backend, "fla_functions", lambda: fakes)
    monkeypatch.setattr(fla_backend, "_state_steps", state_steps)
    monkeypatch.setattr(fla_backend, "_output_step", lambda staged: (staged[0], ()))
    monkeypatch.setattr(fla_backend, "_head_output_step", lambda staged, S_in: (
        (staged[0][..., :V] + torch.einsum("bthk,bhkv->bthv", staged[0][..., V:], S_in), staged[0][..., V:]), ()))
    monkeypatch.setattr(fla_backend, "_backward_steps", backward_steps)
    monkeypatch.setattr(fla_backend, "on_device", lambda t: contextlib.nullcontext())
    return fla_backend


class _Patch:
    """``monkeypatch.setattr`` where no fixture is (a spawned rank, which exits after its test)."""

    setattr = staticmethod(setattr)


def _fla_backend_cases(rank, world, cases):
    """:func:`_check_case` on FlaDelta (its fla steps on CPU, :func:`_reference_fla_steps`)."""
    import allscan.ops.delta.prepare as prepare

    fla_backend = _reference_fla_steps(_Patch())
    prepare.fla_usable = lambda q: True
    for case in cases:
        _check_case(rank, world, dist.group.WORLD, case)
    return sorted(set(fla_backend.fla_functions().calls))


def test_fla_backend_packed_shards_with_reference_steps():
    """FlaDelta's packed path on three ranks (its fla steps on CPU): the middle rank's widened first segment and
    the other segments in one varlen call, the backward in one varlen call over the shard with the segments'
    initial and final states, fewer key than value heads, the in-kernel l2norm, gate and beta sigmoid, a sequence
    across every rank boundary and one cut on a boundary: outputs, final states and every gradient (A_log and
    dt_bias summed over the ranks) against the float64 recurrence on the whole sequence."""
    world, T_local = 3, 70
    T = world * T_local
    cases = [dict(layer=layer, cu=cu, T_local=T_local, B=1, HV=2 * H, gated=True, methods=["zeco"])
             for layer in LAYERS for cu in ([0, 17, T_local, T_local + 3, T], [0, 5, T - 7, T])]
    paths = run_distributed(_fla_backend_cases, world, [_prepare(world, c) for c in cases], timeout=600)
    # the later ranks ran widened first segments, rank 0 a packed forward call, every rank a packed backward call
    assert all(("forward", True, False) in p for p in paths[1:]), paths
    assert ("forward", False, True) in paths[0], paths
    assert all(("backward", False, True) in p for p in paths), paths


def test_fla_backend_option_plumbing_with_reference_steps(monkeypatch):
    """FlaDelta's wrapper around fla's step functions, on CPU: fla's forward and backward steps and its
    l2norm / beta-sigmoid kernels replaced by float64 torch equivalents with fla's conventions (the
    steps see the activated q, k and beta; the backward returns dq, dk, dv, dbeta, dg, dh0, dA_log,
    ddt_bias). With the in-kernel l2norm and beta sigmoid (negative eigenvalues allowed), the forward's
    pieces and the gradients of the raw inputs must equal autograd through the reference."""
    from allscan.ops.delta.gates import DeltaOptions, beta_gate, l2norm

    fla_backend = _reference_fla_steps(monkeypatch)
    be, scale = fla_backend.FlaDelta, K ** -0.5
    gen = torch.Generator().manual_seed(4)
    for layer in ("gdn", "kda"):
        d, do = _data(13, layer, 1, 40, H, 1, gated=False)
        q, k, v, g = d["q"], 3 * d["k"], d["v"], d["g"]  # raw q, k: the kernel normalises them
        beta = torch.randn(1, 40, H, generator=gen, dtype=torch.float64)  # raw logits
        h0, S_in = d["h0"], torch.randn(1, H, K, V, generator=gen, dtype=torch.float64)
        dht = torch.randn(1, H, K, V, generator=gen, dtype=torch.float64)
        opts = DeltaOptions(per_key=layer == "kda", use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            allow_neg_eigval=True)
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0 + S_in)]
        want_o, want_f = recurrent_delta_rule_reference(l2norm(xs[0]), l2norm(xs[1]), xs[2], xs[3],
                                                        beta_gate(xs[4], True), scale, xs[5])
        want = torch.autograd.grad([want_o, want_f], xs, [do, dht])

        run = _run(opts, scale, [0, 40], True)
        (h,), M, staged = be.states(DeltaInputs(q, k, v, g, beta), run, [h0])
        o_head, q_eff, _, saved = be.outputs(staged, lambda: S_in)
        assert _rel(o_head, want_o) < TOL, layer
        assert _rel(h + M @ S_in, want_f) < TOL, layer
        dq, dk, dv, dg, dbeta, (dh0,), _, _ = be.backward(saved, DeltaInputs(q, k, v, g, beta), run, [h0 + S_in], do,
                                                          FinalGrads([dht]))
        for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), (dq, dk, dv, dg, dbeta, dh0), want):
            assert a.dtype == b.dtype and _rel(a, b) < TOL, f"{layer}: d{name}: {_rel(a, b)}"


def test_the_fla_op_keeps_the_normalised_q_k_not_the_inputs(monkeypatch):
    """Eager zeco_gated_delta_rule on FlaDelta (its steps on CPU, :func:`_reference_fla_steps`), q, k, v views of
    one fused projection, the l2norm in the kernel: the gradients are autograd's through the reference, and
    nothing the backward keeps shares the fused projection's memory (it would keep it whole: fla keeps its
    contiguous, l2-normalised copies, and so does the op)."""
    import allscan.ops.delta.prepare as prepare
    from allscan.ops.delta.gates import l2norm

    _reference_fla_steps(monkeypatch)
    monkeypatch.setattr(prepare, "fla_usable", lambda q: True)
    gen = torch.Generator().manual_seed(6)
    T = 24
    fused = torch.randn(1, T, H * (2 * K + V), generator=gen, dtype=torch.float64, requires_grad=True)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)

    def split(t):
        q, k, v = t.split([H * K, H * K, H * V], -1)
        return q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, H, V)

    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        o, _ = zeco_gated_delta_rule(*split(fused), g, beta, LOCAL, use_qk_l2norm_in_kernel=True)
    got = torch.autograd.grad(o, fused, do)[0]
    assert kept and not any(t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for t in kept)
    q, k, v = split(fused)
    # of q and k, their normalised forms alone: two tensors of their shape, not four
    qk_shaped = [t for t in kept if t.shape == q.shape]
    assert len(qk_shaped) == 2, [tuple(t.shape) for t in kept]
    for t, want in zip(qk_shaped, (l2norm(q), l2norm(k))):
        torch.testing.assert_close(t, want.detach(), rtol=1e-6, atol=1e-6)
    want_o, _ = recurrent_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta, K ** -0.5)
    assert _rel(o, want_o) < TOL
    assert _rel(got, torch.autograd.grad(want_o, fused, do)[0]) < TOL


def test_fla_cp_refuses_what_fla_refuses(monkeypatch):
    """``method="fla_cp"`` takes only what fla's CP supports; the rest raises naming the argument before
    any collective (fla would assert deep inside). The capability check is forced on (no GPU here)."""
    import allscan.ops.delta.prepare as prepare

    monkeypatch.setattr(prepare, "fla_usable", lambda q: True)
    d, _ = _data(3, "gdn", 2, 8, H, 2, gated=False)
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    with pytest.raises(ValueError, match="zeco_gated_delta_rule: method='fla_cp' does not take initial_state"):
        zeco_gated_delta_rule(*(t[:1] for t in args), initial_state=d["h0"][:1], method="fla_cp")
    with pytest.raises(ValueError, match="zeco_gated_delta_rule: method='fla_cp' does not return a final state"):
        zeco_gated_delta_rule(*(t[:1] for t in args), output_final_state=True, method="fla_cp")
    with pytest.raises(ValueError, match=r"zeco_gated_delta_rule: method='fla_cp' needs B = 1.*B = 2"):
        zeco_gated_delta_rule(*args, method="fla_cp")
