#!/usr/bin/env python3
"""How far fla-core's gated delta rule (``chunk_gated_delta_rule``, fp32, on this GPU) is from the float64 recurrence,
beside the same recurrence in fp32 on the same GPU: the gradients of q, k, v, the gate's inputs (Qwen3-Next's
``g = -exp(A_log) * softplus(a + dt_bias)``) and beta's (``sigmoid(b)``), q and k l2-normalised in the kernel.

    python3 bench/fla_delta_precision.py [--out DIR]

Why: the hybrids' GPU parity (``tests/hf_gpu_parity.py``) bounds allscan's gradients by transformers' own error,
and that error is fla's. On Hopper with Triton 3.4 to 3.7.0 fla runs this backward in tilelang, whose fp32 matrix
products are TF32: dq and dk come out about 1e-3 from float64 and the gate gradients, sums that cancel, far more,
while an fp32 recurrence is within 1e-6. One case per ``--a-max``: ``A = exp(A_log)`` drawn from (0.01, a_max)
(transformers' initialisation takes 16; strong decays make the gate gradients cancel more). B = 1, T = 128, 4 heads
of 32; relative error in the Frobenius norm. Writes DIR/fla_delta_precision.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

CASES = ((0, 16.0), (2, 1.0))  # (seed, a_max)
INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


def recurrence(q, k, v, g, beta, scale):
    """The gated delta rule token by token (q, k l2-normalised), torch ops in the inputs' dtype."""
    import torch
    import torch.nn.functional as F

    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t][..., None] * u[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale)
    return torch.stack(out, 1)


def gradients(use_fla, device, dtype, tensors):
    """The gradients of every input of ``sum(o * w)``, as float64 on the CPU."""
    import torch
    import torch.nn.functional as F

    x = {n: t.detach().to(device, dtype).requires_grad_() for n, t in tensors.items()}
    g = -x["A_log"].exp() * F.softplus(x["a"] + x["dt_bias"])
    beta = x["b"].sigmoid()
    scale = x["q"].shape[-1] ** -0.5
    if use_fla:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, scale=scale, use_qk_l2norm_in_kernel=True)
    else:
        o = recurrence(x["q"], x["k"], x["v"], g, beta, scale)
    (o * x["w"]).sum().backward()
    return {n: x[n].grad.double().cpu() for n in INPUTS}


def case(seed, a_max):
    import torch

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    torch.manual_seed(seed)
    B, T, H, K = 1, 128, 4, 32
    tensors = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, K),
                   a=torch.randn(B, T, H), b=torch.randn(B, T, H), w=torch.randn(B, T, H, K),
                   A_log=torch.empty(H).uniform_(0.01, a_max).log(), dt_bias=torch.ones(H))
    truth = gradients(False, "cpu", torch.float64, tensors)
    fla32 = gradients(True, "cuda", torch.float32, tensors)
    torch32 = gradients(False, "cuda", torch.float32, tensors)
    return {n: {"fla_fp32": rel(fla32[n], truth[n]), "torch_fp32": rel(torch32[n], truth[n]),
                "truth_norm": truth[n].norm().item()} for n in INPUTS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fla_delta_precision_out")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # fla's Triton dots in IEEE fp32 (tilelang's are TF32)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fla_delta_precision.py: needs a CUDA GPU (fla-core's kernels)")
    torch.backends.cuda.matmul.allow_tf32 = False
    from allscan.ops.gla import limit_fla_autotune

    limit_fla_autotune("one")
    results = {f"seed {s}, A in (0.01, {a})": case(s, a) for s, a in CASES}
    print(f"fla_delta_precision: relative error against float64, {torch.cuda.get_device_name()}")
    for name, rows in results.items():
        print(f"{name}:\n  {'gradient':10s} {'fla fp32':>10s} {'torch fp32':>11s} {'|truth|':>10s}")
        for n, r in rows.items():
            print(f"  d{n:9s} {r['fla_fp32']:10.2e} {r['torch_fp32']:11.2e} {r['truth_norm']:10.3e}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fla_delta_precision.json")
    with open(path, "w") as f:
        json.dump(dict(bench="fla_delta_precision", device=torch.cuda.get_device_name(), torch=torch.__version__,
                       time=time.strftime("%Y-%m-%d %H:%M:%S"), results=results), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
