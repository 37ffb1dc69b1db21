"""``shard_placement_fn``: FSDP2's per-parameter choice of shard dim, checked once for ``fsdpfn.shard`` and
``fsdpfn.compat.fully_shard`` alike.

The function takes the ``nn.Parameter`` and returns ``Shard(d)`` (split it along ``d``; negative dims count
from the end) or ``None`` (``Shard(0)``). The split is ``torch.chunk`` along ``d``, uneven sizes included,
as ``distribute_tensor(x, mesh, [Shard(d)])`` lays it out; for a tensor-parallel ``DTensor`` parameter
``d`` is a dim of its TP-local tensor.

Example:
    >>> from torch.distributed.tensor import Shard
    >>> check_placement(Shard(-1), (4, 3), "parameter 'weight' of Linear", "shard")
    1
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

__all__ = ["PlacementFn", "check_placement", "check_placement_type", "placement_dim"]

PlacementFn = Callable[[nn.Parameter], Any]
"""``shard_placement_fn``: ``(parameter) -> Shard(dim) | None``."""


def check_placement_type(chosen: Any, where: str, kind: str) -> None:
    """Refuse a ``shard_placement_fn`` result that is neither ``None`` nor a ``Shard`` (a
    ``ShardPlacementResult``, a per-parameter mesh, is refused with its own error). ``where`` names the
    parameter (``"parameter 'weight' of Linear"``), ``kind`` the caller (``"shard"``, ``"fully_shard"``).

    Example:
        >>> check_placement_type(None, "parameter 'w'", "shard")
    """
    if chosen is None or isinstance(chosen, Shard):
        return
    if type(chosen).__name__ == "ShardPlacementResult":
        raise NotImplementedError(
            f"{kind}: shard_placement_fn returned a ShardPlacementResult for {where} (a per-parameter mesh); "
            f"fsdpfn shards every parameter of a {kind} call on the call's mesh: return Shard(dim) or None"
        )
    # FSDP2's text first (code catching torch's error keeps working), then what to do
    raise ValueError(f"Invalid shard_placement_fn result: {chosen}\n{kind}: {where}; return None or a Shard(dim)")


def check_placement(chosen: Any, shape: Sequence[int], where: str, kind: str) -> int:
    """The non-negative dim that ``chosen`` (a ``shard_placement_fn`` result) shards a tensor of ``shape``
    on: ``None`` is 0; a ``Shard(d)`` with ``d`` outside ``[-ndim, ndim)``, a ``Shard`` of a 0-d
    parameter, or anything but a ``Shard`` is refused with an error naming ``where``.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> check_placement(Shard(1), (2, 3, 4), "parameter 'w'", "shard"), check_placement(None, (2, 3), "parameter 'w'", "shard")
        (1, 0)
    """
    check_placement_type(chosen, where, kind)
    ndim = len(shape)
    if chosen is None:
        return 0
    if ndim == 0:
        raise ValueError(
            f"{kind}: shard_placement_fn returned {chosen!r} for {where}, a 0-d parameter: it has no dim to shard. "
            "Return None for it (fsdpfn keeps a 0-d parameter whole on the first rank) or make it 1-d"
        )
    dim = chosen.dim + ndim if chosen.dim < 0 else chosen.dim
    if not 0 <= dim < ndim:
        # FSDP2's text first, then where and what to do
        raise AssertionError(
            f"Shard dim {dim} is invalid for {ndim}D tensor: {torch.Size(shape)}\n{kind}: {where}; return Shard(d) with d in [{-ndim}, {ndim - 1}]"
        )
    return dim


def placement_dim(param: nn.Parameter, placement_fn: PlacementFn | None, where: str, kind: str) -> int:
    """The dim ``param`` is sharded on under ``placement_fn`` (``None``: 0 for every parameter), checked by
    ``check_placement``.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> placement_dim(nn.Parameter(torch.ones(2, 3)), lambda p: Shard(-1), "parameter 'w'", "shard")  # doctest: +SKIP
        1
    """
    if placement_fn is None:
        return 0
    return check_placement(placement_fn(param), tuple(param.shape), where, kind)
