"""Local (one-rank) gated linear attention kernels used by :mod:`allscan.layers.gla`.

Two backends with the same staged interface, so that the sequence-parallel layer can overlap its
All-Scan with the local work:

- :class:`TorchGLA`: chunked GLA written in torch (chunk size 64, fp32 math), backward by autograd
  through a recomputation. Runs anywhere (CPU CI with gloo ranks); it is the oracle for the algorithm.
- :class:`FlaGLA`: flash-linear-attention's (fla-core) Triton kernels for ``chunk_gla``, called stage
  by stage: local cumulative gates and chunk states first (so the final state can be sent as early as
  possible), then the intra-chunk attention and output; in backward, the recomputed states and the
  intra-chunk gradients first, the state-gradient recurrence (which needs the gradient arriving from
  the next rank) last.

Both take the local shard cut into segments (``bounds``: local sequence boundaries ``[0, ..., T]``);
every segment is an independent sequence with its own initial state (``None`` = zeros).

Also here: :func:`recurrent_gla_reference`, the token-by-token float64 reference used by the tests.
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from typing import List, Optional, Sequence

import torch

CHUNK = 64


# ---------------------------------------------------------------------------------------------------
# torch chunked GLA (one segment)
# ---------------------------------------------------------------------------------------------------
def torch_chunk_gla(q, k, v, g, scale: float, h0: Optional[torch.Tensor] = None, chunk: int = CHUNK):
    """Chunked GLA of one sequence in fp32 torch ops (differentiable by autograd).

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: log decays (<= 0); h0: ``[B, H, K, V]`` or None.
    Returns ``(o [B, T, H, V] fp32, h_T [B, H, K, V] fp32)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (x.float() for x in (q, k, v, g))
    pad = (-T) % chunk
    if pad:
        # padding after the sequence (g = 0, k = v = q = 0) changes neither outputs nor final state
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    N = (T + pad) // chunk
    C = chunk
    q = q.view(B, N, C, H, K)
    k = k.view(B, N, C, H, K)
    v = v.view(B, N, C, H, V)
    b = g.view(B, N, C, H, K).cumsum(2)  # within-chunk cumulative log decay (<= 0, decreasing)

    # intra-chunk: A[i, j] = sum_k q_i k_j exp(b_i - b_j), j <= i (exponent <= 0: no overflow)
    diff = b.unsqueeze(3) - b.unsqueeze(2)  # [B, N, C(i), C(j), H, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().view(1, 1, C, C, 1, 1)
    decay = torch.where(causal, diff, torch.full_like(diff, -math.inf)).exp()
    A = torch.einsum("bnihk,bnjhk,bnijhk->bnhij", q, k, decay)
    o = torch.einsum("bnhij,bnjhv->bnihv", A, v)

    # inter-chunk: the state entering each chunk
    h = q.new_zeros(B, H, K, V) if h0 is None else h0.float()
    outs = []
    for n in range(N):
        bn = b[:, n]  # [B, C, H, K]
        outs.append(torch.einsum("bihk,bhkv->bihv", q[:, n] * bn.exp(), h))
        last = bn[:, -1]  # [B, H, K]
        kd = k[:, n] * (last.unsqueeze(1) - bn).exp()
        h = last.exp().unsqueeze(-1) * h + torch.einsum("bjhk,bjhv->bhkv", kd, v[:, n])
    o = (o + torch.stack(outs, 1)) * scale
    return o.reshape(B, N * C, H, V)[:, :T], h


