"""The forward and backward passes of Ulysses attention over the two-stream pipeline
(:mod:`.pipeline`), and the autograd function that joins them: the forward keeps each chunk's attention
graph, the backward runs through it (nothing recomputed). Sinks (one logit per query head, a Parameter of the
model) are an input of the function: each rank's gradient holds its own heads' share (the whole sequence's),
zeros elsewhere, so the gradients summed over the group are one process's."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..._contract import settings
from .._launch import refuse_double_backward
from ..a2a import GATHER, SCATTER, a2a_multi
from .checks import OP
from .pipeline import chunks_checked, report_failure, run_pipeline, use_streams
from .plan import ChunkPlan, attend_chunk, chunk_attention, expand_kv, kv_for_chunk


_NOT_TWICE = ("its backward (all-to-alls around each head chunk's attention backward) is not differentiable; use "
              "one-process attention where second-order gradients are needed")


def _graph_kept() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``): the per-chunk graphs are
    then kept for the next backward. True where torch cannot tell (keeping is always correct)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


class UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: ChunkPlan):
        out, graphs = forward_pass(plan, q, k, v, keep_graph=True, sinks=sinks)
        ctx.plan = plan
        ctx.graphs = graphs
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        # The per-chunk graphs are freed as the backward consumes them unless the graph is retained (a
        # second backward then runs through them again); a backward without retain_graph frees them, so a
        # next one raises torch's "backward through the graph a second time" error first.
        plan, graphs = ctx.plan, ctx.graphs
        retain = _graph_kept()
        dq, dk, dv, dsinks = _backward_pass(plan, graphs, dout, ctx.needs_input_grad, retain)
        if not retain:
            ctx.graphs = None
        if dsinks is not None:
            dsinks = dsinks.to(ctx.sinks_dtype)
        return dq, dk, dv, dsinks, None


def _forward_buffers(plan: ChunkPlan, q, k, v):
    """The output and, per chunk, the head-sharded q, k, v it receives (its new k/v heads only),
    allocated up front on the current stream."""
    B, S, D, me = plan.B, plan.Sl * plan.world, plan.D, plan.me
    out = q.new_empty(B, plan.Sl, plan.Hq, D)
    ins = []
    for ch in plan.chunks:
        lo, hi = ch.new_map[me]
        ins.append((q.new_empty(B, S, ch.nq, D), k.new_empty(B, S, hi - lo, D), v.new_empty(B, S, hi - lo, D)))
    return out, ins


def forward_pass(plan: ChunkPlan, q, k, v, keep_graph: bool, streams: Optional[bool] = None, *,
                 sinks: Optional[torch.Tensor] = None):
    """streams: None = two streams on CUDA unless ALLSCAN_ULYSSES_STREAMS=0; False = one stream.
    sinks: ``[Hq]`` sink logits (the plan's spec says sinks), or None.
    With ALLSCAN_CHECK=always a two-stream forward is repeated on one stream (same chunks, same
    kernels) and must match it bitwise, else RuntimeError (a pipeline synchronisation bug)."""
    B, Sl, D, P = plan.B, plan.Sl, plan.D, plan.world
    S = Sl * P
    group = plan.group
    chunks = plan.chunks
    use = use_streams(q) if streams is None else (bool(streams) and q.is_cuda)
    cuda = q.device if use else None
    failed = report_failure(plan, q, "forward")
    check = chunks_checked(group, q)
    me = plan.me
    try:
        out, ins = _forward_buffers(plan, q, k, v)
    except Exception as e:
        failed(None, e)
        raise
    pieces = [(ch.new_map[me][0], ch.new_map[me][1], ins[c][1], ins[c][2]) for c, ch in enumerate(chunks)]
    graphs: List[Optional[tuple]] = [None] * len(chunks)

    def scatter(c, stream):
        ch = chunks[c]
        a2a_multi(SCATTER, [q, k, v], [ch.q_map, ch.new_map, ch.new_map], [plan.Hq, plan.Hkv, plan.Hkv],
                  group, outs=list(ins[c]), stream=stream, check=check, call_signature=plan.call_signature,
                  names=["q", "k", "v"])

    def attend(c):
        ch = chunks[c]
        qc = ins[c][0]
        if ch.nq == 0:
            return qc.new_empty(B, S, 0, D)
        kc, vc = kv_for_chunk(ch, pieces[:c + 1])
        if keep_graph:
            # The graph starts at the expanded k/v: their gradients are reduced in fp32 in _backward_pass
            # rather than by autograd's index_select backward, which adds in the storage dtype.
            kc, vc = expand_kv(ch, kc, vc)
            qc, kc, vc = (t.detach().requires_grad_(True) for t in (qc, kc, vc))
            sc = None if sinks is None else sinks.detach()[ch.q_lo:ch.q_hi].requires_grad_(sinks.requires_grad)
            with torch.enable_grad():
                oc = chunk_attention(plan, qc, kc, vc, sc)
            graphs[c] = (oc, qc, kc, vc, sc)
            return oc.detach()
        return attend_chunk(plan, ch, qc, kc, vc, sinks)

    def gather(c, oc, stream):
        ch = chunks[c]
        a2a_multi(GATHER, [oc], [ch.q_map], [plan.Hq], group, outs=[out], stream=stream, check=check,
                  call_signature=plan.call_signature, names=["attention output"])

    run_pipeline(len(chunks), scatter, attend, gather, cuda, failed=failed)
    del ins
    if cuda is not None and settings.check == "always":
        with torch.no_grad():
            ref, _ = forward_pass(plan, q, k, v, keep_graph=False, streams=False, sinks=sinks)
        if not torch.equal(out, ref):
            diff = (out.float() - ref.float()).abs()
            bad = (diff > 0).reshape(B, Sl, plan.Hq, D).any(3).any(1).any(0).nonzero().flatten().tolist()
            raise RuntimeError(
                f"UlyssesAttention (ALLSCAN_CHECK=always): the two-stream forward differs from the one-stream "
                f"forward with the same {len(chunks)} chunks (max abs diff {diff.max().item():.3g}, heads {bad}): "
                f"a synchronisation bug in the pipeline")
    return out, graphs


def _backward_buffers(plan: ChunkPlan, dout):
    """``(dout contiguous, dq, dk, dv, douts, acc_k, acc_v)``: the gradients this rank gathers, the
    head-sharded output gradient per chunk, and with ``plan.kv_accumulate`` the k/v gradients of the
    whole sequence summed in fp32 (fp64) before they travel (else None, None)."""
    B, Sl, D = plan.B, plan.Sl, plan.D
    S = Sl * plan.world
    dout = dout.contiguous()
    dq = dout.new_empty(B, Sl, plan.Hq, D)
    douts = [dout.new_empty(B, S, ch.nq, D) for ch in plan.chunks]
    if not plan.kv_accumulate:
        return dout, dq, dout.new_empty(B, Sl, plan.Hkv, D), dout.new_empty(B, Sl, plan.Hkv, D), douts, None, None
    # k/v gradients travel and are summed in fp32 (fp64) and rounded once at the end
    acc_dtype = torch.float64 if dout.dtype == torch.float64 else torch.float32
    dk, dv = (torch.zeros(B, Sl, plan.Hkv, D, dtype=acc_dtype, device=dout.device) for _ in range(2))
    n_kv = plan.kv_hi - plan.kv_lo
    acc_k, acc_v = (torch.zeros(B, S, n_kv, D, dtype=acc_dtype, device=dout.device) for _ in range(2))
    return dout, dq, dk, dv, douts, acc_k, acc_v


def _backward_pass(plan: ChunkPlan, graphs, dout, needs, retain: bool = False):
    """dq, dk, dv, dsinks (None where ``needs`` says none is wanted) from the per-chunk graphs the forward kept;
    ``retain``: keep those graphs for another backward (``retain_graph=True``), else free each once used.
    Refused (every rank runs the same graph, so every rank raises, before any all-to-all) under
    ``create_graph=True``: the gradients it returns are not differentiable."""
    B, Sl, D, P = plan.B, plan.Sl, plan.D, plan.world
    S = Sl * P
    group = plan.group
    chunks = plan.chunks
    cuda = dout.device if use_streams(dout) else None
    failed = report_failure(plan, dout, "backward")
    check = chunks_checked(group, dout)
    me = plan.me
    try:
        refuse_double_backward(OP, _NOT_TWICE)
        dout, dq, dk, dv, douts, acc_k, acc_v = _backward_buffers(plan, dout)
        # this rank's heads' share of the sinks' gradient (the others' zeros: summed over the group later)
        dsinks = None
        if len(needs) > 3 and needs[3]:
            dsinks = torch.zeros(plan.Hq, dtype=torch.float64 if dout.dtype == torch.float64 else torch.float32,
                                 device=dout.device)
    except Exception as e:
        failed(None, e)
        raise

    def scatter(c, stream):
        ch = chunks[c]
        a2a_multi(SCATTER, [dout], [ch.q_map], [plan.Hq], group, outs=[douts[c]], stream=stream,
                  check=check, call_signature=plan.call_signature, names=["output gradient"])

    def attend(c):
        ch = chunks[c]
        g = graphs[c]
        if g is None:  # no query head of this chunk on this rank (so no k/v head either)
            if plan.kv_accumulate:  # the k/v gradients travel in the accumulators' dtype
                return dout.new_empty(B, S, 0, D), acc_k[:, :, :0], acc_v[:, :, :0]
            return tuple(dout.new_empty(B, S, 0, D) for _ in range(3))
        oc, qc, kc, vc, sc = g
        if dsinks is not None:
            gq, gk, gv, gs = torch.autograd.grad(oc, (qc, kc, vc, sc), douts[c], retain_graph=retain)
            dsinks[ch.q_lo:ch.q_hi] = gs
        else:
            gq, gk, gv = torch.autograd.grad(oc, (qc, kc, vc), douts[c], retain_graph=retain)
        if not retain:
            graphs[c] = None
        if not plan.kv_accumulate:
            return gq.contiguous(), gk.contiguous(), gv.contiguous()
        idx = ch.index(gk.device, ch.kv_lo - plan.kv_lo)
        acc_k.index_add_(2, idx, gk.to(acc_k.dtype))
        acc_v.index_add_(2, idx, gv.to(acc_v.dtype))
        lo, hi = ch.done_map[me]
        a, b = lo - plan.kv_lo, hi - plan.kv_lo
        return gq.contiguous(), acc_k[:, :, a:b].contiguous(), acc_v[:, :, a:b].contiguous()

    def gather(c, res, stream):
        ch = chunks[c]
        acc = plan.kv_accumulate
        if not acc:
            a2a_multi(GATHER, list(res), [ch.q_map, ch.kv_map, ch.kv_map], [plan.Hq, plan.Hkv, plan.Hkv],
                      group, outs=[dq, dk, dv], stream=stream, check=check, call_signature=plan.call_signature,
                      names=["dq", "dk", "dv"])
        else:
            a2a_multi(GATHER, [res[0]], [ch.q_map], [plan.Hq], group, outs=[dq], stream=stream, check=check,
                      call_signature=plan.call_signature, names=["dq"])
            a2a_multi(GATHER, list(res[1:]), [ch.done_map, ch.done_map], [plan.Hkv, plan.Hkv], group,
                      outs=[dk, dv], accumulate=[True, True], stream=stream, check=check,
                      call_signature=plan.call_signature, names=["dk", "dv"])

    run_pipeline(len(chunks), scatter, attend, gather, cuda, failed=failed)
    if plan.kv_accumulate:
        dk, dv = dk.to(dout.dtype), dv.to(dout.dtype)
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, dsinks)
