"""The one settings object: every ``ALLSCAN_*`` environment variable, read and validated once, at
first use.

:data:`VARIABLES` lists them (README.md's table mirrors it: :func:`markdown_table`, a test keeps the
two equal); :data:`settings` holds their values (``ValueError`` naming the variable on a value it
does not know); an ``ALLSCAN_*`` name in the environment that is neither a setting nor one of
:data:`NOT_SETTINGS` gets a warning naming the nearest known variable.
"""
from __future__ import annotations

import difflib
import math
import os
import threading
import warnings
from typing import Callable, NamedTuple, Optional, Tuple

__all__ = ["Variable", "VARIABLES", "NOT_SETTINGS", "Settings", "settings", "markdown_table",
           "MAX_SELF_FILL_BYTES", "MAX_FILL_CTAS"]

MAX_SELF_FILL_BYTES = 1 << 30
MAX_FILL_CTAS = 1024


def _timeout(name: str, v: str):
    """``group`` (the group's own timeout), ``off``, or seconds > 0."""
    if v in ("group", "off"):
        return v
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not (math.isfinite(t) and 0 < t < 1e9):
        raise ValueError(f"{name}: expected 'group', 'off' or a positive number of seconds, got {v!r}")
    return t


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, v: str) -> str:
        if v not in allowed:
            raise ValueError(f"{name}: expected {', '.join(allowed)}, got {v!r}")
        return v
    return parse


def _flag(name: str, v: str) -> bool:
    if v not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {v!r}")
    return v == "1"


def _count(limit: int, what: str) -> Callable[[str, str], int]:
    def parse(name: str, v: str) -> int:
        if not v.isdigit() or int(v) > limit:
            raise ValueError(f"{name}: expected {what} from 0 to {limit}, got {v!r}")
        return int(v)
    return parse


def _seconds(name: str, v: str) -> float:
    try:
        s = float(v)
    except ValueError:
        s = float("nan")
    if not (math.isfinite(s) and 0 < s <= 1e6):
        raise ValueError(f"{name}: expected seconds, more than 0 and at most 1e6, got {v!r}")
    return s


def _link_model(name: str, v: str) -> Tuple[float, float]:
    try:
        a, b = (float(s) for s in v.split(","))
    except ValueError as e:
        raise ValueError(f"{name}: expected 'latency_us,us_per_byte' (two floats), got {v!r}") from e
    if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
        raise ValueError(f"{name}: expected two positive finite floats 'latency_us,us_per_byte', got {v!r}")
    return a, b


class Variable(NamedTuple):
    name: str       # the environment variable
    attr: str       # the settings attribute ("" for a deprecated alias)
    values: str     # what it accepts
    default: str    # unset (or empty)
    when: str       # when it is read
    meaning: str
    parse: Optional[Callable[[str, str], object]] = None  # (name, raw value) -> value, or ValueError
    unset: object = None  # the value when unset


_FIRST_USE = "first use"
_COMM = "first use; the C++ core when it makes a communicator"

