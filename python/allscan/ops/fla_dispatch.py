"""fla-core's kernel entry points without its backend dispatcher, where it would fall back anyway.

fla-core 0.6 routes each kernel entry point through ``fla.backends.dispatch`` on every call: inside a
``torch.compiler.disable`` wrapper it asks every backend registered for the entry point (TileLang,
Ascend, Gluon, intra-card CP) whether it is available, enabled and implements the function, and runs
the Triton function it wraps when none does. For most entry points on a CUDA machine none does, and
the question costs host time on every launch; allscan's layers launch a dozen of them per fwd+bwd
(issue 14; bench/README.md, "Measurements behind design choices"). :func:`direct` asks it once.

A backend registered for an entry point after allscan resolved it (an fla module imported later, an
``FLA_*`` switch set later) is not seen by allscan's calls; fla registers the backends of an entry
point when the entry point's own module is imported, before allscan's first call.
"""
from __future__ import annotations

from typing import Callable, Optional


def _registry_here(f: Callable):
    """The backend registry of fla's dispatcher held in ``f``'s own closure (not in the functions it
    wraps), or None."""
    try:
        from fla.backends import BackendRegistry
    except Exception:  # noqa: BLE001 - no fla, or an fla without backends: nothing to resolve
        return None
    for cell in getattr(f, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, BackendRegistry):
            return value
    return None


def _layers(fn: Callable):
    """``fn`` and the functions it wraps (``__wrapped__``), outermost first."""
    f: Optional[Callable] = fn
    for _ in range(8):
        if f is None:
            return
        yield f
        f = getattr(f, "__wrapped__", None)


def falls_back(fn: Callable) -> bool:
    """Whether fla's dispatcher around ``fn`` always runs the function it wraps: no backend registered
    for it is available, enabled and implementing it. False when there is no dispatcher to find, or
    anything about it is not as fla-core 0.6 has it."""
    layers = list(_layers(fn))
    registry = next((r for r in map(_registry_here, layers) if r is not None), None)
    if registry is None:
        return False
    inner = layers[-1]
    try:
        for backend in registry._backends.values():
            if (backend.is_available() and backend.is_enabled()
                    and backend.get_implementation(inner.__name__) is not None):
                return False
    except Exception:  # noqa: BLE001 - another fla: keep its dispatcher
        return False
    return True


def direct(fn: Callable) -> Callable:
    """``fn`` (an fla entry point) as allscan calls it: the function fla's dispatcher would run, when
    :func:`falls_back`, and only when the dispatcher and ``torch.compiler.disable`` are the only
    wrappers around it (another wrapper, such as fla's ``input_guard``, does work of its own); else
    ``fn`` itself."""
    if not falls_back(fn):
        return fn
    *wrappers, inner = list(_layers(fn))
    if all(_registry_here(f) is not None or _is_compile_disable(f) for f in wrappers):
        return inner
    return fn


def _is_compile_disable(f: Callable) -> bool:
    """Whether ``f`` is the wrapper ``torch.compiler.disable`` puts around a function."""
    code = getattr(f, "__code__", None)
    return code is not None and "_dynamo" in code.co_filename.replace("\\", "/").split("/")
