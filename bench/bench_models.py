"""Benchmark models and their deterministic data.

* ``compute``: 8 residual MLP blocks, Linear(512->2048)-GELU-Linear(2048->512), batch 64 per rank.
* ``overhead``: 48 residual MLP blocks of width 64 (Linear(64->256)-GELU-Linear(256->64)), batch 32
  per rank: so little compute per unit that the per-unit cost of the sharding machinery shows.
* ``ln_mlp``: 12 pre-norm residual MLP blocks, LayerNorm-Linear(384->1152)-GELU-Linear(1152->384),
  batch 48 per rank: the model #15 measured (one the project had not tuned for).
* ``gpt1b``: a ~1B-parameter pre-norm GPT (16 layers, d_model 2048, 16 heads, seq 1024, vocab 50304,
  untied head), batch 4 per rank: for a GPU only.
* ``gpt_small``: the README's shape of model on a CPU scale: 4 GPT blocks (d_model 256, 4 heads, seq
  128), vocab 8192, untied head, batch 8 per rank; the embeddings and head (~16 MiB) are the root unit.
* shapes of one's own, ``kind:field=value,...``: ``mlp``, ``gpt`` and ``cnn`` (a stem conv + BatchNorm,
  residual blocks conv3x3-BN-ReLU-conv3x3-BN of ``width`` channels, global pooling and a classifier over
  ``vocab`` classes, images of ``seq`` x ``seq``: compute-bound, few parameters, BatchNorm buffers).

Every model keeps its units in ``model.blocks`` (a ``ModuleList``), so the unit plan is the same
for every variant: ``blocks.0``, ``blocks.1``, ... plus the root.

Data is a pure function of ``(seed, step, rank)``, so every variant sees the same sequence, and the
global-batch reference can regenerate every rank's batch on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelSpec", "MODELS", "build_model", "make_batch", "loss_fn", "spec_for"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one benchmark model and its per-rank batch."""

    name: str
    kind: str  # "mlp", "gpt", "cnn" (width = channels, seq = image side, vocab = classes), "rnn" (LSTMs) or "unet" (1-D convs)
    blocks: int
    width: int
    hidden: int
    batch: int
    heads: int = 0
    seq: int = 0
    vocab: int = 0
    gpu_only: bool = False
    norm: bool = False  # mlp: a LayerNorm before each block's first Linear


MODELS: dict[str, ModelSpec] = {
    "compute": ModelSpec("compute", "mlp", blocks=8, width=512, hidden=2048, batch=64),
    "overhead": ModelSpec("overhead", "mlp", blocks=48, width=64, hidden=256, batch=32),
    "ln_mlp": ModelSpec("ln_mlp", "mlp", blocks=12, width=384, hidden=1152, batch=48, norm=True),
    "gpt1b": ModelSpec("gpt1b", "gpt", blocks=16, width=2048, hidden=8192, batch=4, heads=16, seq=1024, vocab=50304, gpu_only=True),
    "gpt_small": ModelSpec("gpt_small", "gpt", blocks=4, width=256, hidden=1024, batch=8, heads=4, seq=128, vocab=8192),
}

# --tiny: the same structure, small enough for a smoke test that takes a few seconds.
TINY: dict[str, ModelSpec] = {
    "compute": ModelSpec("compute", "mlp", blocks=3, width=16, hidden=32, batch=8),
    "overhead": ModelSpec("overhead", "mlp", blocks=4, width=8, hidden=16, batch=4),
    "ln_mlp": ModelSpec("ln_mlp", "mlp", blocks=3, width=12, hidden=36, batch=4, norm=True),
    "gpt1b": ModelSpec("gpt1b", "gpt", blocks=2, width=32, hidden=128, batch=2, heads=2, seq=16, vocab=64, gpu_only=True),
    "gpt_small": ModelSpec("gpt_small", "gpt", blocks=2, width=32, hidden=128, batch=2, heads=2, seq=16, vocab=64),
}