def recurrent_gla_reference(q, k, v, g, scale=None, initial_state=None, cu_seqlens=None):
    """Token-by-token GLA in float64: the reference of the tests.

    g: ``[B, T, H, K]`` (GLA), ``[B, T, H]`` (simple GLA) or None (linear attention).
    With ``cu_seqlens`` (B = 1): every sequence starts from ``initial_state[i]`` (or zeros), and the
    final states are ``[N, H, K, V]``. Returns ``(o float64, final_states float64)``.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.double() for x in (q, k, v))
    if g is None:
        g = torch.zeros(B, T, H, K, dtype=torch.float64, device=q.device)
    elif g.dim() == 3:
        g = g.double().unsqueeze(-1).expand(B, T, H, K)
    g = g.double()
    starts = {0} if cu_seqlens is None else set(int(c) for c in cu_seqlens[:-1])
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    o = torch.zeros(B, T, H, V, dtype=torch.float64, device=q.device)
    finals = []
    for i in range(len(bounds) - 1):
        n = B if cu_seqlens is None else 1
        if initial_state is None:
            h = torch.zeros(n, H, K, V, dtype=torch.float64, device=q.device)
        elif cu_seqlens is None:
            h = initial_state.double().clone()
        else:
            h = initial_state[i:i + 1].double().clone()
        for t in range(bounds[i], bounds[i + 1]):
            h = h * g[:, t].exp().unsqueeze(-1) + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, h)
        finals.append(h)
    del starts
    return o, torch.cat(finals, 0)


# ---------------------------------------------------------------------------------------------------
# the incoming-state terms in torch ops
# ---------------------------------------------------------------------------------------------------
def _decay_factor(q, g, L1):
    """``exp(G_t)`` over the first L1 tokens, broadcastable to ``[B, L1, H, K]`` (None: no decay)."""
    if g is None:
        return None
    e = torch.cumsum(g[:, :L1].float(), dim=1).exp()
    return e.unsqueeze(-1) if e.dim() == 3 else e


def _total(e, like):
    """The total decay over the segment as a multiplier of a ``[B, H, K, V]`` state (None: 1)."""
    if e is None:
        return None
    return e[:, -1].unsqueeze(-1)  # [B, H, K, 1] or [B, H, 1, 1]


def torch_correct_(q, g, o, S_in, scale, L1):
    """In place ``o[:, :L1] += scale * (q * exp(G)) @ S_in``; returns the state multiplier exp(G_L1)."""
    e = _decay_factor(q, g, L1)
    qe = q[:, :L1].float() * scale
    if e is not None:
        qe = qe * e
    o[:, :L1] = (o[:, :L1].float() + torch.einsum("bthk,bhkv->bthv", qe, S_in.float())).to(o.dtype)
    return _total(e, S_in)


def torch_state_grad(q, g, do, scale, L1):
    """``X = scale * sum_t (q_t * exp(G_t)) do_t^T`` over the first L1 tokens, and exp(G_L1)."""
    e = _decay_factor(q, g, L1)
    qe = q[:, :L1].float() * scale
    if e is not None:
        qe = qe * e
    return torch.einsum("bthk,bthv->bhkv", qe, do[:, :L1].float()), _total(e, None)


# ---------------------------------------------------------------------------------------------------
# staged backends
# ---------------------------------------------------------------------------------------------------
class _State:
    """What a backend's forward leaves for the rest of the forward and for the backward."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class TorchGLA:
    """Chunked GLA in torch ops; backward by autograd through a recomputation."""

    name = "torch"

    @staticmethod
    def fwd_states(q, k, v, g, scale, bounds: Sequence[int], h0s: List[Optional[torch.Tensor]]):
        outs, finals = [], []
        with torch.no_grad():
            for j in range(len(bounds) - 1):
                s, e = bounds[j], bounds[j + 1]
                o_j, h_j = torch_chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0s[j])
                outs.append(o_j)
                finals.append(h_j)
        return _State(o=torch.cat(outs, 1), finals=finals)

    @staticmethod
    def fwd_output(st, q, k, v, g, scale, bounds):
        return st.o.to(v.dtype)

    @staticmethod
    def saved(st):
        return None

    # the incoming-state terms over the first L1 tokens (g: the caller's decay, natural log, or None)
    @staticmethod
    def correct(st, q, g, o, S_in, scale, L1):
        return torch_correct_(q, g, o, S_in, scale, L1)

    @staticmethod
    def shard_gamma(st, g):
        return torch.exp(g.float().sum(1))

    @staticmethod
    def bwd_begin(q, k, v, gf, bounds):
        return None

    @staticmethod
    def xgrad(prep, q, g, do, scale, L1):
        return torch_state_grad(q, g, do, scale, L1)

    @staticmethod
    def bwd_prepare(prep, saved, q, k, v, g, scale, bounds, h0s, do):
        return None

    @staticmethod
    def bwd_finish(prep, q, k, v, g, scale, bounds, h0s, do, dhts):
        with torch.enable_grad():
            qq, kk, vv, gg = (x.detach().requires_grad_(True) for x in (q, k, v, g))
            hh = [None if h is None else h.detach().float().requires_grad_(True) for h in h0s]
            outs, roots, grads = [], [], []
            for j in range(len(bounds) - 1):
                s, e = bounds[j], bounds[j + 1]
                o_j, h_j = torch_chunk_gla(qq[:, s:e], kk[:, s:e], vv[:, s:e], gg[:, s:e], scale, hh[j])
                outs.append(o_j)
                if dhts[j] is not None:
                    roots.append(h_j)
                    grads.append(dhts[j].float())
            roots.insert(0, torch.cat(outs, 1))
            grads.insert(0, do.float())
            wrt = [qq, kk, vv, gg] + [h for h in hh if h is not None]
            res = torch.autograd.grad(roots, wrt, grads, allow_unused=True)
        dq, dk, dv, dg = (torch.zeros_like(x) if r is None else r.to(x.dtype) for r, x in zip(res[:4], (q, k, v, g)))
        it = iter(res[4:])
        dh0s = []
        for h in hh:
            if h is None:
                dh0s.append(None)
            else:
                r = next(it)
                dh0s.append(torch.zeros_like(h) if r is None else r)
        return dq, dk, dv, dg, dh0s


