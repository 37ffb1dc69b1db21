"""Archived probe (bench/RESULTS.md run31): torch.optim.AdamW as built by default (for-loop kernel) over
fsdpfn.compat's DTensor parameters against the same kernel on their local tensors, per step, world 2.

    torchrun --nproc-per-node 2 bench/results/run31/optimizer_dtensor.py
"""
import time, torch, torch.distributed as dist, sys
import os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import fsdpfn
from fsdpfn.compat import fully_shard
from bench_models import build_model, spec_for
spec = spec_for("gpt:blocks=6,width=192,heads=4,seq=32,vocab=2000,batch=8")
mesh = fsdpfn.init_mesh(device="cpu")
model = build_model(spec, 0)
for b in model.blocks: fully_shard(b)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.distributed.tensor.distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements) if False else p.detach().clone()*0.01
opt.step()
def t_dt():
    t=time.perf_counter(); c=time.thread_time(); opt.step(); return time.perf_counter()-t, time.thread_time()-c
# local: same for-loop kernel on local tensors
ps=[p for p in model.parameters()]
lp=[p._local_tensor for p in ps]; lg=[p.grad._local_tensor for p in ps]
st=[opt.state[p] for p in ps]
ea=[s['exp_avg']._local_tensor for s in st]; es=[s['exp_avg_sq']._local_tensor for s in st]
steps=[s['step'] for s in st]
print(type(steps[0]), steps[0])
from torch.optim.adamw import adamw
def t_loc():
    t=time.perf_counter(); c=time.thread_time()
    with torch.no_grad():
        adamw(lp, lg, ea, es, [], steps, foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)
    return time.perf_counter()-t, time.thread_time()-c
import statistics
for name,f in [("dtensor",t_dt),("local",t_loc),("dtensor",t_dt),("local",t_loc)]:
    r=[f() for _ in range(15)]
    if dist.get_rank()==0: print(name, "wall %.2f ms cpu %.2f ms"%(statistics.median(x[0] for x in r)*1e3, statistics.median(x[1] for x in r)*1e3))
dist.destroy_process_group()
