"""Rank 1 raises in the middle of backward; rank 0 must exit with an explaining error, not hang.

    torchrun --nproc-per-node 2 tests/scripts/rank_failure.py
"""

import torch
import torch.distributed as dist
from torch import nn

import fsdpfn


class Boom(nn.Module):
    def forward(self, x):
        return _Explode.apply(x)


class _Explode(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if dist.get_rank() == 1:
            raise ValueError("rank 1 fails in the middle of backward")
        return g


def main():
    mesh = fsdpfn.init_mesh()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), Boom(), nn.Linear(4, 2))
    params = fsdpfn.shard(model, mesh, units=["0", "2", "4"])
    params.plan.comm.guard.timeout = 20.0
    apply = fsdpfn.fsdp(model)
    fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(3, 4)).sum())(params)


if __name__ == "__main__":
    main()
