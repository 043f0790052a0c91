"""A layer call repeated with arguments its checks cannot tell apart skips the checks
(:func:`allscan.ops._shards.checked_cut`), and only where the cross-rank check itself is made once per
signature: one process, or NCCL with ``ALLSCAN_CHECK`` first / trust / never. Anything the checks read
that differs (a shape, a dtype, an option, whether the inputs need gradients) checks again, so bad
arguments still raise; packed sequences, ``ALLSCAN_CHECK=always``, options that are not plain Python
values and gloo groups (whose peers exchange their signatures every call) check every call; where the
signature is checked once (NCCL, emulated on gloo), a call checks again once its signature is evicted,
as every rank's repeated check then does; the cuts are forgotten with the collectives' plans. The
layers compute in their own precision under autocast. On CPU: GLA and Gated DeltaNet."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

import allscan  # noqa: E402
import allscan._agreement as agreement  # noqa: E402
import allscan.ops.delta.prepare as delta_prepare  # noqa: E402
import allscan.ops.gla.checks as gla_checks  # noqa: E402
from allscan._settings import settings  # noqa: E402
from allscan.layers import zeco_gated_delta_rule  # noqa: E402
from allscan.ops.gla import zeco_gla  # noqa: E402

H, K, V = 2, 8, 4


class _Counted:
    """Wraps a module's check function, counting its calls."""

    def __init__(self, module, name):
        self.module, self.name, self.real, self.calls = module, name, getattr(module, name), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)

    def __enter__(self):
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.real)
        return False


def _gla(T=16, B=1, grad=False, g_dim=4):
    q, k = (torch.randn(B, T, H, K, requires_grad=grad) for _ in range(2))
    v = torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) if g_dim == 4 else torch.randn(B, T, H))
    return q, k, v, g


def _gdn(T=16, B=1):
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, dtype=torch.float64))
    beta = torch.rand(B, T, H, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.fixture
def env(monkeypatch):
    """Environment variables for one test, the settings re-read after it."""
    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


@pytest.fixture(autouse=True)
def _fresh_cuts():
    allscan.destroy_communicators()  # forgets the cuts with the plans
    yield
    allscan.destroy_communicators()


def test_gla_repeated_call_checks_once_and_gives_the_same_answer():
    q, k, v, g = _gla()
    with _Counted(gla_checks, "check_arguments") as checks:
        o1, _ = zeco_gla(q, k, v, g)
        o2, _ = zeco_gla(q, k, v, g)
        assert checks.calls == 1
        assert torch.equal(o1, o2)
        zeco_gla(*_gla(T=24))  # another length: checked
        assert checks.calls == 2
        zeco_gla(*_gla(g_dim=3))  # simple GLA's decay shape: checked
        zeco_gla(*_gla(grad=True))  # inputs that need gradients: another signature
        zeco_gla(q, k, v, g, initial_state=torch.zeros(1, H, K, V))
        zeco_gla(q, k, v, g, method="lasp2")
        assert checks.calls == 6
        zeco_gla(q, k, v, g, method="lasp2")
        zeco_gla(*_gla(g_dim=3))
        assert checks.calls == 6
        # a bad argument after good calls of the same shapes still raises, naming it
        with pytest.raises(ValueError, match="k must have q's shape"):
            zeco_gla(q, k[:, :8], v, g)
        with pytest.raises(ValueError, match="initial_state must be float32"):
            zeco_gla(q, k, v, g, initial_state=torch.zeros(1, H, K, V, dtype=torch.float64))
        with pytest.raises(ValueError, match="method must be one of"):
            zeco_gla(q, k, v, g, method="ring")
        with pytest.raises(ValueError, match="4-D tensor"):
            zeco_gla(q, k, v[0], g)
        allscan.destroy_communicators()
        zeco_gla(q, k, v, g)  # forgotten with the plans: checked again
        assert checks.calls == 11


def test_gla_checks_every_call_with_packed_sequences_or_check_always(env):
    q, k, v, g = _gla()
    cu = torch.tensor([0, 5, 16])
    with _Counted(gla_checks, "check_arguments") as checks:
        zeco_gla(q, k, v, g, cu_seqlens=cu)
        zeco_gla(q, k, v, g, cu_seqlens=cu)
        assert checks.calls == 2  # the cut reads cu_seqlens' values
        with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at"):
            zeco_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 5, 15]))
        env.setenv("ALLSCAN_CHECK", "always")
        settings.reload()
        zeco_gla(q, k, v, g)
        zeco_gla(q, k, v, g)
        assert checks.calls == 5
        env.setenv("ALLSCAN_CHECK", "first")
        settings.reload()
        zeco_gla(q, k, v, g)
        zeco_gla(q, k, v, g)
        assert checks.calls == 6


def test_delta_repeated_call_checks_once():
    q, k, v, g, beta = _gdn()
    with _Counted(delta_prepare, "_validate") as checks, _Counted(delta_prepare, "_check_gate_options") as gates:
        o1, _ = zeco_gated_delta_rule(q, k, v, g, beta)
        o2, _ = zeco_gated_delta_rule(q, k, v, g, beta)
        assert (checks.calls, gates.calls) == (1, 1)
        assert torch.equal(o1, o2)
        zeco_gated_delta_rule(q, k, v, g, beta, output_final_state=True)  # another option: checked
        zeco_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        assert checks.calls == 3
        zeco_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        assert checks.calls == 3
        with pytest.raises(ValueError, match="beta must be"):
            zeco_gated_delta_rule(q, k, v, g, beta[:, :8])
        with pytest.raises(ValueError, match="A_log and dt_bias are read only with use_gate_in_kernel=True"):
            zeco_gated_delta_rule(q, k, v, g, beta, A_log=torch.zeros(H, dtype=torch.float64))
        with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True"):
            zeco_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
        assert checks.calls == 6
        zeco_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 7, 16]))
        zeco_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 7, 16]))
        assert checks.calls == 8  # packed sequences: every call


