"""The delta-rule layers' fold-in kernels (``allscan.ops.delta.fold_in``): the first segment's outputs with
the incoming state folded in (from fla's widened chunk states and new values) and the gradient of ``S_in``,
against float64. On CPU through Triton's interpreter (in a subprocess: the interpreter is chosen when the
kernels are defined); on GPU the compiled kernels."""
import pytest
import torch
from triton_interpreted import assert_passes_in_subprocess, assert_passes_interpreted

pytest.importorskip("triton")

# (B, T, H, HV, K, V): T not a multiple of the 64-token chunk, K and V not powers of two, grouped value heads;
# K up to 64 takes Q' in the first pass, more in a second
SHAPES = [(1, 70, 2, 2, 16, 32), (2, 130, 1, 3, 24, 40), (1, 200, 1, 1, 32, 16), (1, 90, 1, 2, 16, 200),
          (1, 70, 2, 4, 16, 32),  # value heads in groups over several q/k heads: head i_hv reads q/k head i_hv // 2
          (1, 70, 1, 1, 80, 16)]  # K over one 64-column block: Q' in two passes
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
C = 64


def _chunks(x, T):
    """``[B, T, ...]`` -> per chunk ``[B, c:c+C, ...]`` slices."""
    return [x[:, c:c + C] for c in range(0, T, C)]


def head_outputs_reference(q, k, v_wide, h_wide, g, A, S, scale, dtype):
    """float64 ``(o, Q')`` with the kernel's roundings (fla's): the intra-chunk matrix and KDA's gated
    queries in ``dtype`` before their dots, ``Q'`` rounded before the fold."""
    B, T, H, K = q.shape
    HV, V = v_wide.shape[2], v_wide.shape[3] - K
    r = lambda x: x.to(dtype).double()  # noqa: E731
    qh = q.double().repeat_interleave(HV // H, 2)  # [B, T, HV, K]
    kh = k.double().repeat_interleave(HV // H, 2)
    per_key = g.dim() == 4
    outs = []
    for c, (qc, kc, vc, gc) in enumerate(zip(_chunks(qh, T), _chunks(kh, T), _chunks(v_wide.double(), T),
                                             _chunks(g.double(), T))):
        n = qc.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        hc = h_wide[:, c].double()  # [B, HV, K, W]
        if per_key:
            qg = r(qc * torch.exp2(gc))
            Ac = A[:, c * C:c * C + n, :, :n].double().permute(0, 2, 1, 3)  # [B, HV, i, j]
            Ac = r(torch.where(causal, Ac, torch.zeros(())))
            ow = scale * torch.einsum("bthk,bhkw->bthw", qg, hc) + torch.einsum("bhij,bjhw->bihw", Ac, vc)
        else:
            Ac = torch.einsum("bihk,bjhk->bhij", qc, kc) * torch.exp2(gc.permute(0, 2, 1)[..., :, None]
                                                                      - gc.permute(0, 2, 1)[..., None, :])
            Ac = r(torch.where(causal, Ac, torch.zeros(())))
            ow = (scale * torch.exp2(gc)[..., None] * torch.einsum("bthk,bhkw->bthw", qc, hc)
                  + scale * torch.einsum("bhij,bjhw->bihw", Ac, vc))
        outs.append(ow)
    ow = torch.cat(outs, 1)
    q_eff = r(ow[..., V:])
    return ow[..., :V] + torch.einsum("bthk,bhkv->bthv", q_eff, S.double()), q_eff


def check_fold_in(device: str, shapes=SHAPES, dtypes=DTYPES):
    from allscan.ops.delta.fold_in import fold_state_grad, head_outputs

    gen = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        # what one rounding to dtype allows (the CPU interpreter truncates: up to one unit)
        ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-6}[dtype]
        for B, T, H, HV, K, V in shapes:
            NT = -(-T // C)
            rnd = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen)).to(dtype)  # noqa: E731
            q, k = rnd(B, T, H, K, s=K ** -0.5), rnd(B, T, H, K, s=K ** -0.5)
            v_wide, h_wide = rnd(B, T, HV, V + K), rnd(B, NT, HV, K, V + K)
            S = 3 * torch.randn(B, HV, K, V, generator=gen)
            for per_key in (False, True):
                # cumulative log2 decays within each chunk (fla's), as the layers stage them
                step = -0.1 * torch.rand(B, T, HV, K if per_key else 1, generator=gen)
                g = torch.cat([s.cumsum(1) for s in _chunks(step, T)], 1)
                g = g if per_key else g[..., 0]
                A = torch.randn(B, T, HV, C, generator=gen).to(dtype) if per_key else None
                args = [t.to(device) if t is not None else None for t in (q, k, v_wide, h_wide, g, A, S)]
                o, q_eff = head_outputs(*args, scale=K ** -0.5)
                what = f"{dtype}, {'KDA' if per_key else 'GDN'}, shape {(B, T, H, HV, K, V)}"
                assert o.dtype == dtype and o.shape == (B, T, HV, V) and q_eff.shape == (B, T, HV, K), what
                ref_o, ref_q = head_outputs_reference(q, k, v_wide, h_wide, g, A, S, K ** -0.5, dtype)
                # Q' and the outputs are rounded once to dtype from fp32 sums of exact products
                torch.testing.assert_close(q_eff.cpu().double(), ref_q, rtol=2 * ulp,
                                           atol=2 * ulp * ref_q.abs().max().item(), msg=lambda m: f"Q', {what}: {m}")
                torch.testing.assert_close(o.cpu().double(), ref_o, rtol=2 * ulp,
                                           atol=2 * ulp * ref_o.abs().max().item(),
                                           msg=lambda m: f"output, {what}: {m}")
            dout = torch.randn(B, T, HV, V, generator=gen).to(dtype).to(device)
            q_eff = rnd(B, T, HV, K).to(device)
            d_S = fold_state_grad(q_eff, dout)
            assert d_S.dtype == torch.float32 and d_S.shape == (B, HV, K, V)
            r_S = torch.einsum("bthk,bthv->bhkv", q_eff.cpu().double(), dout.cpu().double())
            # dS_in: exact products of dtype values summed in fp32
            torch.testing.assert_close(d_S.cpu().double(), r_S, rtol=1e-5, atol=1e-5 * r_S.abs().max().item(),
                                       msg=lambda m: f"gradient of S_in, {dtype}: {m}")
            # deterministic: the split sums are added in a fixed order
            assert torch.equal(fold_state_grad(q_eff, dout), d_S), dtype


def test_fold_in_interpreted_on_cpu():
    assert_passes_interpreted("test_fold_in", "check_fold_in")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fold_in_on_gpu():
    # fp32 dots in IEEE (TRITON_F32_DEFAULT=ieee, read when Triton compiles: a fresh process), as the
    # layers' fp32 GPU tests run fla; the layers' sizes: K = V = 128 (the benchmarks), K = 256, V = 512
    # (GatedDeltaNet's defaults)
    assert_passes_in_subprocess("test_fold_in", "check_fold_in_large", "cuda", TRITON_F32_DEFAULT="ieee")


def check_fold_in_large(device: str):
    check_fold_in(device, shapes=SHAPES + [(1, 4096, 4, 4, 128, 128), (2, 1000, 16, 16, 128, 128),
                                           (1, 700, 2, 2, 256, 512)])
