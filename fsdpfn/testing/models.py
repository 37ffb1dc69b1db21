"""Small, seedable model recipes for property tests: MLPs, transformer-ish and recurrent stacks with uneven
widths.

A ``ModelRecipe`` is a picklable description (so it travels to ``spmd`` workers); ``build()`` makes the
same module, with the same initial parameters, in every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelRecipe", "NormMLPBlock", "ParamTree", "RecurrentStack", "TanhStack", "TinyBlock", "TinyTransformer"]


class NormMLPBlock(nn.Module):
    """A pre-norm residual MLP block, ``x + down(gelu(up(norm(x))))``: the submodules ``norm``, ``up`` and
    ``down`` (the names tensor-parallel plans address).

    Example:
        >>> NormMLPBlock(4, 10)(torch.randn(2, 4)).shape
        torch.Size([2, 4])
    """

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyBlock(nn.Module):
    """A pre-norm transformer block: single-head causal self-attention and a GELU MLP.

    The query/key/value projection has no bias: a key bias has an exactly-zero gradient (softmax ignores
    a constant shift), which Adam turns into rounding-noise-sized updates that no two summation orders
    agree on.

    Example:
        >>> TinyBlock(6, 10)(torch.randn(2, 3, 6)).shape
        torch.Size([2, 3, 6])
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        mask = torch.ones(att.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj(att @ v)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Input projection, a stack of ``TinyBlock``s of width ``dim``, and an output head.

    Example:
        >>> TinyTransformer(4, 6, [10, 7], 3)(torch.randn(2, 5, 4)).shape
        torch.Size([2, 5, 3])
    """

    def __init__(self, d_in: int, dim: int, hiddens: list[int], d_out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(TinyBlock(dim, h) for h in hiddens)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class RecurrentStack(nn.Module):
    """torch's recurrent layers in turn (``layers.i``): an ``LSTM``, a bidirectional ``GRU``, a two-layer
    ``LSTM``, ... of the given hidden widths, batch first, then a ``Linear`` head. Each keeps its parameters
    in a cache of its own (``_flat_weights``) besides its parameter slots.

    Example:
        >>> RecurrentStack(4, [5, 3], 2)(torch.randn(2, 6, 4)).shape
        torch.Size([2, 6, 2])
    """

    def __init__(self, d_in: int, hiddens: list[int], d_out: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = d_in
        for i, h in enumerate(hiddens):
            kind = i % 3
            rnn = nn.GRU if kind == 1 else nn.LSTM
            layers.append(rnn(width, h, num_layers=2 if kind == 2 else 1, bidirectional=kind == 1, batch_first=True))
            width = 2 * h if kind == 1 else h
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x)


class TanhStack(nn.Module):
    """``blocks`` of ``Linear(width, width)`` and tanh (``blocks.i``, a unit each in the tests), a
    ``Linear(width, 1)`` head, and the mean square of its output as the loss: the same parameters in every
    process for one ``seed``. ``batch(rank, seed)`` is the batch a rank trains on.

    Example:
        >>> TanhStack(seed=0)(TanhStack.batch(rank=1, seed=0)).shape
        torch.Size([])
    """

    def __init__(self, width: int = 6, blocks: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()

    @staticmethod
    def batch(rank: int, seed: int, width: int = 6, rows: int = 4) -> torch.Tensor:
        """Rank ``rank``'s ``(rows, width)`` batch for ``seed``."""
        return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed * 10 + rank))


@dataclass(frozen=True)
class ModelRecipe:
    """How to build a small model: ``kind`` is ``"mlp"`` (``widths`` = layer widths, first is the input),
    ``"transformer"`` (``widths`` = ``(d_in, dim, d_out, *hiddens)``) or ``"recurrent"`` (a
    ``RecurrentStack``, ``widths`` = ``(d_in, d_out, *hiddens)``); ``seed`` fixes its parameters.

    Example:
        >>> recipe = ModelRecipe("mlp", (3, 5, 2), seed=0)
        >>> model = recipe.build(); x = recipe.inputs(batch=4, seed=1)
        >>> model(x).shape
        torch.Size([4, 2])
    """

    kind: str
    widths: tuple[int, ...]
    seed: int = 0
    seq: int = 3

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The module, initialised from ``seed`` (identical in every process)."""
        torch.manual_seed(self.seed)
        if self.kind == "mlp":
            layers: list[nn.Module] = []
            for i, (a, b) in enumerate(zip(self.widths, self.widths[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(self.widths) - 2:
                    layers.append(nn.Tanh())
            model: nn.Module = nn.Sequential(*layers)
        elif self.kind == "transformer":
            d_in, dim, d_out, *hiddens = self.widths
            model = TinyTransformer(d_in, dim, list(hiddens), d_out)
        elif self.kind == "recurrent":
            d_in, d_out, *hiddens = self.widths
            model = RecurrentStack(d_in, list(hiddens), d_out)
        else:
            raise ValueError(f"ModelRecipe: unknown kind {self.kind!r}")
        return model.to(dtype)

    @property
    def output_width(self) -> int:
        """The width of the model's output (its last dimension)."""
        return self.widths[{"mlp": -1, "transformer": 2, "recurrent": 1}[self.kind]]

    def inputs(self, batch: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A deterministic input batch for the model."""
        g = torch.Generator().manual_seed(seed)
        shape = (batch, self.widths[0]) if self.kind == "mlp" else (batch, self.seq, self.widths[0])
        return torch.randn(shape, generator=g).to(dtype)

    def unit_candidates(self) -> list[str]:
        """Submodule names that make sensible units, in module order."""
        model = self.build()
        if self.kind == "mlp":
            return [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
        names = []
        for name, m in model.named_modules():
            if isinstance(m, (TinyBlock, nn.Linear, nn.RNNBase)) and name:
                names.append(name)
        return names


@dataclass(frozen=True)
class ParamTree:
    """A module made only of parameters at given FQNs (submodules are created on the way).

    ``entries`` are ``(fqn, shape, dtype, requires_grad)``; values come from ``seed``, so every process
    builds the same module. Useful to property-test sharding over arbitrary shapes and dtypes.

    Example:
        >>> tree = ParamTree((("a.w0", (3, 2), torch.float32, True), ("w1", (), torch.float64, False)), seed=0)
        >>> [n for n, _ in tree.build().named_parameters()]
        ['w1', 'a.w0']
    """

    entries: tuple[tuple[str, tuple[int, ...], torch.dtype, bool], ...]
    seed: int = 0

    def build(self) -> nn.Module:
        """The module (parameters registered in ``entries`` order, root-level ones listed first by torch)."""
        g = torch.Generator().manual_seed(self.seed)
        root = nn.Module()
        for fqn, shape, dtype, requires_grad in self.entries:
            path, _, name = fqn.rpartition(".")
            mod = root
            for part in path.split(".") if path else []:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(name, nn.Parameter(_random(shape, dtype, g), requires_grad=requires_grad))
        return root

    def modules(self) -> list[str]:
        """Names of the submodules the tree creates, in module order."""
        return [n for n, _ in self.build().named_modules() if n]


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(shape, generator=g, dtype=wide).to(dtype)