_FUSED = {"ok": os.environ.get("ALLSCAN_GLA_FUSED", "1") != "0",
          "output": os.environ.get("ALLSCAN_GLA_FUSED_OUTPUT", "1") != "0"}


def _fused_ok():
    return _FUSED["ok"]


def _fused_failed(e, which="ok"):
    _FUSED[which] = False
    what = "output kernel (with the incoming state folded in)" if which == "output" else "correction"
    instead = "fla's output kernel and the separate correction" if which == "output" else "torch ops"
    warnings.warn(f"allscan.layers.gla: the fused Triton {what} failed ({type(e).__name__}: {e}); "
                  f"using {instead} from now on")


def set_fused_output(enabled: bool) -> None:
    """Fold the incoming state into the output kernel (default) or apply it afterwards with the
    separate correction kernel (benchmarks compare both; ``ALLSCAN_GLA_FUSED_OUTPUT=0`` sets it off)."""
    _FUSED["output"] = bool(enabled)


# ---------------------------------------------------------------------------------------------------
# fla's autotuning: full (fla's default) or one fixed config per kernel
# ---------------------------------------------------------------------------------------------------
# fla-core autotunes every Triton kernel over 8-48 configs, and its autotune key holds the dtype of
# every tensor argument and which optional ones are None (h0, ht, cu_seqlens, ...). Each new key
# compiles and benchmarks every config: a first fwd+bwd of chunk_gla compiles some hundreds of kernels
# (minutes on a fresh machine), and a test that mixes dtypes, varlen and initial states repeats that
# for each combination. "one" keeps fla's own pruning (shape limits, a Hopper miscompile it avoids) and
# then takes the single surviving config closest to BK = BV = 64, 4 warps, 2 stages: one compile per
# kernel specialisation, no benchmarking. Same kernels, same math; only the tiling is fixed.
_PREF_BLOCK, _PREF_WARPS, _PREF_STAGES = 64, 4, 2
_FLA_AUTOTUNE_MODES = ("full", "one")


def _config_cost(cfg) -> float:
    """Distance of a ``triton.Config`` from the preferred tiling (smaller is closer)."""
    cost = 0.0
    for name, val in getattr(cfg, "kwargs", {}).items():
        if name.startswith("B") and isinstance(val, int) and not isinstance(val, bool) and val > 0:
            cost += abs(math.log2(val / _PREF_BLOCK))
    warps = getattr(cfg, "num_warps", None) or _PREF_WARPS
    stages = getattr(cfg, "num_stages", None) or _PREF_STAGES
    return cost + abs(math.log2(warps / _PREF_WARPS)) + 0.5 * abs(stages - _PREF_STAGES)


