"""A mixture of experts (bench/RESULTS.md run30): 2 MoE blocks of 4 experts with top-1 routing, each block a
unit, each rank its own 3-token batch, so ranks use different experts. The functional layer against a
single-process reference over the global batch (AdamW, unused parameters' gradients zero-filled, as
``value_and_grad`` gives them); compat by default (a rank that did not use an expert another rank used must
raise) and with ``set_reduce_scatter_unused_params(True)`` (equal to the reference).

    python bench/results/run30/moe_probe.py
"""
import copy, sys

import torch, torch.nn as nn, torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, d=16, e=4):
        super().__init__()
        self.gate = nn.Linear(d, e)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d)) for _ in range(e)])

    def forward(self, x):
        idx, out = self.gate(x).argmax(-1), torch.zeros_like(x)
        for i, ex in enumerate(self.experts):
            m = idx == i
            if m.any():
                out[m] = ex(x[m]) * torch.sigmoid(self.gate(x[m])[:, i : i + 1])
        return x + out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.ModuleList([MoE() for _ in range(2)]), nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


UNITS = ["blocks.0", "blocks.1"]


def batch(i, r):
    g = torch.Generator().manual_seed(100 * i + r)
    return torch.randn(3, 8, generator=g), torch.randn(3, 1, generator=g)


def run(unused_params):
    import torch.distributed as dist
    import fsdpfn, fsdpfn.optim as optim, fsdpfn.compat as fc

    r, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    m = copy.deepcopy(base)
    params = fsdpfn.shard(m, fsdpfn.init_mesh(), units=UNITS)
    apply = fsdpfn.fsdp(m)
    opt = optim.adamw(lr=1e-2)
    st = opt.init(params)
    vg = fsdpfn.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))
    cm = copy.deepcopy(base)
    for u in UNITS:
        fc.fully_shard(cm.get_submodule(u))
    fc.fully_shard(cm)
    cm.set_reduce_scatter_unused_params(unused_params)
    copt = torch.optim.AdamW(cm.parameters(), lr=1e-2)
    raised = ""
    for i in range(3):
        x, y = batch(i, r)
        loss, g = vg(params, x, y)
        params, st = opt.update(g, st, params)
        try:
            F.mse_loss(cm(x), y).backward()
        except RuntimeError as exc:
            raised = raised or str(exc)[:160]
        copt.step()
        copt.zero_grad()
        total = sum(F.mse_loss(ref(xx), yy) / world for xx, yy in (batch(i, rr) for rr in range(world)))
        total.backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ropt.step()
        ropt.zero_grad()
    full = fsdpfn.full_state_dict(params, rank0_only=False)
    functional = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    compat = max((q.full_tensor() - p).abs().max().item() for (n, p), q in zip(ref.named_parameters(), cm.parameters()))
    return functional, compat, raised


if __name__ == "__main__":
    import warnings; warnings.filterwarnings("ignore")
    sys.path.insert(0, __file__.rpartition("/")[0])
    from fsdpfn.testing import spmd
    from moe_probe import run as probe
    for world in (2, 3):
        for unused in (False, True):
            for rank, (f, c, raised) in enumerate(spmd(world, probe, unused)):
                print(f"world {world} set_reduce_scatter_unused_params({unused}) rank {rank}: functional {f:.2e}, compat {c:.2e} off the reference; compat raised: {raised or '-'}")
