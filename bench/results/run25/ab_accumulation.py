"""In-process A/B (bench/RESULTS.md run25): gradient accumulation as FSDP2 recipes write it (2 micro-batches
per optimizer step, ``set_requires_gradient_sync(False)`` on the first) through torch's ``fully_shard`` and
``fsdpfn.compat.fully_shard``: compat keeping the first forward's planned groups across the sync toggles
(the default) or falling back to ``"auto"``'s groups at every toggle (``PlannedGroups.reapply`` off, as
before commit 6d308ce). Alternated, 5 optimizer steps a round, 6 rounds; median ms per optimizer step, rank 0.

    torchrun --nproc-per-node 2 bench/results/run25/ab_accumulation.py ln_mlp
"""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn, fsdpfn.compat
from fsdpfn.compat.planned import PlannedGroups
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from bench_models import build_model, make_batches, spec_for, loss_fn

spec = spec_for(sys.argv[1])
mesh = fsdpfn.init_mesh(device="cpu")
rank = dist.get_rank()
batches = make_batches(spec, 0, 6, [rank], torch.device("cpu"))
reapply = PlannedGroups.reapply


def build(fully_shard, keep=True):
    model = build_model(spec, 0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(k):
        PlannedGroups.reapply = reapply if keep else (lambda *a, **kw: False)
        for i in range(2):
            model.set_requires_gradient_sync(i == 1)
            x, y = batches[(k + i) % 6][0]
            loss_fn(spec, model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return model, step


variants = {"torch": build(torch_fully_shard), "compat_kept_groups": build(fsdpfn.compat.fully_shard),
            "compat_auto_groups": build(fsdpfn.compat.fully_shard, keep=False)}
for _, step in variants.values():
    for k in range(3):
        step(k)
res = {k: [] for k in variants}
for r in range(6):
    for name, (_, step) in variants.items():
        for k in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            step(k)
            res[name].append(time.perf_counter() - t0)
if rank == 0:
    from fsdpfn.compat.state import state_of
    for name in ("compat_kept_groups", "compat_auto_groups"):
        print(name, "groups:", [g.name for g in state_of(variants[name][0]).root.plan.groups if g.name])
    base = st.median(res["torch"])
    for name in variants:
        print(f"{name:20s} median {st.median(res[name]) * 1e3:6.1f} ms per optimizer step ({st.median(res[name]) / base:.3f} of torch)")
dist.destroy_process_group()
