"""Exponential moving average of sharded parameters: a shard-local tree_map, no gathering.

    torchrun --nproc-per-node 2 examples/ema.py

Each rank keeps the EMA of its own shards only; the EMA is a ``Sharded`` tree like the parameters, so it
is saved and restored with them (at any world size) and gathered only when it is used.
"""

from __future__ import annotations

import gc
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import fsdpfn


def ema_update(ema: fsdpfn.Sharded, params: fsdpfn.Sharded, decay: float) -> fsdpfn.Sharded:
    """``ema <- decay * ema + (1 - decay) * params`` on every floating leaf, in place; others copied."""
    return tree_map(lambda e, p: e.lerp_(p, 1 - decay) if e.is_floating_point() else p, ema, params)


def main(steps: int = 20, decay: float = 0.9, ckpt: str | None = None) -> dict:
    mesh = fsdpfn.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params = fsdpfn.shard(model, mesh, units=["0", "2"])
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.adamw(lr=1e-2)
    state = opt.init(params)
    ema = tree_map(torch.clone, params)
    stats = params.plan.comm.stats
    ema_collectives = 0
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(16, 8, generator=g)
        loss, grads = fsdpfn.value_and_grad(lambda p: F.mse_loss(apply(p, x), x.sum(-1, keepdim=True)))(params)
        params, state = opt.update(grads, state, params)
        before = stats.all_gathers + stats.reduce_scatters + stats.all_reduces
        ema = ema_update(ema, params, decay)
        ema_collectives += stats.all_gathers + stats.reduce_scatters + stats.all_reduces - before
    ckpt = ckpt or tempfile.mkdtemp()
    fsdpfn.save(ckpt, {"params": params, "ema": ema, "opt": state, "step": steps})
    restored = fsdpfn.load(ckpt, {"params": params, "ema": tree_map(torch.zeros_like, ema), "opt": state, "step": 0})
    same = all(torch.equal(restored["ema"][k], ema[k]) for k in ema.keys())
    if rank == 0:
        print(f"loss {loss.item():.4f}; EMA updates issued {ema_collectives} collectives; restored EMA equal: {same}")
    return dict(ema=dict(ema.params()), params=dict(params.params()), ema_collectives=ema_collectives, restored_equal=same)


if __name__ == "__main__":
    main()
    gc.collect()  # the model's reference cycles first: freed after the group, at exit, torch can abort
    dist.destroy_process_group()
