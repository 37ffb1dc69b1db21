"""Profile one variant's training step loop with cProfile (where the Python time goes).

    python bench/prof_step.py --model overhead --variant functional --steps 30 --top 40
    python bench/prof_step.py --model overhead --variant torch --sort tottime
    torchrun --nproc-per-node 2 bench/prof_step.py --model overhead    # rank 0's profile at world 2
    python bench/prof_step.py --model gpt1b --variant compat --device cuda --fake-world 8 --dtype bf16
                                     # host time per step on a GPU, rank 0 of a fake world (no-op collectives)

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
from bench_models import build_model, make_batches, spec_for
from bench_measure import sync
from bench_variants import ALL_VARIANTS, Functional, build_variant
from step import _bucket_bytes, start_fake_world


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="overhead", help="a bench model or a shape (as bench/step.py --model)")
    p.add_argument("--variant", choices=ALL_VARIANTS, default="functional")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--callers", default=None, help="also list the callers of the functions this regex matches (pstats)")
    p.add_argument("--sort", choices=["cumtime", "tottime"], default="cumtime")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--min-bucket-bytes", type=_bucket_bytes, default="auto",
                   help="an int, 'auto' (default, as bench/step.py) or 'none' (one collective per block)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: param_dtype bf16, reduce_dtype fp32")
    p.add_argument("--fake-world", type=int, default=0, metavar="N",
                   help="rank 0 of a fake world of N (torch's fake process group: no-op collectives), as bench/step.py")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    Functional.min_bucket_bytes = args.min_bucket_bytes
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = spec_for(args.model, args.tiny)
    device = torch.device(args.device)
    if args.fake_world:
        start_fake_world(args.fake_world, device.type)
    mesh = fsdpfn.init_mesh(device=device.type)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    v = build_variant(args.variant, build_model(spec, 0), spec, mesh, device, dtype)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(spec, 0, args.warmup + 2 * args.steps, [rank], device)
    for i in range(args.warmup):
        v.step(*batches[i][0])
    if world > 1 and not args.fake_world:
        dist.barrier()

    def timed(first: int, prof: cProfile.Profile | None = None) -> float:
        sync(device)
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        for i in range(args.steps):
            v.step(*batches[first + i][0])
        sync(device)  # the host time a step costs, not only what it queues
        if prof is not None:
            prof.disable()
        return (time.perf_counter() - t0) / args.steps

    plain = timed(args.warmup)
    prof = cProfile.Profile()
    profiled = timed(args.warmup + args.steps, prof)
    if rank == 0:
        where = f"rank 0 of a fake world of {world}" if args.fake_world else f"world {world}"
        print(f"{args.variant} on {args.model} ({args.device}, {args.dtype}), {where}: {plain * 1e3:.2f} ms/step plain, {profiled * 1e3:.2f} ms/step "
              f"under cProfile ({args.steps} steps, {torch.get_num_threads()} threads; rank 0's profile)")
        stats = pstats.Stats(prof).strip_dirs().sort_stats(args.sort)
        stats.print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
