"""In-process A/B of collective group sizes (bench/RESULTS.md run24): every configuration alternated,
5 steps each, 6 rounds, one process group; median step ms and CPU ms per step on rank 0.

    torchrun --nproc-per-node 2 bench/results/run24/ab_group_sizes.py ln_mlp 1,1,1,1,1,1,1,1,1,1,1,1 1,1,1,1,1,1,2,1,3
"""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn
from bench_models import build_model, make_batches, spec_for
from bench_variants import build_variant
model = sys.argv[1]
configs = [tuple(int(x) for x in c.split(",")) for c in sys.argv[2:]]
spec = spec_for(model)
mesh = fsdpfn.init_mesh(device="cpu")
v = build_variant("functional", build_model(spec, 0), spec, mesh, torch.device("cpu"), torch.float32)
rank = dist.get_rank()
R = 6; per = 5
batches = make_batches(spec, 0, 6, [rank], torch.device("cpu"))
plan = v.params.plan
res = {c: [] for c in configs}; cpu = {c: [] for c in configs}
for i in range(3): v.step(*batches[i % 6][0])
for r in range(R):
    for c in configs:
        plan.regroup(sizes=c)
        v.step(*batches[0][0])
        for k in range(per):
            dist.barrier()
            t0 = time.perf_counter(); c0 = time.process_time()
            v.step(*batches[(k + 1) % 6][0])
            res[c].append(time.perf_counter() - t0); cpu[c].append(time.process_time() - c0)
if rank == 0:
    base = st.median(res[configs[0]])
    for c in configs:
        print(f"{len(c):3d} groups {str(c)[:50]:50s} step median {st.median(res[c])*1e3:6.1f} ({st.median(res[c])/base:.3f}) mean {st.mean(res[c])*1e3:6.1f}  cpu {st.median(cpu[c])*1e3:6.1f}")
