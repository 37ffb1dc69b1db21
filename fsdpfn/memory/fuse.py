"""``fuse_within`` and ``group_sizes_within``: the unit fusions a step can afford, chosen by the planner.

Every collective costs a step more than its bytes: on CPU meshes each one is a synchronisation of the
ranks and a round of thread wake-ups on cores that also compute (bench ln_mlp, world 2: two 3.5 MiB blocks
per collective took the step from 181 to 154 ms, CPU time from 150 to 128 ms). Fusing costs memory: a
group is gathered and its gradients made as a whole. ``min_bucket_bytes="auto"`` in ``shard`` cannot
see the batch or the optimizer, so it fuses only up to 1/8 of the shard bytes; with them the planner can
price each fusion. ``fuse_within`` walks even groups of 2, 3, ... units and keeps the largest whose
estimated peak stays within the budget; ``group_sizes_within`` (what ``fsdp``'s first call uses) also
grows uneven groups from the last unit back. The default budget is the peak torch's ``fully_shard``
with ``torch.optim.AdamW`` as constructed by default needs for the same step: the largest of fsdpfn's
unfused peak, the optimizer step with torch's temporaries (on CPU its default is the for-loop kernel,
``sqrt(v)`` and the quotient of one parameter at a time; elsewhere the foreach kernels, ``sqrt(v)`` of
every trainable shard at once, which ``fsdpfn.optim.adamw``'s fused CPU kernel never allocates; SGD has
none) and FSDP2's backward as the planner models it (``fsdpfn.memory.phases.fsdp2_backward``: FSDP2
copies each group's gradients into a reduce-scatter input and keeps the last one until the next group's
post-backward, which fsdpfn's direct exchanges do not), those two less a small margin
(``budget_margin``) for what the models do not count; where fsdpfn's unfused peak is the largest, each
unit's backward moment is held to its unfused one or torch's modelled peak (``Room.by_unit``). Groups stop
at half the units, so one group's gather still overlaps another's compute.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from fsdpfn.core.comm import EXCHANGE_MIN_BYTES
from fsdpfn.core.exchange import direct_route
from fsdpfn.layout import ShardPlan, build_plan
from fsdpfn.layout.plan import FUSED
from fsdpfn.memory.estimate import _infos, step_estimator
from fsdpfn.memory.keep import check_world_and_budget
from fsdpfn.memory.room import Room, budget_margin, plan_room
from fsdpfn.ops.units import Units, resolve_units
from fsdpfn.policy import MixedPrecisionPolicy, as_mp_policy

__all__ = ["FusionChoice", "GroupSizes", "budget_margin", "first_call_fuses", "fuse_within", "group_sizes_within"]


def first_call_fuses(world: int, replicas: int, units: int) -> bool:
    """Whether ``fsdp``'s first call on an ``"auto"`` plan asks ``fuse_within`` for its groups: more than
    one shard rank, no replicas (HSDP) and at least four units that own parameters; otherwise ``shard``'s
    groups stay. The runtime (transform/fusion.py) and ``estimate("auto")`` both follow this rule."""
    return world > 1 and replicas == 1 and units >= 4


@dataclass(frozen=True)
class FusionChoice:
    """What ``fuse_within`` chose: ``min_bucket_bytes`` to give ``shard`` (``None``: do not fuse),
    ``units_per_group`` (the most units that threshold puts in one group; 1 when unfused), the planner's
    ``peak`` with it and the ``budget`` (bytes).

    Example:
        >>> FusionChoice(min_bucket_bytes=None, units_per_group=1, peak=0, budget=0).min_bucket_bytes is None
        True
    """

    min_bucket_bytes: int | None
    units_per_group: int
    peak: int
    budget: int


def fuse_within(
    model: nn.Module,
    world: int,
    batch: Any,
    *,
    units: Units = None,
    budget: int | None = None,
    torch_foreach: bool | None = None,
    **options: Any,
) -> FusionChoice:
    """The largest fusion of consecutive units whose step ``fsdpfn.memory.estimate`` keeps at or under
    ``budget`` bytes per rank (default: the peak torch's ``fully_shard`` reaches on the same step, see the
    module's docstring). ``model``, ``world``, ``batch``, ``units`` and ``options`` (``optimizer``,
    ``mp_policy``, ``prefetch``, ``loss_fn``, ``device``, ...) are ``estimate``'s; pass ``optimizer`` as the
    step really uses (``"adamw"`` by default). ``torch_foreach`` says how the default budget's torch AdamW is
    built: ``None`` as torch does by default on the device (the for-loop kernel on CPU, foreach elsewhere),
    ``True`` foreach (``sqrt(v)`` of every trainable shard at once), ``False`` the for-loop. Give the
    result's ``min_bucket_bytes`` to ``shard``:

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        >>> units = [str(i) for i in range(8)]
        >>> fuse_within(model, 2, torch.zeros(16, 256), units=units).units_per_group   # CPU: nothing is free
        1
        >>> choice = fuse_within(model, 2, torch.zeros(16, 256), units=units, budget=8 << 20)   # 8 MiB to spend
        >>> choice.units_per_group, choice.peak <= choice.budget
        (4, True)
    """
    if "min_bucket_bytes" in options:
        raise TypeError("fsdpfn.memory.fuse_within: min_bucket_bytes is what it chooses; do not pass it")
    check_world_and_budget("fsdpfn.memory.fuse_within", world, budget)
    names, planned, base, room, sizes, _, _ = _search_inputs(model, world, batch, units, budget, torch_foreach, options)
    if world == 1 or len(sizes) < 4:
        return FusionChoice(None, 1, base.peak, room.total)  # nothing to gather at world 1; fewer than four units leave no two groups of two
    threshold, k, got = _largest_even(planned, world, min(sizes), len(names) // 2, room)
    if got is None:
        return FusionChoice(None, 1, base.peak, room.total)
    made = _run_sizes(got.groups)  # what the threshold really makes of unequal units
    if all(m == 1 for m in made):
        return FusionChoice(None, 1, base.peak, room.total)
    return FusionChoice(threshold, max(made), got.peak, room.total)


@dataclass(frozen=True)
class GroupSizes:
    """What ``group_sizes_within`` chose: ``sizes``, the number of consecutive units (with parameters, in
    order) in each collective group (all ones: unfused), the planner's ``peak`` with them and the
    ``budget`` (bytes); ``forward_spans``, runs of groups forward gathers in one collective each,
    ``kept_gathered``, the units of the last groups left gathered from their forward to their backward, and
    ``units_run``, the units whose forward ran in the planner's forward, in the order they started (ranks
    that plan alike must have run the same ones: ``fsdp``'s first call agrees on it too).

    Example:
        >>> GroupSizes(sizes=(1, 1, 2), peak=0, budget=0).groups
        3
    """

    sizes: tuple[int, ...]
    peak: int
    budget: int
    forward_spans: tuple[int, ...] = ()  # runs of groups forward gathers in one collective (empty: none)
    kept_gathered: tuple[str, ...] = ()  # (keep_gathered: the first call's default)
    units_run: tuple[str, ...] = ()

    @property
    def groups(self) -> int:
        """How many collective groups the units travel in."""
        return len(self.sizes)


def group_sizes_within(
    model: nn.Module,
    world: int,
    batch: Any,
    *,
    units: Units = None,
    budget: int | None = None,
    torch_foreach: bool | None = None,
    fuse_key: Callable[[str], Hashable] | None = None,
    max_group_bytes: int | None = None,
    keep_gathered: bool | None = None,
    everywhere: Callable[[bool], bool] | None = None,
    **options: Any,
) -> GroupSizes:
    """Fuse consecutive units into groups of possibly different sizes whose step ``fsdpfn.memory.estimate``
    keeps at or under ``budget`` (default and arguments as ``fuse_within``): the groups ``fsdp``'s first
    call makes on a ``min_bucket_bytes="auto"`` plan.

    A step does not have the same room everywhere: the last units' backward comes first, before most
    gradients exist, so they can travel in larger groups than the first units, whose backward ends the
    step with every gradient alive. The search grows groups from the last unit back (one estimate per
    unit, the forward counted once), each as large as the budget allows and at most half the units, and
    keeps ``fuse_within``'s even groups when those are fewer. ``fuse_key`` (a function of unit names):
    units whose keys differ never share a group (the compat layer's units with different ``FSDPModule``
    settings, such as a last block kept gathered after forward); the groups then grow within each run
    of equal keys, and no even grouping is tried. ``max_group_bytes``: no group, and no forward span,
    gathers more than that many bytes (a unit larger than it travels alone): where collectives overlap
    compute (GPUs), a group past the link's latency-bound size only delays the compute that waits for it;
    ``fsdp``'s first call passes the mesh's measured target there (``LinkCost.target_bytes()``).
    ``keep_gathered`` (default: when ``reshard_after_forward`` is ``True``, its default, as ``fsdp``'s
    first call does): the last groups stay gathered from their forward to their backward, as many as keep
    the estimate at the chosen groups' peak (``GroupSizes.kept_gathered``, their units), each then
    gathered once a step, not twice. Their backward comes first, right after the forward, while the
    step's peak is usually elsewhere (the optimizer step, the first groups' backward); a kept group is in
    no forward span, and without a ``loss_fn`` the loss's backward is priced as a cross-entropy's
    (``UNSEEN_LOSS_OUTPUTS``), since kept groups sit on it.

    ``everywhere``: for ranks that plan together, each on a batch of its own (``fsdp``'s first call where
    the ranks' batches differ in size): every fit the search decides goes through it (``everywhere(fits)``
    returns whether the step fits on every rank, a collective), so every rank makes the same choice and
    it fits each rank's batch within that rank's budget. The same groups do not fit every batch: fewer rows
    leave less room under torch's lower peak (a forward span of five units planned for 43 rows alone
    measured 1.003x torch's peak on a rank with 8). Its first call says whether this rank could price its
    batch at all; where some rank could not, this raises ``RuntimeError`` on every rank.

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        >>> choice = group_sizes_within(model, 2, torch.zeros(16, 256), units=[str(i) for i in range(8)], budget=8 << 20)
        >>> sum(choice.sizes), choice.groups < 8, choice.peak <= choice.budget
        (8, True, True)
    """
    if "min_bucket_bytes" in options:
        raise TypeError("fsdpfn.memory.group_sizes_within: the group sizes are what it chooses; do not pass min_bucket_bytes")
    check_world_and_budget("fsdpfn.memory.group_sizes_within", world, budget)
    if fuse_key is not None and not callable(fuse_key):
        raise TypeError(f"fsdpfn.memory.group_sizes_within: fuse_key must be a function of unit names or None, got {fuse_key!r}")
    if max_group_bytes is not None and (not isinstance(max_group_bytes, int) or isinstance(max_group_bytes, bool) or max_group_bytes < 1):
        raise ValueError(f"fsdpfn.memory.group_sizes_within: max_group_bytes must be an int >= 1 or None, got {max_group_bytes!r}")
    fit = everywhere if everywhere is not None else bool
    try:
        names, planned, base, room, sizes, unit_bytes, unit_plan = _search_inputs(model, world, batch, units, budget, torch_foreach, options)
    except Exception:
        fit(False)  # (the other ranks learn it before any decision)
        raise
    if not fit(True):
        raise RuntimeError("fsdpfn.memory.group_sizes_within: another rank could not price its batch; plan where every rank can")
    n = len(planned.named)  # the units that own parameters: what the plan's groups are made of
    fits = _fits_within(unit_bytes, planned.named, max_group_bytes)
    keys = [None] * n if fuse_key is None else [fuse_key(u) for u in planned.named]
    for unit, key in zip(planned.named, keys):
        if not isinstance(key, Hashable):
            raise TypeError(f"fsdpfn.memory.group_sizes_within: fuse_key returned {key!r} for unit {unit!r}; it must return a hashable value")
    unfused = GroupSizes((1,) * n, base.peak, room.total, units_run=planned.units_run)
    if world == 1 or len(sizes) < 4 or n < 4:
        return unfused
    even = unfused
    if len(set(keys)) == 1:  # even groups first (fuse_within's search, on the same estimator)
        most = n // 2 if max_group_bytes is None else min(n // 2, max_group_bytes // max(sizes))
        _, _, got = _largest_even(planned, world, min(sizes), most, room, fit)
        even = GroupSizes(_run_sizes(got.groups), got.peak, room.total, units_run=planned.units_run) if got is not None else unfused
    # groups grown from the last unit back, each while the estimate stays within the budget
    done: list[int] = []  # sizes of the groups closed so far, last group first
    current, peak = 1, base.peak
    for i in range(n - 2, -1, -1):  # unit i joins the current group (units i+1 ..) or starts the next
        if current < n // 2 and keys[i] == keys[i + 1] and fits(i, i + current + 1):
            trial = (1,) * i + (current + 1,) + tuple(reversed(done))
            got = planned(world, trial)
            if fit(room.admits(got)):
                current, peak = current + 1, got.peak
                continue
        done.append(current)
        current = 1
    done.append(current)
    grown = GroupSizes(tuple(reversed(done)), peak, room.total, units_run=planned.units_run)
    chosen = grown if grown.groups < even.groups else even
    if keep_gathered if keep_gathered is not None else options.get("reshard_after_forward", True) is True:
        chosen = _with_kept(planned, world, chosen, room, fit)
    if len(set(keys)) == 1:  # (units with other settings, e.g. kept gathered, are never in a span)
        alone = _gathers_alone(unit_plan, world, chosen.sizes, planned.device.type)
        kept = len(_group_units(planned.named, chosen.sizes, chosen.kept_gathered))
        alone[len(alone) - kept :] = [True] * kept  # (a span is gathered and dropped as one)
        chosen = _with_forward_spans(planned, world, chosen, room, fits, alone, fit)
    return chosen


def _with_kept(planned: Any, world: int, chosen: GroupSizes, room: Room, fit: Callable[[bool], bool]) -> GroupSizes:
    """``chosen`` with its last 1, 2, ... groups left gathered after forward, as many as keep the
    estimate at ``chosen.peak`` (no memory beyond what its groups need) and its forward in ``room``
    (``fit``: on every rank)."""
    named, sizes = planned.named, chosen.sizes
    kept: tuple[str, ...] = ()
    for k in range(1, len(sizes) + 1):
        more = tuple(named[sum(sizes[: len(sizes) - k]) :])
        if not fit(room.admits(planned(world, sizes, (), frozenset(more)), chosen.peak)):
            break
        kept = more
    return replace(chosen, kept_gathered=kept)


def _group_units(named: Sequence[str], sizes: Sequence[int], kept: Sequence[str]) -> list[tuple[str, ...]]:
    """The groups of ``sizes`` (units ``named``, in order) whose units are all in ``kept``."""
    groups, at = [], 0
    for size in sizes:
        groups.append(tuple(named[at : at + size]))
        at += size
    return [g for g in groups if set(g) <= set(kept)]


def _fits_within(unit_bytes: dict[str, int], named: Sequence[str], most: int | None) -> Callable[[int, int], bool]:
    """``fits(a, b)``: whether units ``named[a:b]`` gather at most ``most`` bytes together (``unit_bytes``
    each; always, without ``most``; a single unit always fits)."""
    if most is None:
        return lambda a, b: True
    starts = [0]
    for name in named:
        starts.append(starts[-1] + unit_bytes.get(name, 0))
    return lambda a, b: b - a <= 1 or starts[b] - starts[a] <= most


def _gathers_alone(plan: ShardPlan, world: int, sizes: tuple[int, ...], device_type: str) -> list[bool]:
    """For each group of ``sizes`` (``plan``'s units regrouped so, in place): whether the runtime gathers
    it alone, never in a forward span (``fsdpfn.ops.shares_gather``): several bucket dtypes, nothing to
    gather, or a direct exchange between the tensors (CPU, from ``EXCHANGE_MIN_BYTES`` gathered: large
    groups, which gain nothing from sharing)."""
    if sum(sizes) != sum(1 for u in plan.units if u.name):
        return [False] * len(sizes)  # (the estimator's units are the plan's: not reached)
    plan.regroup(sizes=sizes)
    return [
        len(g.gather) != 1
        or direct_route(g.gather[0], world, gather=True, device_type=device_type, min_bytes=EXCHANGE_MIN_BYTES)
        for g in plan.groups if g.name
    ]  # fmt: skip


def _with_forward_spans(
    planned: Any, world: int, chosen: GroupSizes, room: Room, fits: Callable[[int, int], bool], alone: Sequence[bool],
    fit: Callable[[bool], bool],
) -> GroupSizes:
    """``chosen`` with runs of its groups that forward gathers in one collective each, grown from the first
    group on, each as long as the estimate stays within the budget (forward has room that backward does
    not: its activations are still being made; ``fit``: on every rank) and its units ``fits``; a group the
    runtime gathers ``alone`` is in no span. Backward still gathers and reduces group by group."""
    n = chosen.groups
    if n < 2:
        return chosen
    kept = frozenset(chosen.kept_gathered)
    first = [0]  # the first unit of each group, and the end
    for size in chosen.sizes:
        first.append(first[-1] + size)
    done: list[int] = []
    current = 1
    for k in range(1, n):  # group k joins the current span or starts the next
        trial = (*done, current + 1, *(1,) * (n - k - 1))
        shared = not alone[k] and (current > 1 or not alone[k - 1])  # (a span's groups joined it only so)
        if shared and fits(first[k - current], first[k + 1]) and fit(room.admits(planned(world, chosen.sizes, trial, kept))):
            current += 1
            continue
        done.append(current)
        current = 1
    done.append(current)
    if all(s == 1 for s in done):
        return chosen
    spans = tuple(done)
    return replace(chosen, peak=planned(world, chosen.sizes, spans, kept).peak, forward_spans=spans)


def _search_inputs(
    model: nn.Module, world: int, batch: Any, units: Units, budget: int | None, torch_foreach: bool | None, options: dict[str, Any]
) -> tuple[list[str], Any, Any, Room, list[int], dict[str, int], ShardPlan]:
    """What both searches start from: the unit names, the step's estimator (forward counted once), its
    unfused estimate, the room a plan has (the budget given, or torch's peak: ``plan_room``), the sizes of the units that gather anything,
    every unit's gathered bytes by name (as ``min_bucket_bytes`` counts them) and the unfused plan ``shard``
    would build, which they come from."""
    names = resolve_units(model, units)
    planned = step_estimator(model, batch, units=units, **options)
    base = planned(world, None)
    room = plan_room(model, world, planned, budget, torch_foreach, options)
    plan = _unit_plan(model, world, names, options)
    unit_bytes = dict(zip(names, [u.gathered_bytes(world) for u in plan.units if u.name]))
    return names, planned, base, room, [s for s in unit_bytes.values() if s > 0], unit_bytes, plan


def _largest_even(
    planned: Any, world: int, smallest: int, most: int, room: Room, fit: Callable[[bool], bool] = bool
) -> tuple[int | None, int, Any]:
    """Even groups of 2, 3, ... ``most`` units: ``(threshold, k, estimate)`` of the largest whose estimate
    stays within ``room`` (``fit``: on every rank; ``(None, 1, None)`` when not even pairs do). A run of equal units closes at
    ``k`` of them under ``min_bucket_bytes=(k - 1) * smallest + 1``."""
    best: tuple[int | None, int, Any] = (None, 1, None)
    for k in range(2, most + 1):
        threshold = (k - 1) * smallest + 1
        got = planned(world, threshold)
        if not fit(room.admits(got)):
            break
        best = (threshold, k, got)
    return best


def _run_sizes(labels: tuple[str, ...]) -> tuple[int, ...]:
    """The number of units in each non-root group, from ``MemoryEstimate.groups`` labels."""
    return tuple(len(label.split(FUSED)) for label in labels if label != "<root>")


def _unit_plan(model: nn.Module, world: int, names: list[str], options: dict[str, Any]) -> ShardPlan:
    """The plan ``shard`` would build, one group per unit (rank 0's)."""
    policy = as_mp_policy(options.get("mp_policy"), "fsdpfn.memory") or MixedPrecisionPolicy()
    infos, _ = _infos(model, [""] + names)
    return build_plan(infos, [], [""] + names, rank=0, world=world, gather_dtype=policy.gather_dtype)
