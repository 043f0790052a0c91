"""What allscan sees on this machine: ``python -m allscan.info``.

allscan, torch, CUDA, NCCL (the version the extension was compiled against, the one loaded and the
library file it came from), the GPUs and which pairs can reach each other (peer access), the
optional packages found, every ``ALLSCAN_*`` setting in force, the path a CUDA and a CPU tensor
take on the default group, and the transformers model families allscan makes sequence-parallel (from
``allscan.integrations.hf_hybrids.SUPPORTED``, read without importing transformers). :func:`report` returns the
same as a dict.
"""
from __future__ import annotations

import importlib.metadata
import os
from typing import Dict, List, Optional

import torch

import allscan

from . import _C, _nccl
from ._settings import VARIABLES, settings

OPTIONAL = {  # package -> what allscan uses it for, and the extra that installs it
    "fla-core": "GLA / Gated DeltaNet / KDA kernels on GPU (allscan[gla])",
    "flash-linear-attention": "fla's layers and models, for the integrations (allscan[fla])",
    "triton": "fla's and allscan's Triton kernels",
    "tilelang": "fla's gated delta-rule backward on Hopper with Triton < 3.7.1",
    "yunchang": "the Ulysses benchmark's comparison (allscan[bench])",
    "transformers": "the Hugging Face integration (allscan[hf])",
    "matplotlib": "benchmark plots (allscan[bench])",
}


def nccl_version_text(code: int) -> str:
    """NCCL's integer version (``NCCL_VERSION_CODE`` / ``ncclGetVersion``) as ``major.minor.patch``."""
    if code >= 10000:  # since 2.9: major * 10000 + minor * 100 + patch
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def nccl_match(compiled: int, loaded: Optional[int]) -> str:
    """Whether the NCCL loaded is the one compiled against, as the device path (``method="device"``,
    NCCL's device API, whose structs change between releases) judges it: it runs with the same
    major.minor, from 2.28.7 on (the core's own check, which ``allscan.device_path`` reports)."""
    if loaded is None:
        return "no NCCL loaded"
    if compiled == loaded and compiled >= 22807:
        return "match (the device path can run)"
    if compiled == loaded:
        return "match (no device API before 2.28.7: the device path stays off)"
    if compiled // 100 == loaded // 100 and min(compiled, loaded) >= 22807:
        return (f"compatible: compiled against {nccl_version_text(compiled)}, loaded {nccl_version_text(loaded)} "
                "(same major.minor: the device path can run)")
    return (f"differ: compiled against {nccl_version_text(compiled)}, loaded {nccl_version_text(loaded)}; "
            "the device path stays off")


def _loaded_library(fragment: str) -> Optional[str]:
    """The file of a shared library mapped into this process whose name contains ``fragment``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if fragment in os.path.basename(path) and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def _version(pkg: str) -> Optional[str]:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> List[Dict]:
    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    out = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
        out.append(dict(index=i, name=p.name, memory_gib=round(p.total_memory / 2 ** 30, 1),
                        capability=f"{p.major}.{p.minor}", peer_access=peers))
    return out


def _paths() -> Dict[str, str]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {"default group": "torch.distributed is not initialised (a zeco_* op then runs on this process "
                                 "alone; allscan.scan raises)",
                "CUDA tensor": "the C++ core over NCCL on an NCCL group, else torch.distributed",
                "CPU tensor": "torch.distributed (gloo)"}
    backend = str(dist.get_backend()).lower()
    nccl = "nccl" in backend
    return {"default group": f"{dist.get_world_size()} ranks, backend {backend}",
            "CUDA tensor": "the C++ core over NCCL" if nccl else f"torch.distributed ({backend})",
            "CPU tensor": f"torch.distributed ({backend})" if not nccl or "gloo" in backend
            else "no CPU backend in the default group"}


REGISTER_LINE = ("Ulysses attention (a sliding window, a logit soft-cap and attention sinks honoured; "
                 "chunked attention, dropout, padding masks refused by name)")


def transformers_families() -> Dict[str, str]:
    """The transformers families :func:`allscan.integrations.transformers.sequence_parallel` makes
    sequence-parallel, by model type (its ``SUPPORTED`` table: the sequence mixer, its recurrence and the softmax
    attention beside it), and what ``register()`` does for any softmax-attention model."""
    try:
        from allscan.integrations.hf_hybrids import SUPPORTED
    except Exception as e:  # noqa: BLE001 - reported, not raised: info must run whatever is broken
        return {"(the table could not be read)": f"{type(e).__name__}: {e}"}
    out = {kind: f"{mixer} ({recurrence})" + (f" beside {attention}" if attention else ", no attention")
           for kind, (mixer, attention, recurrence) in SUPPORTED.items()}
    out["any softmax-attention model, register()"] = REGISTER_LINE
    return out


def report() -> Dict:
    loaded = None
    try:
        _nccl.load()
        loaded = int(_C.nccl_version())
    except Exception:  # noqa: BLE001 - reported as not loaded
        pass
    compiled = int(_C.NCCL_VERSION_COMPILED)
    return {
        "allscan": allscan.__version__,
        "allscan module": os.path.dirname(allscan.__file__),
        "torch": torch.__version__,
        "CUDA (torch built with)": torch.version.cuda or "none (CPU build)",
        "CUDA available": torch.cuda.is_available(),
        "NCCL compiled against": nccl_version_text(compiled),
        "NCCL loaded": nccl_version_text(loaded) if loaded else "none",
        "NCCL library file": _loaded_library("libnccl") or "not mapped",
        "NCCL versions": nccl_match(compiled, loaded),
        "NCCL that torch reports": (".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
                                    else "n/a (no CUDA)"),
        "GPUs": _gpus(),
        "optional packages": {pkg: _version(pkg) or "not installed" for pkg in OPTIONAL},
        "settings": {v.name: os.environ.get(v.name) or f"(unset: {getattr(settings, v.attr)!r})"
                     for v in VARIABLES if v.attr},
        "paths": _paths(),
        "transformers families (sequence_parallel)": transformers_families(),
    }


def main() -> None:
    info = report()
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}" + (f"   ({OPTIONAL[k]})" if key == "optional packages" else ""))
        elif isinstance(value, list):
            print(f"{key}:" + (" none" if not value else ""))
            for gpu in value:
                print(f"  cuda:{gpu['index']} {gpu['name']}, {gpu['memory_gib']} GiB, sm {gpu['capability']}, "
                      f"peer access to {gpu['peer_access'] or 'none'}")
        else:
            print(f"{key:{width}s}  {value}")


if __name__ == "__main__":
    main()
