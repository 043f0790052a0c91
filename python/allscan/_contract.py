"""What every allscan op and layer shares: the dtype table, the settings, the cross-rank check.

- :data:`DTYPE_CODES`: torch dtype -> the core's dtype code (from ``allscan._C``); the only table.
- :data:`settings`: every ``ALLSCAN_*`` environment variable, read and validated once, at first use
  (:data:`VARIABLES` lists them; README.md's table mirrors it, a test keeps the two equal); an
  unknown ``ALLSCAN_*`` name in the environment gets a warning naming the nearest known one.
- :func:`check_across_ranks`: the one cross-rank signature check every collective runs before it
  communicates, so that ranks passing different shapes raise instead of hanging; and
  :func:`announce_invalid` for a rank whose own arguments failed a local check.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import math
import os
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _C

__all__ = [
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "dtype_code",
    "Variable",
    "VARIABLES",
    "settings",
    "markdown_table",
    "NOT_SETTINGS",
    "MAX_CHECKED_SIGNATURES",
    "check_across_ranks",
    "still_checked",
    "signature_hash",
    "announce_invalid",
    "peers_exchange",
    "clear_checked_signatures",
]

# ------------------------------------------------------------------------------------------------
# The dtype table
# ------------------------------------------------------------------------------------------------
DTYPE_CODES = {
    torch.float32: _C.FLOAT32,
    torch.float16: _C.FLOAT16,
    torch.bfloat16: _C.BFLOAT16,
    torch.float64: _C.FLOAT64,
}
DTYPE_NAMES = {code: str(dt).replace("torch.", "") for dt, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype, what: str) -> int:
    """The core's code of ``dtype``; ``TypeError`` naming ``what`` for a dtype the core lacks."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"{what} must be float32, float16, bfloat16 or float64, got {dtype}")
    return code


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


# ------------------------------------------------------------------------------------------------
# The settings
# ------------------------------------------------------------------------------------------------
MAX_SELF_FILL_BYTES = 1 << 30
MAX_FILL_CTAS = 1024


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


# ------------------------------------------------------------------------------------------------
# The cross-rank signature check
# ------------------------------------------------------------------------------------------------
# One row per rank: [magic, op code, number of fields, values..., zero padding]. The width is fixed,
# so the all-gather itself can never mismatch, whatever the ranks pass.
_WIDTH = 32
_HEADER = 3
_VALID = 0x5CA4
_INVALID = 0xBAD
MAX_CHECKED_SIGNATURES = 1024  # LRU: an evicted signature is checked again on its next use

_checked: "OrderedDict[tuple, weakref.ReferenceType]" = OrderedDict()
_checked_lock = threading.Lock()


def _op_code(op: str) -> int:
    return zlib.crc32(op.encode())


def _on_nccl(group, device: torch.device) -> bool:
    return device.type == "cuda" and "nccl" in str(dist.get_backend(group)).lower()


def peers_exchange(group, device: torch.device) -> bool:
    """Whether every rank exchanges its signature on every call (so a rank that failed locally must
    join): with ``ALLSCAN_CHECK=always``, and in ``first`` mode off NCCL (there the exchange costs no
    host synchronisation the op does not already make)."""
    mode = settings.check
    return mode == "always" or (mode in ("first", "trust") and not _on_nccl(group, device))


def _gather_rows(group, device: torch.device, row: Sequence[int]):
    P = dist.get_world_size(group)
    local = torch.tensor(list(row), dtype=torch.int64, device=device if _on_nccl(group, device) else "cpu")
    rows = [torch.empty_like(local) for _ in range(P)]
    dist.all_gather(rows, local, group=group)
    return [r.tolist() for r in rows]


def _show(name: str, value: int) -> str:
    return DTYPE_NAMES.get(value, "none") if name.endswith("dtype") else str(value)


def check_across_ranks(group, device: torch.device, op: str, fields: Sequence[Tuple[str, int]], *,
                       every_call: bool = False) -> Optional[tuple]:
    """Raise ``ValueError`` on every rank if the ranks of ``group`` pass different ``fields``
    ((name, int) pairs, at most 28) to ``op``, naming each field that differs and every rank's value.

    Obeys ``settings.check`` (``first`` and ``trust``: on NCCL once per signature and group, cached
    in an LRU of :data:`MAX_CHECKED_SIGNATURES`, elsewhere every call; ``always``: every call;
    ``never``: no check). ``every_call``: exchange on every call in ``first`` and ``trust`` too, for
    calls whose signatures change from call to call (their fields read on the host anyway), so that
    neither a mismatch between signatures each checked before nor a rank's local failure (it joins
    with :func:`announce_invalid` ``every_call``) can pass unseen. The fields include whether this
    rank sends the in-band signature (``first``/``always`` do, ``trust`` does not): ranks that
    disagree on it would mismatch in NCCL.
    Under CUDA graph capture it exchanges nothing: a signature checked before capture passes, a new
    one raises ``RuntimeError``. Collective whenever it exchanges. Returns the signature's key where
    it is checked once (NCCL, ``first``/``trust``), for :func:`still_checked`; else None."""
    mode = settings.check
    if mode == "never" or dist.get_world_size(group) == 1:
        return None
    fields = list(fields) + [("in-band signature (ALLSCAN_CHECK first/always: 1, trust: 0)", int(mode != "trust"))]
    values = tuple(int(v) for _, v in fields)
    if len(values) > _WIDTH - _HEADER:
        raise ValueError(f"check_across_ranks: {op} passes {len(values)} fields, at most {_WIDTH - _HEADER}")
    key = (group.group_name, id(group), op, values)
    with _checked_lock:
        ref = _checked.get(key)
        seen = ref is not None and ref() is group
        if seen:
            _checked.move_to_end(key)
    once = mode in ("first", "trust") and _on_nccl(group, device) and not every_call
    if seen and once:
        return key
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if seen:
            return key if once else None  # checked before capture; the exchange would synchronise, which capture forbids
        raise RuntimeError(
            f"allscan.{op}: these arguments were never checked across ranks, and the check cannot run while "
            f"a CUDA graph is being captured; call it once with them before capturing")
    row = [_VALID, _op_code(op), len(values), *values]
    rows = _gather_rows(group, device, row + [0] * (_WIDTH - len(row)))
    _raise_on_difference(op, fields, rows, dist.get_rank(group))
    with _checked_lock:
        _checked[key] = weakref.ref(group)
        _checked.move_to_end(key)
        while len(_checked) > MAX_CHECKED_SIGNATURES:
            _checked.popitem(last=False)
    return key if once else None


