"""Gated DeltaNet and KDA (the delta-rule layers): the local kernels, their reference, and the
sequence-parallel ops on the matrix All-Scan.

Files, in the layout of flash-linear-attention's ``ops/<op>/``:

- :mod:`.naive`: :func:`recurrent_delta_rule_reference`, token by token in float64 (the tests' reference).
- :mod:`.chunk`: the chunked delta rule in torch ops and its local backend ``TorchDelta``.
- :mod:`.fla`: ``FlaDelta``, the same with fla-core's kernels (GPU); :mod:`.fla_imports`, the fla-core
  functions it calls, imported once.
- :mod:`.fla_cp`: ``method="fla_cp"``, fla's own context parallelism (the baseline).
- :mod:`.fold_in`: the Triton kernels that fold the incoming state into the outputs (and its gradient).
- :mod:`.shard`: one shard's forward and backward with the All-Scan, and their autograd function.
- :mod:`.compiled`: the same as custom ops with fake kernels (torch.compile without graph breaks).
- :mod:`.prepare`: what a call does before it runs, eager or compiled: checks, the cut, backend and plan.
- :mod:`.gates`: the q/k l2norm and gate activations fla's kernels apply first, in torch ops; the options.
- :mod:`.zeco`: :func:`zeco_gated_delta_rule` and :func:`zeco_kda`, the sequence-parallel ops.
"""
from .chunk import TorchDelta, chunk_delta_rule
from .naive import recurrent_delta_rule_reference
from .zeco import METHODS, zeco_gated_delta_rule, zeco_kda  # (it imports .compiled: the custom ops)

__all__ = [
    "zeco_gated_delta_rule",
    "zeco_kda",
    "METHODS",
    "recurrent_delta_rule_reference",
    "chunk_delta_rule",
    "TorchDelta",
]
