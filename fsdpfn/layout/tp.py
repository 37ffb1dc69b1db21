"""Pure index arithmetic of tensor-parallel layouts: which slice of a full tensor a rank of a model-parallel
mesh holds (``torch.chunk`` along each sharded dim, mesh dims in order), with no communication.

Example:
    >>> x = torch.arange(8).reshape(4, 2)
    >>> local_slice(x, [(0, 2, 1)])          # Shard(0) over 2 ranks, this rank is 1
    tensor([[4, 5],
            [6, 7]])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["local_slice", "split_factor"]


def local_slice(full: torch.Tensor, splits: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The slice of ``full`` that one rank holds when, for each ``(dim, parts, index)`` in mesh-dim order,
    the tensor is chunked into ``parts`` along ``dim`` and the rank keeps chunk ``index`` (``DTensor``'s
    ``Shard`` layout: trailing chunks may be short or empty). A view; copy it to keep it.

    Example:
        >>> local_slice(torch.arange(6).reshape(3, 2), [(1, 2, 0)])
        tensor([[0],
                [2],
                [4]])
    """
    out = full
    for dim, parts, index in splits:
        if not 0 <= index < parts:
            raise ValueError(f"local_slice: chunk {index} of {parts} does not exist")
        size = out.shape[dim]
        chunk = -(-size // parts) if size else 0
        start = min(index * chunk, size)
        out = out.narrow(dim, start, min(start + chunk, size) - start)
    return out


def split_factor(splits: Sequence[tuple[int, int]], dim: int) -> int:
    """How many pieces later mesh dims cut ``dim`` into: the product of the ``parts`` of every
    ``(dim, parts)`` in ``splits`` on that dim (1 when none does). A data-parallel ``Shard(dim)`` before
    them is then a ``_StridedShard(dim, split_factor=...)`` (FSDP2's layout over TP).

    Example:
        >>> split_factor([(0, 2), (1, 4)], 0)
        2
    """
    factor = 1
    for d, parts in splits:
        if d == dim:
            factor *= parts
    return factor
