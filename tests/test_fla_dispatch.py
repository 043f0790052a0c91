"""allscan.ops.fla_dispatch: fla's kernel entry points called past its backend dispatcher exactly where
the dispatcher would fall back to them (CPU: fla's dispatcher and registries, no kernel runs)."""
import os

import pytest

from allscan.ops.fla_dispatch import direct, falls_back

backends = pytest.importorskip("fla.backends")


def _entry():
    """A dispatched entry point of its own (a registry of its own: fla's stay untouched)."""
    def scaled(x):
        return x + 1
    return scaled, backends.dispatch(scaled)


def test_no_backend_means_the_function_itself():
    inner, dispatched = _entry()
    assert dispatched is not inner and dispatched(1) == 2
    assert falls_back(dispatched)
    assert direct(dispatched) is inner


def test_a_backend_that_would_run_keeps_the_dispatcher():
    inner, dispatched = _entry()

    @backends.register(dispatched)
    class Always(backends.BaseBackend):
        backend_type = "allscan_test_always"

        def scaled(self, x):
            return x + 2

    assert dispatched(1) == 3  # the dispatcher runs the backend...
    assert not falls_back(dispatched)
    assert direct(dispatched) is dispatched  # ...so allscan calls the dispatcher too


@pytest.mark.parametrize("why", ["unavailable", "disabled", "other function"])
def test_a_backend_that_would_not_run_is_skipped(why, monkeypatch):
    inner, dispatched = _entry()
    monkeypatch.delenv("ALLSCAN_TEST_BACKEND", raising=False)

    class Never(backends.BaseBackend):
        backend_type = "allscan_test_never"
        env_var = "ALLSCAN_TEST_BACKEND"
        default_enable = why != "disabled"

        @classmethod
        def is_available(cls):
            return why != "unavailable"

    if why == "other function":
        Never.another = lambda self, x: x + 3
    else:
        Never.scaled = lambda self, x: x + 3
    backends.register(dispatched)(Never)
    assert dispatched(1) == 2  # the dispatcher falls back, as allscan's direct call does
    assert falls_back(dispatched)
    assert direct(dispatched) is inner


def test_other_wrappers_are_kept():
    from fla.utils import input_guard

    inner, dispatched = _entry()
    guarded = input_guard(dispatched)
    assert falls_back(guarded)  # the dispatcher inside would fall back...
    assert direct(guarded) is guarded  # ...but the guard does work of its own


def test_plain_functions_are_left_alone():
    def plain(x):
        return x
    assert not falls_back(plain)
    assert direct(plain) is plain


dispatch_on = pytest.mark.skipif(os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1",
                                 reason="fla's dispatcher switched off: nothing to go past")


@dispatch_on
def test_the_gla_stages_call_fla_past_its_dispatcher():
    # fla-core 0.6 registers no backend for these on CPU or on CUDA (only Ascend and opt-in ones)
    pytest.importorskip("fla.ops.gla.chunk")
    import inspect

    from fla.ops.common import chunk_h
    from fla.ops.gla import chunk as gc
    from fla.ops.utils.cumsum import chunk_local_cumsum, chunk_local_cumsum_vector

    from allscan.ops.gla.fla import FlaGLA

    m = FlaGLA._mods()
    for name in ("chunk_gla_fwd_intra_gk", "chunk_gla_fwd_o_gk", "chunk_gla_bwd_dA", "chunk_gla_bwd_dqk_intra",
                 "chunk_gla_bwd_dv", "chunk_gla_bwd_dqkg"):
        assert falls_back(getattr(gc, name)), name
        assert getattr(m.gla, name) is inspect.unwrap(getattr(gc, name)), name
    for name in ("chunk_fwd_h", "chunk_bwd_dh"):
        assert getattr(m, name) is inspect.unwrap(getattr(chunk_h, name)), name
    assert falls_back(chunk_local_cumsum)
    assert m.chunk_local_cumsum is chunk_local_cumsum_vector


@dispatch_on
def test_the_delta_steps_call_fla_past_its_dispatcher():
    pytest.importorskip("fla.ops.gated_delta_rule")
    import inspect

    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_fwd_o
    from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused

    from allscan.ops.delta.fla_imports import fla_functions

    fns = fla_functions()
    # chunk_bwd_dqkwg and chunk_kda_bwd_wy_dqkg_fused are the steps fla's TileLang backend implements
    for name, fn in (("chunk_gated_delta_rule_fwd_h", chunk_gated_delta_rule_fwd_h), ("chunk_fwd_o", chunk_fwd_o),
                     ("chunk_gated_delta_rule_bwd_dhu", chunk_gated_delta_rule_bwd_dhu),
                     ("chunk_bwd_dqkwg", chunk_bwd_dqkwg), ("chunk_kda_bwd_wy_dqkg_fused", chunk_kda_bwd_wy_dqkg_fused)):
        assert getattr(fns, name) is direct(fn), name  # fla_functions resolves every fla entry point
        if name in ("chunk_gated_delta_rule_fwd_h", "chunk_fwd_o"):  # dispatched, with no backend that runs
            assert falls_back(fn) or os.environ.get("FLA_INTRACARD_CP", "0") != "0", name  # (fla-core 0.6)
        if falls_back(fn):
            assert getattr(fns, name) is inspect.unwrap(fn), name
