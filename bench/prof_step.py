"""Profile one variant's training step loop with cProfile (where the Python time goes).

    python bench/prof_step.py --model overhead --variant functional --steps 30 --top 40
    python bench/prof_step.py --model overhead --variant torch --sort tottime
    torchrun --nproc-per-node 2 bench/prof_step.py --model overhead    # rank 0's profile at world 2

Builds the same model, data and variant as ``bench/step.py``, runs ``--warmup`` untimed steps, then
profiles ``--steps`` steps and prints the ``--top`` entries sorted by ``--sort`` (``cumtime`` or
``tottime``), plus the mean step time with and without the profiler.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.distributed as dist

import fsdpfn
from bench_models import MODELS, build_model, make_batches, spec_for
from bench_variants import ALL_VARIANTS, Functional, build_variant


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="overhead")
    p.add_argument("--variant", choices=ALL_VARIANTS, default="functional")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--sort", choices=["cumtime", "tottime"], default="cumtime")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--min-bucket-bytes", type=int, default=None, help="fuse blocks, as bench/step.py --min-bucket-bytes")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    Functional.min_bucket_bytes = args.min_bucket_bytes
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_for(args.model, args.tiny)
    mesh = fsdpfn.init_mesh(device="cpu")
    v = build_variant(args.variant, build_model(spec, 0), spec, mesh, torch.device("cpu"), torch.float32)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(spec, 0, args.warmup + 2 * args.steps, [rank], torch.device("cpu"))
    for i in range(args.warmup):
        v.step(*batches[i][0])
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        v.step(*batches[args.warmup + i][0])
    plain = (time.perf_counter() - t0) / args.steps
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(args.steps):
        v.step(*batches[args.warmup + args.steps + i][0])
    prof.disable()
    profiled = (time.perf_counter() - t0) / args.steps
    if rank == 0:
        print(f"{args.variant} on {args.model}, world {world}: {plain * 1e3:.2f} ms/step plain, {profiled * 1e3:.2f} ms/step "
              f"under cProfile ({args.steps} steps, {torch.get_num_threads()} threads; rank 0's profile)")
        pstats.Stats(prof).strip_dirs().sort_stats(args.sort).print_stats(args.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
