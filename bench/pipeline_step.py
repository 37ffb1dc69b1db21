"""Benchmark pipeline-parallel stages (``torch.distributed.pipelining``) sharded by fsdpfn.compat against
torch's ``fully_shard``, in the same run.

    torchrun --nproc-per-node 4 bench/pipeline_step.py                     # pp 2 x dp 2, every case
    torchrun --nproc-per-node 4 bench/pipeline_step.py --schedules Schedule1F1B --reshard false --json out.json

The mesh is ``("pp", "dp")`` = 2 x (world / 2); each pp rank holds one stage (two for interleaved schedules)
of ``--blocks`` blocks ``width -> 4 width -> width``, each block a unit, under ``fully_shard`` over ``dp``
with ``reshard_after_forward`` as ``--reshard`` says (``default``: the library's default), and AdamW. For each
(schedule, resharding) case both libraries step alternately (A B A B ...) after ``--warmup`` untimed steps,
so machine noise hits both alike; reported per case: the median step (ms, rank 0), compat / torch, and the
all-gathers and reduce-scatters a step issues on rank 0 (torch's counted at its ``foreach_all_gather``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench_measure import close_process_group, write_cases

INTERLEAVED = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


def _stage_indices(pp_rank: int, schedule: str) -> tuple[list[int], int]:
    if schedule not in INTERLEAVED:
        return [pp_rank], 2
    if "ZBV" in schedule:  # V shape: rank 0 holds the first and the last stage
        return [pp_rank, 3 - pp_rank], 4
    return [pp_rank, pp_rank + 2], 4


class _Run:
    """One library's stages of one case, stepped on demand."""

    def __init__(self, impl: str, schedule: str, reshard: str, args: argparse.Namespace, mesh: Any):
        from torch.distributed import pipelining

        if impl == "torch":
            from torch.distributed.fsdp import fully_shard
        else:
            from fsdpfn.compat import fully_shard
        self.impl, self.args = impl, args
        self.mine, n_stages = _stage_indices(mesh["pp"].get_local_rank(), schedule)
        self.first, self.last = 0 in self.mine, n_stages - 1 in self.mine
        kw = {} if reshard == "default" else dict(reshard_after_forward=reshard == "true")
        w = args.width
        self.modules, stages = [], []
        for i in self.mine:
            torch.manual_seed(i)
            blocks = [nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)) for _ in range(args.blocks)]
            module = nn.Sequential(*blocks)
            for block in module:
                fully_shard(block, mesh=mesh["dp"], **kw)
            fully_shard(module, mesh=mesh["dp"], **kw)
            self.modules.append(module)
            group = mesh["pp"].get_group()
            stages.append(pipelining.PipelineStage(module, i, n_stages, torch.device("cpu"), group=group))
        self.schedule = getattr(pipelining, schedule)(
            stages if len(stages) > 1 else stages[0],
            n_microbatches=args.microbatches,
            loss_fn=lambda o, t: (o - t).pow(2).mean(),
        )
        self.opt = torch.optim.AdamW([p for m in self.modules for p in m.parameters()], lr=1e-4)
        self.rows = args.rows * args.microbatches
        self.gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())

    def step(self) -> float:
        x = torch.randn(self.rows, self.args.width, generator=self.gen)
        dist.barrier()
        t0 = time.perf_counter()
        if self.first:
            self.schedule.step(x, **(dict(target=torch.zeros_like(x), losses=[]) if self.last else {}))
        elif self.last:
            self.schedule.step(target=torch.zeros_like(x), losses=[])
        else:  # pragma: no cover - two pp ranks: every rank holds a first or a last stage
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0

    def collectives(self) -> tuple[int, int]:
        """fsdpfn's all-gathers and reduce-scatters so far on this rank (torch's are counted outside)."""
        from fsdpfn.compat.state import state_of

        stats = [state_of(m).root.comm.stats for m in self.modules]
        return sum(s.all_gathers for s in stats), sum(s.reduce_scatters for s in stats)


def _case(schedule: str, reshard: str, args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    from fsdpfn.testing import fsdp2_all_gathers

    with fsdp2_all_gathers() as counter:
        runs = {impl: _Run(impl, schedule, reshard, args, mesh) for impl in ("torch", "compat")}
        times: dict[str, list[float]] = {impl: [] for impl in runs}
        for impl, run in runs.items():
            for _ in range(args.warmup):
                run.step()
        torch_before, (ag_before, rs_before) = counter.count, runs["compat"].collectives()
        for _ in range(args.steps):
            for impl, run in runs.items():
                times[impl].append(run.step())
        ag, rs = runs["compat"].collectives()
        out = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
        return dict(
            schedule=schedule, reshard=reshard, torch_ms=out["torch"], compat_ms=out["compat"],
            compat_vs_torch=out["compat"] / out["torch"],
            torch_all_gathers_per_step=(counter.count - torch_before) / args.steps,
            compat_all_gathers_per_step=(ag - ag_before) / args.steps,
            compat_reduce_scatters_per_step=(rs - rs_before) / args.steps,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="ScheduleGPipe,Schedule1F1B,ScheduleInterleaved1F1B")
    p.add_argument("--reshard", default="default,true,false", help="comma list of default, true, false")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4, help="blocks per stage")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rows", type=int, default=8, help="rows per microbatch")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world < 2 or world % 2:
        raise SystemExit(f"pipeline_step.py: run it under torchrun with an even number of ranks (2 pp x dp), not {world}")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    results = []
    for schedule in args.schedules.split(","):
        for reshard in args.reshard.split(","):
            results.append(_case(schedule, reshard, args, mesh))
    if dist.get_rank() == 0:
        print(f"pp 2 x dp {world // 2}, {args.microbatches} microbatches, {args.blocks} blocks of {args.width} per "
              f"stage, torch {torch.__version__}, {args.steps} steps after {args.warmup} warm-up (rank 0)")
        print(f"{'schedule':<26} {'reshard':>8} {'torch ms':>9} {'compat ms':>9} {'compat/torch':>12} "
              f"{'all-gathers torch/compat':>25} {'reduce-scatters':>15}")
        for r in results:
            print(f"{r['schedule']:<26} {r['reshard']:>8} {r['torch_ms']:9.1f} {r['compat_ms']:9.1f} "
                  f"{r['compat_vs_torch']:12.3f} {r['torch_all_gathers_per_step']:12.1f} / "
                  f"{r['compat_all_gathers_per_step']:<10.1f} {r['compat_reduce_scatters_per_step']:15.1f}")
        if args.json:
            write_cases(args.json, world, args, results)
    close_process_group()


if __name__ == "__main__":
    main()