def _prune_to_one(orig, configs, nargs, **kwargs):
    """An ``early_config_prune`` that runs fla's own pruning, then keeps the closest config."""
    cands = orig(configs, nargs, **kwargs) if orig is not None else configs
    cands = list(cands) or list(configs)
    return [min(cands, key=_config_cost)]  # min is stable: the first of equals


def _autotuner_of(obj, Autotuner, KernelInterface):
    for _ in range(8):  # Heuristics(Autotuner(JITFunction)) or Autotuner(Heuristics(JITFunction))
        if isinstance(obj, Autotuner):
            return obj
        if not isinstance(obj, KernelInterface):
            return None
        obj = getattr(obj, "fn", None)
    return None


def limit_fla_autotune(mode: str = "one") -> int:
    """Set how fla-core's Triton kernels autotune in this process: ``"one"`` (one fixed config per
    kernel, chosen after fla's own pruning: no benchmarking, one compile per specialisation) or
    ``"full"`` (fla's default). Applies to every autotuned kernel of the fla modules imported so far
    (it imports the ones the GLA layer uses first). Returns the number of kernels set. Needs fla-core
    and Triton (CUDA); changes fla for the whole process, so the library never calls it by itself
    unless ``ALLSCAN_FLA_AUTOTUNE`` is set (the tests and benchmarks call it)."""
    if mode not in _FLA_AUTOTUNE_MODES:
        raise ValueError(f"limit_fla_autotune: mode must be one of {_FLA_AUTOTUNE_MODES}, got {mode!r}")
    import sys

    import fla.ops.common.chunk_h  # noqa: F401 - the modules whose kernels the GLA layer runs
    import fla.ops.gla.chunk  # noqa: F401
    import fla.ops.utils.cumsum  # noqa: F401
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    seen = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(mod).values()):
            at = _autotuner_of(obj, Autotuner, KernelInterface)
            if at is None or id(at) in seen:
                continue
            seen.add(id(at))
            if not hasattr(at, "_allscan_orig_prune"):
                at._allscan_orig_prune = getattr(at, "early_config_prune", None)
            orig = at._allscan_orig_prune
            at.early_config_prune = functools.partial(_prune_to_one, orig) if mode == "one" else orig
    return len(seen)


_AUTOTUNE_ENV_DONE: list = []


def _apply_autotune_env():
    """``ALLSCAN_FLA_AUTOTUNE=one|full`` applies :func:`limit_fla_autotune` on the first fla call."""
    if _AUTOTUNE_ENV_DONE:
        return
    _AUTOTUNE_ENV_DONE.append(True)
    mode = os.environ.get("ALLSCAN_FLA_AUTOTUNE")
    if mode:
        limit_fla_autotune(mode)


@functools.lru_cache(maxsize=None)
def fla_available() -> bool:
    try:
        import fla.ops.gla.chunk  # noqa: F401
        return True
    except Exception:  # ImportError, or triton failing to initialise
        return False


