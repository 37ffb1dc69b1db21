"""The traced executor: an ``apply`` call that ``torch.compile(fullgraph=True)`` captures whole.

It reads the same ``Schedule`` and the same cached bucket collectives as the eager executor (``call.py``)
but emits every step into the graph: each group is gathered by a traceable collective when its first
unit runs (``TracedCollective``, whose backward reduce-scatters), swapped into the module, and dropped
when the group's last unit finishes; a resharding group's gather is marked for recomputation, so the
compiler keeps only its shards for backward and gathers again there. No prefetch and no deferral: the
compiler orders the collectives. ``compile_step`` drives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fsdpfn.core.traced import Collectives
from fsdpfn.layout import Sharded
from fsdpfn.layout.schedule import Schedule
from fsdpfn.ops.api import check_shards, gather_collective
from fsdpfn.ops.traced import traced_gather, warm
from fsdpfn.transform.group_copies import group_done, without_autograd
from fsdpfn.transform.open_call import OpenCall
from fsdpfn.transform.casting import cast_inputs, cast_output

if TYPE_CHECKING:
    from fsdpfn.transform.apply import Apply

__all__ = ["TracedCall", "enter_unit", "exit_unit", "run_traced", "warm_plan"]


class TracedCall:
    """Per-call state of the traced executor (created and used only inside the compiled trace)."""

    traced = True
    remat = False

    def __init__(self, params: Sharded[torch.Tensor], *, scale: float, schedule: Schedule, via: Collectives = "native"):
        self.params = params
        self.via = via
        self.plan = params.plan
        self.scale = scale
        self.schedule = schedule
        self.gathered: dict[str, dict[str, torch.Tensor]] = {}
        self.with_grad: dict[str, bool] = {}  # per gathered group: whether autograd was on when it was gathered
        self.members_done: dict[str, set[str]] = {}

    def gather(self, group: str) -> dict[str, torch.Tensor]:
        """Gather group ``group`` into the graph (for recomputation in backward if it reshards)."""
        b = gather_collective(self.plan, (self.plan.group(group),), self.scale)
        shards = check_shards(self.params, b.fqns)
        full = dict(zip(b.fqns, traced_gather(b, shards, recompute=self.schedule.reshards(group), via=self.via)))
        self.gathered[group] = full
        self.with_grad[group] = torch.is_grad_enabled()
        return full

    def unit_done(self, group: str, unit: str) -> bool:
        """Note that ``unit`` of ``group`` finished its forward; true once all of the group's have."""
        return group_done(self.plan.members(group), self.members_done, group, unit)


def run_traced(apply: Apply, params: Sharded[torch.Tensor], fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``apply.run`` inside a whole-step trace: the root group gathered and swapped in for the call, the
    other groups by the unit hooks (``enter_unit``/``exit_unit``), all of it captured in the graph."""
    plan = params.plan
    if not apply.prepared(plan):
        raise RuntimeError(
            f"fsdpfn.compile_step: the traced step reached {apply!r}, which never ran on these parameters: every "
            "fsdp apply the loss uses must run in the step's first call (which runs eagerly and prepares them); "
            "make a new compile_step when the loss starts using another apply"
        )
    mode = params._mode
    call = TracedCall(params, scale=mode.scale if mode.scale is not None else apply.scale(plan), schedule=apply.schedule(plan), via=mode.collectives)
    opened = OpenCall(call, traced=True)
    apply._forward.append(opened)
    swapped = []
    if any(u.name == "" for u in plan.units):
        swapped += apply._swap(plan, call.gather(""), "")
    swapped += apply._swap_buffers(params)
    args, kwargs = cast_inputs(plan, args, kwargs, "")
    out = fn(*args, **kwargs)
    replaced = apply._replaced_buffers(params)
    apply._restore(swapped)
    apply._forward.pop()
    apply._keep_replaced_buffers(params, replaced, traced=True)
    cast = cast_output(plan, out, "")
    return out if cast is None else cast


def enter_unit(apply: Apply, call: TracedCall, name: str, args: Any, kwargs: Any) -> Any:
    """Unit ``name``'s pre-hook in a traced call: gather its group (once), swap its values in."""
    plan = call.plan
    if name not in plan.group_of:  # a unit of another plan
        apply._unit_swaps.setdefault(name, []).append([])
        return None
    group = plan.group_of[name]
    full = call.gathered.get(group)
    if full is None or without_autograd(call.with_grad[group], full, call.params):
        full = call.gather(group)
    apply._unit_swaps.setdefault(name, []).append(apply._swap(plan, full, name))
    return cast_inputs(plan, args, kwargs, name)


def exit_unit(apply: Apply, call: TracedCall, name: str, out: Any) -> Any:
    """Unit ``name``'s post-hook in a traced call: swap back; drop a resharding group after its last unit."""
    stack = apply._unit_swaps.get(name)
    if stack:
        apply._restore(stack.pop())
    plan = call.plan
    group = plan.group_of.get(name, name)
    if call.schedule.reshards(group) and group in call.gathered and apply.release_after_module(name):
        if call.unit_done(group, name):
            del call.gathered[group]
    return cast_output(plan, out, name) if plan.unit_policies else None


def warm_plan(apply: Apply, params: Sharded[torch.Tensor], scale: float) -> None:
    """Build, eagerly, what the traced executor only reads: the schedule and the bucket collectives of
    every group with their per-rank geometry. Dynamo traces reads of these caches, but filling one inside
    an ``autograd.Function`` would be a side effect it refuses. (The unit hooks and swap tables are made
    by the eager call that must come first.)"""
    plan = params.plan
    apply.schedule(plan)
    for g in plan.groups:
        warm(gather_collective(plan, (g,), scale))
