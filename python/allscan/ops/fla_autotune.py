"""How fla-core's Triton kernels autotune in this process (``ALLSCAN_FLA_AUTOTUNE``), for the GLA and the
delta-rule ops alike: :func:`limit_fla_autotune` (also :func:`allscan.ops.gla.limit_fla_autotune`) and
:func:`apply_autotune_setting`, which every fla call of the ops runs first.
"""
from __future__ import annotations

import functools
import math
import sys

from .._settings import settings

__all__ = ["FLA_AUTOTUNE_MODES", "limit_fla_autotune", "apply_autotune_setting"]

# fla-core autotunes every Triton kernel over 8-48 configs, and its autotune key holds the dtype of
# every tensor argument and which optional ones are None (h0, ht, cu_seqlens, ...). Each new key
# compiles and benchmarks every config: a first fwd+bwd of chunk_gla compiles some hundreds of kernels
# (minutes on a fresh machine), and a test that mixes dtypes, varlen and initial states repeats that
# for each combination. "one" keeps fla's own pruning (shape limits, a Hopper miscompile it avoids) and
# then takes the single surviving config closest to BK = BV = 64, 4 warps, 2 stages: one compile per
# kernel specialisation, no benchmarking. Same kernels, same math; only the tiling is fixed.
_PREF_BLOCK, _PREF_WARPS, _PREF_STAGES = 64, 4, 2
FLA_AUTOTUNE_MODES = ("full", "one")


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
    (it imports the ones the GLA and delta-rule layers use first). Returns the number of kernels set. Needs fla-core
    and Triton (CUDA); changes fla for the whole process, so the library never calls it by itself
    unless ``ALLSCAN_FLA_AUTOTUNE`` is set (the tests and benchmarks call it)."""
    if mode not in FLA_AUTOTUNE_MODES:
        raise ValueError(f"limit_fla_autotune: mode must be one of {FLA_AUTOTUNE_MODES}, got {mode!r}")
    try:
        import fla.ops.common.chunk_h  # noqa: F401 - the modules whose kernels the GLA layer runs
        import fla.ops.gla.chunk  # noqa: F401
        import fla.ops.utils.cumsum  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401 - and the delta-rule layers
        import fla.ops.kda  # noqa: F401
    except ImportError as e:
        raise ImportError(f"limit_fla_autotune needs fla-core >= 0.6 (pip install allscan[gla]): {e}") from e
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


@functools.lru_cache(maxsize=None)
def apply_autotune_setting() -> None:
    """``ALLSCAN_FLA_AUTOTUNE=one|full`` applies :func:`limit_fla_autotune` on the first fla call."""
    if settings.fla_autotune is not None:
        limit_fla_autotune(settings.fla_autotune)
