"""Step time of an unseen model written the README's way (bench/RESULTS.md run29): 6 nn.TransformerEncoderLayer
blocks, both layers against torch's fully_shard with torch.optim.AdamW as built by default, interleaved, 14
steps (medians of the last 10), losses compared.

    torchrun --nproc-per-node 2 bench/results/run29/unseen_step.py [--fused]
"""
import copy, time, sys
import torch, torch.nn.functional as F
import torch.distributed as dist
import fsdpfn, fsdpfn.optim as optim
import fsdpfn.compat as fc
from torch.distributed.fsdp import fully_shard

from unseen_peaks import Net  # the same transformer whose peaks unseen_peaks.py measures (this folder is on sys.path)

mesh = fsdpfn.init_mesh()
rank = dist.get_rank()
torch.manual_seed(0)
base = Net()
N = 6
def batch(i):
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randint(0, 2000, (8, 32), generator=g)
    return x, torch.roll(x, 1, 1)

FUSED = "--fused" in sys.argv  # torch.optim.AdamW(fused=True) on the torch and compat sides (README's advice)


def torch_variant(api):
    m = copy.deepcopy(base)
    for b in m.blocks: api(b)
    api(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, **({"fused": True} if FUSED else {}))
    def step(x, y):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward(); opt.step(); opt.zero_grad()
        return loss.detach()
    return step

def functional_variant():
    m = copy.deepcopy(base)
    params = fsdpfn.shard(m, mesh, units=[f"blocks.{i}" for i in range(N)])
    apply = fsdpfn.fsdp(m)
    opt = optim.adamw(lr=1e-3)
    st = [params, opt.init(params)]
    vg = fsdpfn.value_and_grad(lambda p, x, y: F.cross_entropy(apply(p, x).flatten(0, 1), y.flatten()))
    def step(x, y):
        loss, g = vg(st[0], x, y)
        st[0], st[1] = opt.update(g, st[1], st[0])
        return loss
    return step

def local_variant():
    """No sharding, no communication, this rank's batch only: the compute floor (its loss is not compared)."""
    return torch_variant(lambda module: module)


vs = {"torch": torch_variant(fully_shard), "functional": functional_variant(), "compat": torch_variant(fc.fully_shard), "local": local_variant()}
losses = {k: [] for k in vs}; times = {k: [] for k in vs}
for i in range(14):
    for k, s in vs.items():
        dist.barrier(); t0 = time.perf_counter()
        l = s(*batch(i))
        times[k].append(time.perf_counter() - t0); losses[k].append(float(l))
if rank == 0:
    import statistics as S
    for k in vs:
        print(k, "losses", [round(v, 5) for v in losses[k][:3]], losses[k][-1], "median ms %.1f" % (1e3 * S.median(times[k][4:])), "ratio %.3f" % (S.median(times[k][4:]) / S.median(times["torch"][4:])))
    print("step / local (compute floor): torch %.2f, functional %.2f, compat %.2f" % tuple(S.median(times[k][4:]) / S.median(times["local"][4:]) for k in ("torch", "functional", "compat")))
    print("maxdiff func", max(abs(a - b) for a, b in zip(losses["torch"], losses["functional"])), "compat", max(abs(a - b) for a, b in zip(losses["torch"], losses["compat"])))
dist.destroy_process_group()
