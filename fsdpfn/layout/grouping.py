"""Units and their groups: what each unit owns, its collective buckets, and how runs of units fuse.

A unit's parameters travel in one collective per dtype (``UnitPlan``); fusing a run of consecutive units
(``fuse_units`` by bytes, ``fuse_runs`` by given sizes) makes one larger unit of them, named by its
units joined with ``FUSED``. Pure arithmetic over shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fsdpfn.layout.bucket import BucketLayout
from fsdpfn.layout.spec import ShardSpec

__all__ = ["FUSED", "ParamInfo", "UnitPlan", "bucket_by_dtype", "fuse_runs", "fuse_units", "is_byte_count", "is_partition"]

FUSED = "+"  # joins the unit names of a fused group


@dataclass(frozen=True)
class ParamInfo:
    """What the plan needs to know of one (untied) parameter: ``shape`` is what the all-gather
    rebuilds, split along ``dim``."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    unit: str
    dim: int = 0


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

    def gathered_bytes(self, world: int) -> int:
        """Bytes its all-gather produces over ``world`` ranks: the padded shards, in the gather dtype, times
        ``world`` (what ``min_bucket_bytes`` counts)."""
        return sum(lay.nbytes for lay in self.gather) * world


def bucket_by_dtype(
    members: Sequence[ParamInfo],
    specs: Mapping[str, ShardSpec],
    dtype_of: Callable[[torch.dtype], torch.dtype],
) -> tuple[BucketLayout, ...]:
    groups: dict[torch.dtype, list[str]] = {}
    for info in members:
        groups.setdefault(dtype_of(info.dtype), []).append(info.fqn)
    return tuple(BucketLayout.build(f, [specs[n] for n in f], dtype) for dtype, f in groups.items())


def fuse_units(
    units: Sequence[UnitPlan],
    specs: Mapping[str, ShardSpec],
    world: int,
    min_bucket_bytes: int,
    *,
    key: Callable[[str], Any] | None = None,
    at_most: int | None = None,
) -> tuple[UnitPlan, ...]:
    """Fuse runs of consecutive non-root units into groups of at least ``min_bucket_bytes`` gathered
    bytes: each group's members travel in one collective per dtype (fewer, larger collectives for many
    small units). The root unit stays alone. A group is named by its units joined with ``+``. Units
    whose ``key(name)`` differ never share a group (a unit of another key closes the current one).
    With ``at_most``, a unit that would take a run past that many bytes starts a new run instead
    (``min_bucket_bytes="auto"``: groups never exceed the memory cap).

    Example:
        >>> from fsdpfn.layout.plan import build_plan
        >>> infos = [ParamInfo(f"b{i}.w", (4,), torch.float32, True, f"b{i}") for i in range(3)]
        >>> plan = build_plan(infos, [], ["b0", "b1", "b2"], rank=0, world=1, min_bucket_bytes=32)
        >>> [g.name for g in plan.groups]
        ['b0+b1', 'b2']
    """
    if not is_byte_count(min_bucket_bytes):
        raise ValueError(f"min_bucket_bytes must be an int >= 0 (bytes), got {min_bucket_bytes!r}")
    for u in units:
        if FUSED in u.name:
            raise ValueError(f"unit {u.name!r}: a unit name containing {FUSED!r} cannot be fused; rename it or pass min_bucket_bytes=None")
    out: list[UnitPlan] = []
    run: list[UnitPlan] = []
    size = 0
    for u in units:
        if not u.name:
            out.append(u)
            continue
        nbytes = u.gathered_bytes(world)
        if run and ((key is not None and key(u.name) != key(run[0].name)) or (at_most is not None and size + nbytes > at_most)):
            out.append(_merge(run, specs))
            run, size = [], 0
        run.append(u)
        size += nbytes
        if size >= min_bucket_bytes:
            out.append(_merge(run, specs))
            run, size = [], 0
    if run:
        out.append(_merge(run, specs))
    return tuple(out)


def is_partition(sizes: object, total: int) -> bool:
    """Whether ``sizes`` splits ``total`` consecutive items into runs: a list or tuple of ints >= 1 (no
    bools) adding up to ``total``. Group sizes and forward spans are such partitions.

    Example:
        >>> is_partition([2, 1], 3), is_partition((3, 0), 3), is_partition([True, 2], 3)
        (True, False, False)
    """
    return (
        isinstance(sizes, (list, tuple))
        and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in sizes)
        and sum(sizes) == total
    )


def fuse_runs(units: Sequence[UnitPlan], specs: Mapping[str, ShardSpec], sizes: Sequence[int]) -> tuple[UnitPlan, ...]:
    """Fuse the non-root units, in order, into consecutive runs of ``sizes[0]``, ``sizes[1]``, ... units
    (``sum(sizes)`` must be their count; a size of 1 leaves a unit alone). The root unit stays alone.
    Unlike ``fuse_units`` the groups may differ in size: the planner makes them largest where a step has
    memory to spare (``fsdpfn.memory.group_sizes_within``).

    Example:
        >>> from fsdpfn.layout.plan import build_plan
        >>> infos = [ParamInfo(f"b{i}.w", (4,), torch.float32, True, f"b{i}") for i in range(4)]
        >>> plan = build_plan(infos, [], ["b0", "b1", "b2", "b3"], rank=0, world=1)
        >>> [g.name for g in fuse_runs(plan.units, plan.specs, [1, 1, 2])]
        ['b0', 'b1', 'b2+b3']
    """
    named = [u for u in units if u.name]
    sizes = list(sizes)
    if not is_partition(sizes, len(named)):
        raise ValueError(
            f"sizes must be ints >= 1 adding up to the {len(named)} non-root units (in order), got {sizes!r}"
        )
    for u in named:
        if FUSED in u.name and max(sizes) > 1:
            raise ValueError(f"unit {u.name!r}: a unit name containing {FUSED!r} cannot be fused; rename it")
    out: list[UnitPlan] = []
    k = left = 0  # the run being filled and how many of its units are still to come
    for u in units:  # the root stays where it is; each run goes where its first unit was
        if not u.name:
            out.append(u)
            continue
        if left == 0:
            start = sum(sizes[:k])
            out.append(_merge(named[start : start + sizes[k]], specs))
            left, k = sizes[k], k + 1
        left -= 1
    return tuple(out)


def is_byte_count(value: Any) -> bool:
    """Whether ``value`` is a valid ``min_bucket_bytes``: an int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _merge(run: Sequence[UnitPlan], specs: Mapping[str, ShardSpec]) -> UnitPlan:
    if len(run) == 1:
        return run[0]

    def buckets(kind: str) -> tuple[BucketLayout, ...]:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for u in run:
            for lay in getattr(u, kind):
                by_dtype.setdefault(lay.dtype, []).extend(lay.fqns)
        return tuple(BucketLayout.build(f, [specs[n] for n in f], d) for d, f in by_dtype.items())

    name = FUSED.join(u.name for u in run)
    return UnitPlan(name, tuple(f for u in run for f in u.fqns), buckets("gather"), buckets("reduce"))
