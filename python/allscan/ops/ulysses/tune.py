"""``num_chunks="auto"``: the pipeline's time model, the C it chooses, and the collective measurements
(attention and all-to-all costs, then the whole layer at the model's C against C = 1) that feed it."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..a2a import GATHER, SCATTER, a2a_multi, split_heads
from .passes import UlyssesFn, forward_pass
from .plan import CallSpec, ChunkPlan, attend_chunk


def _time_cuda(fn, reps: int) -> float:
    """Median milliseconds of fn() over reps runs (one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def model_time(C: int, n: int, att: Tuple[float, float], comm: Tuple[float, float]) -> float:
    """Pipeline time (ms) of C equal chunks of a rank's n heads. att = (fixed, per head) of one
    chunk's attention, comm = (fixed, per head) of one chunk's scatter + gather. The first scatter
    and the last gather are exposed; in between each step takes the longer of the attention of a
    chunk and the all-to-alls that run beside it."""
    m = n / C
    a = att[0] + m * att[1]
    x = comm[0] + m * comm[1]
    return x + C * a + (C - 1) * max(0.0, x - a)


def choose_num_chunks(n_heads: int, att: Tuple[float, float], comm: Tuple[float, float],
                      max_chunks: Optional[int] = None, min_gain: float = 0.02) -> int:
    """The C that minimises :func:`model_time`; 1 unless it saves at least ``min_gain`` of C = 1."""
    cmax = max(1, min(n_heads, max_chunks or n_heads))
    t1 = model_time(1, n_heads, att, comm)
    best, best_t = 1, t1
    for C in range(2, cmax + 1):
        t = model_time(C, n_heads, att, comm)
        if t < best_t:
            best, best_t = C, t
    if best_t > t1 * (1.0 - min_gain):
        return 1
    return best


def measure(spec: CallSpec, q, k, v, max_chunks: Optional[int] = None, train: bool = False,
            min_gain_measured: float = 0.01) -> Tuple[int, dict]:
    """Measure (collectively) attention and all-to-all costs at 1 head and all heads per rank, agree
    on the maxima across ranks, choose C from the model, then time the layer at that C against C = 1
    (forward+backward when ``train``) and keep the faster."""
    group, world, B, Sl, Hq, Hkv, D = spec.group, spec.world, spec.B, spec.Sl, spec.Hq, spec.Hkv, spec.D
    n_min = min(hi - lo for lo, hi in split_heads(0, Hq, world))
    full = ChunkPlan(spec, 1)
    one = full
    if n_min > 1:
        one = ChunkPlan(spec, max(1, n_min))
    S = Sl * world

    def att_time(pl):
        ch = pl.chunks[0]
        qc = q.new_empty(B, S, ch.nq, D).normal_()
        kc = q.new_empty(B, S, ch.nkv, D).normal_()
        vc = q.new_empty(B, S, ch.nkv, D).normal_()
        return ch.nq, _time_cuda(lambda: attend_chunk(pl, ch, qc, kc, vc), 2)

    def comm_time(pl):
        ch = pl.chunks[0]
        outs = [q.new_empty(B, S, ch.nq, D), k.new_empty(B, S, ch.nkv, D), v.new_empty(B, S, ch.nkv, D)]
        o = q.new_empty(B, Sl, Hq, D)

        def run():
            a2a_multi(SCATTER, [q, k, v], [ch.q_map, ch.kv_map, ch.kv_map], [Hq, Hkv, Hkv], group,
                           outs=outs, check=False)
            a2a_multi(GATHER, [outs[0]], [ch.q_map], [Hq], group, outs=[o], check=False)

        return _time_cuda(run, 3)

    n_full, t_att_full = att_time(full)
    n_one, t_att_one = att_time(one)
    dist.barrier(group=group)
    t_comm_full = comm_time(full)
    t_comm_one = comm_time(one)
    # Every rank must choose the same C: the maxima over ranks (head counts included) feed the model.
    vals = torch.tensor([t_att_full, t_att_one, t_comm_full, t_comm_one, n_full, n_one], dtype=torch.float64,
                        device=q.device)
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
    t_att_full, t_att_one, t_comm_full, t_comm_one, n_full, n_one = vals.tolist()
    n_full, n_one = max(int(n_full), 1), int(n_one)
    if n_full > n_one:
        att_slope = max(0.0, (t_att_full - t_att_one) / (n_full - n_one))
        comm_slope = max(0.0, (t_comm_full - t_comm_one) / (n_full - n_one))
    else:
        att_slope, comm_slope = t_att_full / n_full, t_comm_full / n_full
    att = (max(0.0, t_att_full - att_slope * n_full), att_slope)
    comm = (max(0.0, t_comm_full - comm_slope * n_full), comm_slope)
    C_model = C = choose_num_chunks(n_full, att, comm, max_chunks)
    measured = None
    if C > 1:
        # The model can promise overlap the hardware does not deliver (on NVLink the all-to-alls and
        # the attention share the SMs and the memory): time the real pipeline at C and at 1, side by
        # side, and keep C only if it is measurably faster.
        measured = _time_candidates(spec, q, k, v, [1, C], train)
        C = pick_measured(measured, min_gain=min_gain_measured)
    info = {
        "t_attention_ms": t_att_full,
        "t_all_to_all_ms": t_comm_full,
        "rho": t_comm_full / (t_comm_full + t_att_full) if t_comm_full + t_att_full > 0 else 0.0,
        "attention_model_ms": att,
        "all_to_all_model_ms": comm,
        "num_chunks": C,
        "model_num_chunks": C_model,
        "predicted_ms": {c: model_time(c, n_full, att, comm) for c in range(1, max(1, n_full) + 1)},
        "measured_ms": measured,
        "measured_pass": "forward+backward" if train else "forward",
    }
    return C, info


def pick_measured(measured: Dict[int, float], min_gain: float = 0.01) -> int:
    """The fastest C of ``measured`` ({C: ms}, C = 1 included), 1 unless it beats C = 1 by at least
    ``min_gain`` (timing noise must not pick a chunking that is no faster)."""
    if 1 not in measured:
        raise ValueError("pick_measured: the measurements must include C = 1")
    best = min(measured, key=lambda c: (measured[c], c))
    if best != 1 and measured[best] > measured[1] * (1.0 - min_gain):
        return 1
    return best


def _time_candidates(spec: CallSpec, q, k, v, candidates, train: bool, reps: int = 5) -> Dict[int, float]:
    """Median ms of the whole layer (forward, or forward+backward when ``train``) at each C, the
    candidates interleaved so that drift (clocks, other work) hits them alike; the maxima over ranks
    (collective: every rank runs the same candidates in the same order)."""
    group = spec.group
    plans = {c: ChunkPlan(spec, c) for c in candidates}
    if train:
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        dout = torch.randn_like(q)

        def run(pl):
            with torch.enable_grad():
                out = UlyssesFn.apply(qg, kg, vg, None, pl)
                torch.autograd.grad(out, (qg, kg, vg), dout)
    else:
        def run(pl):
            forward_pass(pl, q, k, v, keep_graph=False)

    for c in candidates:  # warm-up (first use of a plan's shapes)
        run(plans[c])
    dist.barrier(group=group)
    times: Dict[int, List[float]] = {c: [] for c in candidates}
    for r in range(reps):
        for c in (candidates if r % 2 == 0 else candidates[::-1]):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(plans[c])
            b.record()
            b.synchronize()
            times[c].append(a.elapsed_time(b))
    med = torch.tensor([sorted(times[c])[reps // 2] for c in candidates], dtype=torch.float64, device=q.device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return {c: float(t) for c, t in zip(candidates, med.tolist())}