def _run_gloo_checks_every_call(rank, world):
    """On gloo the peers exchange their signatures every call (ALLSCAN_CHECK=first exchanges once only
    on NCCL): a repeated call must still check and exchange, so that a rank whose arguments change
    is caught on every rank."""
    torch.manual_seed(0)
    q, k, v, g = _gla()
    with _Counted(gla_checks, "check_arguments") as checks:
        for _ in range(3):
            zeco_gla(q, k, v, g, dist.group.WORLD)
        assert checks.calls == 3
    v2 = torch.randn(1, 16, H, V + rank)
    with pytest.raises(ValueError, match=r"ranks passed different arguments.*V \(rank 0: 4, rank 1: 5\)"):
        zeco_gla(q, k, v2, g, dist.group.WORLD)
    qd, kd, vd, gd, beta = _gdn()
    with _Counted(delta_prepare, "_validate") as checks:
        for _ in range(2):
            zeco_gated_delta_rule(qd, kd, vd, gd, beta)
        assert checks.calls == 2


def test_gloo_groups_check_every_call():
    run_distributed(_run_gloo_checks_every_call, 2, timeout=120)


def test_options_that_are_tensors_check_every_call():
    """An option read by value (a flag, a bound) passed as a tensor: its key would hold its shape, not
    its value, so such calls check every call."""
    q, k, v, g, beta = _gdn()
    with _Counted(delta_prepare, "_validate") as checks:
        for _ in range(2):
            zeco_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=torch.tensor(True))
        assert checks.calls == 2


def test_layers_compute_in_their_own_precision_under_autocast():
    """Under the caller's autocast (here CPU bf16) a layer computes as without it."""
    q, k, v, g = _gla()
    qd, kd, vd, gd, beta = (t.float() for t in _gdn())
    o_gla, _ = zeco_gla(q, k, v, g)
    o_gdn, _ = zeco_gated_delta_rule(qd, kd, vd, gd, beta)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
        a_gla, _ = zeco_gla(q, k, v, g)
        a_gdn, _ = zeco_gated_delta_rule(qd, kd, vd, gd, beta)
        assert torch.is_autocast_enabled("cpu")  # restored after each call
    assert a_gla.dtype == o_gla.dtype and torch.equal(a_gla, o_gla)
    assert a_gdn.dtype == o_gdn.dtype and torch.equal(a_gdn, o_gdn)


def _run_once_per_signature(rank, world):
    """gloo made to check each signature once, as on NCCL: repeated calls skip the checks and the
    cross-rank check on every rank; once the signature is evicted (here: forgotten on every rank),
    the next call checks and exchanges again on every rank, as the repeated cross-rank check would."""
    agreement._on_nccl = lambda group, device: True  # this process only: the NCCL rules on gloo
    torch.manual_seed(0)
    q, k, v, g = _gla()
    with _Counted(gla_checks, "check_arguments") as checks, _Counted(gla_checks, "check_across_ranks") as across:
        for _ in range(3):
            zeco_gla(q, k, v, g, dist.group.WORLD)
        assert (checks.calls, across.calls) == (1, 1)
        agreement.clear_checked_signatures()
        for _ in range(2):
            zeco_gla(q, k, v, g, dist.group.WORLD)
        assert (checks.calls, across.calls) == (2, 2)
    # both ranks change their arguments (a new key on each): both check, and the difference raises on
    # both (a rank repeating a cached call while a peer changes its arguments is left to the scan's
    # in-band signature, as with the cross-rank check's own cache)
    v2 = torch.randn(1, 16, H, V + 1 + rank)
    with pytest.raises(ValueError, match=r"ranks passed different arguments.*V \(rank 0: 5, rank 1: 6\)"):
        zeco_gla(q, k, v2, g, dist.group.WORLD)


def test_signature_checked_once_skips_until_evicted():
    run_distributed(_run_once_per_signature, 2, timeout=120)


def _run_packed_cuts_differ(rank, world):
    """Ranks passing different packed cuts (the same number of sequences) raise on every rank, also where
    each cut was checked before and the signature check is otherwise once per signature (NCCL's rules,
    emulated on gloo): packed calls compare their whole cut on every call."""
    agreement._on_nccl = lambda group, device: True
    torch.manual_seed(0)
    q, k, v, g = _gla(T=16)
    qd, kd, vd, gd, beta = _gdn(T=16)
    cut_a, cut_b = torch.tensor([0, 5, 32]), torch.tensor([0, 20, 32])
    for cu in (cut_a, cut_b):  # each cut alike on both ranks: checked, cached
        zeco_gla(q, k, v, g, dist.group.WORLD, cu_seqlens=cu)
        zeco_gated_delta_rule(qd, kd, vd, gd, beta, group=dist.group.WORLD, cu_seqlens=cu)
    mine = cut_a if rank == 0 else cut_b
    with pytest.raises(ValueError, match=r"packed sequence boundaries"):
        zeco_gla(q, k, v, g, dist.group.WORLD, cu_seqlens=mine)
    with pytest.raises(ValueError, match=r"packed sequence boundaries"):
        zeco_gated_delta_rule(qd, kd, vd, gd, beta, group=dist.group.WORLD, cu_seqlens=mine)


def test_ranks_with_different_packed_cuts_raise_on_every_rank():
    run_distributed(_run_packed_cuts_differ, 2, timeout=120)
