"""Train the small GPT of ``train.py`` with the FSDP2-style stateful API of ``fsdpfn.compat``.

    python examples/train_compat.py                                   # a world of one, CPU
    torchrun --nproc-per-node 2 examples/train_compat.py              # 2 CPU ranks (gloo), or 2 GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/train_compat.py --compare    # fsdpfn.compat vs torch, same seeds
    python examples/train_compat.py --impl torch                      # torch.distributed.fsdp itself

The model, text and batches are those of ``train.py`` (imported from it), but the training loop is plain
PyTorch: ``fully_shard(block)`` for each block, then ``fully_shard(model)`` for the root (the tied
embedding/head, positions and final norm); the parameters become ``nn.Parameter(DTensor)`` sharded on dim
0, so ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_`` work on them unchanged. Switching
between fsdpfn and torch is the one import in ``_implementation``. ``--mp`` computes in bf16 (fp32 master
shards, fp32 gradient reduction). ``--compare`` trains with both implementations one after the other in
the same process and prints the two loss curves side by side.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdpfn


def _load_train() -> ModuleType:
    """``examples/train.py`` as a module, found next to this file (script, torchrun or test loader alike)."""
    name = "fsdpfn_examples_train"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so that its classes pickle and a second load reuses it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


train = _load_train()
IMPLS = ("fsdpfn", "torch")


def _implementation(impl: str):
    """``(fully_shard, MixedPrecisionPolicy)`` of ``impl``: the only line that differs between the two."""
    if impl == "fsdpfn":
        from fsdpfn.compat import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = train.base_parser(__doc__)
    p.add_argument("--impl", choices=IMPLS, default="fsdpfn", help="whose fully_shard to use (default: fsdpfn)")
    p.add_argument("--compare", action="store_true", help="train with both implementations and compare the losses")
    p.add_argument("--mp", action="store_true", help="bf16 compute (param_dtype), fp32 gradient reduction")
    return p.parse_args(argv)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor passes through)."""
    return t.to_local() if hasattr(t, "to_local") else t


# --- training ----------------------------------------------------------------------------------
def run(impl: str, args: argparse.Namespace, mesh, data: torch.Tensor, vocab: int) -> dict:
    """Build, shard and train the GPT with ``impl``'s ``fully_shard``; rank 0 logs."""
    fully_shard, MixedPrecisionPolicy = _implementation(impl)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else None)
    lead = rank == 0
    show_bar = lead and not args.no_progress and sys.stdout.isatty()

    torch.manual_seed(args.seed)
    model = train.GPT(vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    mp = MixedPrecisionPolicy(**(dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp else {}))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings (tied to the head) and the final norm
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)

    if lead:
        n_params = sum(p.numel() for p in model.parameters())  # DTensor: the global size
        print(f"[{impl}] GPT: {n_params / 1e6:.2f}M parameters, {args.layers} blocks + root, world {world}, "
              f"{device.type}{' bf16' if args.mp else ''}; {args.batch}x{args.seq} tokens per rank per step",
              flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses: list[tuple[int, float]] = []
    grad_norms: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx, target = train.get_batch(data, args, rank, step, device)
        for group in opt.param_groups:
            group["lr"] = train.lr_at(args, step)
        loss = F.cross_entropy(model(idx).float().flatten(0, 1), target.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # global norm over all ranks
        opt.step()
        opt.zero_grad()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # for the log only: the mean over ranks
            losses.append((step, mean_loss.item() / world))
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            grad_norms.append((step, norm.item()))
            if lead:
                if show_bar:
                    sys.stdout.write("\n")
                print(f"[{impl}] step {step:5d}  loss {losses[-1][1]:.4f}  grad-norm {grad_norms[-1][1]:.3f}",
                      flush=True)
        if show_bar:
            train.progress(step, args.steps, loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_s = args.steps * args.batch * args.seq * world / elapsed
    peak_mib, peak_what = train.peak_memory(device)
    if lead:
        if show_bar:
            sys.stdout.write("\n")
        print(f"[{impl}] done: loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f} in {elapsed:.1f} s, "
              f"{tokens_s:,.0f} tokens/s, {peak_what} {peak_mib:.0f} MiB (rank 0)", flush=True)
    params = {k: _local(v).detach().cpu().clone() for k, v in model.named_parameters()}  # this rank's shards
    return dict(impl=impl, losses=losses, grad_norms=grad_norms, tokens_per_s=tokens_s, peak_mib=peak_mib,
                world=world, elapsed_s=elapsed, params=params)


def main(argv: list[str] | None = None) -> dict:
    """One run (``--impl``), or with ``--compare`` both: ``{"fsdpfn": ..., "torch": ..., "max_loss_diff": ...}``."""
    args = parse_args(argv)
    mesh = fsdpfn.init_mesh(device=args.device)
    data, vocab = train.load_corpus()
    if not args.compare:
        result = run(args.impl, args, mesh, data, vocab)
    else:
        result = {impl: run(impl, args, mesh, data, vocab) for impl in IMPLS}
        a, b = (result[impl]["losses"] for impl in IMPLS)
        result["max_loss_diff"] = max(abs(la - lb) for (_, la), (_, lb) in zip(a, b))
        result["world"] = result["fsdpfn"]["world"]
        if dist.get_rank() == 0:
            print(f"{'step':>5}  {'fsdpfn':>9}  {'torch':>9}  {'|diff|':>9}")
            for (step, la), (_, lb) in zip(a, b):
                print(f"{step:5d}  {la:9.5f}  {lb:9.5f}  {abs(la - lb):9.2e}")
            print(f"max |loss difference| over the logged steps: {result['max_loss_diff']:.3e}", flush=True)
    if args.json and dist.get_rank() == 0:
        strip = lambda r: {k: v for k, v in r.items() if k != "params"}  # noqa: E731
        with open(args.json, "w") as f:
            json.dump({k: strip(v) if isinstance(v, dict) else v for k, v in strip(result).items()}, f)
    return result


if __name__ == "__main__":
    main()
    gc.collect()  # the model's reference cycles first: freed after the group, at exit, torch can abort
    dist.destroy_process_group()
