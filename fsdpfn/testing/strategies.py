"""Hypothesis strategies for property-testing sharded code: shapes, dtypes, specs, world sizes, models.

Example:
    >>> from hypothesis import given
    >>> from fsdpfn.testing import strategies as fst
    >>> @given(fst.shard_specs())
    ... def test_bounds_cover(spec):
    ...     assert sum(spec.local_rows(r) for r in range(spec.world)) == spec.rows
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from fsdpfn.layout import ShardSpec
from fsdpfn.testing.models import ModelRecipe, ParamTree

__all__ = [
    "ALL_DTYPES",
    "FLOAT_DTYPES",
    "dtypes",
    "model_recipes",
    "param_trees",
    "shapes",
    "shard_specs",
    "tensors",
    "tree_unit_plans",
    "unit_plans",
    "world_sizes",
]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ALL_DTYPES = FLOAT_DTYPES + (torch.int64, torch.bool, torch.complex64)


def world_sizes(min_world: int = 1, max_world: int = 4) -> st.SearchStrategy[int]:
    """World sizes in ``[min_world, max_world]``."""
    return st.integers(min_world, max_world)


def dtypes(choices: tuple[torch.dtype, ...] = ALL_DTYPES) -> st.SearchStrategy[torch.dtype]:
    """One of ``choices`` (default: f32, f64, f16, bf16, int64, bool, complex64)."""
    return st.sampled_from(choices)


def shapes(max_dims: int = 4, max_side: int = 7, min_dims: int = 0) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with ``min_dims..max_dims`` dims of size ``0..max_side`` (0-d and empty included)."""
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def shard_specs(draw: st.DrawFn, max_world: int = 16, shape: tuple[int, ...] | None = None) -> ShardSpec:
    """A ``ShardSpec`` over a random shape (or ``shape``), world ``1..max_world`` and a valid (maybe negative) dim."""
    if shape is None:
        shape = draw(shapes())
    ndim = max(len(shape), 1)
    dim = draw(st.integers(-ndim, ndim - 1))
    return ShardSpec(shape, draw(st.integers(1, max_world)), dim)


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor of ``shape`` and ``dtype`` drawn from a hypothesis-chosen seed."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@st.composite
def model_recipes(
    draw: st.DrawFn, kinds: tuple[str, ...] = ("mlp", "transformer"), min_width: int = 1, min_seq: int = 1
) -> ModelRecipe:
    """A small MLP, transformer-ish or (in ``kinds`` only when asked) recurrent stack with uneven widths
    (``min_width``..9), as a picklable recipe.

    For float32 comparisons raise ``min_width`` (very narrow layer norms are ill-conditioned) and
    ``min_seq`` (attention over one position has exactly-zero query/key gradients, which Adam amplifies
    into rounding noise)."""
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 10_000))
    w = st.integers(min_width, max(min_width, 9))
    if kind == "mlp":
        widths = draw(st.lists(w, min_size=2, max_size=5))
        return ModelRecipe("mlp", tuple(widths), seed)
    if kind == "recurrent":
        d_in, d_out = draw(w), draw(w)
        hiddens = draw(st.lists(w, min_size=1, max_size=3))
        return ModelRecipe("recurrent", (d_in, d_out, *hiddens), seed, seq=draw(st.integers(min_seq, max(min_seq, 4))))
    d_in, dim, d_out = draw(w), draw(w), draw(w)
    hiddens = draw(st.lists(w, min_size=1, max_size=3))
    return ModelRecipe("transformer", (d_in, dim, d_out, *hiddens), seed, seq=draw(st.integers(min_seq, max(min_seq, 4))))


@st.composite
def unit_plans(draw: st.DrawFn, recipe: ModelRecipe) -> list[str]:
    """A random subset of the recipe's sensible unit names (nested units included)."""
    candidates = recipe.unit_candidates()
    if not candidates:
        return []
    chosen = draw(st.lists(st.sampled_from(candidates), unique=True, max_size=len(candidates)))
    return sorted(chosen, key=candidates.index)


_PATHS = ("", "a", "a.b", "c", "c.d.e")


@st.composite
def param_trees(
    draw: st.DrawFn,
    dtypes_: tuple[torch.dtype, ...] = ALL_DTYPES,
    max_params: int = 6,
    frozen: bool = True,
) -> ParamTree:
    """A ``ParamTree`` of 1..``max_params`` parameters with random shapes (0-d and empty included),
    dtypes from ``dtypes_`` and nesting; non-float parameters are always frozen, floats maybe."""
    n = draw(st.integers(1, max_params))
    entries = []
    for i in range(n):
        path = draw(st.sampled_from(_PATHS))
        dtype = draw(st.sampled_from(dtypes_))
        trainable = dtype.is_floating_point or dtype.is_complex
        requires_grad = trainable and (not frozen or draw(st.booleans()) or draw(st.booleans()))
        shape = draw(shapes(max_dims=3, max_side=6))
        entries.append((f"{path}.w{i}" if path else f"w{i}", shape, dtype, requires_grad))
    return ParamTree(tuple(entries), draw(st.integers(0, 10_000)))


@st.composite
def tree_unit_plans(draw: st.DrawFn, tree: ParamTree) -> list[str]:
    """A random subset of a ``ParamTree``'s submodules to use as units (nested ones included)."""
    mods = tree.modules()
    return draw(st.lists(st.sampled_from(mods), unique=True)) if mods else []
