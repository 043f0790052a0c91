"""The contract every op and layer shares: the settings (allscan._settings: every ALLSCAN_* variable,
its default, a bad value raising ValueError naming it, an unknown name warning, the README's table),
the dtype table (allscan._dtypes), and the one cross-rank signature check (allscan._agreement: what
it names, its modes, its bounded cache)."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import allscan
from allscan import _agreement, _dtypes, _settings
from allscan._settings import VARIABLES, settings
from distributed import run_distributed

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


@pytest.fixture
def clean_env(monkeypatch):
    """No ALLSCAN_* variable set; the settings re-read before and after the test."""
    for name in list(os.environ):
        if name.startswith("ALLSCAN_"):
            monkeypatch.delenv(name)
    settings.reload()
    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


# ------------------------------------------------------------------------------------------------
# Settings
# ------------------------------------------------------------------------------------------------
BAD = [
    ("ALLSCAN_CHECK", "yes", "expected first, trust, always, never, got 'yes'"),
    ("ALLSCAN_CHECK", "1", "expected first, trust, always, never"),
    ("ALLSCAN_COMM", "torch", "expected owned, borrowed, got 'torch'"),
    ("ALLSCAN_TIMEOUT", "0", "expected 'group', 'off' or a positive number of seconds, got '0'"),
    ("ALLSCAN_TIMEOUT", "10m", "a positive number of seconds, got '10m'"),
    ("ALLSCAN_TIMEOUT", "inf", "a positive number of seconds"),
    ("ALLSCAN_LINK_MODEL", "5", "two floats"),
    ("ALLSCAN_LINK_MODEL", "0,1e-6", "positive finite"),
    ("ALLSCAN_LINK_MODEL", "nan,1e-6", "positive finite"),
    ("ALLSCAN_HEAD_FILL", "selff", "expected auto, self, side, series, got 'selff'"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "8M", "expected a byte count from 0 to 1073741824, got '8M'"),
    ("ALLSCAN_SELF_FILL_MAX_BYTES", "1073741825", "from 0 to 1073741824"),
    ("ALLSCAN_FILL_CTAS", "-1", "expected a CTA count from 0 to 1024, got '-1'"),
    ("ALLSCAN_FILL_CTAS", "1025", "from 0 to 1024"),
    ("ALLSCAN_DEVICE_PATH", "on", "expected auto, off, got 'on'"),
    ("ALLSCAN_DEVICE_TIMEOUT_S", "0", "expected seconds, more than 0 and at most 1e6, got '0'"),
    ("ALLSCAN_DEVICE_TIMEOUT_S", "10s", "expected seconds"),
    ("ALLSCAN_GLA_BACKEND", "triton", "expected auto, fla, torch, got 'triton'"),
    ("ALLSCAN_GLA_FUSED", "yes", "expected 0 or 1, got 'yes'"),
    ("ALLSCAN_GLA_FUSED_OUTPUT", "true", "expected 0 or 1"),
    ("ALLSCAN_FLA_AUTOTUNE", "none", "expected one, full, got 'none'"),
    ("ALLSCAN_ULYSSES_STREAMS", "2", "expected 0 or 1, got '2'"),
    ("ALLSCAN_A2A_IMPL", "cpp", "expected auto, torch, got 'cpp'"),
    ("ALLSCAN_A2A_CHECK", "alwasy", "expected auto, always, never, got 'alwasy'"),
    ("ALLSCAN_ULYSSES_CHECK", "on", "expected 0 or 1, got 'on'"),
]


@pytest.mark.parametrize("var,value,needle", BAD)
def test_a_bad_value_raises_naming_the_variable(clean_env, var, value, needle):
    clean_env.setenv(var, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=var) as e:
            settings.reload()
    assert needle in str(e.value)


def test_timeout_setting_values(clean_env):
    for raw, want in (("group", "group"), ("off", "off"), ("2.5", 2.5)):
        clean_env.setenv("ALLSCAN_TIMEOUT", raw)
        settings.reload()
        assert settings.timeout == want


def test_every_variable_with_values_has_a_bad_value_test():
    free = {"ALLSCAN_PERF"}  # a path: any value
    assert {v.name for v in VARIABLES} - free == {name for name, _, _ in BAD}


def test_a_bad_value_raises_at_the_first_scan(clean_env):
    clean_env.setenv("ALLSCAN_CHECK", "yes")
    code = ("import tempfile, torch, torch.distributed as dist, allscan\n"
            "f = tempfile.mktemp()\n"
            "dist.init_process_group('gloo', init_method='file://' + f, rank=0, world_size=1)\n"
            "try:\n    allscan.scan(torch.ones(3))\nexcept ValueError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ALLSCAN_CHECK="yes"))
    assert "ERR ALLSCAN_CHECK: expected first, trust, always, never, got 'yes'" in out.stdout, out.stdout + out.stderr


def test_defaults(clean_env):
    got = {v.attr: getattr(settings, v.attr) for v in VARIABLES if v.attr}
    assert got == {
        "check": "first", "comm": "owned", "timeout": "group", "link_model": None, "head_fill": "auto", "self_fill_max_bytes": 8 << 20, "fill_ctas": 8,
        "device_path": "auto", "device_timeout_s": 600.0, "gla_backend": "auto", "gla_fused": True, "gla_fused_output": True, "fla_autotune": None,
        "ulysses_streams": True, "a2a_impl": "auto", "perf_binary": None,
    }


def test_good_values_and_empty_is_unset(clean_env):
    for var, value in [("ALLSCAN_CHECK", "never"), ("ALLSCAN_LINK_MODEL", "5,1e-6"), ("ALLSCAN_HEAD_FILL", "series"),
                       ("ALLSCAN_SELF_FILL_MAX_BYTES", "1073741824"), ("ALLSCAN_FILL_CTAS", "0"),
                       ("ALLSCAN_GLA_BACKEND", "torch"), ("ALLSCAN_GLA_FUSED", "0"), ("ALLSCAN_GLA_FUSED_OUTPUT", "0"),
                       ("ALLSCAN_FLA_AUTOTUNE", "one"), ("ALLSCAN_ULYSSES_STREAMS", "0"), ("ALLSCAN_A2A_IMPL", "torch"),
                       ("ALLSCAN_PERF", "/x/allscan_perf")]:
        clean_env.setenv(var, value)
    clean_env.setenv("ALLSCAN_CHECK", "")  # empty = unset
    settings.reload()
    assert (settings.check, settings.link_model, settings.head_fill, settings.self_fill_max_bytes) == (
        "first", (5.0, 1e-6), "series", 1 << 30)
    assert (settings.fill_ctas, settings.gla_backend, settings.gla_fused, settings.gla_fused_output) == (
        0, "torch", False, False)
    assert (settings.fla_autotune, settings.ulysses_streams, settings.a2a_impl, settings.perf_binary) == (
        "one", False, "torch", "/x/allscan_perf")


@pytest.mark.parametrize("env,want", [
    ({"ALLSCAN_A2A_CHECK": "always"}, "always"),
    ({"ALLSCAN_A2A_CHECK": "auto"}, "first"),
    ({"ALLSCAN_A2A_CHECK": "never"}, "never"),
    ({"ALLSCAN_ULYSSES_CHECK": "1"}, "always"),
    ({"ALLSCAN_ULYSSES_CHECK": "0"}, "first"),
    ({"ALLSCAN_CHECK": "never", "ALLSCAN_A2A_CHECK": "always"}, "never"),  # the new name wins
    ({"ALLSCAN_CHECK": "first", "ALLSCAN_ULYSSES_CHECK": "1"}, "first"),
])
def test_deprecated_check_variables_warn_and_map(clean_env, env, want):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.warns(FutureWarning, match="is deprecated: use ALLSCAN_CHECK"):
        settings.reload()
    assert settings.check == want


def test_assigned_before_the_first_read_survives_it(clean_env):
    for k in list(settings.__dict__):
        del settings.__dict__[k]  # as in a fresh process: nothing read yet
    allscan.set_check_every_call(True)
    assert settings.head_fill == "auto"  # the first read of the environment
    assert settings.check == "always"
    allscan.set_check_every_call(False)
    assert settings.check == "first"


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="allscan settings have no attribute 'chek'"):
        settings.chek  # noqa: B018


def _unknown_warnings(record):
    return [str(w.message) for w in record if "is not an allscan variable" in str(w.message)]


def test_an_unknown_variable_warns_once_naming_the_nearest(clean_env):
    clean_env.setattr(_settings, "_warned_unknown", set())
    clean_env.setenv("ALLSCAN_CHEK", "always")
    clean_env.setenv("ALLSCAN_GLA_FUSE", "0")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        settings.reload()
        assert settings.check == "first"  # ignored
        settings.reload()  # read again: no second warning
    got = _unknown_warnings(record)
    assert len(got) == 2, got
    assert got[0].startswith("ALLSCAN_CHEK is set but is not an allscan variable")
    assert "did you mean ALLSCAN_CHECK?" in got[0]
    assert got[1].startswith("ALLSCAN_GLA_FUSE is set") and "did you mean ALLSCAN_GLA_FUSED?" in got[1]


def test_variables_that_are_not_settings_do_not_warn(clean_env):
    clean_env.setattr(_settings, "_warned_unknown", set())
    for name in list(_settings.NOT_SETTINGS) + [v.name for v in VARIABLES if v.attr]:
        clean_env.setenv(name, "")  # empty = unset, for the settings
    clean_env.setenv("ALLSCAN_TEST_RANKS_PER_GPU", "2")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        settings.reload()
    assert _unknown_warnings(record) == []


def test_the_unknown_variable_warning_comes_at_the_first_read():
    code = ("import warnings, allscan\n"
            "warnings.simplefilter('always')\n"
            "print('imported', flush=True)\n"
            "allscan.settings.check\n"
            "allscan.settings.comm\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ALLSCAN_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(env, ALLSCAN_CHEK="always", ALLSCAN_TEST_RANKS_PER_GPU="2"))
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("is not an allscan variable") == 1, out.stderr
    assert "ALLSCAN_CHEK is set but is not an allscan variable, so it is ignored; did you mean ALLSCAN_CHECK?" in out.stderr


# Names that look like variables in the project's code but are no environment variables.
_NOT_ENVIRONMENT = {"ALLSCAN_KERNELS", "ALLSCAN_BUILD_BENCH", "ALLSCAN_BUILD_PYTHON", "ALLSCAN_PERF_MPI",
                    "ALLSCAN_VERSION_", "ALLSCAN_VERSION_MAJOR", "ALLSCAN_VERSION_MINOR", "ALLSCAN_VERSION_PATCH"}


def test_every_allscan_variable_the_project_uses_is_known():
    """The ALLSCAN_* names in the project's Python and shell code: settings, or listed as read but
    not settings (so that no one of them warns as unknown)."""
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    known = {v.name for v in VARIABLES} | set(_settings.NOT_SETTINGS) | _NOT_ENVIRONMENT
    found = {}
    for top in ("python", "tests", "bench", "scripts", "examples"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for fname in files:
                path = os.path.join(dirpath, fname)
                if not fname.endswith((".py", ".sh")) or os.path.samefile(path, __file__):
                    continue
                with open(path, errors="replace") as f:
                    for name in re.findall(r"\bALLSCAN_[A-Z0-9_]+", f.read()):
                        found.setdefault(name, os.path.relpath(path, root))
    unknown = {name: where for name, where in found.items() if name not in known}
    assert not unknown, f"add these to VARIABLES or NOT_SETTINGS in allscan._settings: {unknown}"


def test_readme_table_is_the_variables_table():
    with open(README) as f:
        text = f.read()
    assert _settings.markdown_table() in text, "README.md's ALLSCAN_* table differs from _settings.markdown_table()"
    for v in VARIABLES:
        assert text.count(f"| `{v.name}` |") == 1, v.name


# ------------------------------------------------------------------------------------------------
# dtype table and public names
# ------------------------------------------------------------------------------------------------
def test_dtype_table_is_the_cores():
    from allscan import _C

    assert _dtypes.DTYPE_CODES == {torch.float32: _C.FLOAT32, torch.float16: _C.FLOAT16,
                                     torch.bfloat16: _C.BFLOAT16, torch.float64: _C.FLOAT64}
    assert _dtypes.dtype_code(torch.bfloat16, "x") == _C.BFLOAT16
    with pytest.raises(TypeError, match="my arg must be float32, float16, bfloat16 or float64, got torch.int8"):
        _dtypes.dtype_code(torch.int8, "my arg")


def test_a2a_is_reachable_right_after_import():
    code = "import allscan\nprint(allscan.a2a.scatter_heads.__module__, allscan.a2a.split_heads(0, 5, 2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "allscan.ops.a2a [(0, 3), (3, 5)]", out.stdout + out.stderr


def test_every_public_submodule_is_reachable_right_after_import():
    names = ("a2a", "ops", "layers", "integrations", "info", "perf", "reference", "core")
    code = ("import allscan\n"
            f"print(' '.join(getattr(allscan, n).__name__ for n in {names!r}))\n"
            "print(allscan.layers.GatedDeltaNet.__name__, allscan.integrations.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[0] == " ".join(f"allscan.{n}" for n in names), out.stdout + out.stderr
    assert "GatedDeltaNet allscan.integrations" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------
# The cross-rank check (gloo ranks; NCCL's caching is reached by marking the group as NCCL)
# ------------------------------------------------------------------------------------------------
class _Counter:
    def __init__(self):
        self.n = 0
        self.orig = _agreement._gather_rows

    def __call__(self, *a):
        self.n += 1
        return self.orig(*a)


def _expect(exc, needle, fn):
    try:
        fn()
    except exc as e:
        assert needle in str(e), str(e)
        return str(e)
    raise AssertionError(f"expected {exc.__name__} containing {needle!r}, nothing was raised")


def _check_modes(rank, P):
    import torch.distributed as dist

    g = dist.group.WORLD
    cpu = torch.device("cpu")
    count = _Counter()
    _agreement._gather_rows = count
    fields = [("batch B", 2), ("heads", 4 + rank)]
    msg = _expect(ValueError, "ranks disagree on heads (rank 0: 4, rank 1: 5)",
                  lambda: _agreement.check_across_ranks(g, cpu, "op", fields))
    assert "allscan.op: ranks passed different arguments" in msg and "batch B" not in msg, msg
    assert count.n == 1
    same = [("batch B", 2), ("heads", 4)]
    # first, off NCCL: every call
    settings.check = "first"
    for _ in range(3):
        _agreement.check_across_ranks(g, cpu, "op", same)
    assert count.n == 4
    # never: no exchange, a mismatch passes
    settings.check = "never"
    _agreement.check_across_ranks(g, cpu, "op", fields)
    assert count.n == 4
    # first, on NCCL: once per signature and group
    _agreement._on_nccl = lambda group, device: True
    settings.check = "first"
    _agreement.check_across_ranks(g, cpu, "op", same)
    _agreement.check_across_ranks(g, cpu, "op", same)
    assert count.n == 4  # checked above
    _agreement.check_across_ranks(g, cpu, "op", [("batch B", 3), ("heads", 4)])
    _agreement.check_across_ranks(g, cpu, "op", [("batch B", 3), ("heads", 4)])
    assert count.n == 5
    # always: every call
    settings.check = "always"
    _agreement.check_across_ranks(g, cpu, "op", same)
    _agreement.check_across_ranks(g, cpu, "op", same)
    assert count.n == 7
    # the cache is an LRU with a bound: the least recently used signature is checked again
    settings.check = "first"
    _agreement.clear_checked_signatures()
    _agreement.MAX_CHECKED_SIGNATURES = 3
    for b in range(4):
        _agreement.check_across_ranks(g, cpu, "op", [("b", b)])
    assert count.n == 11 and len(_agreement._checked) == 3
    _agreement.check_across_ranks(g, cpu, "op", [("b", 3)])  # still cached
    assert count.n == 11
    _agreement.check_across_ranks(g, cpu, "op", [("b", 0)])  # evicted: exchanged again
    assert count.n == 12
    # ranks in different collectives, and a rank that rejected its own arguments
    _expect(ValueError, "are in a different collective", lambda: _agreement.check_across_ranks(
        g, cpu, "op_a" if rank == 0 else "op_b", [("x", 1)]))
    settings.check = "always"
    if rank == 1:
        _agreement.announce_invalid(g, cpu, "op")
    else:
        _expect(ValueError, "allscan.op: rank(s) [1] rejected their own arguments",
                lambda: _agreement.check_across_ranks(g, cpu, "op", same))
    return True


def test_check_across_ranks_modes_cache_and_messages():
    assert run_distributed(_check_modes, 2, timeout=120) == [True, True]


def test_one_version_everywhere():
    """The C API header's ALLSCAN_VERSION_* macros are the one place the version is written: the
    package metadata (pyproject's dynamic version), allscan.__version__ (from the core) and CMake's
    project version (read from the header) all come from them."""
    import importlib.metadata
    import re

    import allscan

    header = os.path.join(os.path.dirname(__file__), "..", "csrc", "allscan", "include", "allscan", "allscan.h")
    with open(header) as f:
        parts = dict(re.findall(r"^#define ALLSCAN_VERSION_(MAJOR|MINOR|PATCH) +(\d+)", f.read(), re.M))
    want = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    assert allscan.__version__ == want
    assert importlib.metadata.version("allscan") == want
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
        assert not re.search(r'^version *=', f.read(), re.M), "pyproject.toml must not write the version itself"


def test_the_in_band_signature_is_a_stable_nonzero_hash_of_the_fields():
    from allscan._agreement import signature_hash
    from allscan._settings import settings

    saved = settings.check
    try:
        settings.check = "first"
        a = signature_hash("scan", [("tensor numel", 16), ("reverse", 0)])
        assert a == signature_hash("scan", [("tensor numel", 16), ("reverse", 0)]) and a != 0
        assert a < 2 ** 64
        assert a != signature_hash("scan", [("tensor numel", 16), ("reverse", 1)])
        assert a != signature_hash("matrix_scan", [("tensor numel", 16), ("reverse", 0)])
        for mode in ("trust", "never"):  # no in-band signature: the fast, trusting modes
            settings.check = mode
            assert signature_hash("scan", [("tensor numel", 16)]) == 0
    finally:
        settings.check = saved


def _modes_disagree(rank, world):
    settings.check = "first" if rank == 0 else "trust"  # rank 0 would send the signature, rank 1 not
    with pytest.raises(ValueError, match=r"ranks disagree on in-band signature .*rank 0: 1, rank 1: 0"):
        allscan.scan(torch.ones(4), torch.full((4,), 0.5))


def test_ranks_that_disagree_on_the_in_band_signature_raise_on_every_rank():
    """`trust` sends no signature ahead of a scan's first block, `first` does: on NCCL their
    transfers would not match, so the host check compares the modes."""
    run_distributed(_modes_disagree, 2)
