"""Train a small GPT with fsdpfn's functional API: explicit sharded parameters, pure steps.

    python examples/train.py                                # a world of one, CPU
    torchrun --nproc-per-node 2 examples/train.py           # 2 CPU ranks (gloo), or 2 GPUs (NCCL)

The text is generated here (a small grammar of sentences), so nothing is downloaded. The embedding is
tied to the output head; each of the 4 pre-norm blocks is one unit. On a GPU the model computes in
bf16 (fp32 master shards, fp32 gradient reduction). ``--save-every N`` writes an atomic checkpoint
(parameters, optimizer state, step); ``--resume`` continues from it exactly (bit for bit on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdpfn
import fsdpfn.optim as optim

# --- data -------------------------------------------------------------------------------------
_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "a small bird", "the teacher", "our neighbour"]
_VERBS = ["sees", "likes", "follows", "draws", "finds", "carries", "watches"]
_OBJECTS = ["the ball", "a red apple", "the river", "an old book", "the green hat", "a paper boat"]
_PLACES = ["in the garden", "near the house", "at school", "by the sea", "on the hill", "after dinner"]


def make_corpus(n_sentences: int, seed: int) -> str:
    """Sentences from a tiny grammar: structured enough that a small model's loss falls fast."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        out.append(s[0].upper() + s[1:])
    return " ".join(out)


# --- model ------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, a final norm and a head tied to the embedding."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: sharded once, gets both uses' gradients
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --- training ---------------------------------------------------------------------------------
def base_parser(description: str | None) -> argparse.ArgumentParser:
    """The flags every training example shares (model size, data, schedule, logging)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--json", default=None, help="write the losses and throughput to this file (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stdout is not a terminal)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.add_argument("--ckpt", default="checkpoints/gpt", help="checkpoint directory (DCP format)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt if it holds a checkpoint")
    p.add_argument("--stop-after", type=int, default=0, help="stop after this step, as if interrupted (tests)")
    return p.parse_args(argv)


def load_corpus() -> tuple[torch.Tensor, int]:
    """The encoded training text and the vocabulary size."""
    text = make_corpus(4000, seed=1234)
    chars = sorted(set(text))
    return torch.tensor([chars.index(c) for c in text], dtype=torch.long), len(chars)


def get_batch(data: torch.Tensor, args: argparse.Namespace, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: a function of (seed, rank, step) alone, so a resumed run reads
    the same data."""
    gen = torch.Generator().manual_seed((args.seed * 1_000_003 + rank) * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=gen)
    idx = torch.stack([data[s : s + args.seq] for s in starts]).to(device)
    target = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts]).to(device)
    return idx, target


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``args.lr``."""
    return args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))


def peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in MiB and what was measured."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "peak GPU memory"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak RSS"


def progress(step: int, total: int, loss: float, width: int = 30) -> None:
    done = int(width * step / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.3f}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    show_bar = not args.no_progress and sys.stdout.isatty()
    mesh = fsdpfn.init_mesh(device=args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else None)
    lead = rank == 0

    data, vocab = load_corpus()

    torch.manual_seed(args.seed)
    model = GPT(vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    mp = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    params = fsdpfn.shard(model, mesh, units=[f"blocks.{i}" for i in range(args.layers)], mp_policy=mp)
    apply = fsdpfn.fsdp(model)

    def loss_fn(p: fsdpfn.Sharded, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = apply(p, idx)
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    step_fn = fsdpfn.value_and_grad(loss_fn)
    opt = optim.adamw(lr=lambda step: lr_at(args, step), weight_decay=0.1, betas=(0.9, 0.95))
    state = opt.init(params)

    first = 1
    if args.resume and os.path.isdir(args.ckpt):
        restored = fsdpfn.load(args.ckpt, {"params": params, "opt": state, "step": 0})
        params, state, first = restored["params"], restored["opt"], restored["step"] + 1
        if lead:
            print(f"resumed from {args.ckpt} at step {first - 1}", flush=True)
    losses: list[tuple[int, float]] = []
    if lead:
        n_params = sum(s.numel for s in params.specs.values())
        print(f"GPT: {n_params / 1e6:.2f}M parameters, {args.layers} units + root, world {world}, {device.type}"
              f"{' bf16' if mp else ''}; {args.batch}x{args.seq} tokens per rank per step", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for step in range(first, args.steps + 1):
        idx, target = get_batch(data, args, rank, step, device)
        loss, grads = step_fn(params, idx, target)
        grads, norm = optim.clip_grad_norm(grads, args.clip)
        params, state = opt.update(grads, state, params)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            mean_loss = loss.detach().clone()
            params.plan.comm.all_reduce_sum(mean_loss).wait()  # for the log only: the mean over ranks
            losses.append((step, mean_loss.item() / world))
            if lead:
                if show_bar:
                    sys.stdout.write("\n")
                print(f"step {step:5d}  loss {losses[-1][1]:.4f}  grad-norm {norm.item():.3f}", flush=True)
        if lead and show_bar:
            progress(step, args.steps, loss.item())
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            fsdpfn.save(args.ckpt, {"params": params, "opt": state, "step": step})  # atomic
        if step == args.stop_after:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    done_steps = max(1, min(args.steps, args.stop_after or args.steps) - first + 1)
    tokens_s = done_steps * args.batch * args.seq * world / elapsed
    peak_mib, peak_what = peak_memory(device)
    result = dict(losses=losses, tokens_per_s=tokens_s, peak_mib=peak_mib, world=world, elapsed_s=elapsed, first_step=first)
    result["params"] = {k: v.detach().cpu().clone() for k, v in params.params().items()}  # this rank's shards
    if lead:
        if show_bar:
            sys.stdout.write("\n")
        print(f"done: loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f} in {elapsed:.1f} s, "
              f"{tokens_s:,.0f} tokens/s, {peak_what} {peak_mib:.0f} MiB (rank 0)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({k: v for k, v in result.items() if k != "params"}, f)
    return result


if __name__ == "__main__":
    main()
    gc.collect()  # the model's reference cycles first: freed after the group, at exit, torch can abort
    dist.destroy_process_group()
