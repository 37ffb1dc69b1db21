"""Benchmark fsdpfn.compat against torch's ``fully_shard`` under common training recipes, in the same run.

    torchrun --nproc-per-node 2 bench/recipe_step.py                          # every recipe, the default GPT
    torchrun --nproc-per-node 2 bench/recipe_step.py --recipes lora,accum --optimizer fused --json out.json
    torchrun --nproc-per-node 4 bench/recipe_step.py --replicas 2 --recipes plain,accum     # HSDP 2 x 2

Both libraries shard a copy of one ``bench_models`` model (``--model``, as ``bench/step.py --model``; a GPT)
the way an FSDP2 user does (every block, then the root; with ``--replicas R``, HSDP on an ``(R, world / R)``
mesh; ``--dtype bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``) and train it
with ``torch.optim.AdamW`` (torch's default kernel, or ``--optimizer fused``) on the same batches. A recipe changes the model or the step:

- ``plain``: forward, backward, step;
- ``titan``: torchtitan's resharding: every block but the last reshards after forward (backward begins with
  the last, so it stays gathered);
- ``ac``: every block wrapped in ``checkpoint_wrapper`` (non-reentrant activation checkpointing) first;
- ``lora``: the blocks' linear weights and biases, the embeddings and the head frozen, rank-8 adapters beside
  every block linear (the only trained weights besides the norms);
- ``eval``: an evaluation forward under ``no_grad`` before every training step;
- ``accum``: four microbatches a step, gradient sync only in the last (``set_requires_gradient_sync``);
- ``accum_rs``: four microbatches, each reduce-scattered, the all-reduce over the replicas only in the last
  (``set_requires_all_reduce``: HSDP's accumulation; under FSDP the same as ``plain`` with four microbatches);
- ``shape_check``: ``plain`` after one forward on a single sequence (``model(x[:1])``, autograd on), the
  check users run before training: the first forward plans compat's groups (for that batch, until a
  larger training batch plans them again);
- ``dpo``: two forwards (a chosen and a rejected batch, DPO's pair), then one backward through both: two
  graphs' activations alive at once (the groups were planned for one).

For each recipe the libraries step alternately (A B A B ...) after ``--warmup`` untimed steps, so machine noise
hits both alike; reported: the median step (ms, rank 0), compat / torch, the peak of one step (``MemTracker``,
parameters and optimizer state included; not with ``--compile``, whose kernels allocate where it cannot see)
as compat / torch, and the largest difference between the two
libraries' losses over the run (the run fails, naming the recipe, beyond ``--rtol``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_measure import close_process_group, reduce_max, write_cases  # noqa: E402
from bench_models import build_model, make_batch, spec_for  # noqa: E402

RECIPES = ("plain", "titan", "ac", "lora", "eval", "accum", "accum_rs", "shape_check", "dpo")
MICROBATCHES = 4  # of the accum recipe


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trained low-rank update ``x A^T B^T`` (rank ``r``)."""

    def __init__(self, base: nn.Linear, r: int = 8):
        super().__init__()
        self.base = base.requires_grad_(False)
        g = torch.Generator().manual_seed(base.in_features * 31 + base.out_features)
        self.a = nn.Parameter(torch.randn(r, base.in_features, generator=g) * 0.01)
        self.b = nn.Parameter(torch.randn(base.out_features, r, generator=g) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _prepare(model: nn.Module, recipe: str) -> nn.Module:
    if recipe == "lora":
        for block in model.blocks:
            for name, child in list(block.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(block, name, LoRALinear(child))
        for module in (model.tok, model.pos, model.head):
            module.requires_grad_(False)
    if recipe == "ac":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    return model


class _Run:
    """One library's model and optimizer for one recipe, stepped on demand."""

    def __init__(self, impl: str, recipe: str, base: nn.Module, spec: Any, args: argparse.Namespace, mesh: Any):
        if impl == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from fsdpfn.compat import MixedPrecisionPolicy, fully_shard
        self.recipe, self.spec, self.rank = recipe, spec, dist.get_rank()
        self.model = _prepare(copy.deepcopy(base), recipe)
        bf16 = args.dtype == "bf16"
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
        last = len(self.model.blocks) - 1
        if args.compile:  # torchtitan's order: checkpointing, then compile, then fully_shard
            for block in self.model.blocks:
                block.compile()
        for i, block in enumerate(self.model.blocks):
            keep = {"reshard_after_forward": i < last} if recipe == "titan" else {}
            fully_shard(block, mesh=mesh, **kw, **keep)
        fully_shard(self.model, mesh=mesh, **kw)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        kernel = {"fused": True} if args.optimizer == "fused" else {}
        self.opt = torch.optim.AdamW(trained, lr=1e-3, weight_decay=0.01, **kernel)
        self.losses: list[float] = []
        self.before_forward: Any = None  # MemTracker's reset_mod_stats while a peak is measured
        if recipe == "shape_check":
            self.model(make_batch(spec, 0, 0, self.rank)[0][:1])


    def _loss(self, seed: int, step: int) -> torch.Tensor:
        x, y = make_batch(self.spec, seed, step, self.rank)
        if self.before_forward is not None:  # MemTracker refuses a second forward of a module it tracked
            self.before_forward()
        return F.cross_entropy(self.model(x).float().flatten(0, 1), y.flatten())

    def step(self, k: int) -> None:
        if self.recipe == "eval":
            with torch.no_grad():
                self._loss(1, k)
        if self.recipe in ("accum", "accum_rs"):
            for mb in range(MICROBATCHES):
                if self.recipe == "accum":
                    self.model.set_requires_gradient_sync(mb == MICROBATCHES - 1)
                else:  # HSDP: reduce-scatter every microbatch, all-reduce over the replicas in the last only
                    self.model.set_requires_all_reduce(mb == MICROBATCHES - 1)
                loss = self._loss(0, k * MICROBATCHES + mb) / MICROBATCHES
                loss.backward()
        elif self.recipe == "dpo":
            loss = self._loss(0, k) - 0.5 * self._loss(0, k + 1000)
            loss.backward()
        else:
            loss = self._loss(0, k)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())

    def resident(self) -> list[torch.Tensor]:
        state = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *state]


