"""Per rank and step: time the main thread waits on all-gathers and on reduce-scatters (bench/RESULTS.md run28).

    torchrun --nproc-per-node 2 bench/results/run28/waits_by_kind.py "mlp:blocks=16,width=300,hidden=1000,batch=40,norm=1"
"""
import os, sys, time, statistics as st, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn
from fsdpfn.core import handle as H
from bench_models import build_model, make_batches, spec_for
from bench_variants import Functional, build_variant
spec = spec_for(sys.argv[1])
mesh = fsdpfn.init_mesh(device="cpu"); rank = dist.get_rank()
batches = make_batches(spec, 0, 4, [rank], torch.device("cpu"))
Functional.min_bucket_bytes = "auto"  # as bench/step.py runs it (shard's default)
v = build_variant("functional", build_model(spec, 0), spec, mesh, torch.device("cpu"), torch.float32)  # the bench's own step
acc = collections.Counter(); cnt = collections.Counter(); on = {"v": False}
orig = H.Handle.wait
def wait(self):
    if self._done or not on["v"]:
        return orig(self)
    fp = self._fp; k = fp.kind if fp is not None else "?"
    t = time.perf_counter()
    try: return orig(self)
    finally: acc[k] += time.perf_counter() - t; cnt[k] += 1
H.Handle.wait = wait
steps = []
for i in range(14):
    x, y = batches[i % 4][0]
    on["v"] = i >= 4
    t = time.perf_counter()
    v.step(x, y)
    if i >= 4: steps.append(time.perf_counter() - t)
n = len(steps)
print(f"rank {rank}: step {1e3*st.median(steps):.1f} ms; waits per step: " + ", ".join(f"{k} {1e3*v/n:.1f} ms ({cnt[k]//n})" for k, v in acc.items()))
dist.destroy_process_group()
