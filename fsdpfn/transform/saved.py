"""What a call keeps for a tensor autograd saves: ``Packed`` (where it lives in a unit's gathered
parameters, re-gathered on unpack) or ``OuterSaved`` (what the saved-tensor hooks around the call, such as
``save_on_cpu`` or a non-reentrant checkpoint's, made of it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["OuterSaved", "Packed", "checkpoint_region", "outer_saved_hooks", "packed_reference"]


@dataclass(frozen=True)
class Packed:
    """A saved tensor replaced by where it lives in a unit's gathered parameters."""

    unit: str
    fqn: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    spec: Any = None  # a saved DTensor's spec (its local tensor is what aliases the unit's buffer)


def packed_reference(storages: dict[int, tuple[str, str]], t: Any) -> Packed | None:
    """Where ``t`` lives in a gathered group, if it aliases one of ``storages`` (storage pointer ->
    ``(unit, fqn)``): a ``DTensor`` by its local tensor, as tensor-parallel modules save it. ``None`` for
    anything else, which the call does not replace.

    Example:
        >>> w = torch.zeros(4, 3)
        >>> packed_reference({w.untyped_storage().data_ptr(): ("0", "0.weight")}, w[1:]).offset
        3
    """
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local) is not torch.Tensor or local.layout != torch.strided or local.numel() == 0:
        return None  # gathered buffers are plain tensors; other subclasses (collective results) have no storage to match
    hit = storages.get(local.untyped_storage().data_ptr())
    if hit is None:
        return None
    spec = t._spec if local is not t else None
    return Packed(hit[0], hit[1], local.storage_offset(), tuple(local.shape), tuple(local.stride()), spec)


@dataclass(frozen=True)
class OuterSaved:
    """A saved tensor handed to the ``saved_tensors_hooks`` that were active around the ``apply`` call
    (``torch.autograd.graph.save_on_cpu()``, a user's compression): what their pack returned."""

    value: Any


def outer_saved_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The ``(pack, unpack)`` saved-tensor hooks active now (``None``: none, or a torch without the query)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def checkpoint_region(hooks: tuple[Callable[[torch.Tensor], Any], Any] | None) -> bool:
    """Whether ``hooks`` (``outer_saved_hooks()``) are a non-reentrant activation checkpoint's forward
    hooks: the call begins inside its region."""
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")
