"""The delta layers' backward on fla's kernels calls fla's backward steps one by one
(``allscan.ops.delta.fla._backward_steps``), so that the reverse All-Scan runs beside fla's
recomputation of the chunk states. fla's own ``chunk_gated_delta_rule_bwd`` / ``chunk_kda_bwd`` are the
specification: with every step replaced by a recorder (no GPU needed), both must make the same calls,
with the same arguments, in the same order, and return the same results, for every gate option."""
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fla.ops.gated_delta_rule")
pytest.importorskip("fla.ops.kda")

import fla.ops.gated_delta_rule.chunk as fla_gdn  # noqa: E402
import fla.ops.kda.chunk_bwd as fla_kda  # noqa: E402

from allscan.ops.delta import fla as allscan_fla  # noqa: E402
from allscan.ops.delta.chunk import DeltaInputs  # noqa: E402
from allscan.ops.delta.gates import DeltaOptions  # noqa: E402
from allscan.ops.delta.shard import FinalGrads  # noqa: E402

# the steps each backward calls: fla's name in its module -> the name in allscan's fla_functions()
GDN_STEPS = {"recompute_w_u_fwd": "gdn_recompute_w_u_fwd", "chunk_gated_delta_rule_fwd_h": None,
             "chunk_bwd_dv_local": None, "chunk_gated_delta_rule_bwd_dhu": None, "chunk_bwd_dqkwg": None,
             "prepare_wy_repr_bwd": None, "chunk_local_cumsum": None, "gdn_gate_bwd": None}
KDA_STEPS = {"kda_gate_chunk_cumsum": None, "recompute_w_u_fwd": "kda_recompute_w_u_fwd",
             "chunk_gated_delta_rule_fwd_h": None, "chunk_kda_bwd_dAv": None, "chunk_gated_delta_rule_bwd_dhu": None,
             "chunk_kda_bwd_wy_dqkg_fused": None, "chunk_kda_bwd_intra": None, "chunk_local_cumsum": None,
             "kda_gate_bwd": None}


