"""Gated linear attention (GLA): the local kernels, their reference, and the sequence-parallel op.

Files, in the layout of flash-linear-attention's ``ops/<op>/``:

- :mod:`.naive`: :func:`recurrent_gla_reference`, token by token in float64 (the tests' reference).
- :mod:`.chunk`: chunked GLA in torch ops (the local kernels on CPU) and its staged backend ``TorchGLA``.
- :mod:`.fla`: the fla glue: fla-core's ``chunk_gla`` kernels called stage by stage (``FlaGLA``, CUDA),
  the switches of allscan's own Triton kernels, and :func:`limit_fla_autotune` (``ALLSCAN_FLA_AUTOTUNE``).
- :mod:`.incoming_state`: allscan's Triton kernels for the incoming state's two terms (CUDA).
- :mod:`.zeco`: :func:`zeco_gla`, the sequence-parallel op (ZeCO All-Scan of the chunk states).
- :mod:`.stage_times`: :func:`host_stage_times`, the benchmarks' timer of the op's stages on the host, from
  outside the op (through its hooks, :mod:`allscan.ops.hooks`).

Public: :func:`zeco_gla`, :data:`LOCAL`, :data:`METHODS`, :func:`recurrent_gla_reference`,
:func:`torch_chunk_gla`, :func:`limit_fla_autotune`, :func:`fla_available`, :func:`set_fused_output`,
:func:`fused_kernels_enabled`, and the benchmark hook :func:`host_stage_times` (:data:`STAGES`).
"""
from .chunk import torch_chunk_gla
from .fla import fla_available, fused_kernels_enabled, limit_fla_autotune, set_fused_output
from .naive import recurrent_gla_reference
from .stage_times import STAGES, host_stage_times
from .zeco import LOCAL, METHODS, zeco_gla

__all__ = [
    "zeco_gla",
    "LOCAL",
    "METHODS",
    "recurrent_gla_reference",
    "torch_chunk_gla",
    "limit_fla_autotune",
    "fla_available",
    "set_fused_output",
    "fused_kernels_enabled",
    "host_stage_times",
    "STAGES",
]
