"""An unseen 2-D CNN with BatchNorm written the README's way (bench/RESULTS.md run30): a stem, 6 residual
blocks (conv3x3-BN-ReLU-conv3x3-BN), global pooling and a classifier; each block a unit. Against torch's
``fully_shard`` with torch.optim.AdamW as built by default: losses and every rank's BatchNorm running
statistics after the steps (they are per rank: each rank's own batches), step time (interleaved, medians
of the last 10 of 14 steps), and the step peak by MemTracker (``fsdpfn.testing.memory``).

    torchrun --nproc-per-node 2 bench/results/run30/bn_cnn.py [--fused]  # step time and correctness
    PYTHONPATH=bench/results/run30 python bench/results/run30/bn_cnn.py peaks   # peaks, worlds 2 and 3
"""
import copy, statistics, sys, time

import torch, torch.nn as nn, torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class Net(nn.Module):
    def __init__(self, c=64, n=6, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList([Block(c) for _ in range(n)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean((2, 3)))


UNITS = [f"blocks.{i}" for i in range(6)]


def peaks(kind):
    import fsdpfn.compat
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak
    torch.manual_seed(0)
    x = torch.randn(16, 3, 16, 16)
    ours = measured_step_peak(Net(), x, units=UNITS, min_bucket_bytes="auto")
    theirs = measured_fsdp2_step_peak(Net(), x, units=UNITS)
    compat = measured_fsdp2_step_peak(Net(), x, units=UNITS, fully_shard=fsdpfn.compat.fully_shard)
    return ours.peak, theirs, compat, ours.groups


def steps():
    import torch.distributed as dist
    import fsdpfn, fsdpfn.optim as optim
    import fsdpfn.compat as fc
    from torch.distributed.fsdp import fully_shard

    mesh = fsdpfn.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net()

    def batch(i):
        g = torch.Generator().manual_seed(1000 * i + rank)
        return torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)

    def torch_variant(api):
        m = copy.deepcopy(base)
        for b in m.blocks:
            api(b)
        api(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, **({"fused": True} if "--fused" in sys.argv else {}))

        def step(x, y):
            loss = F.cross_entropy(m(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            return loss.detach()
        return step, lambda: {n: b.clone() for n, b in m.named_buffers()}

    def functional_variant():
        m = copy.deepcopy(base)
        params = fsdpfn.shard(m, mesh, units=UNITS)
        apply = fsdpfn.fsdp(m)
        opt = optim.adamw(lr=1e-3)
        st = [params, opt.init(params)]
        vg = fsdpfn.value_and_grad(lambda p, x, y: F.cross_entropy(apply(p, x), y))

        def step(x, y):
            loss, g = vg(st[0], x, y)
            st[0], st[1] = opt.update(g, st[1], st[0])
            return loss
        return step, lambda: {n: st[0][n].clone() for n in st[0].plan.buffers}

    vs = {"torch": torch_variant(fully_shard), "functional": functional_variant(), "compat": torch_variant(fc.fully_shard),
          "local": torch_variant(lambda module: module)}
    losses = {k: [] for k in vs}; times = {k: [] for k in vs}; cpu = {k: [] for k in vs}
    for i in range(14):
        for k, (s, _) in vs.items():
            dist.barrier(); t0 = time.perf_counter(); c0 = time.process_time()
            loss = s(*batch(i))
            times[k].append(time.perf_counter() - t0); cpu[k].append(time.process_time() - c0); losses[k].append(float(loss))
    stats = {k: b() for k, (_, b) in vs.items()}
    diff = {k: max((stats[k][n] - stats["torch"][n]).abs().max().item() for n in stats["torch"] if stats["torch"][n].is_floating_point())
            for k in ("functional", "compat")}
    if rank == 0:
        med = {k: statistics.median(times[k][4:]) for k in vs}
        for k in vs:
            print(f"{k}: median {1e3 * med[k]:.1f} ms (process CPU {1e3 * statistics.median(cpu[k][4:]):.1f} ms), ratio {med[k] / med['torch']:.3f}, last loss {losses[k][-1]:.6f}")
        print("step / local: " + ", ".join(f"{k} {med[k] / med['local']:.2f}" for k in ("torch", "functional", "compat")))
        print("max loss diff vs torch: " + ", ".join(f"{k} {max(abs(a - b) for a, b in zip(losses['torch'], losses[k])):.2e}" for k in ("functional", "compat")))
    print(f"rank {rank} running-stat max diff vs torch's on this rank: {diff}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "peaks" in sys.argv[1:]:
        import warnings; warnings.filterwarnings("ignore")
        from fsdpfn.testing import spmd
        from bn_cnn import peaks as p
        for world in (2, 3):
            for rank, (o, t, c, g) in enumerate(spmd(world, p, "bn")):
                print(f"world {world} rank {rank}: functional {o / t:.5f} ({o - t:+d} B), compat {c / t:.5f} ({c - t:+d} B) of torch's {t / 2**20:.2f} MiB; groups {g}")
    else:
        steps()