class Recorder:
    """Stand-ins for fla's steps: each call is recorded with its arguments bound to the real step's
    parameters (defaults filled in), tensors by name; each result is a fresh named tensor."""

    def __init__(self, names, heads=1):
        self.heads = heads
        self.names = dict(names)  # id(tensor) -> name
        self.calls = []
        self.made = []

    def name(self, x):
        if isinstance(x, torch.Tensor):
            return self.names.get(id(x), "<unnamed tensor>")
        return x

    def step(self, label, real):
        sig = inspect.signature(inspect.unwrap(real))

        def fake(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            self.calls.append((label, {k: self.name(v) for k, v in bound.arguments.items()}))
            # [B, T, value heads, 1], each with a value of its own (results reshaped by the backward,
            # such as dq and dk summed over grouped value heads, are compared by value)
            outs = tuple(torch.full((1, 1, self.heads, 1), float(len(self.made) + i)) for i in range(_RESULTS[label]))
            for i, t in enumerate(outs):
                self.names[id(t)] = f"{label}[{i}]"
            self.made.extend(outs)  # kept alive: every id stays one tensor's
            return outs if len(outs) > 1 else outs[0]

        return fake


# how many results each step returns (fla-core 0.6.0)
_RESULTS = {"gdn_recompute_w_u_fwd": 2, "chunk_gated_delta_rule_fwd_h": 3, "chunk_bwd_dv_local": 1,
            "chunk_gated_delta_rule_bwd_dhu": 3, "chunk_bwd_dqkwg": 4, "prepare_wy_repr_bwd": 4,
            "chunk_local_cumsum": 1, "gdn_gate_bwd": 3, "kda_gate_chunk_cumsum": 1, "kda_recompute_w_u_fwd": 4,
            "chunk_kda_bwd_dAv": 2, "chunk_kda_bwd_wy_dqkg_fused": 6, "chunk_kda_bwd_intra": 4, "kda_gate_bwd": 3}


def _record(module, steps, fla_call, allscan_call, names, monkeypatch, heads=1):
    """Both backwards on the same named inputs, every step recorded: (fla's calls, results), (allscan's
    calls, results); a result is its name, or the tensor where the backward made it of the steps'."""
    runs = []
    for side in ("fla", "allscan"):
        rec = Recorder(names, heads)
        # each step recorded under allscan's name for it, on both sides
        fakes = {(fla_name if side == "fla" else ours or fla_name): rec.step(ours or fla_name, getattr(module, fla_name))
                 for fla_name, ours in steps.items()}
        with monkeypatch.context() as m:
            if side == "fla":
                for fla_name, fake in fakes.items():
                    m.setattr(module, fla_name, fake)
                out = fla_call()
            else:
                m.setattr(allscan_fla, "fla_functions", lambda: SimpleNamespace(**fakes, RCP_LN2=fla_gdn.RCP_LN2))
                out = allscan_call()
        runs.append((rec.calls, [rec.names.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in out]))
    return runs


def _same_results(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
        else:
            assert a == b


def _inputs(names, value_heads=1):
    """Named stand-in inputs ``[B, T, heads, 1]``: one head of q and k, ``value_heads`` of v and do."""
    ts = {n: torch.zeros(1, 1, value_heads if n in ("v", "do") else 1, 1) for n in names}
    return ts, {id(t): n for n, t in ts.items()}


def _x(t):
    """The named inputs as the backward steps take them."""
    return DeltaInputs(t["q"], t["k"], t["v"], t["g"], t["beta"])


@pytest.mark.parametrize("gate_in_kernel", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_gated_deltanet_backward_steps_are_fla_s(gate_in_kernel, varlen, monkeypatch):
    t, names = _inputs(["q", "k", "v", "g_cum", "g", "beta", "A", "h0", "do", "dht", "cu", "ci", "A_log", "dt_bias"])
    cu, ci = (t["cu"], t["ci"]) if varlen else (None, None)
    opts = DeltaOptions(per_key=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=gate_in_kernel,
                        A_log=t["A_log"] if gate_in_kernel else None, dt_bias=t["dt_bias"] if gate_in_kernel else None)

    def fla_call():
        return inspect.unwrap(fla_gdn.chunk_gated_delta_rule_bwd)(
            q=t["q"], k=t["k"], v=t["v"], g=t["g_cum"], beta=t["beta"], A=t["A"], scale=0.25, initial_state=t["h0"],
            do=t["do"], dht=t["dht"], cu_seqlens=cu, chunk_indices=ci, use_gate_in_kernel=gate_in_kernel,
            g_input=t["g"] if gate_in_kernel else None, A_log=opts.A_log, dt_bias=opts.dt_bias)

    def allscan_call():
        return allscan_fla._backward_steps(_x(t), (t["g_cum"], t["A"]), opts, 0.25, t["h0"], t["do"],
                                           FinalGrads([t["dht"]]), (cu, ci))

    (fla_calls, fla_out), (our_calls, our_out) = _record(fla_gdn, GDN_STEPS, fla_call, allscan_call, names, monkeypatch)
    assert [c[0] for c in our_calls] == [c[0] for c in fla_calls]
    for (label, theirs), (_, ours) in zip(fla_calls, our_calls):
        assert ours == theirs, label
    _same_results(our_out, fla_out)


@pytest.mark.parametrize("value_heads", [1, 2])  # 2: grouped value heads, dq and dk summed over each group
@pytest.mark.parametrize("gate_in_kernel", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_kda_backward_steps_are_fla_s(gate_in_kernel, varlen, value_heads, monkeypatch):
    t, names = _inputs(["q", "k", "v", "g_cum", "g", "beta", "Aqk", "Akk", "h0", "do", "dht", "cu", "ci", "A_log",
                        "dt_bias"], value_heads)
    cu, ci = (t["cu"], t["ci"]) if varlen else (None, None)
    opts = DeltaOptions(per_key=True, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=gate_in_kernel,
                        A_log=t["A_log"] if gate_in_kernel else None, dt_bias=t["dt_bias"] if gate_in_kernel else None,
                        safe_gate=True, lower_bound=-5.0)
    g_cum = None if gate_in_kernel else t["g_cum"]  # what the forward keeps (fla recomputes it with its gate)

    def fla_call():
        return fla_kda.chunk_kda_bwd(
            q=t["q"], k=t["k"], v=t["v"], beta=t["beta"], Aqk=t["Aqk"], Akk=t["Akk"], scale=0.25,
            initial_state=t["h0"], do=t["do"], dht=t["dht"], g=g_cum, g_org=t["g"] if gate_in_kernel else None,
            cu_seqlens=cu, chunk_indices=ci, safe_gate=True, lower_bound=-5.0, use_gate_in_kernel=gate_in_kernel,
            A_log=opts.A_log, dt_bias=opts.dt_bias)

    def allscan_call():
        return allscan_fla._backward_steps(_x(t), (g_cum, t["Aqk"], t["Akk"]), opts, 0.25, t["h0"], t["do"],
                                           FinalGrads([t["dht"]]), (cu, ci))

    (fla_calls, fla_out), (our_calls, our_out) = _record(fla_kda, KDA_STEPS, fla_call, allscan_call, names, monkeypatch,
                                                         heads=value_heads)
    assert [c[0] for c in our_calls] == [c[0] for c in fla_calls]
    for (label, theirs), (_, ours) in zip(fla_calls, our_calls):
        assert ours == theirs, label
    _same_results(our_out, fla_out)


@pytest.mark.parametrize("layer", ["gdn", "kda"])
def test_the_reverse_scan_is_asked_for_where_fla_s_backward_state_kernel_starts(layer, monkeypatch):
    """The final state's gradient is taken after the chunk states' recomputation is issued (the scan
    runs beside it) and before the backward state kernel that reads it."""
    t, names = _inputs(["q", "k", "v", "g_cum", "g", "beta", "A", "Akk", "h0", "do", "dht"])
    order = []

    class Watched(FinalGrads):
        def mark(self):
            order.append("mark")

        def start(self):
            order.append("start")

        def get(self):
            order.append("get")
            return super().get()

    module, steps = (fla_kda, KDA_STEPS) if layer == "kda" else (fla_gdn, GDN_STEPS)
    rec = Recorder(names)
    fakes = {(ours or name): rec.step(ours or name, getattr(module, name)) for name, ours in steps.items()}

    def logged(label):
        def call(*a, **kw):
            order.append(label)
            return fakes[label](*a, **kw)
        return call

    monkeypatch.setattr(allscan_fla, "fla_functions", lambda: SimpleNamespace(**{k: logged(k) for k in fakes}))
    opts = DeltaOptions(per_key=layer == "kda")
    factors = (t["g_cum"], t["A"], t["Akk"]) if layer == "kda" else (t["g_cum"], t["A"])
    allscan_fla._backward_steps(_x(t), factors, opts, 0.25, t["h0"], t["do"], Watched([t["dht"]]))
    recompute = "kda_recompute_w_u_fwd" if layer == "kda" else "gdn_recompute_w_u_fwd"
    local_dv = "chunk_kda_bwd_dAv" if layer == "kda" else "chunk_bwd_dv_local"
    assert order[:7] == [recompute, "mark", "chunk_gated_delta_rule_fwd_h", "start", local_dv, "get",
                         "chunk_gated_delta_rule_bwd_dhu"]


class LaunchRecorder:
    """A stand-in for a Triton kernel: ``kernel[grid](**kwargs)`` is recorded, tensors by name (the
    output ``A`` by its shape, dtype and contents: each side allocates its own)."""

    def __init__(self, names):
        self.names, self.launches = names, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            args = {k: (("A", tuple(v.shape), v.dtype, bool(v.any())) if k == "A" else self.names.get(id(v), "?"))
                    if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self.launches.append((tuple(grid), args, kwargs.get("A")))
        return launch


@pytest.mark.parametrize("value_heads", [1, 2])
def test_gdn_solve_kernel_is_launched_as_fla_s_intra_function_launches_it(value_heads, monkeypatch):
    """The widened Gated DeltaNet forward runs fla's fused kkt + solve kernel itself (then allscan's WY
    kernel, not fla's): it must launch it as fla's ``chunk_gated_delta_rule_fwd_intra`` does for chunk 64
    (grid, arguments, a zeroed ``A`` of k's dtype) and return what it wrote."""
    import fla.ops.gated_delta_rule.chunk_fwd as fla_intra

    T, H, K = 130, 2, 16  # a chunk cut short
    k = torch.randn(1, T, H, K, dtype=torch.bfloat16)
    g, beta = torch.randn(1, T, H * value_heads), torch.rand(1, T, H * value_heads, dtype=torch.bfloat16)
    names = {id(k): "k", id(g): "g", id(beta): "beta"}
    theirs, ours = LaunchRecorder(names), LaunchRecorder(names)
    monkeypatch.setattr(fla_intra, "chunk_gated_delta_rule_fwd_kkt_solve_kernel", theirs)
    monkeypatch.setattr(fla_intra, "IS_INTEL", False)  # fla's fused path, as on NVIDIA GPUs
    monkeypatch.setattr(fla_intra, "recompute_w_u_fwd", lambda **kw: (None, None))
    fla_intra.chunk_gated_delta_rule_fwd_intra(k=k, v=torch.zeros(1, T, H * value_heads, 8), g=g, beta=beta,
                                               chunk_size=64)
    monkeypatch.setattr(allscan_fla, "fla_functions", lambda: SimpleNamespace(gdn_kkt_solve_kernel=ours))
    A = allscan_fla._gdn_solved_factors(k, g, beta)
    assert len(theirs.launches) == 1 and len(ours.launches) == 1
    assert ours.launches[0][:2] == theirs.launches[0][:2]
    assert A is ours.launches[0][2]
