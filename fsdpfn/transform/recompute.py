"""A unit's gathered values in its modules while the unit's backward runs (activation-checkpoint recompute).

A non-reentrant checkpoint region is re-run in backward, and the modules in it read their parameters
then. Where the region contains the unit's own module, the unit's pre-hook swaps the values in; where it
lies inside the unit (or inside the root), nothing of fsdpfn runs before it. So, as FSDP2 does, a unit's
values are put into every slot of its parameters when the unit's backward starts (a prehook on the
grad_fn of each of its forward outputs, and of the ``apply`` call's for the root), gathering them again
if the unit resharded, and taken out when the unit's gradient reduction starts (or, at the latest, when
the backward ends). A unit that is a torch.nn built-in owning its parameters directly (a Linear, an
Embedding) is skipped unless its values are at hand: nothing inside it can be recomputed without its
hooks, and its backward may need no values at all (an input layer's weight gradient). No module carries a hook for this, so compiled code sees the same modules in the
forward and in the recompute and runs the same graphs in both.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

import fsdpfn.trees as trees
from fsdpfn.ops.units import recompute_reads_values
from fsdpfn.transform.eager import eager
from fsdpfn.transform.reentrant import in_reentrant_recompute, is_reentrant_node, reentrant_error, took_gradients, untracked

if TYPE_CHECKING:
    from fsdpfn.transform.apply import Apply
    from fsdpfn.transform.call import Call

__all__ = ["BackwardSwaps"]


class BackwardSwaps:
    """The backward-time swaps of one ``Apply``: which call's values sit in which unit's slots."""

    def __init__(self, apply: Apply):
        self.apply = apply
        # (id(call), unit) -> (call, swaps, the values swapped in: alive in the module's slots until taken out)
        self.active: dict[tuple[int, str], tuple[Call, list[Any], dict[str, torch.Tensor]]] = {}
        self.current: dict[str, Call] = {}  # unit -> the call whose backward is running it
        self.reentrant: list[str] = []  # units a reentrant checkpoint recomputed in this backward
        self._queued = False

    def arm_on(self, call: Call, unit: str, out: Any) -> None:
        """Swap ``unit``'s values in (from ``call``) when a backward first reaches a tensor of ``out``."""
        for t in trees.leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                # an output made by a reentrant checkpoint around the unit's module (checkpoint_wrapper):
                # its node recomputes the module without the unit's hooks and differentiates that itself
                t.grad_fn.register_prehook(functools.partial(self._enter, call, unit, is_reentrant_node(t.grad_fn)))

    @eager
    def _enter(self, call: Call, unit: str, reentrant: bool, _grads: Any) -> None:
        key = (id(call), unit)
        if key in self.active or unit not in call.group_of:
            return
        group = call.group_of[unit]
        if not reentrant and not self._reachable(call.plan, unit) and group not in call.gathered and group not in call.regathered:
            return  # nothing but the unit's own hooks can read its values: gather again only if backward needs it
        values = self.values(call, group, unit, reentrant)
        self.active[key] = (call, self.apply._swap(call.plan, values, unit), values)
        self.current[unit] = call

    def values(self, call: Call, group: str, unit: str, reentrant: bool = False) -> dict[str, torch.Tensor]:
        """Group ``group``'s values (from ``call``) for a recompute of ``unit`` in this backward. A reentrant
        checkpoint's recompute (the unit's hooks run inside one, or its node is the unit's output) gets
        them gathered differentiably: its own backward then reduces them (``Call.gather_for_reentrant``).
        Any other unit its forward gathered without gradients, recomputed with them, is noted for the end
        of the backward to refuse (its gradients would be lost)."""
        if reentrant or in_reentrant_recompute():
            values = call.gather_for_reentrant(group)
        else:
            values = call.values_for_recompute(group)
            if torch.is_grad_enabled() and unit not in self.reentrant and untracked(values, call.plan.requires_grad):
                self.reentrant.append(unit)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        return values

    def _reachable(self, plan: Any, unit: str) -> bool:
        """Whether a recompute could read unit ``unit``'s parameters without passing its own hooks: not when
        every one of them sits directly on one of the unit's modules and those are torch.nn built-ins (a
        Linear or an Embedding checkpoints nothing inside its forward)."""
        key = ("recompute_reachable", id(self.apply), unit)
        got = plan.memo.get(key)
        if got is None:
            apply = self.apply
            modules = apply.unit_modules(unit) if unit else [apply.module]
            owners = [apply.module.get_submodule(name.rpartition(".")[0]) for fqn in plan.unit(unit).fqns for name in plan.names(fqn)]
            got = plan.memo[key] = recompute_reads_values(modules, owners)
        return got

    def leave(self, call: Call, group: str) -> dict[str, torch.Tensor]:
        """Take out the values of ``call``'s group ``group`` (its gradient reduction is starting). Returns
        the gradients a reentrant checkpoint inside a member left on those values (its own backward
        differentiated the recompute, which read them): the group's reduction adds them to its own."""
        extra: dict[str, torch.Tensor] = {}
        for unit in call.members(group):
            hit = self.active.pop((id(call), unit), None)
            if hit is not None:
                for fqn, v in hit[2].items():
                    if v.is_leaf and v.grad is not None:
                        extra[fqn] = v.grad if fqn not in extra else extra[fqn] + v.grad
                        v.grad = None
                self.apply._restore(hit[1])
                if self.current.get(unit) is call:
                    del self.current[unit]
        return extra

    def leave_all(self) -> None:
        """Take out every value still in (the end of a backward, or the start of a forward after a
        backward that raised)."""
        self._queued = False
        for _call, swapped, _values in reversed(list(self.active.values())):
            self.apply._restore(swapped)
        self.active.clear()
        self.current.clear()
        self.reentrant.clear()

    def _note_gradients(self, unit: str, values: dict[str, torch.Tensor]) -> None:
        """A recompute's values that hold gradients were reached by a reentrant checkpoint's inner backward
        (a non-reentrant recompute only feeds saved tensors to the original graph)."""
        if unit not in self.reentrant and took_gradients(values):
            self.reentrant.append(unit)

    def _end_of_backward(self) -> None:
        """``leave_all``, then refuse the backward if a reentrant checkpoint recomputed a unit: its
        parameters' gradients stayed on the recompute's values (every reduction has run by now)."""
        for (_, unit), (_call, _swapped, values) in self.active.items():
            self._note_gradients(unit, values)
        units = list(self.reentrant)
        self.leave_all()
        if units:
            raise reentrant_error("backward", units)