def spec_for(name: str, tiny: bool = False) -> ModelSpec:
    """The ``ModelSpec`` called ``name`` (its tiny version with ``tiny``), or a shape of one's own written
    ``kind:field=value,...`` (``mlp:blocks=16,width=300,hidden=1000,batch=40,norm=1``; ``gpt:...`` also
    takes ``heads``, ``seq`` and ``vocab``; ``cnn:blocks=6,width=64,seq=16,vocab=10,batch=16`` a BatchNorm
    CNN; ``rnn:blocks=4,width=128,seq=16,batch=16`` a stack of residual LSTMs;
    ``unet:blocks=3,width=32,seq=256,batch=8`` a 1-D U-Net of ``blocks`` levels): a model the bench has not
    seen, same block types and data."""
    if ":" not in name:
        return (TINY if tiny else MODELS)[name]
    kind, _, fields = name.partition(":")
    if kind not in ("mlp", "gpt", "cnn", "rnn", "unet"):
        raise ValueError(f"model shape {name!r}: the kind before ':' must be 'mlp', 'gpt', 'cnn', 'rnn' or 'unet'")
    known = {f for f in ModelSpec.__dataclass_fields__ if f not in ("name", "kind", "gpu_only")}
    values: dict[str, int | bool] = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        if key not in known or not value.isdigit():
            raise ValueError(f"model shape {name!r}: {item!r} is not field=integer with a field among {sorted(known)}")
        values[key] = bool(int(value)) if key == "norm" else int(value)
    base = {"blocks": 4, "width": 256, "hidden": 1024, "batch": 16}
    if kind == "gpt":
        base.update(heads=4, seq=64, vocab=4096, batch=8)
    if kind == "cnn":
        base.update(blocks=6, width=64, seq=16, vocab=10, batch=16)
    if kind == "rnn":
        base.update(width=128, seq=16)
    if kind == "unet":
        base.update(blocks=3, width=32, seq=256, batch=8)
    return ModelSpec(name, kind, **{**base, **values})  # type: ignore[arg-type]


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` (``fc1(norm(x))`` with ``norm``)."""

    def __init__(self, width: int, hidden: int, norm: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(width) if norm else None
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) if self.norm is not None else x
        return x + self.fc2(F.gelu(self.fc1(h)))


class MLPStack(nn.Module):
    """A stack of residual MLP blocks; the root owns no parameters."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(spec.width, spec.hidden, spec.norm) for _ in range(spec.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class GPTBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA), then a GELU MLP."""

    def __init__(self, dim: int, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``blocks`` GPT blocks, final norm, untied head (root unit)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.width)
        self.pos = nn.Embedding(spec.seq, spec.width)
        self.blocks = nn.ModuleList(GPTBlock(spec.width, spec.hidden, spec.heads) for _ in range(spec.blocks))
        self.norm = nn.LayerNorm(spec.width)
        self.head = nn.Linear(spec.width, spec.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * spec.blocks) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ConvBlock(nn.Module):
    """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))``, 3x3 convolutions without bias."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    """A stem (conv + BatchNorm + ReLU) and classifier (root unit) around ``blocks`` residual conv blocks."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, spec.width, 3, padding=1, bias=False), nn.BatchNorm2d(spec.width), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(spec.width) for _ in range(spec.blocks))
        self.head = nn.Linear(spec.width, spec.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class LSTMBlock(nn.Module):
    """``x + lstm(norm(x))``: a pre-norm residual LSTM of the model's width."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.lstm = nn.LayerNorm(width), nn.LSTM(width, width, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lstm(self.norm(x))[0]


class LSTMStack(nn.Module):
    """``blocks`` residual LSTM blocks over ``(batch, seq, width)`` and a ``Linear`` head (root unit): torch's
    RNNs keep their parameters in a cache of their own (``_flat_weights``)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.blocks = nn.ModuleList(LSTMBlock(spec.width) for _ in range(spec.blocks))
        self.head = nn.Linear(spec.width, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


UNET_CHANNELS = 4  # the U-Net's input and output channels


class UNet1d(nn.Module):
    """A 1-D U-Net: ``blocks`` down levels (stride-2 conv, GroupNorm, SiLU; channels doubling from ``width``)
    then as many up levels, each upsampling (nearest) and reading the down level's output beside it (a skip
    connection: held from its forward until the up level's); ``self.blocks`` holds the down levels, then
    the up levels (the units, in the order they run); the input and output convs are the root's."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        c, depth = spec.width, spec.blocks
        self.depth = depth
        self.inp = nn.Conv1d(UNET_CHANNELS, c, 3, padding=1)
        down = [self._level(c << i, c << (i + 1), stride=2) for i in range(depth)]
        up = [self._level((c << (i + 1)) + (c << i), c << i, stride=1) for i in reversed(range(depth))]
        self.blocks = nn.ModuleList(down + up)
        self.out = nn.Conv1d(c, UNET_CHANNELS, 1)

    @staticmethod
    def _level(cin: int, cout: int, stride: int) -> nn.Module:
        return nn.Sequential(nn.Conv1d(cin, cout, 3, padding=1, stride=stride), nn.GroupNorm(min(4, cout), cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skips = [h]
        for level in self.blocks[: self.depth]:
            h = level(h)
            skips.append(h)
        skips.pop()
        for level in self.blocks[self.depth :]:
            skip = skips.pop()
            h = level(torch.cat([F.interpolate(h, size=skip.shape[-1]), skip], 1))
        return self.out(h)


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The model with its initial weights, a pure function of ``seed`` (built on CPU, fp32)."""
    torch.manual_seed(seed)
    return {"mlp": MLPStack, "gpt": GPT, "cnn": CNN, "rnn": LSTMStack, "unet": UNet1d}[spec.kind](spec)


def _teacher(spec: ModelSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randn(spec.width, spec.width, generator=g) / math.sqrt(spec.width)


def make_batch(spec: ModelSpec, seed: int, step: int, rank: int, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (on CPU): a pure function of its arguments.

    MLP models: ``x ~ N(0, 1)`` of shape ``(batch, width)`` and the fixed target ``tanh(x @ T)`` (``T`` a
    fixed random teacher matrix). GPT: random tokens ``(batch, seq)`` and their shifted targets. CNN:
    images ``x ~ N(0, 1)`` of shape ``(batch, 3, seq, seq)`` and random labels in ``[0, vocab)``. RNN: as
    MLP, over sequences ``(batch, seq, width)``. U-Net: ``x ~ N(0, 1)`` of shape ``(batch, 4, seq)`` and
    the target ``tanh(x)`` reversed along the sequence.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    if spec.kind == "unet":
        x = torch.randn(spec.batch, UNET_CHANNELS, spec.seq, generator=g)
        return x, torch.tanh(x).flip(-1)
    if spec.kind == "cnn":
        return torch.randn(spec.batch, 3, spec.seq, spec.seq, generator=g), torch.randint(0, spec.vocab, (spec.batch,), generator=g)
    if spec.kind in ("mlp", "rnn"):
        x = torch.randn(spec.batch, *((spec.seq,) if spec.kind == "rnn" else ()), spec.width, generator=g)
        t = teacher if teacher is not None else _teacher(spec, seed)
        return x, torch.tanh(x @ t)
    tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_batches(spec: ModelSpec, seed: int, steps: int, ranks: list[int], device: torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``out[step][i]`` = the batch of rank ``ranks[i]`` at ``step``, moved to ``device``."""
    teacher = _teacher(spec, seed) if spec.kind in ("mlp", "rnn") else None
    return [[tuple(t.to(device) for t in make_batch(spec, seed, s, r, teacher)) for r in ranks] for s in range(steps)]  # type: ignore[misc]


def loss_fn(spec: ModelSpec, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE (MLP, RNN and U-Net models), token cross-entropy (GPT) or class cross-entropy (CNN), always
    computed in fp32, mean over the batch."""
    if spec.kind in ("mlp", "rnn", "unet"):
        return F.mse_loss(out.float(), target.float())
    if spec.kind == "cnn":
        return F.cross_entropy(out.float(), target)
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten())


def count_params(model: nn.Module) -> int:
    """Number of (untied) parameters."""
    return sum(p.numel() for p in model.parameters())
