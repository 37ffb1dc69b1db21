"""In-process A/B (bench/RESULTS.md run26): the functional layer with the forward spans its first call
planned, and the same plan with the spans dropped after the first call (one forward gather per group);
torch's fully_shard alongside. Each variant alternated, 5 steps a round, 6 rounds; median step ms on rank
0, and each fsdpfn variant's peak (MemTracker) over one step.

    torchrun --nproc-per-node 2 bench/results/run26/ab_spans.py overhead
"""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from bench_models import build_model, make_batches, spec_for, loss_fn
from fsdpfn.testing.memory import memory_tracker

spec = spec_for(sys.argv[1])
mesh = fsdpfn.init_mesh(device="cpu")
rank = dist.get_rank()
batches = make_batches(spec, 0, 6, [rank], torch.device("cpu"))

def functional(spans):
    model = build_model(spec, 0)
    params = fsdpfn.shard(model, mesh, units=[f"blocks.{i}" for i in range(len(model.blocks))])
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.adamw(lr=1e-3)
    S = {"p": params, "s": opt.init(params)}
    g = fsdpfn.value_and_grad(lambda p, x, y: loss_fn(spec, apply(p, x), y))
    def step(x, y):
        loss, grads = g(S["p"], x, y)
        S["p"], S["s"] = opt.update(grads, S["s"], S["p"])
        return loss
    step(*batches[0][0])
    plan = S["p"].plan
    if not spans:
        plan.memo.pop(FORWARD_SPANS_MEMO, None)
        for k in [k for k in plan.memo if isinstance(k, tuple) and k and k[0] == "schedule"]:
            del plan.memo[k]
    return step, S, plan

def tstep_make():
    tm = build_model(spec, 0)
    for b in tm.blocks: torch_fully_shard(b, mesh=mesh)
    torch_fully_shard(tm, mesh=mesh)
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    def tstep(x, y):
        loss = loss_fn(spec, tm(x), y); loss.backward(); topt.step(); topt.zero_grad(); return loss
    return tstep, tm, topt

f_on, S_on, plan_on = functional(True)
f_off, S_off, plan_off = functional(False)
tstep, tm, topt = tstep_make()
variants = {"torch": tstep, "functional_spans": f_on, "functional_nospans": f_off}
for s in variants.values():
    for i in range(3): s(*batches[i][0])
peaks = {}
for name, s, S in (("functional_spans", f_on, S_on), ("functional_nospans", f_off, S_off)):
    tracker = memory_tracker()
    tracker.track_external(*S["p"].params().values(), *[v for v in torch.utils._pytree.tree_leaves(S["s"]) if isinstance(v, torch.Tensor)])
    with tracker:
        s(*batches[3][0])
    peaks[name] = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
res = {k: [] for k in variants}
for r in range(int(os.environ.get("ROUNDS", 6))):
    for name, s in variants.items():
        for k in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            s(*batches[k % 6][0])
            res[name].append(time.perf_counter() - t0)
if rank == 0:
    print(spec.name, "spans", plan_on.memo.get(FORWARD_SPANS_MEMO), "groups", len(plan_on.groups), {k: round(v / 2**20, 3) for k, v in peaks.items()})
    base = st.median(res["torch"])
    for name in variants:
        print(f"{name:20s} step median {st.median(res[name]) * 1e3:6.1f} ms ({st.median(res[name]) / base:.3f} of torch)")
dist.destroy_process_group()