def still_checked(group, key: tuple) -> bool:
    """Whether the signature whose key :func:`check_across_ranks` returned is still among the checked
    ones, kept recent as a repeated check would keep it: a caller that skips repeated checks must
    check again once it is evicted, when every rank's repeated check exchanges again."""
    with _checked_lock:
        ref = _checked.get(key)
        if ref is None or ref() is not group:
            return False
        _checked.move_to_end(key)
        return True


def signature_hash(op: str, fields: Sequence[Tuple[str, int]]) -> int:
    """The 64-bit value the core's chain schedules send ahead of their first block so that a
    receiver can tell a call made with other arguments (``allscanScanArgs_t.signature``): a hash of
    ``op`` and ``fields`` (equal on every rank exactly when the fields are); 0 (no in-band check)
    with ``ALLSCAN_CHECK=trust`` or ``never``."""
    if settings.check in ("never", "trust"):
        return 0
    return _hash_fields(op, tuple((name, int(v)) for name, v in fields))


@functools.lru_cache(maxsize=MAX_CHECKED_SIGNATURES)
def _hash_fields(op: str, fields: Tuple[Tuple[str, int], ...]) -> int:
    text = op + ":" + ",".join(f"{name}={v}" for name, v in fields)
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1


def _raise_on_difference(op: str, fields, rows, me: int) -> None:
    bad = [q for q, row in enumerate(rows) if row[0] == _INVALID]
    if bad:
        raise ValueError(f"allscan.{op}: rank(s) {bad} rejected their own arguments or failed before this call "
                         f"(see the error raised there); this is rank {me}")
    others = [q for q, row in enumerate(rows) if row[1] != rows[me][1]]
    if others:
        raise ValueError(f"allscan.{op}: rank(s) {others} are in a different collective at the same time "
                         f"(this is rank {me}, in {op})")
    if all(row == rows[0] for row in rows):
        return
    parts = []
    counts = {row[2] for row in rows}
    if len(counts) > 1:
        parts.append("the number of fields (" + ", ".join(f"rank {q}: {row[2]}" for q, row in enumerate(rows)) + ")")
    for i, (name, _) in enumerate(fields):
        column = [row[_HEADER + i] for row in rows]
        if any(v != column[0] for v in column):
            per_rank = ", ".join(f"rank {q}: {_show(name, v)}" for q, v in enumerate(column))
            parts.append(f"{name} ({per_rank})")
    raise ValueError(
        f"allscan.{op}: ranks passed different arguments (a collective would hang): ranks disagree on "
        + "; ".join(parts) + f". Every rank must pass the same shapes, dtypes and options (this is rank {me})")


def announce_invalid(group, device: torch.device, op: str, reason: str = "", *, every_call: bool = False) -> None:
    """A rank whose own arguments failed a local check joins the exchange its peers make in the
    current mode (see :func:`peers_exchange`; ``every_call``: the peers' :func:`check_across_ranks`
    exchanges on every call, in every mode but ``never``), with a marker that makes them raise instead
    of waiting for it. Where the peers do not exchange (NCCL in ``first`` mode: they may be waiting in a
    call this rank will not make) it reports ``reason`` on the fault board (``allscan._faults``)
    instead. Nothing under capture, or alone."""
    if dist.get_world_size(group) == 1:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # nothing runs before the graph is replayed
    if not (peers_exchange(group, device) or (every_call and settings.check != "never")):
        from . import _comm  # noqa: PLC0415 - _comm imports this module

        _comm.report_local_error(group, device, f"allscan.{op}: {reason or 'its own arguments failed a check'}")
        return
    _gather_rows(group, device, [_INVALID, _op_code(op)] + [0] * (_WIDTH - 2))


def clear_checked_signatures() -> None:
    """Forget every checked signature (``allscan.destroy_communicators`` calls it)."""
    with _checked_lock:
        _checked.clear()
