"""How much memory the unit-fusion planner may spend: ``Room`` (a plan's step and its forward) and the
default budget, torch's ``fully_shard`` peak on the same step (``plan_room``, ``budget_margin``).

``fsdpfn.memory.fuse`` searches groups within it; see that module's docstring for what the default
budget counts and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fsdpfn.memory.estimate import OPTIMIZERS

__all__ = ["Room", "budget_margin", "plan_room"]


@dataclass(frozen=True)
class Room:
    """What a plan's estimate may reach: ``total``, its peak over the step, and ``forward``, its forward's.
    Example: ``Room(100, 80).admits(est)`` when ``est.peak <= 100`` and its forward phase ``<= 80``.
    The forward is priced group by group as it runs (what each moment holds), backward and FSDP2's model
    with some slack (each group's moments at their largest); so where the budget is fsdpfn's own unfused
    peak, met in its backward, a forward grown up to it would pass torch's real peak: the forward is held to
    the unfused forward's peak or torch's modelled one, whichever is more.

    ``by_unit`` (where the budget is fsdpfn's own unfused peak): the unfused plan's backward moments per
    unit (``MemoryEstimate.backward_by_unit``). Its estimate is compared like with like only at the same
    moment: where it overstates the moment of its peak (the last units' backward, every activation alive),
    a fused group whose moment comes elsewhere could grow into that slack and pass torch's real peak
    (an unseen token mixer: 1.014x). So each unit's moment may grow up to torch's modelled peak
    (``torch_peak``) or not at all where the unfused one is already above it."""

    total: int
    forward: int
    torch_peak: int = 0
    by_unit: Mapping[str, int] | None = field(default=None, hash=False, compare=False)

    def admits(self, got: Any, total: int | None = None) -> bool:
        """Whether estimate ``got`` stays within ``total`` (default: this room's) and ``forward``, and each
        unit's backward moment within ``by_unit``'s rule."""
        if got.peak > (self.total if total is None else total) or got.phases["forward"].total > self.forward:
            return False
        if self.by_unit is None:
            return True
        mine = got.backward_by_unit
        return all(mine.get(u, 0) <= max(self.torch_peak, most) for u, most in self.by_unit.items())


def plan_room(model: nn.Module, world: int, planned: Any, budget: int | None, torch_foreach: bool | None, options: dict[str, Any]) -> Room:
    """The budget given (the forward's too), or torch's peak for the same step (see the module's docstring):
    the largest of fsdpfn's unfused peak (``planned``'s estimate), torch's optimizer step with its AdamW
    temporaries (``torch_foreach``: as torch builds it, on ``model``'s trainable shards at ``world``) and
    FSDP2's backward as modelled, those two less ``budget_margin``.

    Example:
        >>> plan_room(model, 2, step_estimator(model, x, units=units), None, None, {"optimizer": "adamw"})  # doctest: +SKIP
    """
    if budget is not None:
        return Room(budget, budget)
    base = planned(world, None)
    step = base.phases["optimizer step"]
    optimizer = options.get("optimizer", "adamw")
    _, scratch = OPTIMIZERS["none" if optimizer is None else optimizer]  # estimate has checked the name
    if torch_foreach is None:  # torch's default: the for-loop kernel on CPU, foreach elsewhere
        torch_foreach = planned.device.type != "cpu"
    if not scratch:
        torch_scratch = 0
    elif not torch_foreach:  # the for-loop kernel: sqrt(v) and its quotient, one parameter at a time
        torch_scratch = 2 * max((-(-p.numel() // world) * p.element_size() for p in model.parameters() if p.requires_grad), default=0)
    else:  # foreach (FSDP2's DTensors included): sqrt(v) of every trainable shard at once
        torch_scratch = step.gradients
    # fsdpfn's own unfused peak needs no margin: a plan estimated under it is compared like with like
    torch_model = max(step.total - step.temporaries + torch_scratch, planned.fsdp2_backward(world))
    torch_peak = torch_model - budget_margin(torch_model)
    forward = max(base.phases["forward"].total, torch_peak)
    if base.peak <= torch_peak:
        return Room(torch_peak, forward)
    return Room(base.peak, forward, torch_peak, dict(base.backward_by_unit))


def budget_margin(torch_peak: int) -> int:
    """Bytes the default budget stays under torch's modelled peak (its optimizer step, its backward):
    64 KiB and 0.1% of it. The estimate counts what a step holds, but not every scalar, step counter and
    index tensor, and the model of FSDP2 is not exact either; a plan grown right up to the modelled peak
    passed torch's measured one by 1 KiB (MLP blocks of 64/128 with two frozen blocks fused, world 2).

    Example:
        >>> budget_margin(100 << 20)
        170393
    """
    return (64 << 10) + torch_peak // 1000
