"""Ulysses attention with head-chunked overlap (HCMS), forward and backward: the op behind
:class:`allscan.layers.UlyssesAttention`.

Ulysses sequence parallelism turns ``[B, S_local, H, D]`` (sequence-sharded, all heads) into
``[B, S, H_rank, D]`` (whole sequence, this rank's heads) with an all-to-all, runs attention, and
turns the output back with a second all-to-all. Here the heads are cut into ``C`` chunks and the
chunks are pipelined over two CUDA streams::

    comm stream:     S0 S1 .. G0 S2 .. G1 S3 ..          S = scatter-heads of q, k, v of a chunk
    compute stream:        A0    A1    A2 ...             A = attention of a chunk (SDPA)
                                                          G = gather-heads of the chunk's output

so that the all-to-alls of chunks c-1 and c+1 run while chunk c is attended. The backward pass is
pipelined the same way: scatter of the output gradient, per-chunk SDPA backward (through the graph the
forward kept, so nothing is recomputed), gather of dq, dk, dv.

Chunks are rank-major (:func:`allscan.ops.chunk_head_ranges`): every rank's own heads are cut into C
pieces, so C never changes which heads a rank attends. Heads need not divide the group size (the first
``H % P`` ranks get one more), and k/v may have fewer heads than q (grouped-query attention): each
rank receives the k/v heads its query heads use (replicated when there are fewer k/v heads than
ranks), and their gradients are summed back.

On CPU (or any non-NCCL group) the same code runs sequentially through the torch.distributed path.

One concern a module, each importing only those above it:

- :mod:`.checks`: the checks of one call's arguments, its cross-rank signature, packed bounds;
- :mod:`.masked`: the local attention with a sliding window, a soft-cap or sinks (math path; FlexAttention on CUDA);
- :mod:`.plan`: the plan of one call (head chunks, grouped-query indexing) and a chunk's attention;
- :mod:`.pipeline`: the two-stream driver and where a failing step is reported;
- :mod:`.passes`: the forward and backward passes over the pipeline and their autograd function;
- :mod:`.tune`: ``num_chunks="auto"``: the pipeline model and the measurements that choose C;
- :mod:`.traced`: the form torch.compile traces (one chunk, custom ops);
- :mod:`.api`: :func:`ulysses_attention`, its plan and auto caches.
"""
from .api import clear_auto_cache, ulysses_attention
from .checks import packed_bounds, refuse_packed_while_tracing, signature  # noqa: F401  (the packed layers' checks)
from .masked import MaskSpec, masked_attention  # noqa: F401  (one process's form of the same attention)
from .tune import choose_num_chunks, model_time, pick_measured  # noqa: F401

__all__ = ["ulysses_attention", "choose_num_chunks", "pick_measured", "clear_auto_cache"]
