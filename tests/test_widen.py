"""``allscan.ops.delta.widen.widened``: fla's WY values widened with zero columns, against torch's cat.
On CPU through Triton's interpreter (in a subprocess: the interpreter is chosen when the kernel is
defined); on GPU the compiled kernel."""
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_widened_on_gpu():
    # the layers' sizes: K = V = 128 (the benchmarks), K = 256, V = 512 (GatedDeltaNet's defaults)
    check_widened("cuda", shapes=SHAPES + [(1, 4096, 16, 128, 256), (1, 700, 4, 512, 768)])
