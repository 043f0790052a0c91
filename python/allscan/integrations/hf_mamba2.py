"""The rewired forwards of transformers' Mamba2 mixers (``mamba2``, ``nemotron_h``, ``bamba``,
``granitemoehybrid``, ``falcon_h1``, ``zamba2``): each mirrors the mixer's own ``forward`` on the path
transformers takes without mamba-ssm (transformers 5.25: ``causal_conv1d_forward``, then ``mamba2_scan_forward``'s
chunked form; the cache branches refused) on this rank's contiguous shard, with the module's own Parameters and
per-token pieces (``in_proj``, the gated RMSNorm with its group size, ``out_proj``; Falcon-H1's
``ssm_in_multiplier`` and ``mup_vector``, and its optional norm). What crosses the rank boundaries is allscan's:

- the depthwise causal convolution over ``xBC`` reads ``conv_kernel - 1`` tokens of the previous rank
  (:func:`allscan.integrations.hf_shard.causal_conv`: the halo exchange, zeros on rank 0 as the module's own
  left padding; with packed rows no window reads before its sequence's start);
- the SSD recurrence is allscan's sequence-parallel :func:`allscan.ops.ssd.zeco_ssd`, given what transformers'
  ``mamba2_chunk_scan`` computes with: ``dt`` after ``dt_bias``, softplus and the module's ``time_step_limit``
  clamp (in the model's dtype, as transformers does), ``A = -exp(A_log)`` in fp32, B and C per group (head h
  reads group ``h // (H // n_groups)``), the ``D`` skip; each packed sequence from a zero state
  (the batch's context, ``context=``).

The six mixers' forwards are one code (transformers generates them from Mamba2's), but for Falcon-H1's
multipliers and optional norm. transformers' torch scan computes and returns fp32 whatever the model's dtype;
the op returns the model's dtype, promoted here to fp32 before the norm. In fp32 and fp64 models the norm sees
what it sees in transformers; in bf16/fp16 models ``dt * x`` and the scan's output are rounded once to the
model's dtype on the way (as mamba-ssm's kernels do), so they agree with transformers' torch path to that dtype's
rounding, not bitwise.
"""
from __future__ import annotations

import hashlib
import inspect
import re
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from allscan.context import SequenceContext

from .hf_shard import causal_conv, collective_begins, layer_call

__all__ = ["FORWARDS", "helpers_digest", "CHECKED_HELPERS"]

# transformers' module-level functions the mirrored forward also stands for (the conv's and the scan's
# arithmetic): their source in each family's modeling module (docstrings aside: one digest for all six), as
# 5.25.0 wrote it
_HELPERS = ("causal_conv1d_fn", "causal_conv1d_forward", "mamba2_chunk_scan", "mamba2_scan_forward")
CHECKED_HELPERS = "9becd33358e47ca6d1cdfa8f9a3145eb9b2429a9"


def helpers_digest(model_type: str) -> Optional[str]:
    """sha1 of the source of the family's conv and scan helpers (``_HELPERS``) in its loaded modeling module,
    docstrings dropped; None when they cannot be read."""
    module = sys.modules.get(f"transformers.models.{model_type}.modeling_{model_type}")
    try:
        src = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    parts = []
    for name in _HELPERS:
        start = src.find(f"\ndef {name}(")
        if start < 0:
            return None
        end = src.find("\n\n\n", start + 1)
        body = re.sub(r'"""(.|\n)*?"""', '""""""', src[start:end if end > 0 else len(src)])
        parts.append(body)
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


def _ssd(mod, hidden_states, B, C, dt, ctx: SequenceContext) -> torch.Tensor:
    """``mamba2_scan_forward``'s chunked form without a cache, on the whole sequence: ``[b, T_local,
    intermediate_size]``, in the module's scan output dtype (fp32 at least, as transformers' torch scan)."""
    from allscan.ops.ssd import zeco_ssd

    b, T, _ = hidden_states.shape
    A = -torch.exp(mod.A_log.float())
    dt = F.softplus(dt + mod.dt_bias.to(dt.dtype))
    lo, hi = mod.time_step_limit
    dt = torch.clamp(dt, min=lo, max=hi)
    x = hidden_states.reshape(b, T, mod.num_heads, mod.head_dim)
    B = B.reshape(b, T, mod.n_groups, mod.ssm_state_size)
    C = C.reshape(b, T, mod.n_groups, mod.ssm_state_size)
    collective_begins()
    y, _ = zeco_ssd(x, dt, A, B, C, mod.D, context=ctx)
    y = y.reshape(b, T, mod.intermediate_size)
    return y.to(torch.promote_types(y.dtype, torch.float32))


def _mixer(mod, group, hidden_states, cache, attention_mask, kwargs, falcon: bool):
    ctx = layer_call(mod, group, hidden_states, cache, attention_mask, kwargs)
    dtype = hidden_states.dtype
    if falcon:  # Falcon-H1's mup multipliers, on the input and on each part of the projection
        hidden_states = hidden_states * mod.ssm_in_multiplier
    projected_states = mod.in_proj(hidden_states)
    if falcon:
        projected_states = projected_states * mod.mup_vector
    gate, hidden_states_B_C, dt = projected_states.split([mod.intermediate_size, mod.conv_dim, mod.num_heads], dim=-1)
    hidden_states_B_C = causal_conv(mod, hidden_states_B_C, ctx)
    groups_state = mod.n_groups * mod.ssm_state_size
    hidden_states, B, C = torch.split(hidden_states_B_C, [mod.intermediate_size, groups_state, groups_state], dim=-1)
    scan_output = _ssd(mod, hidden_states, B, C, dt, ctx)
    if falcon and not mod.mamba_rms_norm:
        scan_output = scan_output * F.silu(gate)
    else:
        scan_output = mod.norm(scan_output, gate)
    return mod.out_proj(scan_output.to(dtype))


def _mamba2_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    return _mixer(mod, group, hidden_states, cache, attention_mask, kwargs, falcon=False)


def _falcon_h1_forward(mod, group, hidden_states, cache, attention_mask, kwargs):
    return _mixer(mod, group, hidden_states, cache, attention_mask, kwargs, falcon=True)


FORWARDS = {"mamba2": _mamba2_forward, "nemotron_h": _mamba2_forward, "bamba": _mamba2_forward,
            "granitemoehybrid": _mamba2_forward, "falcon_h1": _falcon_h1_forward, "zamba2": _mamba2_forward}
