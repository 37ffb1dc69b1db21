"""``Placeholder``: what a unit's parameter slot holds during an ``apply`` call outside that unit's forward.

A unit's parameters exist in full only while its module runs (its forward hooks swap the gathered values
in and out). Code that reads one elsewhere (a tied head computing ``h @ self.embed.weight.t()`` while
``embed`` is a unit of its own; a child of a unit called directly) used to meet a ``meta`` tensor there,
and a ``meta`` tensor does not always fail: torch's CPU matmul (``@``, ``F.linear``, ``mm``) takes one
beside real tensors and returns uninitialised memory (1e29 gradients, no error). A ``Placeholder`` has
the parameter's shape and dtype (metadata reads work: ``x.to(w.dtype)``) and refuses every operation,
naming the parameter and its unit.

Example:
    >>> w = Placeholder((3, 4), torch.float32, "embed.weight", "embed")
    >>> w.shape, w.dtype
    (torch.Size([3, 4]), torch.float32)
    >>> torch.ones(2, 4) @ w.t()                      # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    PlaceholderUsedError: apply: parameter 'embed.weight' of unit 'embed' was used outside ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["Placeholder", "PlaceholderUsedError"]


class PlaceholderUsedError(RuntimeError):
    """An operation read a unit's parameter outside that unit's forward, inside an ``apply`` call."""


class Placeholder(torch.Tensor):
    """A parameter slot's stand-in outside its unit's forward: shape and dtype only (on the ``meta``
    device); any operation on it raises ``PlaceholderUsedError`` naming the parameter (``param_name``)
    and its unit (``unit_name``)."""

    param_name: str
    unit_name: str
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, name: str, unit: str) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device="meta")
        t.param_name, t.unit_name = name, unit
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        shape = tuple(self.shape)
        return f"Placeholder({self.param_name!r} of unit {self.unit_name!r}, shape={shape}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        held = next(t for t in leaves if isinstance(t, Placeholder))
        name, unit = held.param_name, held.unit_name
        raise PlaceholderUsedError(
            f"apply: parameter {name!r} of unit {unit!r} was used outside that unit's forward (by {func}). fsdp "
            "gathers a unit's parameters only while the unit's module runs (its forward hooks); elsewhere in the "
            "call they are not there. Code that uses a unit's weight from another module (a head computing "
            f"x @ embed.weight.t() while {unit!r} is a unit of its own) or calls a child of the unit directly "
            f"bypasses that: use the weight inside the forward of {unit!r} (call the unit's module itself, or make "
            "the child a unit of its own), or let one unit hold both modules (units=[...] naming their common "
            "parent, or leaving them to the root)"
        )
