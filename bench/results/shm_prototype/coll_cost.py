import os, time, torch, torch.distributed as dist, resource
import fsdpfn
from fsdpfn.core.comm import Comm
torch.set_num_threads(1)
mesh = fsdpfn.init_mesh(device="cpu")
comm = Comm(mesh)
rank = dist.get_rank()
def cpu(): 
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
for numel in (1 << 12, 1 << 16, 442_000, 884_000):
    for mode in ("gather", "reduce"):
        x = torch.randn(numel)
        full = torch.randn(2, numel)
        n = 40
        for rep in range(2):
            dist.barrier()
            t, c = time.perf_counter(), cpu()
            for _ in range(n):
                if mode == "gather": comm.all_gather(x).wait()
                else: comm.reduce_scatter(full.clone()).wait()
            dt, dc = (time.perf_counter() - t) / n * 1e3, (cpu() - c) / n * 1e3
        if rank == 0: print(f"{mode} {numel*4/1e6:.2f} MB/rank: {dt:.3f} ms wall, {dc:.3f} ms cpu per collective")
dist.destroy_process_group()
