"""The one dtype table: torch dtype -> the core's dtype code (from ``allscan._C``)."""
from __future__ import annotations

import torch

from . import _C

__all__ = ["DTYPE_CODES", "DTYPE_NAMES", "dtype_code"]

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

