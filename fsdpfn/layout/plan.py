"""The shard plan: which parameters exist, how each is split, and which unit's buckets carry it.

A plan is static metadata shared by every tree derived from one ``shard`` call (parameters, gradients,
optimizer state). Plans compare by identity: two ``shard`` calls give two plans even for the same module,
so a tree can never be paired with the bookkeeping of another one by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fsdpfn.layout.bucket import BucketLayout
from fsdpfn.layout.spec import ShardSpec

__all__ = ["ParamInfo", "ShardPlan", "UnitPlan", "bucket_by_dtype", "build_plan"]


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know of one (untied) parameter."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    unit: str


@dataclass(frozen=True)
class UnitPlan:
    """One unit: the parameters it owns and its collective buckets (one per dtype).

    ``gather`` buckets hold every member in its collective (all-gather) dtype; ``reduce`` buckets hold
    only the members that take gradients, in the reduction dtype. Frozen members cost no reduction.
    """

    name: str
    fqns: tuple[str, ...]
    gather: tuple[BucketLayout, ...]
    reduce: tuple[BucketLayout, ...]

    @property
    def label(self) -> str:
        """The unit's name for messages (``<root>`` for the root unit)."""
        return self.name or "<root>"


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Static metadata of a ``Sharded`` tree. Compared by identity.

    ``params`` and ``buffers`` are the leaf names in their fixed, rank-independent order. ``aliases``
    maps every tied name to the name that owns the storage. ``rank``/``world`` are this process's place
    in the shard group; ``replicas`` is the size of the replicate dimension (1 without HSDP).
    """

    params: tuple[str, ...]
    buffers: tuple[str, ...]
    specs: Mapping[str, ShardSpec]
    dtypes: Mapping[str, torch.dtype]
    requires_grad: Mapping[str, bool]
    units: tuple[UnitPlan, ...]
    unit_of: Mapping[str, str]
    aliases: Mapping[str, str]
    rank: int
    world: int
    replicas: int = 1
    mesh: Any = None
    comm: Any = None
    mp_policy: Any = None
    offload_policy: Any = None
    module_type: str = ""
    ignored: tuple[str, ...] = ()
    transient_buffers: frozenset[str] = frozenset()  # non-persistent buffers: not in state_dict()
    unit_policies: Mapping[str, Any] = field(default_factory=dict)  # per-unit mixed precision (compat)
    _by_name: dict[str, UnitPlan] = field(default_factory=dict, repr=False)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)  # derived objects, built once per plan

    def __post_init__(self) -> None:
        self._by_name.update({u.name: u for u in self.units})

    @property
    def keys(self) -> tuple[str, ...]:
        """Every leaf name: parameters first, then buffers."""
        return self.params + self.buffers

    @cached_property
    def tied(self) -> Mapping[str, tuple[str, ...]]:
        """For every parameter with tied names: the other names it goes by (``aliases`` inverted)."""
        out: dict[str, tuple[str, ...]] = {}
        for alias, owner in self.aliases.items():
            out[owner] = (*out.get(owner, ()), alias)
        return out

    def names(self, fqn: str) -> tuple[str, ...]:
        """Every name of parameter ``fqn``: itself first, then its tied aliases."""
        return (fqn, *self.tied.get(fqn, ()))

    def unit(self, name: str) -> UnitPlan:
        """The unit called ``name`` (``""`` for the root)."""
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(repr(u.name) for u in self.units)
            raise KeyError(f"no unit {name!r} in this plan; units are {known}") from None

    def policy(self, unit: str) -> Any:
        """The mixed-precision policy of unit ``unit`` (the plan's own unless the unit has one)."""
        return self.unit_policies.get(unit, self.mp_policy)

    def describe(self) -> str:
        """A short human-readable summary, used by ``repr``."""
        return (
            f"{len(self.params)} params, {len(self.buffers)} buffers in {len(self.units)} units, "
            f"rank {self.rank} of {self.world}" + (f" x {self.replicas} replicas" if self.replicas > 1 else "")
        )


def build_plan(
    infos: Sequence[ParamInfo],
    buffers: Sequence[str],
    unit_names: Sequence[str],
    *,
    rank: int,
    world: int,
    gather_dtype: Callable[[torch.dtype], torch.dtype] = lambda d: d,
    reduce_dtype: Callable[[torch.dtype], torch.dtype] = lambda d: d,
    aliases: Mapping[str, str] | None = None,
    unit_dtypes: Mapping[str, tuple[Callable[[torch.dtype], torch.dtype], Callable[[torch.dtype], torch.dtype]]] | None = None,
    **extra: Any,
) -> ShardPlan:
    """Build a plan: shard every parameter on dim 0 and bucket each unit's members by dtype.

    ``gather_dtype``/``reduce_dtype`` map a parameter's own dtype to the dtype its bucket moves in
    (mixed precision); ``unit_dtypes[unit]`` overrides the pair for one unit. Units keep the order of
    ``unit_names``; a unit that owns nothing is dropped.

    Example:
        >>> infos = [ParamInfo("w", (4, 3), torch.float32, True, "")]
        >>> plan = build_plan(infos, [], [""], rank=0, world=2)
        >>> plan.units[0].gather[0].numel
        6
    """
    specs = {i.fqn: ShardSpec(i.shape, world) for i in infos}
    units = []
    for name in unit_names:
        members = [i for i in infos if i.unit == name]
        if not members:
            continue
        to_gather, to_reduce = (unit_dtypes or {}).get(name, (gather_dtype, reduce_dtype))
        gather = bucket_by_dtype(members, specs, to_gather)
        trainable = [i for i in members if i.requires_grad]
        units.append(UnitPlan(name, tuple(i.fqn for i in members), gather, bucket_by_dtype(trainable, specs, to_reduce)))
    return ShardPlan(
        params=tuple(i.fqn for i in infos),
        buffers=tuple(buffers),
        specs=specs,
        dtypes={i.fqn: i.dtype for i in infos},
        requires_grad={i.fqn: i.requires_grad for i in infos},
        units=tuple(units),
        unit_of={i.fqn: i.unit for i in infos},
        aliases=dict(aliases or {}),
        rank=rank,
        world=world,
        **extra,
    )


def bucket_by_dtype(
    members: Sequence[ParamInfo],
    specs: Mapping[str, ShardSpec],
    dtype_of: Callable[[torch.dtype], torch.dtype],
) -> tuple[BucketLayout, ...]:
    groups: dict[torch.dtype, list[str]] = {}
    for info in members:
        groups.setdefault(dtype_of(info.dtype), []).append(info.fqn)
    return tuple(BucketLayout.build(f, [specs[n] for n in f], dtype) for dtype, f in groups.items())
