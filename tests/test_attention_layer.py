"""allscan.layers.Attention (fla's softmax attention layer on Ulysses) on CPU with gloo, fp64, against the
layer's formula written out in this file on the whole sequence: projections, q/k norms, rotary embeddings
at global positions restarting at each packed sequence, causal softmax attention within each sequence,
grouped-query heads, the output projection; outputs and every gradient. Also its rotary against fla's own
reference function, and its refusals."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from allscan.layers import Attention  # noqa: E402
from allscan.layers.rotary import RotaryEmbedding  # noqa: E402

HIDDEN, HEADS, KV_HEADS, THETA = 32, 4, 2, 500.0


def layer_formula(mod: Attention, x: torch.Tensor, bounds) -> torch.Tensor:
    """The layer on the whole sequence ``x [B, T, hidden]`` from its parameters, token by token in fp64."""
    B, T, _ = x.shape
    D, H, Hk = mod.head_dim, mod.num_heads, mod.num_kv_heads
    q = mod.q_proj(x).view(B, T, H, D)
    k = mod.k_proj(x).view(B, T, Hk, D)
    v = mod.v_proj(x).view(B, T, Hk, D)
    if mod.qk_norm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * mod.q_norm.weight
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-5) * mod.k_norm.weight
    seq = torch.zeros(T, dtype=torch.long)
    pos = torch.arange(T)
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        seq[a:b], pos[a:b] = j, torch.arange(b - a)
    freq = mod.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = pos[:, None].double() * freq[None, :]  # [T, D/2]
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]

    def rotate(t):
        a, b = t[..., :D // 2], t[..., D // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // Hk, 2), v.repeat_interleave(H // Hk, 2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / D ** 0.5
    visible = (seq[:, None] == seq[None, :]) & (torch.arange(T)[:, None] >= torch.arange(T)[None, :])
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * D)
    return mod.o_proj(o)


def _module(seed=0, **kw):
    torch.manual_seed(seed)
    mod = Attention(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, qkv_bias=True, qk_norm=True,
                    rope_theta=THETA, **kw).double()
    with torch.no_grad():  # norms away from ones, so that a norm left out shows
        mod.q_norm.weight.uniform_(0.5, 1.5)
        mod.k_norm.weight.uniform_(0.5, 1.5)
    return mod


def _sharded_equals_formula(rank, world, B, T, bounds, local=False):
    from allscan.ops import LOCAL

    mod = _module(num_chunks=2, **({"group": LOCAL} if local else {}))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.randn(B, T, HIDDEN, generator=gen, dtype=torch.float64)
    ref = layer_formula(mod, x.requires_grad_(True), bounds or (0, T))
    (ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad()

    Tl = T // world
    sl = slice(rank * Tl, (rank + 1) * Tl)
    xs = x.detach()[:, sl].clone().requires_grad_(True)
    cu = None if bounds is None else torch.tensor(bounds)
    o, attn, cache = mod(xs, cu_seqlens=cu)
    assert attn is None and cache is None
    torch.testing.assert_close(o, ref.detach()[:, sl], rtol=1e-10, atol=1e-10)
    (o * w[:, sl]).sum().backward()
    torch.testing.assert_close(xs.grad, x.grad[:, sl], rtol=1e-10, atol=1e-10)
    for n, p in mod.named_parameters():
        if world > 1:
            dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-10, msg=lambda m: f"{n}: {m}")
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_layer_equals_its_formula(world):
    assert all(run_distributed(_sharded_equals_formula, world, 2, 6 * world, None))


@pytest.mark.parametrize("world,bounds", [(1, (0, 4, 4, 9, 12)), (2, (0, 6, 9, 12)), (3, (0, 2, 7, 8, 12))])
def test_sharded_layer_with_packed_sequences_equals_its_formula(world, bounds):
    """Packed sequences cut anywhere: at a rank's start (2 ranks: 6), inside shards, an empty one."""
    assert all(run_distributed(_sharded_equals_formula, world, 1, 12, bounds))


@pytest.mark.parametrize("bounds", [None, (0, 4, 4, 9, 12)])
def test_one_process_layer_equals_its_formula(bounds):
    """``group=LOCAL``: one process, its own attention (no Ulysses), packed or not."""
    assert _sharded_equals_formula(0, 1, 1, 12, bounds, local=True)


def test_rotary_equals_fla_reference():
    """allscan's rotary at positions 20.. equals fla's reference function on fla's tables' rows 20.."""
    ops = pytest.importorskip("fla.modules.rotary.ops", reason="needs flash-linear-attention 0.6")
    rot = RotaryEmbedding(16, 500.0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 10, 3, 16, generator=gen), torch.randn(2, 10, 1, 16, generator=gen)
    angles = torch.outer(torch.arange(30, dtype=torch.float32), rot.inv_freq)[20:]
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)  # fla's tables, in the inputs' dtype
        got_q, got_k = rot(q.to(dtype), k.to(dtype), torch.arange(20, 30))
        want_q = ops.rotary_embedding_ref(q.to(dtype).float(), cos.float(), sin.float()).to(dtype)
        want_k = ops.rotary_embedding_ref(k.to(dtype).float(), cos.float(), sin.float()).to(dtype)
        assert got_q.dtype == dtype
        torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)


def test_refusals_name_the_argument():
    from allscan.ops import LOCAL

    with pytest.raises(NotImplementedError, match=r"window_size=64 \(sliding-window attention\)"):
        Attention(hidden_size=HIDDEN, num_heads=HEADS, window_size=64)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a positive multiple of num_kv_heads \(3\)"):
        Attention(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be a multiple of num_heads \(4\)"):
        Attention(hidden_size=30, num_heads=HEADS)
    mod = Attention(hidden_size=HIDDEN, num_heads=HEADS, group=LOCAL)
    x = torch.zeros(1, 4, HIDDEN)
    with pytest.raises(NotImplementedError, match="attention_mask is not supported"):
        mod(x, attention_mask=torch.ones(1, 4))
    with pytest.raises(NotImplementedError, match="caching"):
        mod(x, use_cache=True)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T_local, 32\]"):
        mod(torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        mod(x, cu_seqlens=torch.tensor([0, 3]))


def _one_rank_bad_input(rank, world):
    mod = Attention(hidden_size=HIDDEN, num_heads=HEADS)
    x = torch.zeros(1, 4, HIDDEN if rank == 0 else 16)
    match = r"rank\(s\) \[1\] rejected their own arguments or failed" if rank == 0 else r"hidden_states must be"
    with pytest.raises(ValueError, match=match):
        mod(x)
    return True


def test_one_rank_bad_input_reaches_every_rank():
    assert run_distributed(_one_rank_bad_input, 2, timeout=60) == [True, True]
