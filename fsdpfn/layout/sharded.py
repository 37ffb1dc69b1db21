"""``Sharded``: the sharded parameter pytree.

Its children are this rank's unpadded local shards, keyed by parameter FQN, followed by the module's
buffers (replicated, never sharded, never reduced). Its static metadata is the ``ShardPlan``. It is a
pytree node for ``torch.utils._pytree`` (hence ``torch.func``) and for optree's ``"torch"`` namespace, so
``tree_map(f, params)`` returns a ``Sharded`` with the same plan.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as torch_pytree

from fsdpfn.layout.plan import ShardPlan
from fsdpfn.layout.spec import ShardSpec

__all__ = ["DonatedError", "Sharded"]

T = TypeVar("T")


class DonatedError(RuntimeError):
    """A ``Sharded`` tree was read after an in-place update donated it (``fsdpfn.optim``'s ``update``)."""


class Sharded(Generic[T]):
    """A mapping from leaf name to this rank's local shard, carrying the plan that made it.

    Leaves are usually tensors; derived trees (gradients, optimizer state, ``tree_map`` results) may
    hold anything, ``None`` included (frozen parameters have ``None`` gradients).

    Example:
        >>> params = fsdpfn.shard(model, mesh)                       # doctest: +SKIP
        >>> params["0.weight"].shape, params.specs["0.weight"]       # doctest: +SKIP
        >>> zeros = torch.utils._pytree.tree_map(torch.zeros_like, params)  # still a Sharded  # doctest: +SKIP
        >>> ema = copy.deepcopy(params)     # its own leaves, the same plan  # doctest: +SKIP

    A tree cannot be pickled (its plan holds the mesh's process groups): ``fsdpfn.save`` writes one.
    """

    __slots__ = ("_leaves_", "_plan", "_mode", "_donated")

    def __init__(self, leaves: Mapping[str, T], plan: ShardPlan) -> None:
        if not isinstance(plan, ShardPlan):
            raise TypeError(f"Sharded: plan must be a ShardPlan, got {type(plan).__name__}")
        keys = plan.keys
        missing = [k for k in keys if k not in leaves]
        extra = [k for k in leaves if k not in plan.specs and k not in plan.buffers]
        if missing or extra:
            raise KeyError(
                "Sharded: leaves do not match the plan"
                + (f"; missing {missing}" if missing else "")
                + (f"; not in the plan {extra}" if extra else "")
            )
        self._leaves_ = {k: leaves[k] for k in keys}
        self._plan = plan
        self._mode: Any = None  # transient: how value_and_grad wants this tree's gradients reduced
        self._donated: str | None = None  # what took this tree's leaves (an in-place optimizer update)

    @classmethod
    def _from_children(cls, children: list[Any], plan: ShardPlan) -> Sharded[Any]:
        obj = cls.__new__(cls)
        obj._leaves_ = dict(zip(plan.keys, children))
        obj._plan = plan
        obj._mode = None
        obj._donated = None
        return obj

    @property
    def _leaves(self) -> dict[str, T]:
        if self._donated is not None:
            raise DonatedError(
                f"this Sharded was donated to {self._donated}, which updated its shards in place and returned "
                "them in a new tree: use the tree it returned (params, state = opt.update(grads, state, params)). "
                "To keep the values from before the step, copy them first "
                "(torch.utils._pytree.tree_map(torch.clone, params)), or make the optimizer with inplace=False"
            )
        return self._leaves_

    def donate(self, to: str) -> None:
        """Mark this tree as donated to ``to`` (an in-place update that returned its leaves in a new tree):
        from now on reading its leaves raises ``DonatedError`` (metadata still reads), as JAX refuses a
        donated buffer, instead of silently showing the updated values under the old name."""
        self._donated = to

    # --- mapping protocol ---------------------------------------------------------------------
    def __getitem__(self, key: str) -> T:
        try:
            return self._leaves[key]
        except KeyError:
            owner = self._plan.aliases.get(key)
            if owner is not None:
                return self._leaves[owner]
            raise KeyError(f"{key!r} is not a leaf of this Sharded ({self._plan.describe()})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __contains__(self, key: object) -> bool:
        return key in self._leaves

    def keys(self) -> Any:
        """Leaf names: parameters in plan order, then buffers (the same on every rank)."""
        return self._leaves.keys()

    def values(self) -> Any:
        """Leaves in ``keys()`` order."""
        return self._leaves.values()

    def items(self) -> Any:
        """``(name, leaf)`` pairs in ``keys()`` order."""
        return self._leaves.items()

    def get(self, key: str, default: Any = None) -> Any:
        """``self[key]`` or ``default``."""
        return self._leaves.get(key, default)

    # --- metadata -----------------------------------------------------------------------------
    @property
    def plan(self) -> ShardPlan:
        """The static plan shared by every tree derived from the same ``shard`` call."""
        return self._plan

    @property
    def specs(self) -> Mapping[str, ShardSpec]:
        """``ShardSpec`` of every parameter (buffers have none)."""
        return self._plan.specs

    @property
    def mesh(self) -> Any:
        """The device mesh the tree is sharded over."""
        return self._plan.mesh

    @property
    def units(self) -> tuple[str, ...]:
        """Unit names (module FQNs, ``""`` for the root), in collective order."""
        return tuple(u.name for u in self._plan.units)

    def params(self) -> dict[str, T]:
        """Parameter leaves only (no buffers), in plan order."""
        return {k: self._leaves[k] for k in self._plan.params}

    def buffers(self) -> dict[str, T]:
        """Buffer leaves only, in plan order."""
        return {k: self._leaves[k] for k in self._plan.buffers}

    def replace(self, updates: Mapping[str, Any]) -> Sharded[Any]:
        """A new tree with some leaves replaced (names must belong to the plan).

        Example:
            >>> params = params.replace({"0.bias": torch.zeros_like(params["0.bias"])})  # doctest: +SKIP
        """
        unknown = [k for k in updates if k not in self._leaves]
        if unknown:
            raise KeyError(f"Sharded.replace: {unknown} are not leaves of this tree")
        return Sharded._from_children([updates.get(k, v) for k, v in self._leaves.items()], self._plan)

    # --- copies ---------------------------------------------------------------------------------
    def __copy__(self) -> Sharded[T]:
        return Sharded._from_children(list(self._leaves.values()), self._plan)

    def __deepcopy__(self, memo: dict[int, Any]) -> Sharded[T]:
        """A tree of copied leaves with the same plan (static metadata, shared: the copy lives on the same
        mesh), e.g. an EMA or a reference copy: ``copy.deepcopy(params)``."""
        return Sharded._from_children([copy.deepcopy(v, memo) for v in self._leaves.values()], self._plan)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Sharded cannot be pickled (torch.save included): its plan holds the process groups of its mesh. "
            "Save it with fsdpfn.save(path, params) (loadable at any world size: params = fsdpfn.load(path, like)); "
            "or save this rank's leaves, torch.save(dict(params.items()), f), and rebuild them with "
            "like.replace(torch.load(f)) in a run with the same plan"
        )

    def __repr__(self) -> str:
        if self._donated is not None:
            return f"Sharded(<donated to {self._donated}>; {self._plan.describe()})"
        shown = ", ".join(f"{k!r}: {_short(v)}" for k, v in list(self._leaves.items())[:4])
        more = ", ..." if len(self._leaves) > 4 else ""
        return f"Sharded({{{shown}{more}}}; {self._plan.describe()})"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}"
    return type(v).__name__ if v is not None else "None"


Mapping.register(Sharded)


def _flatten(tree: Sharded[Any]) -> tuple[list[Any], ShardPlan]:
    return list(tree._leaves.values()), tree._plan


def _flatten_with_keys(tree: Sharded[Any]) -> tuple[list[tuple[Any, Any]], ShardPlan]:
    return [(torch_pytree.MappingKey(k), v) for k, v in tree._leaves.items()], tree._plan


torch_pytree.register_pytree_node(
    Sharded,
    _flatten,
    Sharded._from_children,
    serialized_type_name="fsdpfn.Sharded",
    flatten_with_keys_fn=_flatten_with_keys,
)

try:  # importing torch's optree bridge flushes the registration into optree's "torch" namespace
    import torch.utils._cxx_pytree  # noqa: F401
except ImportError:  # pragma: no cover - optree is a hard dependency, but stay importable without it
    pass
