"""The delta-rule layers' fold-in kernels (``allscan.ops.delta.fold_in``): ``o + Q' S_in`` and the gradient
of ``S_in`` against float64, with the strided slices fla's widened call hands it. On CPU through Triton's interpreter
(in a subprocess: the interpreter is chosen when the kernels are defined); on GPU the compiled kernels."""
import pytest
import torch
from triton_interpreted import assert_passes_interpreted

pytest.importorskip("triton")

# (B, T, H, K, V): T not a multiple of the 64-token block, K and V not powers of two, several heads
SHAPES = [(1, 70, 2, 16, 32), (2, 130, 3, 24, 40), (1, 200, 1, 32, 16), (1, 90, 1, 16, 200)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def check_fold_in(device: str, shapes=SHAPES, dtypes=DTYPES):
    from allscan.ops.delta.fold_in import fold_forward, fold_state_grad

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        # what one rounding to dtype allows (the CPU interpreter truncates: up to one unit)
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}[dtype]
        for B, T, H, K, V in shapes:
            wide = torch.randn(B, T, H, V + K, generator=gen).to(dtype).to(device)
            S = (3 * torch.randn(B, H, K, V, generator=gen)).to(device)
            o, q_eff = wide[..., :V], wide[..., V:]  # fla's widened output, sliced as the layer slices it
            out = fold_forward(o, q_eff, S)
            assert out.dtype == dtype and out.shape == (B, T, H, V)
            again, q_copy = fold_forward(o, q_eff, S, copy_q=True)  # what the layer keeps for its backward
            assert torch.equal(again, out) and q_copy.is_contiguous() and torch.equal(q_copy, q_eff), dtype
            dout = torch.randn(B, T, H, V, generator=gen).to(dtype).to(device)
            d_S = fold_state_grad(q_eff, dout)
            assert d_S.dtype == torch.float32 and d_S.shape == (B, H, K, V)

            w64, S64 = wide.double(), S.double()
            ref = w64[..., :V] + torch.einsum("bthk,bhkv->bthv", w64[..., V:], S64)
            r_S = torch.einsum("bthk,bthv->bhkv", w64[..., V:], dout.double())
            what = f"{dtype}, shape {(B, T, H, K, V)}"
            # outputs are rounded once to dtype from fp32-accurate sums
            torch.testing.assert_close(out.double(), ref, rtol=ulp, atol=1e-5 * ref.abs().max().item(),
                                       msg=lambda m: f"output, {what}: {m}")
            # dS_in: exact products of dtype values summed in fp32
            torch.testing.assert_close(d_S.double(), r_S, rtol=1e-5, atol=1e-5 * r_S.abs().max().item(),
                                       msg=lambda m: f"gradient of S_in, {what}: {m}")
            # deterministic: the split sums are added in a fixed order
            assert torch.equal(fold_state_grad(q_eff, dout), d_S), what


def test_fold_in_interpreted_on_cpu():
    assert_passes_interpreted("test_fold_in", "check_fold_in")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fold_in_on_gpu():
    # the layers' sizes: K = V = 128 (the benchmarks), K = 256, V = 512 (GatedDeltaNet's defaults)
    check_fold_in("cuda", shapes=SHAPES + [(1, 4096, 4, 128, 128), (2, 1000, 16, 128, 128), (1, 700, 2, 256, 512)])
