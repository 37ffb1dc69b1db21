"""Putting a value in a module's parameter slot the way ``setattr`` would for modules that cache their
parameters.

fsdpfn writes ``module._parameters[name]`` directly (``setattr`` would run each module's own
``__setattr__`` and ``nn.Module``'s checks on every swap). torch's RNNs (``nn.RNNBase``: ``RNN``, ``LSTM``,
``GRU``) also keep their parameters in a list of their own, ``_flat_weights``, that their ``__setattr__``
updates and their forward refreshes when a parameter changed. Written past it, the list keeps the tensor
that was replaced: after ``shard`` donated it, or ``fully_shard`` registered the sharded ``DTensor``, the
module's full weights stay resident (FSDP2 assigns through ``__setattr__``); after a unit's forward, its
whole gathered buffer.

Example:
    >>> lstm = torch.nn.LSTM(2, 3); shard_of_w = torch.zeros(6, 2)
    >>> set_parameter(lstm, "weight_ih_l0", torch.nn.Parameter(shard_of_w))
    >>> lstm._flat_weights[0] is lstm.weight_ih_l0
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["PARAMETER_CACHES", "caches_restored", "parameter_cache", "set_parameter"]

# the attributes in which nn.RNNBase keeps its parameters for its forward (the tensors, and weak references
# by which its forward sees that a parameter changed)
PARAMETER_CACHES = ("_flat_weights", "_flat_weight_refs")


def parameter_cache(module: nn.Module) -> dict[str, Any] | None:
    """``module``'s ``__dict__`` if it keeps its parameters in a cache (``PARAMETER_CACHES``), else ``None``.

    Example:
        >>> parameter_cache(torch.nn.GRU(2, 3)) is not None, parameter_cache(torch.nn.Linear(2, 3))
        (True, None)
    """
    attributes = vars(module)
    return attributes if all(c in attributes for c in PARAMETER_CACHES) else None


def set_parameter(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Register ``value`` as ``module``'s parameter ``name`` (``module._parameters[name] = value``) and, for a
    module that keeps its parameters in a cache (``PARAMETER_CACHES``), in that cache as its ``__setattr__``
    would put it."""
    module._parameters[name] = value
    names = vars(module).get("_flat_weights_names")
    if names is not None and name in names and "_flat_weights" in vars(module):
        module._flat_weights[names.index(name)] = value


@contextlib.contextmanager
def caches_restored(module: nn.Module) -> Iterator[None]:
    """Put back, on exit, the parameter caches (``PARAMETER_CACHES``) of ``module`` and its submodules as
    they were on entry: around a stateless call (``torch.func.functional_call``), after which an RNN's cache
    would keep the values swapped in (the planner's fake tensors, a gathered buffer).

    Example:
        >>> lstm = torch.nn.LSTM(2, 3); values = {n: torch.zeros_like(p) for n, p in lstm.named_parameters()}
        >>> with caches_restored(lstm):
        ...     _ = torch.func.functional_call(lstm, values, (torch.randn(1, 2),))
        >>> lstm._flat_weights[0] is lstm.weight_ih_l0
        True
    """
    caches = [c for c in map(parameter_cache, module.modules()) if c is not None]
    saved = [(attributes, {c: attributes[c] for c in PARAMETER_CACHES}) for attributes in caches]
    try:
        yield
    finally:
        for attributes, cache in saved:
            attributes.update(cache)