VARIABLES: Tuple[Variable, ...] = (
    Variable("ALLSCAN_CHECK", "check", "`first`, `trust`, `always`, `never`", "`first`", _FIRST_USE,
             "The cross-rank argument check of every collective and layer. `first`: on NCCL, the first "
             "time a signature is seen per group (then cached; a layer call repeated with arguments its "
             "checks cannot tell apart skips its local checks too), plus an 8-byte signature ahead of each "
             "scan's first block that the receiver compares on the GPU; on other backends every call. "
             "`trust`: as `first` without the in-band signature (about 4 us less per scan below 1 MiB; "
             "a rank that switches to a cached signature with the same bytes gives wrong values). "
             "`always`: every call (one small all-gather and a host synchronisation), a rank whose own "
             "arguments fail joins the exchange so the others raise too, and Ulysses attention repeats "
             "each two-stream forward on one stream and compares. `never`: no check (no in-band "
             "signature either). The same on every rank (the host check compares `trust` with the others).",
             _choice("first", "trust", "always", "never"), "first"),
    Variable("ALLSCAN_COMM", "comm", "`owned`, `borrowed`", "`owned`", _FIRST_USE,
             "The NCCL communicator of a group: one allscan creates and owns (so a timed-out one can be "
             "aborted) or torch's own ProcessGroupNCCL communicator, borrowed (no second communicator, but "
             "allscan cannot abort it: a dead peer then hangs as torch's own send/recv does).",
             _choice("owned", "borrowed"), "owned"),
    Variable("ALLSCAN_TIMEOUT", "timeout", "`group`, `off`, seconds", "`group`", _FIRST_USE,
             "Bounded failure on NCCL: a collective not done after this long (the group's own timeout "
             "by default) fails its communicator: aborted when owned; every later call on it raises "
             "`allscan.CommunicatorTimeout`. `off`: no watch.",
             _timeout, "group"),
    Variable("ALLSCAN_LINK_MODEL", "link_model", "`latency_us,us_per_byte` (two positive floats)",
             "measured (P > 2)", _FIRST_USE,
             "The link model that chooses the All-Scan's block count, instead of measuring it.",
             _link_model, None),
    Variable("ALLSCAN_HEAD_FILL", "head_fill", "`auto`, `self`, `side`, `series`", "`auto`", _COMM,
             "How the All-Scan's chain head writes its own result (README, \"the head's own result\").",
             _choice("auto", "self", "side", "series"), "auto"),
    Variable("ALLSCAN_SELF_FILL_MAX_BYTES", "self_fill_max_bytes", "bytes, 0 to 1073741824", "8388608", _COMM,
             "`auto` head fill: the largest state that takes the self copy.",
             _count(MAX_SELF_FILL_BYTES, "a byte count"), 8 << 20),
    Variable("ALLSCAN_FILL_CTAS", "fill_ctas", "0 to 1024", "8", _COMM,
             "CTAs of the head's side fill (0: in series after the send).",
             _count(MAX_FILL_CTAS, "a CTA count"), 8),
    Variable("ALLSCAN_DEVICE_PATH", "device_path", "`auto`, `off`", "`auto`", _COMM,
             "`allscan.scan(method=\"device\")`: device-initiated over NVLink where every rank is load/store "
             "accessible (`auto`), or always the pipelined NCCL path (`off`).",
             _choice("auto", "off"), "auto"),
    Variable("ALLSCAN_DEVICE_TIMEOUT_S", "device_timeout_s", "seconds, more than 0 and at most 1e6", "600", _COMM,
             "The device path's bound on waiting for a neighbour: then its results are NaN and later calls "
             "on the communicator raise `allscan.CommunicatorTimeout`.",
             _seconds, 600.0),
    Variable("ALLSCAN_GLA_BACKEND", "gla_backend", "`auto`, `fla`, `torch`", "`auto`", _FIRST_USE,
             "The GLA layer's local kernels: fla-core on CUDA when importable (`auto`), or forced.",
             _choice("auto", "fla", "torch"), "auto"),
    Variable("ALLSCAN_GLA_FUSED", "gla_fused", "`0`, `1`", "`1`", _FIRST_USE,
             "GLA: the fused Triton correction kernel (`0`: torch ops).",
             _flag, True),
    Variable("ALLSCAN_GLA_FUSED_OUTPUT", "gla_fused_output", "`0`, `1`", "`1`", _FIRST_USE,
             "GLA: fold the incoming state into the output kernel (`0`: fla's output kernel, then a "
             "separate correction).",
             _flag, True),
    Variable("ALLSCAN_FLA_AUTOTUNE", "fla_autotune", "`one`, `full`", "unset (fla's own)", "first fla call",
             "How fla-core's Triton kernels autotune: `one` fixed config per kernel or `full`.",
             _choice("one", "full"), None),
    Variable("ALLSCAN_ULYSSES_STREAMS", "ulysses_streams", "`0`, `1`", "`1`", _FIRST_USE,
             "Ulysses attention: pipeline the chunks over two CUDA streams (`0`: one stream).",
             _flag, True),
    Variable("ALLSCAN_A2A_IMPL", "a2a_impl", "`auto`, `torch`", "`auto`", _FIRST_USE,
             "The chunked all-to-all: the C++ core on NCCL (`auto`) or torch.distributed everywhere.",
             _choice("auto", "torch"), "auto"),
    Variable("ALLSCAN_PERF", "perf_binary", "a path", "`build/*/bench/allscan_perf`", "by tests/test_perf_cli.py",
             "The `allscan_perf` binary the CLI tests run.",
             lambda name, v: v, None),
    Variable("ALLSCAN_A2A_CHECK", "", "`auto`, `always`, `never`", "unset", _FIRST_USE,
             "Deprecated (FutureWarning): `ALLSCAN_CHECK` (`auto` = `first`); ignored when that is set."),
    Variable("ALLSCAN_ULYSSES_CHECK", "", "`0`, `1`", "unset", _FIRST_USE,
             "Deprecated (FutureWarning): `1` = `ALLSCAN_CHECK=always`; ignored when that is set."),
)

