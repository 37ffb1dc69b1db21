"""The shard plan: which parameters exist, how each is split, and which unit's buckets carry it.

A plan is static metadata shared by every tree derived from one ``shard`` call (parameters, gradients,
optimizer state). Plans compare by identity: two ``shard`` calls give two plans even for the same module,
so a tree can never be paired with the bookkeeping of another one by accident.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fsdpfn.layout.autobucket import LinkCost, auto_bucket_bytes
from fsdpfn.layout.grouping import FUSED, ParamInfo, UnitPlan, bucket_by_dtype, fuse_runs, fuse_units, is_byte_count, is_partition
from fsdpfn.layout.spec import ShardSpec

# the unit and group names are re-exported: callers import them from the plan they belong to
__all__ = ["FUSED", "ParamInfo", "ShardPlan", "UnitPlan", "bucket_by_dtype", "build_plan", "fuse_runs", "fuse_units", "is_byte_count", "is_partition"]


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
    groups: tuple[UnitPlan, ...] = ()  # what travels in one collective: units, or runs of fused units
    group_of: Mapping[str, str] = field(default_factory=dict)  # unit name -> its group's name
    bucket_bytes: int | None = None  # the fusion threshold in force (what min_bucket_bytes="auto" chose)
    auto_fusion: bool = False  # min_bucket_bytes="auto": the first call may fuse further (see regroup)
    tp: Mapping[str, Any] = field(default_factory=dict)  # tensor-parallel parameters: fqn -> fsdpfn.ops.tp.TPLayout
    transforms: Mapping[str, Any] = field(default_factory=dict)  # fqn -> its all-gather transform (ops.extension)
    origin: ShardPlan | None = None  # the plan shard built, when this one was derived from it (layout/trainable.py)
    _by_name: dict[str, UnitPlan] = field(default_factory=dict, repr=False)
    _by_group: dict[str, UnitPlan] = field(default_factory=dict, repr=False)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)  # derived objects, built once per plan

    def __post_init__(self) -> None:
        self._by_name.update({u.name: u for u in self.units})
        if not self.groups:
            object.__setattr__(self, "groups", self.units)
        if not self.group_of:
            object.__setattr__(self, "group_of", {u.name: u.name for u in self.units})
        self._by_group.update({g.name: g for g in self.groups})

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

    @cached_property
    def reduce_dtypes(self) -> Mapping[str, torch.dtype]:
        """The dtype each trainable parameter's gradient is reduced (and accumulated) in (its units' reduce
        buckets: the same whatever the groups)."""
        return {f: lay.dtype for u in self.units for lay in u.reduce for f in lay.fqns}

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

    def group(self, name: str) -> UnitPlan:
        """The collective group called ``name``: a unit, or several consecutive units fused into one
        ``UnitPlan`` (``shard(..., min_bucket_bytes=)``) whose name joins theirs with ``+``."""
        try:
            return self._by_group[name]
        except KeyError:
            known = ", ".join(repr(g.name) for g in self.groups)
            raise KeyError(f"no collective group {name!r} in this plan; groups are {known}") from None

    def regroup(self, min_bucket_bytes: int | None = None, *, sizes: Sequence[int] | None = None) -> bool:
        """Fuse the units again, into runs of at least ``min_bucket_bytes`` gathered bytes (``None``: one
        group per unit) or, with ``sizes``, into consecutive runs of that many units each (``fuse_runs``:
        groups of different sizes), in place (every tree holding this plan sees it) and forget what was
        derived from the old groups. Shards, specs and buckets do not change: only what travels in one collective. Every
        rank must regroup alike, before a call starts (``fsdp`` does it on its first call, when
        ``min_bucket_bytes="auto"``). Returns whether the groups changed: when they would not, the plan is
        left exactly as it was (``bucket_bytes`` and what was derived from its groups included).

        Example:
            >>> infos = [ParamInfo(f"b{i}.w", (4, 4), torch.float32, True, f"b{i}") for i in range(4)]
            >>> plan = build_plan(infos, [], [f"b{i}" for i in range(4)], rank=0, world=2)
            >>> plan.regroup(65), [g.name for g in plan.groups]   # 64 bytes each: two per group
            (True, ['b0+b1', 'b2+b3'])
            >>> plan.regroup(100)                                 # the same groups
            False
            >>> plan.regroup(sizes=[1, 3]), [g.name for g in plan.groups]
            (True, ['b0', 'b1+b2+b3'])
        """
        if min_bucket_bytes is not None and not is_byte_count(min_bucket_bytes):
            raise ValueError(f"regroup: min_bucket_bytes must be an int >= 0 (bytes) or None, got {min_bucket_bytes!r}")
        if sizes is not None:
            if min_bucket_bytes is not None:
                raise ValueError("regroup: pass min_bucket_bytes or sizes, not both")
            groups = fuse_runs(self.units, self.specs, sizes)
        else:
            groups = fuse_units(self.units, self.specs, self.world, min_bucket_bytes) if min_bucket_bytes else self.units
        if [g.name for g in groups] == [g.name for g in self.groups]:
            return False
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "group_of", {u: g.name for g in groups for u in g.name.split(FUSED)})
        object.__setattr__(self, "bucket_bytes", min_bucket_bytes or (max(g.gathered_bytes(self.world) for g in groups) if sizes else None))
        self._by_group.clear()
        self._by_group.update({g.name: g for g in groups})
        self._forget_derived()  # derived from the old groups (collectives, schedules, members, orders)
        return True

    def set_planned_schedule(self, spans: Sequence[int] | None, kept: Iterable[str] = ()) -> None:
        """What the fusion planner chose beyond the groups, forgetting the schedules built otherwise: runs of
        ``spans`` consecutive named groups (sizes, in plan order) gathered in one forward collective each
        (``None``: every group on its own), and the units ``kept`` gathered from their forward to their
        backward (``KEPT_GATHERED_MEMO``; ``fsdp`` with ``reshard_after_forward=True`` reads it). Every
        rank alike, between calls.

        Example:
            >>> infos = [ParamInfo(f"b{i}.w", (4, 4), torch.float32, True, f"b{i}") for i in range(4)]
            >>> plan = build_plan(infos, [], [f"b{i}" for i in range(4)], rank=0, world=2)
            >>> plan.set_planned_schedule((2, 1, 1), kept=["b3"]); plan.memo[FORWARD_SPANS_MEMO], plan.memo[KEPT_GATHERED_MEMO]
            ((2, 1, 1), frozenset({'b3'}))
        """
        if spans is not None and sum(spans) != sum(1 for g in self.groups if g.name):
            raise ValueError(f"set_planned_schedule: spans {tuple(spans)} do not cover the plan's named groups")
        kept = frozenset(kept)
        unknown = sorted(kept - {u.name for u in self.units if u.name})
        if unknown:
            raise ValueError(f"set_planned_schedule: kept names units the plan does not have: {unknown}")
        spans = None if spans is None else tuple(spans)
        if self.memo.get(FORWARD_SPANS_MEMO) == spans and self.memo.get(KEPT_GATHERED_MEMO, frozenset()) == kept:
            return
        self._forget_derived()
        if spans is not None:
            self.memo[FORWARD_SPANS_MEMO] = spans
        if kept:
            self.memo[KEPT_GATHERED_MEMO] = kept

    def _forget_derived(self) -> None:
        for key in [k for k in self.memo if k[0] not in _PLAN_STATE]:
            del self.memo[key]

    def members(self, group: str) -> tuple[str, ...]:
        """The unit names fused into group ``group`` (just ``(group,)`` for an unfused unit)."""
        got = self.memo.get(("members", group))
        if got is None:
            got = self.memo[("members", group)] = tuple(u for u, g in self.group_of.items() if g == group)
        return got

    def policy(self, unit: str) -> Any:
        """The mixed-precision policy of unit ``unit`` (the plan's own unless the unit has one)."""
        return self.unit_policies.get(unit, self.mp_policy)

    def describe(self) -> str:
        """A short human-readable summary, used by ``repr``."""
        return (
            f"{len(self.params)} params, {len(self.buffers)} buffers in {len(self.units)} units, "
            f"rank {self.rank} of {self.world}" + (f" x {self.replicas} replicas" if self.replicas > 1 else "")
        )


# fsdpfn.optim's ``init`` notes here which optimizer updates this plan's shards ("adamw", "sgd", ...):
# the first call's fusion plans the step's memory for it
OPTIMIZER_MEMO = ("optimizer",)
# set once the first call's fusion planner has run on this plan (transform/fusion.py; compat reads it)
FUSION_PLANNED_MEMO = ("fusion_planned",)
# what the fusion planner last planned for: (this rank's batch elements, ``Guard.replans`` then); a training
# batch past it asks every rank to plan again (transform/fusion.py)
PLANNED_BATCH_MEMO = ("planned_batch",)
# the first call's fusion planner's forward spans (sizes over the named groups, in plan order): consecutive
# groups gathered in one collective in forward (fsdpfn.layout.schedule); derived from the groups, so a
# regroup forgets them
FORWARD_SPANS_MEMO = ("forward_spans",)
# the units the first call's fusion planner leaves gathered from their forward to their backward (a frozenset:
# the last groups, when that costs no memory; ``fsdp`` with ``reshard_after_forward=True`` reads it);
# set with the spans, forgotten by a regroup
KEPT_GATHERED_MEMO = ("kept_gathered",)
# memo entries that are state, not derived from the groups: kept by ``ShardPlan.regroup``
# "validated": apply's check that a module matches the plan's parameters (transform/validate.py), which no
# grouping changes; forgotten at the first call's regroup, it left compile_step's trace refusing the plan
# "requires_grad": the plans derived from this one for other trainable parameters (fsdpfn.freeze/unfreeze)
_PLAN_STATE = frozenset(
    {"applies", "checkpoint.world_comm", "validated", "requires_grad", OPTIMIZER_MEMO[0], FUSION_PLANNED_MEMO[0],
     PLANNED_BATCH_MEMO[0]}
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
    min_bucket_bytes: int | str | None = None,
    fuse_key: Callable[[str], Any] | None = None,
    link: LinkCost | Callable[[], LinkCost] | None = None,
    device_type: str | None = None,
    **extra: Any,
) -> ShardPlan:
    """Build a plan: shard every parameter on its ``ParamInfo.dim`` (0 by default) and bucket each
    unit's members by dtype.

    ``gather_dtype``/``reduce_dtype`` map a parameter's own dtype to the dtype its bucket moves in
    (mixed precision); ``unit_dtypes[unit]`` overrides the pair for one unit. Units keep the order of
    ``unit_names``; a unit that owns nothing is dropped. With ``min_bucket_bytes``, consecutive non-root
    units are fused into collective groups of at least that many gathered (full-size) bytes each (the
    last group of a run may be smaller); see ``fuse_units`` (``fuse_key`` too). ``min_bucket_bytes="auto"``
    fills groups up to the size ``auto_bucket_bytes`` picks from ``link`` (the mesh's measured all-gather
    cost, or a function measuring it, called only when fusing could pay), never past it; ``device_type``
    (default: ``comm``'s) is where the step runs, which sets the cap (see ``auto_bucket_bytes``).

    Example:
        >>> infos = [ParamInfo("w", (4, 3), torch.float32, True, "")]
        >>> plan = build_plan(infos, [], [""], rank=0, world=2)
        >>> plan.units[0].gather[0].numel
        6
    """
    specs = {i.fqn: ShardSpec(i.shape, world, i.dim) for i in infos}
    units = []
    for name in unit_names:
        members = [i for i in infos if i.unit == name]
        if not members:
            continue
        to_gather, to_reduce = (unit_dtypes or {}).get(name, (gather_dtype, reduce_dtype))
        gather = bucket_by_dtype(members, specs, to_gather)
        trainable = [i for i in members if i.requires_grad]
        units.append(UnitPlan(name, tuple(i.fqn for i in members), gather, bucket_by_dtype(trainable, specs, to_reduce)))
    if min_bucket_bytes not in (None, "auto") and not is_byte_count(min_bucket_bytes):
        raise ValueError(f"min_bucket_bytes must be an int >= 0 (bytes), 'auto' or None, got {min_bucket_bytes!r}")
    at_most = None
    auto = min_bucket_bytes == "auto"
    if auto:
        if link is None:
            raise ValueError("build_plan: min_bucket_bytes='auto' needs the mesh's measured all-gather cost (link=)")
        comm = extra.get("comm")
        device_type = device_type or (comm.groups.device_type if comm is not None else None)
        min_bucket_bytes = at_most = auto_bucket_bytes(units, world, link, device_type)
    fused = bool(min_bucket_bytes)
    groups = fuse_units(units, specs, world, min_bucket_bytes, key=fuse_key, at_most=at_most) if fused else tuple(units)
    return ShardPlan(
        groups=groups,
        group_of={u: g.name for g in groups for u in g.name.split(FUSED)} if fused else {},
        bucket_bytes=min_bucket_bytes or None,
        # fusion keyed per unit (compat's per-module settings and state) is not one regroup can redo
        auto_fusion=auto and fuse_key is None,
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
