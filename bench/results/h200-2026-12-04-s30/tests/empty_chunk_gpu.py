"""One H200, an NCCL group of one: Ulysses fwd+bwd in bf16 with grouped k/v heads (2 query, 1 k/v head)
and 3 head chunks (one chunk empty), against one chunk and against fp64 SDPA."""
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from allscan.ops import ulysses as U

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
g = torch.Generator().manual_seed(3)
B, S, Hq, Hkv, D = 2, 64, 2, 1, 32
mk = lambda h: torch.randn(B, S, h, D, generator=g, dtype=torch.float64)
q, k, v, w = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
o = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.repeat_interleave(2, 2).transpose(1, 2),
                                   vr.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
(o * w).sum().backward()
ref = [o.detach(), qr.grad, kr.grad, vr.grad]
got = {}
for C in (1, 3):
    ql, kl, vl = (t.to(dev, torch.bfloat16).requires_grad_(True) for t in (q, k, v))
    out = U.ulysses_attention(ql, kl, vl, num_chunks=C, causal=True)
    (out.float() * w.to(dev).float()).sum().backward()
    got[C] = [t.double().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]
for name, a, one, r in zip(("out", "dq", "dk", "dv"), got[3], got[1], ref):
    e, e1 = (a - r).abs().max().item(), (one - r).abs().max().item()
    print(f"{name}: C=3 err {e:.3e}  C=1 err {e1:.3e}  |C3-C1| {(a - one).abs().max().item():.3e}")
    assert e <= 0.05 * r.abs().max().item() and (a - one).abs().max().item() <= 0.02 * r.abs().max().item(), name
print("ok")
dist.destroy_process_group()
