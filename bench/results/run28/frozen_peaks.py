"""Peaks of two models the bench has no variant for, fsdpfn (functional, ``min_bucket_bytes="auto"``; compat)
against torch's ``fully_shard`` (bench/RESULTS.md run28): a ConvNet with BatchNorm blocks, and a LayerNorm
MLP with a frozen embedding, a frozen first block and an untied head.

    PYTHONPATH=bench/results/run28 python bench/results/run28/frozen_peaks.py
(spmd's workers import ``run`` from this module, so its folder must be on their path)
"""
import torch
import torch.nn as nn


class ConvBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.GELU()

    def forward(self, x):
        return x + self.act(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, c=48, n=6):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList([ConvBlock(c) for _ in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


class Frozen(nn.Module):
    def __init__(self, d=192, n=6, vocab=1000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d).requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d)) for _ in range(n)])
        self.blocks[0].requires_grad_(False)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def run(kind):
    import fsdpfn
    import fsdpfn.compat
    from fsdpfn.testing.memory import measured_fsdp2_step_peak, measured_step_peak

    torch.manual_seed(0)
    build = ConvNet if kind == "conv" else Frozen
    x = torch.randn(8, 3, 24, 24) if kind == "conv" else torch.randint(0, 1000, (4, 32))
    units = [f"blocks.{i}" for i in range(6)]
    ours = measured_step_peak(build(), x, units=units, min_bucket_bytes="auto")
    theirs = measured_fsdp2_step_peak(build(), x, units=units)
    compat = measured_fsdp2_step_peak(build(), x, units=units, fully_shard=fsdpfn.compat.fully_shard)
    return ours.peak, theirs, compat, ours.groups


if __name__ == "__main__":
    from fsdpfn.testing import spmd
    from frozen_peaks import run as importable_run  # the workers cannot import __main__

    for kind in ("conv", "frozen"):
        for world in (2, 3):
            for rank, (o, t, c, g) in enumerate(spmd(world, importable_run, kind)):
                print(f"{kind} world {world} rank {rank}: functional {o / t:.3f}, compat {c / t:.3f} of torch's {t / 2**20:.2f} MiB; groups {g}")
