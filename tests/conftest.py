import os
import sys

import pytest

# The tests import the helper module tests/distributed.py as `distributed`.
sys.path.insert(0, os.path.dirname(__file__))


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    if _cuda_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
