"""The schedule of a step: what is gathered, kept, re-gathered and reduced, and when.

A ``Schedule`` is derived from a plan and the transform's settings (resharding, prefetch, explicit
prefetch lists) with no communication and no tensors, and both executors read it:

- the eager executor (module hooks, ``fsdpfn.transform.call``) gathers each group when its first unit
  runs and launches the ``forward_prefetch`` groups with it; a resharding group is dropped after its
  forward and re-gathered in backward (launching ``backward_prefetch`` with it);
- the traced executor (``fsdpfn.transform.traced``) emits the same gathers as traceable collectives,
  re-gathers resharding groups in backward by recomputation, and leaves the timing to the compiler.

``counts()`` is what one training step moves, so tests can check either executor against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fsdpfn.layout.bucket import BucketLayout
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO, ShardPlan, is_partition

__all__ = ["CollectiveCounts", "GroupStep", "Schedule", "build_schedule", "window"]


@dataclass(frozen=True)
class GroupStep:
    """One collective group's part of a step: its units, buckets and whether it reshards."""

    name: str
    units: tuple[str, ...]
    gather: tuple[BucketLayout, ...]
    reduce: tuple[BucketLayout, ...]
    reshard: bool
    forward_prefetch: tuple[str, ...]
    backward_prefetch: tuple[str, ...] | None  # None: the window before it in the forward order


@dataclass(frozen=True)
class CollectiveCounts:
    """Collectives of one forward + backward: all-gathers (forward, plus the re-gathers of resharding
    groups), reduce-scatters, and all-reduces over the replicate dimension (HSDP)."""

    all_gathers: int
    regathers: int
    reduce_scatters: int
    all_reduces: int

    @property
    def forward_gathers(self) -> int:
        """All-gathers of the forward alone."""
        return self.all_gathers - self.regathers


@dataclass(frozen=True)
class Schedule:
    """What one step does with each collective group, in forward order (see the module docstring).

    Example:
        >>> schedule = build_schedule(params.plan, reshard=True, prefetch=1)   # doctest: +SKIP
        >>> schedule.forward_prefetch("blocks.0"), schedule.reshards("blocks.0")  # doctest: +SKIP
        (('blocks.1',), True)
    """

    order: tuple[str, ...]
    steps: Mapping[str, GroupStep]
    prefetch: int
    world: int = 1  # shard ranks
    replicas: int = 1  # replicate ranks (HSDP)
    spans: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # first group -> its forward span

    def forward_span(self, name: str) -> tuple[str, ...]:
        """The groups gathered in one collective with group ``name`` in forward, ``name`` first, when it
        begins a forward span of several groups (each is still re-gathered and reduced on its own in
        backward); ``()`` otherwise."""
        return self.spans.get(name, ())

    def step(self, name: str) -> GroupStep:
        """Group ``name``'s step."""
        try:
            return self.steps[name]
        except KeyError:
            raise KeyError(f"no collective group {name!r} in this schedule; groups are {list(self.order)}") from None

    def reshards(self, name: str) -> bool:
        """Whether group ``name`` is dropped after its forward and re-gathered in backward."""
        got = self.steps.get(name)
        return got is not None and got.reshard

    @property
    def any_reshard(self) -> bool:
        """Whether any group reshards (the eager executor then packs saved tensors)."""
        return any(s.reshard for s in self.steps.values())

    def forward_prefetch(self, name: str) -> tuple[str, ...]:
        """Groups to launch when group ``name`` is gathered in forward."""
        got = self.steps.get(name)
        return got.forward_prefetch if got is not None else ()

    def backward_prefetch(self, name: str, order: Sequence[str] | None = None) -> tuple[str, ...]:
        """Groups to launch when group ``name`` is re-gathered in backward, nearest first: the explicit
        list if one was given, else the ``prefetch`` groups before it in ``order`` (the forward order
        this call actually ran, by default the schedule's)."""
        got = self.steps.get(name)
        if got is not None and got.backward_prefetch is not None:
            return got.backward_prefetch
        return window(self.order if order is None else order, name, self.prefetch, ahead=False)

    def counts(self) -> CollectiveCounts:
        """The collectives of one step when every group runs once: a resharding group is re-gathered
        once in backward (the eager executor skips that when backward saved nothing from the group).
        One shard rank moves nothing over the shard group; HSDP adds one all-reduce per reduce bucket."""
        shard = self.world > 1
        gathers = sum(len(s.gather) for s in self.steps.values()) if shard else 0
        regathers = sum(len(s.gather) for s in self.steps.values() if s.reshard) if shard else 0
        reduces = sum(len(s.reduce) for s in self.steps.values())
        return CollectiveCounts(
            gathers + regathers, regathers, reduces if shard else 0, reduces if self.replicas > 1 else 0
        )


