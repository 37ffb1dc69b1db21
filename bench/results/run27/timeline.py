"""One step's collective timeline on both ranks (bench/RESULTS.md run27): every launch and wait of fsdpfn's
core, with wall and thread-CPU times, merged across ranks on the shared monotonic clock (one machine).
Archived probe, not part of the bench: it patches ``Comm._launch`` and ``Handle.wait``.

    torchrun --nproc-per-node 2 bench/results/run27/timeline.py "mlp:blocks=16,width=300,hidden=1000,batch=40,norm=1"

``STEPS=14 SUMMARY=1`` (run31) records every step from the fifth on and prints each launch's and wait's
median and largest wall and thread-CPU time instead of one step's events.
"""
import os, sys, time, statistics as st, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn
from fsdpfn.core import handle as H
from fsdpfn.core import comm as C
from bench_models import build_model, make_batches, spec_for, loss_fn

STEPS = int(os.environ.get("STEPS", "8"))
SUMMARY = bool(os.environ.get("SUMMARY"))
spec = spec_for(sys.argv[1])
mesh = fsdpfn.init_mesh(device="cpu")
rank = dist.get_rank()
batches = make_batches(spec, 0, STEPS, [rank], torch.device("cpu"))
model = build_model(spec, 0)
params = fsdpfn.shard(model, mesh, units=[f"blocks.{i}" for i in range(len(model.blocks))])
apply = fsdpfn.fsdp(model)
opt = fsdpfn.optim.adamw(lr=1e-3)
state = opt.init(params)
g = fsdpfn.value_and_grad(lambda p, x, y: loss_fn(spec, apply(p, x), y))
log = []
rec = {"on": False}
orig_wait = H.Handle.wait
def wait(self):
    if self._done or not rec["on"]:
        return orig_wait(self)
    fp = self._fp
    name = f"{fp.kind} {fp.label}" if fp is not None else "?"
    t = time.perf_counter(); c = time.thread_time()
    try:
        return orig_wait(self)
    finally:
        log.append(("wait", name, t, time.perf_counter(), time.thread_time() - c))
H.Handle.wait = wait
orig_launch = C.Comm._launch
def launch(self, name, fn, **kw):
    t = time.perf_counter(); c = time.thread_time()
    h = orig_launch(self, name, fn, **kw)
    if rec["on"]:
        fp = kw.get("fp")
        log.append(("launch", f"{fp.kind} {fp.label}" if fp else name, t, time.perf_counter(), time.thread_time() - c))
    return h
C.Comm._launch = launch
for i in range(STEPS):
    x, y = batches[i][0]
    rec["on"] = i >= 4 if SUMMARY else i == 6
    t0 = time.perf_counter()
    if rec["on"]: log.append(("step", "start", t0, t0, 0))
    loss, grads = g(params, x, y)
    params, state = opt.update(grads, state, params)
    if rec["on"]: log.append(("step", "end", time.perf_counter(), time.perf_counter(), 0))
out = [None, None]
dist.all_gather_object(out, log)
if rank == 0:
    t0 = min(e[2] for l in out for e in l)
    rows = sorted([(e[2] - t0, r, e) for r, l in enumerate(out) for e in l])
    agg = collections.defaultdict(list)
    for t, r, e in rows:
        kind, name, a, b, cpu = e
        if SUMMARY:
            agg[(kind, name)].append(((b - a) * 1e3, cpu * 1e3))
        else:
            print(f"{t*1e3:8.2f} r{r} {kind:6} {name[:40]:40} {(b-a)*1e3:7.2f} ms cpu {cpu*1e3:5.2f}")
    for (kind, name), v in agg.items():
        walls, cpus = [x[0] for x in v], [x[1] for x in v]
        print(f"{kind:6} {name[:34]:34} n={len(v):3} wall med {st.median(walls):6.2f} max {max(walls):6.2f}  "
              f"cpu med {st.median(cpus):6.2f} max {max(cpus):6.2f}")
dist.destroy_process_group()
