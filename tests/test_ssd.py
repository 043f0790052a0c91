"""Mamba2's SSD as a sequence-parallel op (:func:`allscan.ops.ssd.zeco_ssd`) on CPU: gloo ranks against the
float64 recurrence on the whole sequence (:func:`allscan.ssd_reference.ssd_recurrence`).

Checked at P = 1 (in process), and P = 4, 3 and 2 in one spawn of four ranks (subgroups): y, the final
states, and the gradients of x, dt, A, B, C, D and the initial state; groups of B and C shared by several
heads; packed rows with sequence starts inside shards and one exactly on a rank boundary; the methods
lasp1 and lasp2; bad arguments raise naming the argument, one rank's on every rank.
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

from allscan.ops import LOCAL  # noqa: E402
from allscan.ops.ssd import zeco_ssd  # noqa: E402
from allscan.ssd_reference import ssd_recurrence  # noqa: E402

H, N = 4, 3  # heads, state size
TOL = 1e-10  # float64 inputs run in float64 (zeco_gla's torch backend): against float64, relative to the largest
F64 = torch.float64


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _data(seed, b, T, G, hd, n_h0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x, dt = rnd(b, T, H, hd), F.softplus(rnd(b, T, H) - 1.0)
    A, B, C, D = -torch.exp(0.5 * rnd(H)), rnd(b, T, G, N), rnd(b, T, G, N), rnd(H)
    h0 = rnd(n_h0, H, hd, N)  # float64, as the inputs
    return x, dt, A, B, C, D, h0, rnd(b, T, H, hd)


def _final_rows(cu, rank, T_local):
    """The packed sequences that end on ``rank`` (their final states are returned there)."""
    return [i for i in range(len(cu) - 1) if rank * T_local < cu[i + 1] <= (rank + 1) * T_local]


def _reference(ins, dy, dfinals, cu, T_local, world):
    """float64 y, every rank's final state and the gradients of ``ins`` (x, dt, A, B, C, D, h0) for the loss
    sum(y dy) + sum_p <final_p, dfinal_p>."""
    ins = [t.detach().double().requires_grad_(True) for t in ins]
    x, dt, A, B, C, D, h0 = ins
    y, fin = ssd_recurrence(x, dt, A, B, C, D, initial_state=h0, cu_seqlens=cu)
    loss = (y * dy).sum()
    if cu is None:  # the state after each rank's last token: the recurrence on the prefix
        finals = []
        for p in range(world):
            e = (p + 1) * T_local
            finals.append(ssd_recurrence(x[:, :e], dt[:, :e], A, B[:, :e], C[:, :e], initial_state=h0)[1])
    else:
        finals = [fin] * world
    loss = loss + sum((f * d.double()).sum() for f, d in zip(finals, dfinals))
    return y.detach(), [f.detach() for f in finals], torch.autograd.grad(loss, ins)


def _check_case(rank, world, group, case):
    b, G, hd, T_local, cu_list = case["b"], case["G"], case["hd"], case["T_local"], case["cu"]
    cu = None if cu_list is None else torch.tensor(cu_list)
    n_h0 = b if cu is None else len(cu_list) - 1
    x, dt, A, B, C, D, h0, dy = _data(17 + hd + world, b, T_local * world, G, hd, n_h0)
    gen = torch.Generator().manual_seed(5)
    dfinals = [torch.randn(n_h0, H, hd, N, generator=gen) for _ in range(world)]
    if cu is not None:  # a row's final state is returned (and its gradient given) where its sequence ends
        for p in range(world):
            keep = torch.zeros(n_h0, 1, 1, 1)
            keep[_final_rows(cu_list, p, T_local)] = 1
            dfinals[p] = dfinals[p] * keep
    ref_y, ref_finals, ref_grads = _reference((x, dt, A, B, C, D, h0), dy, dfinals, cu_list, T_local, world)
    sl = slice(rank * T_local, (rank + 1) * T_local)
    for method in case["methods"]:
        tag = f"{method} {case} P={world} rank={rank}"
        ins = [t[:, sl].clone().requires_grad_(True) for t in (x, dt)]
        ins += [A.clone().requires_grad_(True)]
        ins += [t[:, sl].clone().requires_grad_(True) for t in (B, C)]
        ins += [t.clone().requires_grad_(True) for t in (D, h0)]
        y, fin = zeco_ssd(*ins[:6], group, initial_state=ins[6], output_final_state=True, cu_seqlens=cu,
                          method=method)
        assert y.shape == x[:, sl].shape and y.dtype == F64, tag
        assert _rel(y, ref_y[:, sl]) < TOL, f"y: {tag}"
        assert fin.shape == (n_h0, H, hd, N) and fin.dtype == F64, tag
        if cu is None:
            assert _rel(fin, ref_finals[rank]) < TOL, f"final state: {tag}"
        else:
            ends = _final_rows(cu_list, rank, T_local)
            for i in range(n_h0):
                if i in ends:
                    assert _rel(fin[i], ref_finals[0][i]) < TOL, f"final state row {i}: {tag}"
                else:
                    assert torch.count_nonzero(fin[i]) == 0, f"final row {i} ends elsewhere: {tag}"
        loss = (y * dy[:, sl]).sum() + (fin * dfinals[rank]).sum()
        grads = torch.autograd.grad(loss, ins)
        for name, got, want in zip(("x", "dt", "A", "B", "C", "D", "initial_state"), grads, ref_grads):
            if name in ("x", "dt", "B", "C"):  # sharded: this rank's slice
                want = want[:, sl]
            elif world > 1:  # replicated (A, D) or used where a sequence starts: summed over the ranks
                got = got.clone()
                dist.all_reduce(got, group=group)
            assert got.shape == want.shape, f"d{name} shape: {tag}"
            assert _rel(got, want) < TOL, f"d{name}: {tag}: {_rel(got, want)}"


def _cases(world):
    """Every behaviour once: groups shared by heads (G < H) and batch 2; a packed row whose starts fall
    inside shards and one exactly on a rank boundary (P > 1 ranks); head dims 2 and 4."""
    T_local = 70 if world == 1 else 20  # one process: more than one 64-token chunk
    T = world * T_local
    packed = [0, 7, T_local, T_local + 13, T] if world > 1 else [0, 7, 40, T]
    return [dict(b=2, G=2, hd=2 if world != 4 else 4, T_local=T_local, cu=None, methods=["zeco"]),
            dict(b=1, G=1, hd=2, T_local=T_local, cu=packed, methods=["zeco"])]


def _run_pairs(rank, group):
    """P = 2 (ranks 0, 1 and 2, 3 at once): every case, the baselines' methods, and one rank's bad
    argument raising there and on its peer (then the group still works)."""
    for case in _cases(2):
        _check_case(rank % 2, 2, group, case)
    _check_case(rank % 2, 2, group, dict(b=1, G=4, hd=2, T_local=20, cu=None, methods=["lasp1", "lasp2"]))
    x, dt, A, B, C, D, _, _ = _data(3, 1, 8, 2, 2, 1)
    bad = rank % 2 == 1
    with pytest.raises(ValueError, match=r"dt must be" if bad else r"rank\(s\) \[1\] rejected"):
        zeco_ssd(x, dt[:, :7] if bad else dt, A, B, C, D, group)
    cu = torch.tensor([0, 5, 16])
    bad_B = torch.cat([B, B[:, :, :1]], 2) if bad else B  # G = 3 does not divide H = 4
    with pytest.raises(ValueError, match=r"multiple of the groups G = 3" if bad else r"rank\(s\) \[1\]"):
        zeco_ssd(x, dt, A, bad_B, C, D, group, cu_seqlens=cu)
    y, _ = zeco_ssd(x, dt, A, B, C, D, group, cu_seqlens=cu)
    assert y.shape == x.shape
    # valid on each rank, but not the same call: B and C in other groups, a skip term on one rank only
    with pytest.raises(ValueError, match=r"groups of B and C \(G\)"):
        zeco_ssd(x, dt, A, B[:, :, :1] if bad else B, C[:, :, :1] if bad else C, D, group)
    with pytest.raises(ValueError, match="D given"):
        zeco_ssd(x, dt, A, B, C, None if bad else D, group, cu_seqlens=cu)
    # the batch's context instead of group and cu_seqlens: the same result, initial states by its sequences
    from allscan import SequenceContext

    ctx = SequenceContext(group, cu_seqlens=cu)
    h0 = torch.randn(2, H, 2, N, dtype=F64)
    want = zeco_ssd(x, dt, A, B, C, D, group, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    got = zeco_ssd(x, dt, A, B, C, D, context=ctx, initial_state=h0, output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"initial_state must be \[num_seqs, H, P, N\]"
                       if bad else r"rank\(s\) \[1\]"):
        zeco_ssd(x, dt, A, B, C, D, context=ctx, initial_state=h0[:1] if bad else h0)
    with pytest.raises(ValueError, match="context= and cu_seqlens= given together"):
        zeco_ssd(x, dt, A, B, C, D, context=ctx, cu_seqlens=cu)


def _run_spawned(rank, world):
    """One spawn of four ranks: P = 4 on the whole group, P = 3 on ranks 0..2, P = 2 on two pairs."""
    for case in _cases(world):
        _check_case(rank, world, dist.group.WORLD, case)
    # P = 3: packed, starts inside shards, one on a rank boundary, a sequence over three ranks
    triple = dist.new_group([0, 1, 2])
    if rank < 3:
        _check_case(rank, 3, triple, dict(b=1, G=2, hd=3, T_local=20, cu=[0, 20, 23, 60], methods=["zeco"]))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _run_pairs(rank, pairs[rank // 2])


def test_zeco_ssd_one_process():
    for case in _cases(1):
        _check_case(0, 1, None, case)
    _check_case(0, 1, LOCAL, dict(b=1, G=1, hd=1, T_local=30, cu=None, methods=["zeco"]))


def test_zeco_ssd_two_three_and_four_ranks():
    run_distributed(_run_spawned, 4, timeout=300)


def test_bad_arguments_name_the_argument():
    x, dt, A, B, C, D, h0, _ = _data(1, 1, 8, 2, 2, 1)
    cases = [
        (dict(x=x[0]), "x must be"),
        (dict(dt=dt[..., :3]), "dt must be"),
        (dict(dt=dt.long()), "dt must be a floating-point"),
        (dict(A=A[:3]), "A must be"),
        (dict(B=B[:, :7]), "B must be"),
        (dict(B=torch.cat([B, B[:, :, :1]], 2), C=torch.cat([C, C[:, :, :1]], 2)), "multiple of the groups"),
        (dict(C=C[..., :2]), "C must have B's shape"),
        (dict(B=B.float()), "B must have x's dtype"),
        (dict(D=D[:2]), "D must be"),
        (dict(initial_state=h0[..., :2]), "initial_state must be"),
        (dict(initial_state=h0.float()), "initial_state must be float64 for torch.float64 inputs"),
        (dict(method="ring"), "method must be one of"),
        (dict(cu_seqlens=[0, 8]), "cu_seqlens must be"),
        (dict(cu_seqlens=torch.tensor([0, 3, 9])), "cu_seqlens must start at 0 and end at"),
    ]
    for change, message in cases:
        args = dict(x=x, dt=dt, A=A, B=B, C=C, D=D)
        kwargs = {}
        for k, v in change.items():
            (args if k in args else kwargs)[k] = v
        with pytest.raises((ValueError, TypeError), match=message):
            zeco_ssd(*args.values(), **kwargs)
