"""Host time of one Triton launch of allscan's fold kernel: kernel[grid](...) vs the CompiledKernel's
runner, alone (median of 300). Also prints Triton's version and how JITFunction.run passes args."""
import inspect, statistics, time, torch, triton
import triton.runtime.jit as J
from allscan.ops.delta import fold_in as F
print("triton", triton.__version__)
src = inspect.getsource(J.JITFunction.run)
print([l.strip() for l in src.splitlines() if "kernel.run(" in l or "bound_args.values" in l or "non_constexpr" in l][:6])
import triton.compiler.compiler as C
print("CompiledKernel.__getitem__" , hasattr(C.CompiledKernel, "__getitem__"))
B, T, H, K, V = 1, 8192, 16, 128, 128
dev = "cuda"
o = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
S = torch.randn(B, H, K, V, device=dev)
out = torch.empty_like(o)
BK, BV = 128, 64
grid = (triton.cdiv(T, 64), triton.cdiv(V, BV), B * H)
args = (o, q, S, out, out, T, H, *[o.stride(i) for i in range(3)], *[q.stride(i) for i in range(3)], *[out.stride(i) for i in range(3)])
kw = dict(K=K, V=V, BT=64, BK=BK, BV=BV, SPLIT=True, STORE_Q=False)
ck = F._fold_forward[grid](*args, **kw)
print("returned", type(ck).__name__)
names = F._fold_forward.arg_names
allargs = []
it = iter(args)
for n, p in zip(names, F._fold_forward.params):
    allargs.append(kw[n] if n in kw else next(it))
def t(fn, n=300):
    for _ in range(20): fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6
ref = out.clone()
r1 = t(lambda: F._fold_forward[grid](*args, **kw))
runner = ck[grid]
try:
    out.zero_(); runner(*allargs); torch.cuda.synchronize(); ok_all = torch.equal(out, ref)
except Exception as e:
    ok_all = repr(e)
print("runner(all args incl constexpr) equal:", ok_all)
nonc = [a for a, p in zip(allargs, F._fold_forward.params) if not p.is_constexpr]
try:
    out.zero_(); runner(*nonc); torch.cuda.synchronize(); ok_nc = torch.equal(out, ref)
except Exception as e:
    ok_nc = repr(e)
print("runner(non-constexpr args) equal:", ok_nc)
use = allargs if ok_all is True else nonc
r2 = t(lambda: runner(*use))
stream = torch.cuda.current_stream().cuda_stream
r3 = t(lambda: ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *use))
r4 = t(lambda: torch.empty_like(o))
print(f"us per launch: kernel[grid] {r1:.1f}  compiled[grid] {r2:.1f}  compiled.run {r3:.1f}  (empty_like {r4:.1f})")
