"""``allscan.a2a``: the chunked all-to-all's public names (implemented in :mod:`allscan.ops.a2a`)."""
from .ops.a2a import (GATHER, SCATTER, a2a_multi, chunk_head_ranges, gather_heads, gather_heads_multi,  # noqa: F401
                      kv_head_ranges, scatter_heads, scatter_heads_multi, split_heads)
from .ops.a2a import __all__  # noqa: F401
