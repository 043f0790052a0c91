"""``allscan.ops.delta.widen``: fla's WY values widened with zero columns (``widened``, against torch's
cat) and Gated DeltaNet's ``w`` and ``[u | 0]`` in one pass (``gdn_wy_widened``, against a float64
reference on the same rounded operands; on GPU also bitwise against fla's ``recompute_w_u_fwd`` then
``widened``). On CPU through Triton's interpreter (in a subprocess: the interpreter is chosen when the
kernel is defined); on GPU the compiled kernel."""
import pytest
import torch
from triton_interpreted import assert_passes_interpreted

pytest.importorskip("triton")

# (B, T, H, V, width): widths that are and are not powers of two, rows not a multiple of a program's
SHAPES = [(1, 70, 2, 32, 48), (2, 33, 3, 40, 64), (1, 5, 1, 16, 16), (1, 9, 2, 200, 456)]


def check_widened(device: str, shapes=SHAPES):
    from allscan.ops.delta.widen import widened

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for B, T, H, V, W in shapes:
            u = torch.randn(B, T, H, V, generator=gen).to(dtype).to(device)
            out = widened(u, W)
            ref = torch.cat([u, u.new_zeros(B, T, H, W - V)], -1)
            assert out.dtype == dtype and out.is_contiguous() and torch.equal(out, ref), (dtype, (B, T, H, V, W))
    # a strided u (made contiguous first), and empty ones
    u = torch.randn(2, 6, 3, 40, generator=gen).to(device)[:, ::2, :, :24]
    assert torch.equal(widened(u, 30), torch.cat([u, u.new_zeros(2, 3, 3, 6)], -1))
    for shape, W in (((1, 0, 2, 8), 12), ((1, 3, 2, 0), 5)):
        out = widened(torch.zeros(shape, device=device), W)
        assert out.shape == shape[:-1] + (W,) and not out.any(), shape
    with pytest.raises(ValueError, match="width must be at least"):
        widened(torch.zeros(1, 2, 1, 8, device=device), 4)


def test_widened_interpreted_on_cpu():
    assert_passes_interpreted("test_widen", "check_widened")


# (B, T, H, HV, K, V, width): chunks cut short, K and V below a 64-wide tile and not powers of two, value
# heads grouped over the key heads, zero columns fewer and more than a tile
WY_SHAPES = [(1, 70, 2, 2, 32, 32, 64), (2, 33, 1, 3, 64, 40, 104), (1, 128, 2, 4, 64, 64, 128),
             (1, 5, 1, 1, 16, 16, 32), (1, 65, 1, 2, 96, 48, 200)]
# Per element, relative to the sum of the magnitudes of its terms, in 16 bits: the output's rounding (half
# an ulp) and an operand rounded the other way (an ulp: the GPU's exp2 may differ from torch's in its last
# bit); fp32 exact on the CPU (interpreted) and TF32 (w's dots, as fla's) on the GPU. Triton's interpreter
# rounds to bf16 toward zero: w's two operand roundings and its output's, up to an ulp each.
_WY_EPS = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -18}
_WY_EPS_TF32 = 2.0 ** -9
_WY_EPS_INTERPRETED_BF16 = 2.0 ** -5


def _wy_floor(dtype: torch.dtype) -> float:
    """The absolute error where the relative bound vanishes (the decay's exp2 underflows over a long
    sequence): an ulp of the dtype's subnormals, and the GPU's fp32 flushing subnormal operands and
    results to zero (at most fp32's smallest normal per term; the tests' A entries are below 1, 64 terms)."""
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps + 65 * torch.finfo(torch.float32).tiny