def window(order: Sequence[str], name: str, size: int, *, ahead: bool) -> tuple[str, ...]:
    """Up to ``size`` names after (``ahead``) or before ``name`` in ``order``, nearest first.

    Example:
        >>> window(["a", "b", "c", "d"], "b", 2, ahead=True), window(["a", "b", "c"], "c", 2, ahead=False)
        (('c', 'd'), ('b', 'a'))
    """
    if size <= 0 or name not in order:
        return ()
    order = list(order)
    i = order.index(name)
    return tuple(order[i + 1 : i + 1 + size] if ahead else order[max(0, i - size) : i][::-1])


def build_schedule(
    plan: ShardPlan,
    *,
    order: Sequence[str] | None = None,
    reshard: bool | Callable[[str], bool] = True,
    prefetch: int = 1,
    forward_prefetch: Mapping[str, Sequence[str]] | None = None,
    backward_prefetch: Mapping[str, Sequence[str]] | None = None,
    forward_spans: Sequence[int] | None = None,
) -> Schedule:
    """The schedule of ``plan``'s collective groups.

    ``order`` is the forward order of the groups (the plan's order by default: the eager executor
    passes the order the previous call ran). ``reshard`` says which groups are dropped after forward:
    a bool for every group but the root (which stays gathered for the whole forward), or a predicate on
    the group name. Nothing reshards where gathering copies nothing (one shard rank, no cast).
    ``prefetch`` groups ahead are launched with each gather, unless ``forward_prefetch`` /
    ``backward_prefetch`` name the groups to launch explicitly (FSDP2's ``set_modules_to_*_prefetch``).
    ``forward_spans``: sizes of runs of consecutive named groups (plan order, summing to their number)
    that forward gathers in one collective each (``None``: what the first call's planner chose, once
    ``order`` is given, the order a call ran: spanned in the plan's order, a model that runs its units
    otherwise would hold a span's buffer longer than priced); a span is kept only where its groups run
    consecutively in ``order``, each reshards, and nothing is prefetched explicitly.

    Example:
        >>> s = build_schedule(plan, prefetch=2)   # doctest: +SKIP
        >>> s.counts().all_gathers                 # doctest: +SKIP
    """
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"build_schedule: prefetch must be an int >= 0, got {prefetch!r}")
    names = [g.name for g in plan.groups]
    ran_order = order is not None
    if order is None:
        order = names
    else:
        unknown = [n for n in order if n not in plan.group_of.values() and n not in names]
        if unknown:
            raise ValueError(f"build_schedule: order names groups {unknown} that the plan does not have ({names})")
        order = list(dict.fromkeys(order)) + [n for n in names if n not in order]
    moves = _moves(plan)
    explicit_fwd = forward_prefetch or {}
    explicit_bwd = backward_prefetch or {}
    steps = {}
    for g in plan.groups:
        wants = reshard(g.name) if callable(reshard) else reshard and bool(g.name)
        bwd = explicit_bwd.get(g.name)
        steps[g.name] = GroupStep(
            name=g.name,
            units=plan.members(g.name),
            gather=g.gather,
            reduce=g.reduce,
            reshard=bool(wants) and moves,
            forward_prefetch=tuple(explicit_fwd[g.name]) if g.name in explicit_fwd else window(order, g.name, prefetch, ahead=True),
            backward_prefetch=tuple(bwd) if bwd is not None else None,
        )
    if forward_spans is None:
        forward_spans = plan.memo.get(FORWARD_SPANS_MEMO) if ran_order else None
    spans = _spans(plan, order, steps, forward_spans)
    if explicit_fwd or explicit_bwd:
        spans = {}
    return Schedule(tuple(order), steps, prefetch, plan.world, plan.replicas, spans)


def _spans(plan: ShardPlan, order: Sequence[str], steps: Mapping[str, GroupStep], sizes: Sequence[int] | None) -> dict[str, tuple[str, ...]]:
    named = [g.name for g in plan.groups if g.name]
    if not sizes or plan.world == 1:
        return {}
    if not is_partition(tuple(sizes), len(named)):
        raise ValueError(f"build_schedule: forward_spans {tuple(sizes)} must be sizes >= 1 summing to the {len(named)} named groups")
    out: dict[str, tuple[str, ...]] = {}
    at = 0
    position = {n: i for i, n in enumerate(order)}
    for size in sizes:
        span = tuple(named[at : at + size])
        at += size
        if size < 2 or not all(steps[n].reshard for n in span):
            continue
        first = position[span[0]]
        if all(position.get(n) == first + i for i, n in enumerate(span)):  # consecutive in the order run
            out[span[0]] = span
    return out


def _moves(plan: ShardPlan) -> bool:
    """Whether gathering moves or casts anything (not: one shard rank and every bucket in the
    parameters' own dtypes, where the gathered parameters are the shards themselves)."""
    return plan.world > 1 or any(lay.dtype != plan.dtypes[f] for g in plan.groups for lay in g.gather for f in lay.fqns)
