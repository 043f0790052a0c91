"""``python -m allscan.info``: runs on a fresh interpreter and reports what the issue asks for (the supported
transformers families among it, read from the hybrids' table without importing transformers); the NCCL version
comparison that version-sensitive paths use."""
import subprocess
import sys

import pytest

from allscan._settings import settings
from allscan.info import nccl_match, nccl_version_text, report, transformers_families


@pytest.fixture
def restored_settings():
    """The global settings as they were before the test (a report() under a patched environment loads them)."""
    saved = dict(settings.__dict__)
    yield
    settings.__dict__.clear()
    settings.__dict__.update(saved)


def test_info_runs_and_reports_everything():
    out = subprocess.run([sys.executable, "-m", "allscan.info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for needle in ("allscan ", "torch ", "NCCL compiled against", "NCCL loaded", "NCCL library file", "NCCL versions",
                   "GPUs:", "optional packages:", "fla-core:", "settings:", "ALLSCAN_CHECK:", "paths:", "CUDA tensor:",
                   "transformers families (sequence_parallel):", "qwen3_next: Qwen3NextGatedDeltaNet (gated delta rule) "
                   "beside Qwen3NextAttention", "kimi_linear: KimiLinearDeltaAttention (KDA)",
                   "sliding window, a logit soft-cap and attention sinks honoured"):
        assert needle in out.stdout, f"{needle!r} missing from:\n{out.stdout}"


def test_families_come_from_the_table_without_transformers(monkeypatch):
    """Every entry of hf_hybrids.SUPPORTED is listed (a family added there appears by itself), and reading the
    table imports no transformers."""
    from allscan.integrations import hf_hybrids

    monkeypatch.setitem(hf_hybrids.SUPPORTED, "new_family", ("NewMixer", None, "Mamba2 SSD"))
    families = transformers_families()
    assert set(hf_hybrids.SUPPORTED) <= set(families), families
    assert families["new_family"] == "NewMixer (Mamba2 SSD), no attention"
    out = subprocess.run([sys.executable, "-c", "import sys; from allscan.info import transformers_families as f; "
                          "f(); print('transformers' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_report_reads_the_settings_and_the_loaded_nccl(monkeypatch, restored_settings):
    monkeypatch.setenv("ALLSCAN_CHECK", "always")
    info = report()
    assert info["settings"]["ALLSCAN_CHECK"] == "always"
    from allscan import _C

    assert info["NCCL versions"] == nccl_match(_C.NCCL_VERSION_COMPILED, _C.nccl_version())
    assert info["NCCL compiled against"] == nccl_version_text(_C.NCCL_VERSION_COMPILED)


def test_nccl_versions():
    assert nccl_version_text(22809) == "2.28.9"
    assert nccl_version_text(23203) == "2.32.3"
    assert nccl_version_text(2708) == "2.7.8"
    assert nccl_match(22809, 22809) == "match (the device path can run)"
    assert nccl_match(22803, 22803).startswith("match (no device API")
    assert nccl_match(22809, 22808).startswith("compatible: compiled against 2.28.9, loaded 2.28.8")
    assert nccl_match(22809, 22803).startswith("differ")  # 2.28.3's device structs differ
    assert nccl_match(23203, 22809) == ("differ: compiled against 2.32.3, loaded 2.28.9; "
                                        "the device path stays off")
    assert nccl_match(22809, None) == "no NCCL loaded"
