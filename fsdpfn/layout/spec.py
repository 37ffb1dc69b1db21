"""How one tensor is split over the ranks of a shard group: ``ShardSpec`` and its pure helpers.

Splitting follows ``torch.chunk``: every rank owns ``chunk = ceil(rows / world)`` rows of dimension
``dim`` except the trailing ranks, which may own fewer rows or none. A 0-d tensor counts as one row that
rank 0 owns (its local shard is the 1-element tensor ``x.reshape(1)``; other ranks hold an empty one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["ShardSpec", "contiguous_stride", "shard_tensor", "unshard_tensors"]


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor of ``shape`` is split over ``world`` ranks along ``dim`` (``torch.chunk`` semantics).

    ``dim`` is normalised to a non-negative index (negative values count from the end). Every rank
    holds the same *padded* shard, ``padded_local_shape``; only the first ``local_shape(rank)`` rows of
    it are real, the rest is zero padding that never leaves fsdpfn.

    Example:
        >>> spec = ShardSpec((5, 3), world=4)
        >>> [spec.bounds(r) for r in range(4)]
        [(0, 2), (2, 4), (4, 5), (5, 5)]
        >>> spec.local_shape(2), spec.padded_local_shape
        ((1, 3), (2, 3))
    """

    shape: tuple[int, ...]
    world: int
    dim: int = 0

    def __post_init__(self) -> None:
        entries = self.shape if isinstance(self.shape, (tuple, list, torch.Size)) else None
        if entries is None or any(isinstance(s, bool) or not isinstance(s, int) for s in entries):
            raise TypeError(f"ShardSpec: shape must be a sequence of ints, got {self.shape!r}")
        shape = tuple(int(s) for s in entries)
        if any(s < 0 for s in shape):
            raise ValueError(f"ShardSpec: shape {shape} has a negative size")
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"ShardSpec: world must be an int >= 1, got {self.world!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"ShardSpec: dim must be an int, got {self.dim!r}")
        ndim = max(len(shape), 1)  # a 0-d tensor shards like its 1-element flattening
        if not -ndim <= self.dim < ndim:
            raise ValueError(
                f"ShardSpec: dim={self.dim} is out of range for shape {shape}; "
                f"use a dim in [{-ndim}, {ndim - 1}]"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dim", self.dim % ndim)

    # --- sizes --------------------------------------------------------------------------------
    @cached_property
    def rows(self) -> int:
        """Size of the sharded dimension (1 for a 0-d tensor)."""
        return self.shape[self.dim] if self.shape else 1

    @cached_property
    def chunk(self) -> int:
        """Rows per rank before trimming: ``ceil(rows / world)``."""
        return math.ceil(self.rows / self.world)

    @cached_property
    def row_numel(self) -> int:
        """Elements in one row (the product of every dimension but ``dim``)."""
        return math.prod(self.other_dims)

    @cached_property
    def numel(self) -> int:
        """Elements of the full tensor."""
        return math.prod(self.shape)

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of ``dim`` that ``rank`` owns (``start == stop`` for an empty shard)."""
        self._check_rank(rank)
        start = min(rank * self.chunk, self.rows)
        return start, min(start + self.chunk, self.rows)

    def local_rows(self, rank: int) -> int:
        """Number of rows ``rank`` owns."""
        start, stop = self.bounds(rank)
        return stop - start

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s unpadded shard (``(1,)`` or ``(0,)`` for a 0-d tensor)."""
        return self._with_rows(self.local_rows(rank))

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s unpadded shard."""
        return self.local_rows(rank) * self.row_numel

    @cached_property
    def padded_local_shape(self) -> tuple[int, ...]:
        """Shape of the padded shard, the same on every rank."""
        return self._with_rows(self.chunk)

    @cached_property
    def padded_numel(self) -> int:
        """Elements of the padded shard, the same on every rank."""
        return self.chunk * self.row_numel

    @cached_property
    def other_dims(self) -> tuple[int, ...]:
        """The dimensions other than ``dim``, in order (the shape of one row)."""
        return self.shape[: self.dim] + self.shape[self.dim + 1 :]

    def _with_rows(self, rows: int) -> tuple[int, ...]:
        if not self.shape:
            return (rows,)
        return self.shape[: self.dim] + (rows,) + self.shape[self.dim + 1 :]

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"ShardSpec: rank {rank!r} is not in [0, {self.world}) for world={self.world}")


def _rows_view(x: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    return x.reshape(1) if not spec.shape else x


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``: what a ``DTensor`` built from local
    shards declares for its global tensor. Zero-size dims count as one, as torch's own strides do.

    Example:
        >>> contiguous_stride((2, 3, 4))
        (12, 4, 1)
    """
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def shard_tensor(x: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Return ``rank``'s unpadded shard of ``x`` as a new contiguous tensor (no communication).

    Example:
        >>> x = torch.arange(10).reshape(5, 2)
        >>> shard_tensor(x, ShardSpec((5, 2), world=2), rank=1)
        tensor([[6, 7],
                [8, 9]])
    """
    if tuple(x.shape) != spec.shape:
        raise ValueError(f"shard_tensor: tensor of shape {tuple(x.shape)} does not match spec shape {spec.shape}")
    start, stop = spec.bounds(rank)
    return _rows_view(x, spec).narrow(spec.dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def unshard_tensors(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Reassemble the full tensor from every rank's unpadded shard, in rank order (no communication).

    Example:
        >>> spec = ShardSpec((3,), world=2)
        >>> unshard_tensors([torch.tensor([1, 2]), torch.tensor([3])], spec)
        tensor([1, 2, 3])
    """
    if len(shards) != spec.world:
        raise ValueError(f"unshard_tensors: got {len(shards)} shards for a spec of world={spec.world}")
    for rank, s in enumerate(shards):
        if tuple(s.shape) != spec.local_shape(rank):
            raise ValueError(
                f"unshard_tensors: shard of rank {rank} has shape {tuple(s.shape)}, "
                f"expected {spec.local_shape(rank)} for {spec}"
            )
    full = torch.cat(list(shards), dim=spec.dim)
    return full.reshape(spec.shape)
