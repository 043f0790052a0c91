"""allscan's collectives as functions: validate -> plan -> launch over the C++ core (NCCL) or
torch.distributed, with their custom ops, autograd and fake kernels. Layers use only these names.

- :mod:`allscan.ops.scan`: the All-Scan (``allscan.scan``).
- :mod:`allscan.ops.a2a`: the chunked all-to-all (``allscan.a2a``), scatter-heads and gather-heads.
- :mod:`allscan.ops.ulysses`: Ulysses attention over the chunked all-to-all (``ulysses_attention``).
- :mod:`allscan.ops.gla`, :mod:`allscan.ops.delta`: the sequence-parallel linear-attention ops
  (``zeco_gla``; ``zeco_gated_delta_rule``, ``zeco_kda``), loaded on first use; :data:`LOCAL` is their
  ``group=`` for one process inside an initialised process group.
- :mod:`allscan.ops.hooks`: the documented hooks where those ops call out (benchmarks time them).
- :func:`own_work`: a layer's own work between the collectives of one call, so that a rank whose work
  raises tells its peers instead of leaving them waiting; :func:`tell_peers_of_failure`, the same for a
  caller that catches the error itself.
- :func:`refuse_double_backward`: a layer's own autograd node whose backward is not differentiable refuses a
  backward with ``create_graph=True`` on every rank.
"""
from .._comm import normalize_group
from ._launch import own_work, refuse_double_backward, tell_peers_of_failure
from ._shards import LOCAL, sequence_parallel_group
from . import a2a
from .a2a import (GATHER, SCATTER, a2a_multi, chunk_head_ranges, gather_heads, gather_heads_multi, kv_head_ranges,
                  scatter_heads, scatter_heads_multi, split_heads)
from .scan import ScanHandle, destroy_communicators, scan, set_check_every_call

__all__ = ["normalize_group", "LOCAL", "sequence_parallel_group", "own_work", "tell_peers_of_failure",
           "refuse_double_backward", "scan",
           "ScanHandle", "set_check_every_call", "destroy_communicators", *a2a.__all__]