def _peak_mib(run: _Run, k: int) -> float:
    """The peak of step ``k`` on this rank (``MemTracker``, resident parameters and optimizer state included)."""
    from fsdpfn.testing.memory import memory_tracker

    tracker = memory_tracker()
    tracker.track_external(*run.resident())
    run.before_forward = tracker.reset_mod_stats  # per-module stats only: the peak snapshot stays
    try:
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            run.step(k)
    finally:
        run.before_forward = None
    snap = tracker.get_tracker_snapshot("peak")
    return max((d.get("Total", 0) for d in snap.values()), default=0) / 2**20


def _case(recipe: str, base: nn.Module, spec: Any, args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    runs = {impl: _Run(impl, recipe, base, spec, args, mesh) for impl in ("torch", "compat")}
    times: dict[str, list[float]] = {impl: [] for impl in runs}
    for k in range(args.warmup + args.steps):
        for impl, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run.step(k)
            if k >= args.warmup:
                times[impl].append(time.perf_counter() - t0)
    if args.compile:  # compiled kernels allocate below the dispatcher, where MemTracker cannot see them
        peaks: dict[str, float | None] = {impl: None for impl in runs}
    else:
        mine = [_peak_mib(run, args.warmup + args.steps) for run in runs.values()]
        peaks = dict(zip(runs, reduce_max(mine, dist.get_world_size())))  # the largest rank's
    ms = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs["compat"].losses, runs["torch"].losses))
    return dict(
        recipe=recipe, torch_ms=ms["torch"], compat_ms=ms["compat"], compat_vs_torch=ms["compat"] / ms["torch"],
        torch_peak_mib=peaks["torch"], compat_peak_mib=peaks["compat"],
        peak_vs_torch=None if peaks["torch"] is None else peaks["compat"] / peaks["torch"],  # type: ignore[operator]
        loss_rel_diff=diff, final_loss=runs["torch"].losses[-1],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt:blocks=6,width=192,heads=4,seq=32,vocab=2000,batch=8", help="a GPT shape (bench/step.py --model)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {', '.join(RECIPES)}")
    p.add_argument("--optimizer", choices=["default", "fused"], default="default", help="torch.optim.AdamW's kernel")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16 parameters, fp32 reduction")
    p.add_argument("--compile", action="store_true", help="compile every block (block.compile()) before fully_shard")
    p.add_argument("--replicas", type=int, default=1, help="HSDP: a (replicas, world / replicas) mesh (default 1: FSDP)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rtol", type=float, default=None, help="largest relative loss difference (1e-4 fp32, 2e-2 bf16)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"recipe_step.py: unknown recipe(s) {unknown}; choose from {', '.join(RECIPES)}")
    spec = spec_for(args.model)
    if spec.kind != "gpt":
        raise SystemExit(f"recipe_step.py: --model must be a GPT shape (the recipes name its blocks, embeddings and head), not {spec.kind!r}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if args.replicas < 1 or world % args.replicas:
        raise SystemExit(f"recipe_step.py: --replicas must divide the world ({world}), got {args.replicas}")
    shape = (world,) if args.replicas == 1 else (args.replicas, world // args.replicas)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp",) if len(shape) == 1 else ("replicate", "shard"))
    base = build_model(spec, 0)
    results = [_case(recipe, base, spec, args, mesh) for recipe in recipes]
    bad = [r for r in results if r["loss_rel_diff"] > (args.rtol or (2e-2 if args.dtype == "bf16" else 1e-4))]
    if dist.get_rank() == 0:
        print(f"{args.model}, world {world}{f' (HSDP {shape[0]} x {shape[1]})' if len(shape) == 2 else ''}, torch {torch.__version__}, {args.dtype}{', compiled blocks' if args.compile else ''}, AdamW {args.optimizer} kernel, {args.steps} steps "
              f"after {args.warmup} warm-up (rank 0; peaks: the largest rank's)")
        print(f"{'recipe':<7} {'torch ms':>9} {'compat ms':>9} {'compat/torch':>12} {'peak MiB torch':>14} "
              f"{'compat':>7} {'peak ratio':>10} {'loss diff':>10}")
        for r in results:
            peaks = (f"{r['torch_peak_mib']:14.2f} {r['compat_peak_mib']:7.2f} {r['peak_vs_torch']:10.3f}" if r["peak_vs_torch"]
                     else f"{'-':>14} {'-':>7} {'-':>10}")
            print(f"{r['recipe']:<7} {r['torch_ms']:9.1f} {r['compat_ms']:9.1f} {r['compat_vs_torch']:12.3f} {peaks} {r['loss_rel_diff']:10.1e}")
        if args.json:
            write_cases(args.json, world, args, results)
    close_process_group()
    if bad:
        raise SystemExit(f"recipe_step.py: compat's losses differ from torch's beyond tolerance in {[r['recipe'] for r in bad]}")


if __name__ == "__main__":
    main()
