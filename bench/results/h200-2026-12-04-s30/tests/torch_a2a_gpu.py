"""One H200, an NCCL group of one: UlyssesAttention fwd+bwd through torch's all-to-all (two streams,
_a2a_dist.prepare + exchange on the comm stream) against the core's all-to-all: bitwise equal."""
import torch
import torch.distributed as dist
import allscan
from allscan.ops import ulysses as U

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
g = torch.Generator().manual_seed(7)
B, S, Hq, Hkv, D = 2, 256, 8, 2, 64
mk = lambda h: torch.randn(B, S, h, D, generator=g).to(dev, torch.bfloat16)
q, k, v, w = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
res = {}
for impl in ("auto", "torch"):
    allscan.settings.a2a_impl = impl
    for C in (1, 4):
        U.clear_auto_cache()
        ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = U.ulysses_attention(ql, kl, vl, num_chunks=C, causal=True)
        (out.float() * w.float()).sum().backward()
        torch.cuda.synchronize()
        res[impl, C] = [t.clone() for t in (out, ql.grad, kl.grad, vl.grad)]
for C in (1, 4):
    same = [torch.equal(a, b) for a, b in zip(res["auto", C], res["torch", C])]
    print(f"C={C}: torch's all-to-all bitwise the core's (out, dq, dk, dv): {same}")
    assert all(same), C
print("ok")
dist.destroy_process_group()
