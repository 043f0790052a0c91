"""Host time of each piece of allscan.scan's eager fast path on the GPU host (session scratch)."""
import importlib, os, statistics, sys, time
import torch, torch.distributed as dist
import allscan
from allscan._threads import one_thread
from allscan._contract import settings
from allscan import _comm
S = importlib.import_module("allscan.ops.scan")
L = importlib.import_module("allscan.ops._launch")
torch.cuda.set_device(0); dev = torch.device("cuda", 0)
dist.init_process_group("nccl", device_id=dev)
grp = dist.group.WORLD
x = torch.randn(1, 16, 128, 128, device=dev); g = torch.rand(1, 16, 128, device=dev)
allscan.scan(x, g); allscan.scan(x, g, async_op=True).wait(); torch.cuda.synchronize()
key = S._fast_key(grp, x, g, None, None, False, False, None, "pipelined", False)
hit = S._eager.get(key)
assert hit is not None
akey = S._fast_key(grp, x, g, None, None, False, False, None, "pipelined", True)
ahit = S._eager.get(akey)
from allscan import _threads
def t(name, f, n=2000):
    r = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(n): f()
        r.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    print(f"{name:48s} {statistics.median(r):7.2f} us", flush=True)
def ot():
    with one_thread(None, "scan"): pass
def el():
    e = _threads.enter(grp, "scan"); _threads.leave(grp, e)
rows = [
 ("empty lambda", lambda: None),
 ("torch.empty_like(x)", lambda: torch.empty_like(x)),
 ("scan()", lambda: allscan.scan(x, g)),
 ("core: S.launch(plan)", lambda: S.launch(hit.plan, x, g, None, False, False, 0)),
 ("hit(x, g, None)", lambda: hit(x, g, None)),
 ("scan(async).wait()", lambda: allscan.scan(x, g, async_op=True).wait()),
 ("ahit(x,g,None).wait()", lambda: ahit(x, g, None).wait()),
 ("is_compiling", torch.compiler.is_compiling),
 ("one_thread(None)", ot),
 ("normalize_group(None)", lambda: _comm.normalize_group(None)),
 ("dist.group.WORLD", lambda: dist.group.WORLD),
 ("enter+leave", el),
 ("_fast_key", lambda: S._fast_key(grp, x, g, None, None, False, False, None, "pipelined", False)),
 ("hit.serves", lambda: hit.serves(grp, x, g, None)),
 ("_as_given", lambda: S._as_given(x, g, None)),
 ("side_stream_handle(noop launch)", lambda: S.side_stream_handle(x, (x, g, None), lambda side: x)),
 ("side_stream_handle(noop).wait()", lambda: S.side_stream_handle(x, (x, g, None), lambda side: x).wait()),
 ("hash(key)", lambda: hash(key)),
 ("_eager.get(key)", lambda: S._eager.get(key)),
 ("dict.get(key)", lambda: dict.get(S._eager, key)),
 ("plan_is_current", lambda: L.plan_is_current(hit.plan, grp)),
 ("settings.check", lambda: settings.check),
 ("torch.cuda.current_device()", torch.cuda.current_device),
 ("torch._C._cuda_getDevice()", torch._C._cuda_getDevice),
 ("x.device", lambda: x.device),
 ("x.device.index", lambda: x.device.index),
 ("x.get_device()", lambda: x.get_device()),
 ("x.shape", lambda: x.shape),
 ("x.is_contiguous()", lambda: x.is_contiguous()),
 ("x.requires_grad", lambda: x.requires_grad),
 ("x.data_ptr()", lambda: x.data_ptr()),
 ("stream_ptr(0)", lambda: L.stream_ptr(0)),
 ("torch.is_grad_enabled()", torch.is_grad_enabled),
]
for name, f in rows:
    t(name, f)
dist.destroy_process_group()
