"""A/B (bench/RESULTS.md run28): the cost of one extra tiny message exchange per backward reduction (what merging reduce(k)+regather(k-1) would save).

    torchrun --nproc-per-node 2 bench/results/run28/ab_extra_message.py "mlp:blocks=24,width=128,hidden=333,batch=64,norm=0" 1
"""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch, torch.distributed as dist
import fsdpfn
from fsdpfn.core import exchange as E
from bench_models import build_model, make_batches, spec_for
from bench_variants import Functional, build_variant

spec = spec_for(sys.argv[1]); extra_n = int(sys.argv[2]) if len(sys.argv) > 2 else 1
mesh = fsdpfn.init_mesh(device="cpu")
rank = dist.get_rank()
batches = make_batches(spec, 0, 4, [rank], torch.device("cpu"))
Functional.min_bucket_bytes = "auto"  # as bench/step.py runs it (shard's default)
v = build_variant("functional", build_model(spec, 0), spec, mesh, torch.device("cpu"), torch.float32)  # the bench's own step
flag = {"on": False}
tiny = torch.zeros(16)
inbox = torch.zeros(16)
for nm in ("reduce_flat", "reduce_direct"):
    orig = getattr(E.Exchange, nm)
    def wrapped(self, *a, _orig=orig, **k):
        fn, add, extra = _orig(self, *a, **k)
        if not flag["on"]:
            return fn, add, extra
        tags = [self.tags() for _ in range(extra_n)]
        def fn2(_async):
            w = fn(_async)
            for tag in tags:
                for j in self.others:
                    w.works.append(self._recv(inbox.view(torch.uint8), j, tag))
                    w.works.append(self._send(tiny.view(torch.uint8), j, tag))
            return w
        return fn2, add, extra
    setattr(E.Exchange, nm, wrapped)
times = {False: [], True: []}
for rnd in range(8):
    for on in (False, True) if rnd % 2 == 0 else (True, False):
        flag["on"] = on
        dist.barrier()
        for i in range(5):
            x, y = batches[i % 4][0]
            t = time.perf_counter()
            v.step(x, y)
            if i > 0: times[on].append(time.perf_counter() - t)
if rank == 0:
    print(f"{sys.argv[1]} extra {extra_n}: base {1e3*st.median(times[False]):.1f} ms, with extra messages {1e3*st.median(times[True]):.1f} ms")
dist.destroy_process_group()