class FlaGLA:
    """fla-core's ``chunk_gla`` Triton kernels, called stage by stage (CUDA only)."""

    name = "fla"

    @staticmethod
    def _mods():
        _apply_autotune_env()
        from fla.ops.common.chunk_h import chunk_bwd_dh, chunk_fwd_h
        from fla.ops.gla import chunk as gc
        from fla.ops.utils import prepare_chunk_indices
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum
        return _State(chunk_fwd_h=chunk_fwd_h, chunk_bwd_dh=chunk_bwd_dh, gla=gc,
                      prepare_chunk_indices=prepare_chunk_indices, RCP_LN2=RCP_LN2,
                      chunk_local_cumsum=chunk_local_cumsum)

    @staticmethod
    def _layout(q, bounds):
        T = q.shape[1]
        BT = min(64, max(16, 1 << max(0, (T - 1).bit_length())))  # as fla's ChunkGLAFunction
        if len(bounds) == 2:
            return BT, None, None
        m = FlaGLA._mods()
        cu = torch.tensor(bounds, dtype=torch.long, device=q.device)
        return BT, cu, m.prepare_chunk_indices(cu, BT)

    @staticmethod
    def _stack(hs, like_shape, device):
        if all(h is None for h in hs):
            return None
        if len(hs) == 1:
            return hs[0].float().contiguous()
        return torch.cat([torch.zeros(like_shape, dtype=torch.float, device=device) if h is None else h.float()
                          for h in hs], 0).contiguous()

    @staticmethod
    def _split(ht, n):
        return [ht] if n == 1 else [ht[j:j + 1] for j in range(n)]

    @staticmethod
    def fwd_states(q, k, v, g, scale, bounds, h0s):
        m = FlaGLA._mods()
        BT, cu, ci = FlaGLA._layout(q, bounds)
        B, T, H, K = k.shape
        V = v.shape[-1]
        h0 = FlaGLA._stack(h0s, (1, H, K, V), q.device)
        gcum = m.chunk_local_cumsum(g, BT, scale=m.RCP_LN2, cu_seqlens=cu)
        h, ht = m.chunk_fwd_h(k=k, v=v, g=None, gk=gcum, gv=None, h0=h0, output_final_state=True,
                              cu_seqlens=cu, chunk_size=BT, states_in_fp32=False)
        return _State(gcum=gcum, h=h, BT=BT, cu=cu, ci=ci, finals=FlaGLA._split(ht, len(bounds) - 1))

    @staticmethod
    def fwd_output(st, q, k, v, g, scale, bounds):
        m = FlaGLA._mods()
        A = m.gla.chunk_gla_fwd_intra_gk(q=q, k=k, g=st.gcum, scale=scale, cu_seqlens=st.cu,
                                         chunk_size=st.BT, chunk_indices=st.ci)
        o = m.gla.chunk_gla_fwd_o_gk(q=q, v=v, g=st.gcum, A=A, h=st.h, scale=scale, cu_seqlens=st.cu,
                                     chunk_size=st.BT, chunk_indices=st.ci)
        st.A = A
        st.h = None  # recomputed in backward (in fp32, from the true incoming state), as fla does
        return o

    @staticmethod
    def fused_output_ok():
        return _fused_ok() and _FUSED["output"]

    @staticmethod
    def fwd_intra(st, q, k, scale):
        """The intra-chunk attention only: what the forward computes while the incoming state is in
        flight, when the output is then made by :meth:`fwd_output_with_state`."""
        m = FlaGLA._mods()
        st.A = m.gla.chunk_gla_fwd_intra_gk(q=q, k=k, g=st.gcum, scale=scale, cu_seqlens=st.cu,
                                            chunk_size=st.BT, chunk_indices=st.ci)

    @staticmethod
    def fwd_output_with_state(st, q, v, S_in, scale, L1):
        """The output with the incoming state of the first local segment folded in (one kernel);
        returns (o, the segment's total decay as a state multiplier). None if the kernel failed (the
        caller then takes fla's output kernel and the separate correction)."""
        try:
            from ._gla_triton import output_with_state
            offs = FlaGLA._offsets(st, L1)
            o = output_with_state(q, v, st.gcum, st.A, st.h, S_in, scale, st.BT, offs, cu_seqlens=st.cu,
                                  chunk_indices=st.ci)
        except Exception as e:  # noqa: BLE001 - a Triton failure must not stop training
            _fused_failed(e, "output")
            return None
        st.h = None
        return o, offs[1].unsqueeze(-1)

    @staticmethod
    def saved(st):
        return st.A

    @staticmethod
    def _offsets(st, L1):
        """chunk_offsets of the forward's gates over the first L1 tokens, computed once per forward
        (the All-Scan's decay and the output correction use the same ones)."""
        from ._gla_triton import chunk_offsets
        if getattr(st, "offs_L1", None) != L1:
            st.offs, st.offs_L1 = chunk_offsets(st.gcum, L1, st.BT), L1
        return st.offs

    @staticmethod
    def correct(st, q, g, o, S_in, scale, L1):
        if _fused_ok():
            try:
                from ._gla_triton import correct_output_
                return correct_output_(o, q, st.gcum, S_in, scale, L1, st.BT,
                                       offsets=FlaGLA._offsets(st, L1)).unsqueeze(-1)
            except Exception as e:  # noqa: BLE001 - a Triton failure must not stop training
                _fused_failed(e)
        return torch_correct_(q, g, o, S_in, scale, L1)

    @staticmethod
    def shard_gamma(st, g):
        # the shard is one segment here; its total decay from fla's chunk-local cumulative gates
        e = FlaGLA._offsets(st, st.gcum.shape[1])[1]  # [B, H, K]
        return e[..., 0].contiguous() if g.dim() == 3 else e  # simple GLA: [B, H], as on every other rank

    @staticmethod
    def bwd_begin(q, k, v, gf, bounds):
        m = FlaGLA._mods()
        BT, cu, ci = FlaGLA._layout(q, bounds)
        gcum = m.chunk_local_cumsum(gf, BT, scale=m.RCP_LN2, cu_seqlens=cu)
        return _State(BT=BT, cu=cu, ci=ci, gcum=gcum)

    @staticmethod
    def xgrad(prep, q, g, do, scale, L1):
        if _fused_ok():
            try:
                from ._gla_triton import state_grad
                X, e = state_grad(q, prep.gcum, do, scale, L1, prep.BT)
                return X, e.unsqueeze(-1)
            except Exception as e:  # noqa: BLE001
                _fused_failed(e)
        return torch_state_grad(q, g, do, scale, L1)

    @staticmethod
    def bwd_prepare(prep, saved_A, q, k, v, g, scale, bounds, h0s, do):
        """Everything of the local backward that does not need the gradient of the final state."""
        m = FlaGLA._mods()
        BT, cu, ci, gcum = prep.BT, prep.cu, prep.ci, prep.gcum
        B, T, H, K = k.shape
        V = v.shape[-1]
        h0 = FlaGLA._stack(h0s, (1, H, K, V), q.device)
        h, _ = m.chunk_fwd_h(k=k, v=v, g=None, gk=gcum, gv=None, h0=h0, output_final_state=False,
                             cu_seqlens=cu, chunk_size=BT, states_in_fp32=True)
        dA = m.gla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, cu_seqlens=cu, chunk_size=BT, chunk_indices=ci)
        dq, dk = m.gla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=gcum, dA=dA, cu_seqlens=cu, chunk_size=BT,
                                               chunk_indices=ci)
        return _State(BT=BT, cu=cu, ci=ci, h0=h0, gcum=gcum, h=h, dq=dq, dk=dk, A=saved_A)

    @staticmethod
    def bwd_finish(p, q, k, v, g, scale, bounds, h0s, do, dhts):
        m = FlaGLA._mods()
        B, T, H, K = k.shape
        V = v.shape[-1]
        dht = FlaGLA._stack(dhts, (1, H, K, V), q.device)
        dh, dh0 = m.chunk_bwd_dh(q=q, k=k, v=v, do=do, h0=p.h0, dht=dht, scale=scale, g=None, gk=p.gcum,
                                 gv=None, cu_seqlens=p.cu, chunk_size=p.BT, states_in_fp32=True)
        dv = m.gla.chunk_gla_bwd_dv(k=k, g=p.gcum, A=p.A, do=do, dh=dh, cu_seqlens=p.cu, chunk_size=p.BT,
                                    chunk_indices=p.ci)
        dq, dk, dg = m.gla.chunk_gla_bwd_dqkg(q=q, k=k, v=v, h=p.h, g=p.gcum, do=do, dh=dh, dq=p.dq, dk=p.dk,
                                              scale=scale, cu_seqlens=p.cu, chunk_size=p.BT, chunk_indices=p.ci)
        n = len(bounds) - 1
        if dh0 is None:
            dh0s = [None] * n
        else:
            parts = FlaGLA._split(dh0, n)
            dh0s = [None if h is None else parts[j] for j, h in enumerate(h0s)]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, dh0s
