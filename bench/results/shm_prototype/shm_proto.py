# prototype: all-gather through a shared-memory file + a tiny gloo all-reduce as the barrier
import os, time, torch, torch.distributed as dist, resource
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
MAX = 4 << 20  # floats per slot
path = "/dev/shm/fsdpfn_proto"
if rank == 0:
    with open(path, "wb") as f: f.truncate(world * MAX * 4)
dist.barrier()
shm = torch.from_file(path, shared=True, size=world * MAX, dtype=torch.float32).view(world, MAX)
flag = torch.zeros(1)
for numel in (1 << 12, 1 << 16, 442_000, 884_000):
    x = torch.full((numel,), float(rank + 1))
    out = torch.empty(world, numel)
    n = 40
    for rep in range(2):
        dist.barrier()
        t, c = time.perf_counter(), cpu()
        for i in range(n):
            shm[rank, :numel].copy_(x)
            w = dist.all_reduce(flag, async_op=True)  # everyone has written
            w.wait()
            out.copy_(shm[:, :numel])
            w2 = dist.all_reduce(flag, async_op=True)  # everyone has read (before the slot is reused)
            w2.wait()
        dt, dc = (time.perf_counter() - t) / n * 1e3, (cpu() - c) / n * 1e3
    assert torch.equal(out, torch.arange(1, world + 1, dtype=torch.float32)[:, None].expand(world, numel))
    if rank == 0: print(f"shm gather {numel*4/1e6:.2f} MB/rank: {dt:.3f} ms wall, {dc:.3f} ms cpu")
dist.barrier()
if rank == 0: os.unlink(path)
dist.destroy_process_group()
