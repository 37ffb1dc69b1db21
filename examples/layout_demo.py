"""Shard a small transformer over the ranks and print each rank's layout.

    torchrun --nproc-per-node 2 examples/layout_demo.py      # 2 CPU ranks (gloo)
    python examples/layout_demo.py                           # a world of one
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import fsdpfn
from fsdpfn.testing.models import TinyBlock, TinyTransformer


def main() -> list[str]:
    mesh = fsdpfn.init_mesh()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer(d_in=8, dim=12, hiddens=[30, 30, 30], d_out=5)
    params = fsdpfn.shard(model, mesh, units=TinyBlock, donate=False)
    full = fsdpfn.unshard(params)
    exact = all(torch.equal(full[n], p) for n, p in model.named_parameters())

    lines = [f"rank {rank}: {params.plan.describe()}"]
    for unit in params.plan.units:
        for b in unit.gather:
            lines.append(
                f"  unit {unit.label:10s} bucket {str(b.dtype):14s} {len(b.fqns):2d} params, "
                f"{b.numel:6d} elements per rank ({b.nbytes / 1024:.1f} KiB)"
            )
    for fqn in list(params.keys())[:6]:
        spec = params.specs[fqn]
        lines.append(f"  {fqn:22s} full {str(spec.shape):10s} rows {spec.bounds(rank)} local {tuple(params[fqn].shape)}")
    lines.append(f"  ... {len(params)} leaves; unshard reproduces the model exactly: {exact}")
    stats = params.plan.comm.stats
    lines.append(f"  collectives so far: {stats.all_gathers} all-gathers (one per unit bucket)")
    for r in range(dist.get_world_size()):  # print rank by rank
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    return lines


if __name__ == "__main__":
    main()
    gc.collect()  # the model's reference cycles first: freed after the group, at exit, torch can abort
    dist.destroy_process_group()
