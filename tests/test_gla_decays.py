"""The fla backend's chunk-local decay sums (``FlaGLA._chunk_decays``): a decay per head broadcast over K (simple
GLA, Mamba2's SSD), summed once per head and then broadcast, equals fla's sums over every column of the
materialised gates, with and without packed sequences; full GLA gates go through fla's own sums. On CPU through
Triton's interpreter (in a subprocess: the interpreter is chosen when fla's kernels are defined), bitwise; on GPU
the compiled kernels (fla's scalar and vector sums may associate differently: within 1e-6)."""
import pytest
import torch
from triton_interpreted import assert_passes_interpreted

pytest.importorskip("fla.ops.utils.cumsum")


def _same(got, ref, exact: bool) -> bool:
    return torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=1e-6, atol=1e-6)


def check_chunk_decays(device: str):
    from allscan.ops.gla import limit_fla_autotune

    limit_fla_autotune("one")  # the interpreter cannot time fla's autotuning candidates
    from allscan.ops.gla.fla import FlaGLA

    m = FlaGLA._mods()
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, BT = 1, 200, 3, 16, 64
    per_head = -torch.rand(B, T, H, generator=gen).to(device)
    full = -torch.rand(B, T, H, K, generator=gen).to(device)
    for bounds in (None, [0, 50, 130, T]):  # one sequence; packed, starts inside chunks
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long, device=device)
        ci = None if cu is None else m.prepare_chunk_indices(cu, BT)
        view = per_head.unsqueeze(-1).expand(B, T, H, K)
        got = FlaGLA._chunk_decays(view, BT, cu, ci)
        ref = m.chunk_local_cumsum(view.contiguous(), BT, scale=m.RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
        assert got.is_contiguous() and got.dtype == torch.float32 and _same(got, ref, device == "cpu"), bounds
        got = FlaGLA._chunk_decays(full, BT, cu, ci)  # fla's own sums: the same kernel, bitwise everywhere
        assert torch.equal(got, m.chunk_local_cumsum(full, BT, scale=m.RCP_LN2, cu_seqlens=cu, chunk_indices=ci))


def test_chunk_decays_interpreted_on_cpu():
    assert_passes_interpreted("test_gla_decays", "check_chunk_decays")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_chunk_decays_on_gpu():
    check_chunk_decays("cuda")
