"""The tensors inside a module's inputs and outputs: torch's pytree, plus the dataclasses it does not know.

A unit's forward takes and returns whatever the user's model passes around. torch's pytree (what
``torch.func`` and ``torch.compile`` see) walks tuples, lists, dicts, namedtuples and registered types
(Hugging Face registers its ``ModelOutput``s), but a plain ``@dataclass`` is one opaque leaf to it: the
tensors inside were missed by mixed-precision casts (FSDP2 casts them) and, under ``torch.func``, were
constants to the unit's autograd function (gradients of 1.0 off, silently). Here such a dataclass is a
node whose children are its ``init`` fields, rebuilt with ``dataclasses.replace`` (as FSDP2 does).

Example:
    >>> import torch
    >>> @dataclasses.dataclass
    ... class Out:
    ...     logits: torch.Tensor
    ...     n: int = 0
    >>> values, spec = flatten({"out": Out(torch.ones(2), 3)})
    >>> values
    [tensor([1., 1.]), 3]
    >>> unflatten([torch.zeros(2), 3], spec)
    {'out': Out(logits=tensor([0., 0.]), n=3)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.utils._pytree as pytree

__all__ = ["TreeSpec", "flatten", "leaves", "map_leaves", "unflatten"]


class _Node(NamedTuple):
    template: Any  # the dataclass instance (replace() keeps what is not a child)
    names: tuple[str, ...]  # its init fields, the children
    spec: TreeSpec  # of the children's values, as a list
    count: int  # how many leaves they flatten to


class TreeSpec(NamedTuple):
    """How ``flatten`` took a value apart: torch's spec with opaque dataclasses as leaves, and where
    those sit among its leaves."""

    outer: pytree.TreeSpec
    nodes: dict[int, _Node]
    count: int  # torch's leaves, dataclasses counted once


def _unknown_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def flatten(x: Any) -> tuple[list[Any], TreeSpec]:
    """The leaves of ``x`` (torch's pytree order; an unregistered dataclass's ``init`` fields in
    declaration order, recursively) and a spec ``unflatten`` rebuilds ``x``'s structure from."""
    outer_leaves, outer = pytree.tree_flatten(x, is_leaf=_unknown_dataclass)
    out: list[Any] = []
    nodes: dict[int, _Node] = {}
    for i, leaf in enumerate(outer_leaves):
        if _unknown_dataclass(leaf):
            names = tuple(f.name for f in dataclasses.fields(leaf) if f.init)
            children, spec = flatten([getattr(leaf, n) for n in names])
            nodes[i] = _Node(leaf, names, spec, len(children))
            out.extend(children)
        else:
            out.append(leaf)
    return out, TreeSpec(outer, nodes, len(outer_leaves))


def unflatten(values: list[Any], spec: TreeSpec) -> Any:
    """``x`` rebuilt from its leaves (``flatten``'s inverse)."""
    it = iter(values)
    rebuilt: list[Any] = []
    for i in range(spec.count):
        node = spec.nodes.get(i)
        if node is None:
            rebuilt.append(next(it))
            continue
        children = unflatten([next(it) for _ in range(node.count)], node.spec)
        rebuilt.append(dataclasses.replace(node.template, **dict(zip(node.names, children))))
    return pytree.tree_unflatten(rebuilt, spec.outer)


def leaves(x: Any) -> list[Any]:
    """``flatten(x)[0]``."""
    return flatten(x)[0]


def map_leaves(fn: Callable[[Any], Any], x: Any) -> Any:
    """``x`` with ``fn`` applied to every leaf."""
    values, spec = flatten(x)
    return unflatten([fn(v) for v in values], spec)