def wy_reference(k, v, beta, A, g, width):
    """float64 ``(w, [u | 0])`` chunk by chunk, from the operands the kernel rounds as fla's does (``v *
    beta`` and ``k * beta * exp2(g)`` in the values' dtype, ``k * beta`` in it first when beta has it),
    and the sums of their terms' magnitudes ``(|A| |kb|, |A| |vb|)``, the scale of each element's error."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = torch.zeros(B, T, HV, K, dtype=torch.float64)
    u = torch.zeros(B, T, HV, width, dtype=torch.float64)
    kh = k.float().repeat_interleave(HV // H, dim=2)
    vb = (v.float() * beta.float()[..., None]).to(v.dtype).double()
    kb = kh * beta.float()[..., None]
    if beta.dtype == k.dtype:
        kb = kb.to(k.dtype).float()
    kb = (kb * torch.exp2(g.float())[..., None]).to(k.dtype).double()
    w_size, u_size = torch.zeros_like(w), torch.zeros_like(u)
    for t0 in range(0, T, 64):
        n = min(64, T - t0)
        a = A[:, t0:t0 + n, :, :n].double().permute(0, 2, 1, 3)  # [B, HV, n, n]
        for out, size, ops in ((u, u_size, vb), (w, w_size, kb)):
            x = ops[:, t0:t0 + n].permute(0, 2, 1, 3)
            out[:, t0:t0 + n, :, :x.shape[-1]] = (a @ x).permute(0, 2, 1, 3)
            size[:, t0:t0 + n, :, :x.shape[-1]] = (a.abs() @ x.abs()).permute(0, 2, 1, 3)
    return w, u, w_size, u_size


def wy_inputs(B, T, H, HV, K, V, dtype, gen, beta_dtype=None):
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    beta = torch.rand(B, T, HV, generator=gen).to(beta_dtype or dtype)
    A = (torch.randn(B, T, HV, 64, generator=gen) / 8).clamp(-1, 1).to(dtype)
    g = -torch.rand(B, T, HV, generator=gen).cumsum(1) / 16  # a cumulative log2 decay, fp32 as fla's
    return k, v, beta, A, g


def check_gdn_wy_widened(device: str, shapes=WY_SHAPES):
    from allscan.ops.delta.widen import gdn_wy_widened

    gen = torch.Generator().manual_seed(1)
    junk = None
    # beta in the values' dtype, or fp32 (fla's sigmoid in the kernel makes it fp32)
    for dtype, beta_dtype in ((torch.bfloat16, None), (torch.float16, None), (torch.float32, None),
                              (torch.bfloat16, torch.float32)):
        for B, T, H, HV, K, V, W in shapes:
            k, v, beta, A, g = wy_inputs(B, T, H, HV, K, V, dtype, gen, beta_dtype)
            del junk  # freed memory the outputs are likely to reuse: the zero columns must be written
            w, u = gdn_wy_widened(*(t.to(device) for t in (k, v, beta, A, g)), W)
            junk = torch.full((2 * u.numel(),), float("nan"), dtype=dtype, device=device)
            assert w.dtype == dtype and u.dtype == dtype and w.shape == (B, T, HV, K) and u.shape == (B, T, HV, W)
            want_w, want_u, w_size, u_size = wy_reference(k, v, beta, A, g, W)
            eps = _WY_EPS[dtype]
            if device == "cpu" and dtype == torch.bfloat16:
                eps = _WY_EPS_INTERPRETED_BF16
            elif device != "cpu" and dtype == torch.float32:
                eps = _WY_EPS_TF32
            for name, got, want, size in (("w", w, want_w, w_size), ("u", u, want_u, u_size)):
                excess = ((got.cpu().double() - want).abs() - eps * size - _wy_floor(dtype)).max().item()
                assert excess <= 0, (name, dtype, beta_dtype, (B, T, H, HV, K, V, W), excess)
            assert not u[..., V:].any(), "the widened columns are zeros"
    w, u = gdn_wy_widened(*(t.to(device) for t in wy_inputs(1, 0, 1, 1, 16, 16, torch.float32, gen)), 32)
    assert w.shape == (1, 0, 1, 16) and u.shape == (1, 0, 1, 32)
    k, v, beta, A, g = (t.to(device) for t in wy_inputs(1, 3, 2, 2, 16, 16, torch.float32, gen))
    with pytest.raises(ValueError, match="width must be at least"):
        gdn_wy_widened(k, v, beta, A, g, 8)
    with pytest.raises(ValueError, match="HV a multiple of k's heads"):
        gdn_wy_widened(k, v[:, :, :1], beta[:, :, :1], A[:, :, :1], g[:, :, :1], 32)
    with pytest.raises(ValueError, match=r"A must be \[1, 3, 2, 64\]"):
        gdn_wy_widened(k, v, beta, A[..., :32], g, 32)
    with pytest.raises(ValueError, match=r"g_cum must be \[1, 3, 2\]"):
        gdn_wy_widened(k, v, beta, A, g[:, :2], 32)


def test_gdn_wy_widened_interpreted_on_cpu():
    assert_passes_interpreted("test_widen", "check_gdn_wy_widened")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_widened_on_gpu():
    # the layers' sizes: K = V = 128 (the benchmarks), K = 256, V = 512 (GatedDeltaNet's defaults)
    check_widened("cuda", shapes=SHAPES + [(1, 4096, 16, 128, 256), (1, 700, 4, 512, 768)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gdn_wy_widened_on_gpu_equals_fla():
    """The compiled kernel against the reference, and bitwise against what it replaces: fla's intra-chunk
    function's factors (its solve kernel as the layer launches it) and WY values, then ``widened``."""
    # (every shape and dtype compiles a kernel: a few of each, the benchmarks' shape among them; fla's
    # kernels tried in one config each, as the benchmarks run them)
    check_gdn_wy_widened("cuda", shapes=WY_SHAPES[1:3] + WY_SHAPES[4:] + [(1, 4096, 16, 16, 128, 128, 256)])
    pytest.importorskip("fla.ops.gated_delta_rule")
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    from allscan.ops.delta.fla import _gdn_solved_factors
    from allscan.ops.delta.widen import gdn_wy_widened, widened
    from allscan.ops.gla import limit_fla_autotune

    limit_fla_autotune("one")

    gen = torch.Generator().manual_seed(2)
    for dtype, beta_dtype in ((torch.bfloat16, None), (torch.float16, None), (torch.float32, None),
                              (torch.bfloat16, torch.float32)):
        # the benchmarks' shape; a chunk cut short with grouped value heads and K != V; GatedDeltaNet's defaults
        for B, T, H, HV, K, V in ((1, 4096, 16, 16, 128, 128), (1, 4129, 8, 16, 128, 64), (1, 1000, 4, 4, 256, 512)):
            k, v, beta, A, g = (t.cuda() for t in wy_inputs(B, T, H, HV, K, V, dtype, gen, beta_dtype))
            w_fla, u_fla, A_fla = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
            assert torch.equal(_gdn_solved_factors(k, g, beta), A_fla), (dtype, beta_dtype, T)
            w, u = gdn_wy_widened(k, v, beta, A, g, V + K)
            w_ref, u_ref = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g)
            assert torch.equal(w, w_ref) and torch.equal(u, widened(u_ref, V + K)), (dtype, beta_dtype, T)
