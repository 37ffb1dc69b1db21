"""In-process A/B (bench/RESULTS.md run25): torchtitan's recipe, the last block kept gathered after forward
(``fully_shard(block, reshard_after_forward=False)`` on it), through torch's ``fully_shard`` and
``fsdpfn.compat.fully_shard``; compat either as planned at its first forward (groups within runs of equal
settings) or with one group per unit (``set_min_bucket_bytes(None)``). Each variant alternated, 5 steps a
round, 6 rounds; median step ms on rank 0, and each variant's peak (MemTracker) over one step.

    torchrun --nproc-per-node 2 bench/results/run25/ab_kept_last.py ln_mlp
"""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn, fsdpfn.compat
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from bench_models import build_model, make_batches, spec_for, loss_fn
from fsdpfn.testing.memory import memory_tracker

spec = spec_for(sys.argv[1])
mesh = fsdpfn.init_mesh(device="cpu")
rank = dist.get_rank()
batches = make_batches(spec, 0, 6, [rank], torch.device("cpu"))


def build(fully_shard, planned=True):
    model = build_model(spec, 0)
    n = len(model.blocks)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh)
    if not planned:
        model.set_min_bucket_bytes(None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x, y):
        loss = loss_fn(spec, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, step


variants = {"torch": build(torch_fully_shard), "compat_planned": build(fsdpfn.compat.fully_shard),
            "compat_unfused": build(fsdpfn.compat.fully_shard, planned=False)}
for _, _, step in variants.values():
    for i in range(3):
        step(*batches[i][0])
peaks = {}
for name, (model, opt, step) in variants.items():
    tracker = memory_tracker()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tracker.track_external(*model.parameters(), *model.buffers(), *state)
    with tracker:
        step(*batches[3][0])
    peaks[name] = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
res = {k: [] for k in variants}
for r in range(6):
    for name, (_, _, step) in variants.items():
        for k in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            step(*batches[k % 6][0])
            res[name].append(time.perf_counter() - t0)
if rank == 0:
    from fsdpfn.compat.state import state_of
    groups = [g.name for g in state_of(variants["compat_planned"][0]).root.plan.groups if g.name]
    print(spec.name, "world", dist.get_world_size(), "compat planned groups:", groups)
    base = st.median(res["torch"])
    for name in variants:
        print(f"{name:16s} step median {st.median(res[name]) * 1e3:6.1f} ms ({st.median(res[name]) / base:.3f} of torch)  peak {peaks[name] / 2**20:6.2f} MiB ({peaks[name] / peaks['torch']:.3f})")
dist.destroy_process_group()
