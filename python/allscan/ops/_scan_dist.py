"""The All-Scan on plain torch.distributed (any backend: gloo on CPU).

Not a toy: it is the path for users without GPUs, the correctness oracle of the NCCL path, and it
runs the same three methods (pipelined, serial = LASP-1, allgather = LASP-2) with the same block
partition and the same arithmetic as the C++ core, so every method and path is bitwise equal to
:func:`allscan.reference.scan_reference`.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _C
from ..reference import combine

MAX_BLOCKS = _C.MAX_BLOCKS            # the core's limits, so both paths partition alike
MIN_BLOCK_BYTES = _C.MIN_BLOCK_BYTES

_models: Dict[tuple, Tuple[float, float]] = {}  # (group name, id(group)) -> model
_models_lock = threading.Lock()


def choose_num_blocks_model(nranks: int, nbytes: int, latency_us: float, us_per_byte: float) -> int:
    """The block-count rule of the C++ core (allscanChooseNumBlocksModel), for this path.

    T(K) = (P - 2 + K) * (a + b*N/K); K* = sqrt((P-2) b N / a); 1 at P <= 2. Kept equal to the C++
    rule by a test.
    """
    if nranks <= 2 or nbytes == 0 or not latency_us > 0.0 or not us_per_byte > 0.0:
        return 1
    kmax = min(MAX_BLOCKS, max(1, nbytes // MIN_BLOCK_BYTES))

    def cost(k: int) -> float:
        return (nranks - 2 + k) * (latency_us + us_per_byte * nbytes / k)

    kstar = math.sqrt((nranks - 2) * us_per_byte * nbytes / latency_us)
    k0 = max(1, min(kmax, int(math.floor(kstar))))
    k1 = max(1, min(kmax, k0 + 1))
    return k1 if cost(k1) < cost(k0) else k0


def block_elems(count: int, num_blocks: int, elem_size: int) -> int:
    """Elements per block: ceil(count/K) rounded up to 16 bytes' worth (as the C++ core)."""
    vec = 16 // elem_size
    b = max(1, -(-count // num_blocks))
    return -(-b // vec) * vec


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (what torch.distributed's point-to-point calls take)."""
    return dist.get_global_rank(group, group_rank)


def link_model(group) -> Tuple[float, float]:
    """(latency_us, us_per_byte) of neighbour messages in ``group``, measured once and cached.

    Collective. Every rank gets the max over ranks so that all choose the same block count.
    """
    name = (group.group_name, id(group))
    with _models_lock:
        m = _models.get(name)
    if m is not None:
        return m
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    sizes = (8 << 10, 1 << 20)
    times = []
    for nbytes in sizes:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty_like(send)
        reps = 3
        t0 = time.perf_counter()
        for _ in range(reps):
            ops = [
                dist.P2POp(dist.isend, send, global_rank(group, (r + 1) % P), group),
                dist.P2POp(dist.irecv, recv, global_rank(group, (r - 1) % P), group),
            ]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        times.append((time.perf_counter() - t0) * 1e6 / reps)
    b = (times[1] - times[0]) / (sizes[1] - sizes[0])
    if not b > 0.0:
        b = times[1] / sizes[1]
    a = max(times[0] - b * sizes[0], 0.1)
    t = torch.tensor([a, b], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    m = (float(t[0]), float(t[1]))
    with _models_lock:
        _models[name] = m
    return m


def effective_blocks(group, count: int, elem_size: int, num_blocks: int, method: str) -> int:
    if method != "pipelined":
        return 1
    if num_blocks > 0:
        return min(num_blocks, MAX_BLOCKS)  # as the core: more blocks only add message latencies
    P = dist.get_world_size(group)
    if P <= 2:
        return 1
    a, b = link_model(group)
    return choose_num_blocks_model(P, count * elem_size, a, b)


def scan(
    x: torch.Tensor,
    g: Optional[torch.Tensor],
    init: Optional[torch.Tensor],
    group,
    reverse: bool,
    inclusive: bool,
    num_blocks: int,
    method: str,
) -> torch.Tensor:
    """The All-Scan of contiguous ``x`` over ``group`` with torch.distributed point-to-point calls
    (``method="device"``, the core's NVLink path, is the pipelined method here)."""
    method = "pipelined" if method == "device" else method
    staged = x.is_cuda  # e.g. a gloo group with CUDA tensors: go through the host
    if staged:
        dev = x.device
        x = x.cpu()
        g = None if g is None else g.cpu()
        init = None if init is None else init.cpu()
    y = _scan_host(x, g, init, group, reverse, inclusive, num_blocks, method)
    return y.to(dev) if staged else y


def _scan_host(x, g, init, group, reverse, inclusive, num_blocks, method):
    P = dist.get_world_size(group)
    r = dist.get_rank(group)
    head = P - 1 if reverse else 0
    if P == 1:
        if inclusive:
            return x.clone() if init is None else combine(g, init, x)
        return torch.zeros_like(x) if init is None else init.clone()

    if method == "allgather":
        if init is not None:
            # init is read on the chain head only, as in the other methods: take the head's.
            init = init.clone()
            dist.broadcast(init, src=global_rank(group, head), group=group)
        xs = [torch.empty_like(x) for _ in range(P)]
        dist.all_gather(xs, x, group=group)
        gs = None
        if g is not None:
            gs = [torch.empty_like(g) for _ in range(P)]
            dist.all_gather(gs, g, group=group)
        order = range(P - 1, r - (1 if inclusive else 0), -1) if reverse else range(0, r + (1 if inclusive else 0))
        y = None if init is None else init
        for q in order:
            y = xs[q].clone() if y is None else combine(None if gs is None else gs[q], y, xs[q])
        return torch.zeros_like(x) if y is None else (y.clone() if y is init else y)

    prev = global_rank(group, r + 1 if reverse else r - 1) if r != head else None
    has_next = r > 0 if reverse else r < P - 1
    nxt = global_rank(group, r - 1 if reverse else r + 1) if has_next else None

    count = x.numel()
    K = effective_blocks(group, count, x.element_size(), num_blocks, method)
    be = block_elems(count, K, x.element_size())
    nblocks = max(1, -(-count // be)) if count else 0
    flat_x = x.reshape(-1)
    gflat = None if g is None else g.reshape(-1)
    inner = count // g.numel() if g is not None and g.numel() else 1
    sends = []

    def gblock(k, n):
        # The decay elements covering state elements [k*be, k*be+n), expanded per element.
        if gflat is None:
            return None
        idx = torch.arange(k * be, k * be + n) // inner
        return gflat[idx]

    if r == head:
        if init is None:
            s = x.clone() if inclusive else x
            y = s if inclusive else torch.zeros_like(x)
        else:
            s = combine(g, init, x)
            y = s if inclusive else init.clone()
        sflat = s.reshape(-1)
        for k in range(nblocks):
            lo, hi = k * be, min(count, (k + 1) * be)
            sends.append(dist.isend(sflat[lo:hi], nxt, group=group))
        for req in sends:
            req.wait()
        return y

    y = torch.empty_like(x)
    recv_buf = torch.empty_like(flat_x) if inclusive else y.reshape(-1)
    send_buf = y.reshape(-1) if inclusive else torch.empty_like(flat_x)
    for k in range(nblocks):
        lo, hi = k * be, min(count, (k + 1) * be)
        dist.recv(recv_buf[lo:hi], prev, group=group)
        if has_next or inclusive:
            send_buf[lo:hi] = combine(gblock(k, hi - lo), recv_buf[lo:hi], flat_x[lo:hi])
        if has_next:
            sends.append(dist.isend(send_buf[lo:hi], nxt, group=group))
    for req in sends:
        req.wait()
    return y
