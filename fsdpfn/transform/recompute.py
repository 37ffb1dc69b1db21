"""Activation-checkpoint recomputes *inside* a unit: the unit's values, swapped in while backward re-runs it.

A non-reentrant checkpoint region inside a unit's forward (or inside the root's) is re-run in backward
without the unit's own pre-hook, so the modules in it would read their own, stale, parameters. While a
backward runs, module hooks put the unit's gathered values into every module that owns one of its
parameters for the length of that module's forward, and take them out again after it.

The hooks are global module hooks that exist only while a backward runs: armed by a prehook on the
outputs of every unit and of the ``apply`` call, disarmed by a callback at the end of that backward.
During forward no module carries a hook it did not have, so compiled code sees every block alike
and shares one graph between them (per-module hooks are guarded on by id, one compilation per block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as tree
from torch import nn

from fsdpfn.layout import ShardPlan
from fsdpfn.transform.eager import eager

if TYPE_CHECKING:
    from fsdpfn.transform.apply import Apply

__all__ = ["RecomputeSwaps"]

_Target = tuple[str, list[tuple[str, str]]]  # (unit, [(parameter name, owning fqn)])


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RecomputeSwaps:
    """The recompute swapping of one ``Apply``: which modules own which unit's parameters, and the
    global hooks that swap them while a backward runs."""

    def __init__(self, apply: Apply):
        self.apply = apply
        self.targets: dict[int, tuple[nn.Module, list[_Target]]] = {}
        self._units: set[str] = set()
        self._handles: tuple[Any, Any] | None = None
        self._swaps: dict[int, list[Any]] = {}
        self._arm_hook: Callable[..., None] = self._arm

    def add_unit(self, plan: ShardPlan, unit: str) -> None:
        """Register the submodules that own unit ``unit``'s parameters (the unit's own modules excluded:
        their unit hooks swap for themselves)."""
        if unit in self._units:
            return
        self._units.add(unit)
        apply = self.apply
        own = {id(m) for m in (apply.unit_modules(unit) if unit else [apply.module])}
        by_path: dict[str, list[tuple[str, str]]] = {}
        for owner in plan.unit(unit).fqns:
            for name in plan.names(owner):
                by_path.setdefault(name.rpartition(".")[0], []).append((name, owner))
        for path, names in by_path.items():
            mod = apply.module.get_submodule(path)
            if id(mod) not in own:
                self.targets.setdefault(id(mod), (mod, []))[1].append((unit, names))

    # --- arming ------------------------------------------------------------------------------------
    def arm_on(self, out: Any) -> None:
        """Install the hooks when a backward reaches any tensor of ``out`` (a forward's output)."""
        if not self.targets:
            return
        for t in tree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(self._arm_hook)

    def _arm(self, _grads: Any) -> None:
        if self._handles is None:
            self._handles = (
                nn.modules.module.register_module_forward_pre_hook(self._pre),
                nn.modules.module.register_module_forward_hook(self._post, always_call=True),
            )
            torch.autograd.Variable._execution_engine.queue_callback(self._disarm)

    def _disarm(self) -> None:
        if self._handles is not None:
            for h in self._handles:
                h.remove()
            self._handles = None

    # --- the hooks (eager, also under compile: a recompute of compiled code breaks around them) ------
    @eager
    def _pre(self, mod: nn.Module, _args: Any) -> None:
        hit = self.targets.get(id(mod))
        if hit is None or hit[0] is not mod:
            return
        apply = self.apply
        if apply._forward or apply._remat_depth or not _in_backward():
            return
        swapped: list[Any] = []
        for unit, names in hit[1]:
            call = apply._recompute_call(unit)
            if call is not None:
                swapped += apply._swap_names(names, call.values_for_recompute(call.plan.group_of[unit]))
        self._swaps.setdefault(id(mod), []).append(swapped)

    @eager
    def _post(self, mod: nn.Module, _args: Any, _out: Any) -> None:
        stack = self._swaps.get(id(mod))
        if stack and self.targets.get(id(mod), (None,))[0] is mod:
            self.apply._restore(stack.pop())
