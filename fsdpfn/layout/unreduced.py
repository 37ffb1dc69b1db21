"""``Unreduced``: per-rank full gradients whose reduction was deferred (gradient accumulation).

``value_and_grad(fn, reduce=False)`` returns one; ``fsdpfn.accumulate`` adds microbatches; a single
``fsdpfn.reduce(acc, like)`` at the end does one reduce-scatter per bucket. It is its own pytree type so
that it can never be mistaken for reduced (``Sharded``) gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from fsdpfn.layout.plan import ShardPlan

__all__ = ["Unreduced"]


class Unreduced:
    """Full-shaped, not yet reduced gradients of one rank, keyed by parameter FQN (trainable only).

    Example:
        >>> (loss, g1) = fsdpfn.value_and_grad(loss_fn, reduce=False)(params, mb1)   # doctest: +SKIP
        >>> acc = fsdpfn.accumulate(acc, g1)                                         # doctest: +SKIP
        >>> grads = fsdpfn.reduce(acc, params)       # one reduce-scatter per bucket  # doctest: +SKIP
    """

    __slots__ = ("_grads", "_plan")

    def __init__(self, grads: Mapping[str, torch.Tensor | None], plan: ShardPlan) -> None:
        names = _names(plan)
        unknown = [k for k in grads if k not in names]
        if unknown:
            raise KeyError(f"Unreduced: {unknown} are not trainable parameters of the plan")
        self._grads = {k: grads.get(k) for k in names}
        self._plan = plan

    @property
    def plan(self) -> ShardPlan:
        """The plan of the parameters these gradients belong to."""
        return self._plan

    def __getitem__(self, key: str) -> torch.Tensor | None:
        return self._grads[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)

    def keys(self) -> Any:
        """Trainable parameter names in plan order."""
        return self._grads.keys()

    def items(self) -> Any:
        """``(name, full gradient or None)`` pairs."""
        return self._grads.items()

    def __repr__(self) -> str:
        have = sum(v is not None for v in self._grads.values())
        return f"Unreduced({have}/{len(self._grads)} gradients; {self._plan.describe()})"


def _names(plan: ShardPlan) -> list[str]:
    names = plan.memo.get(("trainable",))
    if names is None:
        names = plan.memo[("trainable",)] = [f for f in plan.params if plan.requires_grad[f]]
    return names


def _unflatten(children: list[Any], plan: ShardPlan) -> Unreduced:
    obj = Unreduced.__new__(Unreduced)
    obj._grads = dict(zip(_names(plan), children))
    obj._plan = plan
    return obj


torch_pytree.register_pytree_node(
    Unreduced,
    lambda u: (list(u._grads.values()), u._plan),
    _unflatten,
    serialized_type_name="fsdpfn.Unreduced",
    flatten_with_keys_fn=lambda u: ([(torch_pytree.MappingKey(k), v) for k, v in u._grads.items()], u._plan),
)
