import os
import sys

import pytest

# The tests import the helper module tests/distributed.py as `distributed`.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def single_rank():
    """A one-rank gloo group in this process (the default group), destroyed after the module: later
    modules (some check what happens without torch.distributed) find the process as it was."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from distributed import _free_port

        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


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
