"""Archived probe (bench/RESULTS.md run31): a 3-block residual model with torch.utils.checkpoint(use_reentrant=True)
around the blocks ("outer_reentrant") or inside them ("inner_reentrant"), through fsdpfn's functional layer,
fsdpfn.compat and torch's fully_shard at world 2, gradients against one process. Before 745d1c2 the
functional layer gave the blocks' parameters zeros and compat None, silently; now both raise by name.

    python bench/results/run31/reentrant_probe.py outer_reentrant inner_reentrant plain

(``spmd`` imports the workers from this module: run it with bench/results/run31 on PYTHONPATH.)
"""
import torch, torch.nn as nn, torch.distributed as dist
import fsdpfn
from torch.utils.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.lin1, self.lin2, self.mode = nn.Linear(6, 12), nn.Linear(12, 6), mode
    def inner(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))
    def forward(self, x):
        if self.mode == "reentrant" and torch.is_grad_enabled():
            return x + checkpoint(self.inner, x, use_reentrant=True)
        return x + self.inner(x)

class Outer(nn.Module):
    """checkpoint around whole blocks (units) with reentrant=True"""
    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList([Block("plain") for _ in range(3)])
        self.head = nn.Linear(6, 2)
        self.mode = mode
    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True) if self.mode == "outer_reentrant" and torch.is_grad_enabled() else b(x)
        return self.head(x)

def build(kind, seed):
    torch.manual_seed(seed)
    if kind == "inner_reentrant":
        m = Outer("plain")
        for b in m.blocks: b.mode = "reentrant"
    else:
        m = Outer(kind)
    return m

UNITS = ["blocks.0", "blocks.1", "blocks.2"]

def xs_for(rank):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)

def reference(kind, seed, world):
    m = build(kind, seed); m.mode = "plain"
    for b in m.blocks: b.mode = "plain"
    loss = sum(m(xs_for(r)).pow(2).mean() for r in range(world)) / world
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}

def worker(kind, seed, layer, raf):
    rank = dist.get_rank()
    m = build(kind, seed)
    x = xs_for(rank)
    mesh = fsdpfn.init_mesh()
    try:
        if layer == "functional":
            params = fsdpfn.shard(m, mesh, units=UNITS)
            apply = fsdpfn.fsdp(m, reshard_after_forward=raf)
            loss, grads = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())(params, x)
            with torch.inference_mode():
                y = apply(params, x.detach())
            return {k: grads[k] for k in grads.keys()}, None, y
        elif layer == "compat":
            from fsdpfn.compat import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for u in UNITS: fully_shard(m.get_submodule(u), reshard_after_forward=raf)
        fully_shard(m, reshard_after_forward=raf)
        m(x).pow(2).mean().backward()
        g = {n: (p.grad.to_local().clone() if p.grad is not None else None) for n, p in m.named_parameters()}
        with torch.inference_mode():
            y = m(x.detach())
        return g, None, y
    except Exception as e:
        import traceback
        return None, f"{type(e).__name__}: {e}"[:900] + traceback.format_exc()[-1500:], None



if __name__ == "__main__":
    import sys
    from fsdpfn.testing import spmd
    for kind in sys.argv[1:] or ["outer_reentrant", "inner_reentrant", "plain"]:
      for raf in (True, False):
        ref = reference(kind, 0, 2)
        m = build(kind, 0); 
        for layer in ("functional", "compat", "torch"):
            res = spmd(2, worker, kind, 0, layer, raf)
            errs = [e for _, e, _ in res if e]
            if errs:
                print(kind, raf, layer, "ERROR", errs[0][:300]); continue
            worst = 0.0
            for n in ref:
                if any(r[0][n] is None for r in res):
                    print("   None grad:", n, [r[0][n] is None for r in res]); continue
                full = fsdpfn.unshard_tensors([r[0][n] for r in res], fsdpfn.ShardSpec(tuple(ref[n].shape), 2))
                e = (full - ref[n]).abs().max().item()
                if e > 1e-6: print("   wrong:", n, e)
                worst = max(worst, e)
            mm = build(kind, 0)
            yerr = max((res[r][2] - mm(xs_for(r).detach())).abs().max().item() for r in range(2))
            print(kind, raf, layer, "grad err", worst, "inference err", yerr)