_A2A_CHECK_ALIAS = {"auto": "first", "always": "always", "never": "never"}

# ``ALLSCAN_*`` variables the project reads that are not settings: not warned about as unknown.
NOT_SETTINGS = {
    "ALLSCAN_TEST_RANKS_PER_GPU": "tests/distributed.py: NCCL ranks that may share one GPU in the tests",
    "ALLSCAN_TEST_BACKEND": "tests/test_fla_dispatch.py: the switch of a test backend registered with fla",
}
_warned_unknown: set = set()  # unknown names warned about in this process (each once)


def _warn_unknown_variables() -> None:
    """Warn, once per name and process, of an ``ALLSCAN_*`` variable in the environment that is no
    setting (a misspelling is otherwise ignored without a word), naming the nearest known one."""
    known = [v.name for v in VARIABLES] + list(NOT_SETTINGS)
    for name in sorted(os.environ):
        if not name.startswith("ALLSCAN_") or name in known or name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
        hint = f"; did you mean {nearest[0]}?" if nearest else ""
        warnings.warn(f"{name} is set but is not an allscan variable, so it is ignored{hint} "
                      f"(README.md lists the ALLSCAN_* variables)", UserWarning, stacklevel=4)


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    return v if v else None  # empty = unset


class Settings:
    """Every ``ALLSCAN_*`` variable, read and validated together at the first attribute access
    (``ValueError`` naming the variable on a value it does not know; a warning naming the nearest
    known variable for an ``ALLSCAN_*`` name that is none); :meth:`reload` re-reads.
    Attributes may be assigned (``allscan.set_check_every_call`` sets ``check``)."""

    _lock = threading.Lock()

    def __getattr__(self, attr: str):
        # Only reached while the attribute is missing: before the first read.
        if attr.startswith("_"):
            raise AttributeError(attr)
        self._load()
        try:
            return self.__dict__[attr]
        except KeyError:
            raise AttributeError(f"allscan settings have no attribute {attr!r}") from None

    def reload(self) -> None:
        with self._lock:
            self.__dict__.clear()
        self._load()

    def _load(self) -> None:
        _warn_unknown_variables()
        values = {}
        for var in VARIABLES:
            if var.attr:
                raw = _env(var.name)
                values[var.attr] = var.unset if raw is None else var.parse(var.name, raw)
        values["check"] = self._check_with_aliases(values["check"])
        with self._lock:
            for attr, value in values.items():
                self.__dict__.setdefault(attr, value)  # keep what was assigned before the first read

    @staticmethod
    def _check_with_aliases(check: str) -> str:
        explicit = _env("ALLSCAN_CHECK") is not None
        a2a = _env("ALLSCAN_A2A_CHECK")
        uly = _env("ALLSCAN_ULYSSES_CHECK")
        if a2a is not None:
            mapped = _choice("auto", "always", "never")("ALLSCAN_A2A_CHECK", a2a.lower())
            warnings.warn("ALLSCAN_A2A_CHECK is deprecated: use ALLSCAN_CHECK=first|always|never"
                          + (" (ALLSCAN_CHECK is set and wins)" if explicit else ""), FutureWarning, stacklevel=4)
            if not explicit:
                check, explicit = _A2A_CHECK_ALIAS[mapped], True
        if uly is not None:
            on = _flag("ALLSCAN_ULYSSES_CHECK", uly)
            warnings.warn("ALLSCAN_ULYSSES_CHECK is deprecated: use ALLSCAN_CHECK=always"
                          + (" (ALLSCAN_CHECK is set and wins)" if explicit else ""), FutureWarning, stacklevel=4)
            if on and not explicit:
                check = "always"
        return check


settings = Settings()


def markdown_table() -> str:
    """README.md's table of the variables (a test checks that the README holds exactly this)."""
    rows = ["| Variable | Values | Default | Read | Meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.values} | {v.default} | {v.when} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
