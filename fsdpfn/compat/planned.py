"""The collective groups a compat root's first forward plans, and keeping them across rebuilds.

A compat root plans uneven groups at its first forward, as ``fsdp``'s first call does
(``fsdpfn.transform.fusion``, ``fsdpfn.memory.group_sizes_within``), when the planner's estimate models
every unit below it: the root's mixed precision, no explicit prefetch lists and no custom collectives.
Units whose other settings differ (``UnitState.fuse_key``: a last block kept gathered after forward,
units of several modules) are planned in runs of equal keys. The estimate knows units by one module's
name: a unit of several modules counts as its first module, and the others' parameters as the root's,
gathered for the whole step (more than they hold, never less).

A knob changed later rebuilds the root's plan. Gradient accumulation toggles
``set_requires_gradient_sync`` on every unit, every few steps: the rebuild then keeps the planned groups
(``UnitState.plan_key``, the knobs they were priced with, is unchanged), and its forward spans when every
unit's settings still agree (not the last groups it kept gathered through training forwards: those go);
any other change leaves ``min_bucket_bytes="auto"``'s groups. The groups kept
are the latest planned (a larger training batch plans again: ``fsdpfn.transform.fusion.note_batch``), and
the rebuilt plan goes on planning again as the first one would have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdpfn.compat.state import UnitState
from fsdpfn.layout import ShardPlan
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO, FUSION_PLANNED_MEMO, PLANNED_BATCH_MEMO

__all__ = ["PlannedGroups", "plans_groups"]


def plans_groups(root: UnitState, states: Mapping[str, UnitState]) -> bool:
    """Whether a plan of ``states`` (unit name -> state, ``""`` the root's) under ``root`` is one the
    first forward plans: ``"auto"`` on the root and every other unit as the planner's estimate models it.

    Example:
        >>> plans_groups(root_state, {"": root_state, "blocks.0": block_state})   # doctest: +SKIP
        True
    """
    if root.min_bucket_bytes != "auto":
        return False
    return all(
        st.mp_policy == root.mp_policy and st.forward_prefetch is None and st.backward_prefetch is None and st.custom is None
        for name, st in states.items() if name
    )


class PlannedGroups:
    """The grouping a root's first forward planned: noted before the plan is rebuilt, applied again to
    the rebuilt plan where only gradient-sync switches changed.

    Example:
        >>> planned = PlannedGroups()
        >>> planned.note(old_plan)                       # before a rebuild   # doctest: +SKIP
        >>> planned.reapply(new_plan, root, states, keys)  # after it           # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # each unit's plan_key when the first plan was made
        self.groups: tuple[list[str], tuple[int, ...]] | None = None  # (unit names, group sizes)
        self.spans: tuple[int, ...] = ()  # the forward spans planned over those groups
        self.batch: Any = None  # what they were planned for (PLANNED_BATCH_MEMO)

    def start(self, root: UnitState, states: Mapping[str, UnitState]) -> None:
        """The first plan is about to be planned: remember the knobs it is priced with."""
        self.keys = {n: st.plan_key(st is root) for n, st in states.items()}

    def note(self, plan: ShardPlan | None) -> None:
        """Before a rebuild: remember ``plan``'s groups if a forward planned them."""
        if plan is not None and plan.auto_fusion and plan.memo.get(FUSION_PLANNED_MEMO):
            names = [u.name for u in plan.units if u.name]
            self.groups = (names, tuple(len(plan.members(g.name)) for g in plan.groups if g.name))
            self.spans = tuple(plan.memo.get(FORWARD_SPANS_MEMO, ()))
            self.batch = plan.memo.get(PLANNED_BATCH_MEMO)

    def reapply(self, plan: ShardPlan, root: UnitState, states: Mapping[str, UnitState], keys: Mapping[str, Any]) -> bool:
        """Regroup the rebuilt ``plan`` as planned when its units are the same, every unit's ``plan_key``
        is unchanged and each group's units share a ``fuse_key`` in ``keys``; returns whether it did."""
        if self.groups is None or not plans_groups(root, states):
            return False
        names, sizes = self.groups
        if [u.name for u in plan.units if u.name] != names:
            return False
        if any(st.plan_key(st is root) != self.keys.get(n) for n, st in states.items()):
            return False
        start = 0
        for k in sizes:
            if len({keys[u] for u in names[start : start + k]}) != 1:
                return False
            start += k
        plan.regroup(sizes=sizes)
        if self.spans and len({keys[u] for u in names}) == 1:  # spans were planned with every unit alike
            plan.set_planned_schedule(self.spans)
        object.__setattr__(plan, "auto_fusion", True)  # planned already: a larger batch plans again
        plan.memo[FUSION_PLANNED_MEMO] = True
        if self.batch is not None:
            plan.memo[PLANNED_BATCH_MEMO] = self.batch
        return True
