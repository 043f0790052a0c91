import torch, time, statistics
from allscan.ops.delta import fold_in as F
B,T,H,K,V=1,8192,16,128,128
wide=torch.randn(B,T,H,V+K,device="cuda",dtype=torch.bfloat16); S=torch.randn(B,H,K,V,device="cuda")
f=F._fold_forward
a=F.fold_forward(wide[..., :V], wide[..., V:], S); b=F.fold_forward(wide[..., :V], wide[..., V:], S)
print("variants", len(f.variants), "enabled", f.enabled, "equal", torch.equal(a,b))
def t(n=200):
    ts=[]
    for _ in range(n):
        t0=time.perf_counter(); F.fold_forward(wide[..., :V], wide[..., V:], S); ts.append(time.perf_counter()-t0)
    return statistics.median(ts)*1e6
r={True:[],False:[]}
for _ in range(3):
    for on in (False, True):
        f.enabled=on; r[on].append(t())
print("fold_forward us: triton", statistics.median(r[False]), "fast", statistics.median(r[True]))
