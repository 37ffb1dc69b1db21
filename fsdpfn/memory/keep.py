"""``keep_gathered``: which units to leave gathered after their forward, chosen by the planner.

A unit that ``fsdp`` does not reshard after its forward is not gathered again in backward: one all-gather
and one synchronisation of the ranks fewer per unit and step, paid for with its full-size parameters
alive from its forward to its backward. The last units of the forward are the cheapest to keep (their
backward comes first, so they are held the shortest time, while activations are at their largest anyway,
and the step's peak is often elsewhere: the optimizer step, or the first units' backward). The planner
walks k = 1, 2, ... last units kept and stops before the estimated peak passes the budget, by default the
peak of resharding every unit: the speed comes without more memory than the default needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdpfn.memory.estimate import estimate
from fsdpfn.ops.units import Units, resolve_units

__all__ = ["ReshardRule", "keep_gathered"]


@dataclass(frozen=True)
class ReshardRule:
    """``fsdp``'s ``reshard_after_forward`` predicate keeping the units in ``kept`` gathered (every other
    unit reshards); ``peak`` is the planner's per-rank peak with it, ``budget`` the bound it was chosen
    under (bytes). Picklable and printable.

    Example:
        >>> rule = ReshardRule(kept=("blocks.3",), peak=0, budget=0)
        >>> rule("blocks.0"), rule("blocks.3")
        (True, False)
    """

    kept: tuple[str, ...]
    peak: int
    budget: int

    def __call__(self, unit: str) -> bool:
        return unit not in self.kept


def check_world_and_budget(what: str, world: Any, budget: Any) -> None:
    """The planner's choosers take one world size and a byte budget (or ``None``): raise naming ``what``."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{what}: world must be one int >= 1 (the ranks a parameter is sharded over), got {world!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"{what}: budget must be an int >= 0 (bytes per rank) or None, got {budget!r}")


def keep_gathered(
    model: nn.Module,
    world: int,
    batch: Any,
    *,
    units: Units = None,
    budget: int | None = None,
    **options: Any,
) -> ReshardRule:
    """The most last-in-forward units ``fsdp`` can keep gathered while ``fsdpfn.memory.estimate`` keeps
    the step's per-rank peak at or under ``budget`` bytes (default: the peak with every unit resharded,
    i.e. no more memory than ``reshard_after_forward=True``). ``model``, ``world``, ``batch``, ``units``
    and ``options`` (``mp_policy``, ``optimizer``, ``prefetch``, ``min_bucket_bytes``, ``loss_fn``, ...)
    are ``estimate``'s; pass the same ``units`` (and ``min_bucket_bytes``) as to ``shard``. Returns a
    ``ReshardRule`` to give ``fsdp(model, reshard_after_forward=rule)``; it keeps nothing when even one
    unit would pass the budget (then ``rule.peak`` may exceed a ``budget`` below the resharding peak).
    The estimate is conservative by about one unit on mixed plans (docs/memory.md).

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
        >>> rule = keep_gathered(model, 2, torch.zeros(64, 256), units=[str(i) for i in range(6)], min_bucket_bytes=None)
        >>> rule.kept, rule.peak <= rule.budget, rule("0"), rule("5")
        (('5',), True, True, False)
    """
    if "reshard_after_forward" in options:
        raise TypeError("fsdpfn.memory.keep_gathered: reshard_after_forward is what it chooses; do not pass it")
    check_world_and_budget("fsdpfn.memory.keep_gathered", world, budget)
    names = resolve_units(model, units)

    def peak(kept: tuple[str, ...]) -> int:
        rule = ReshardRule(kept, 0, 0)
        return estimate(model, world, batch, units=units, reshard_after_forward=rule, **options).peak  # type: ignore[union-attr]

    base = peak(())
    limit = base if budget is None else budget
    kept: tuple[str, ...] = ()
    best = base
    for k in range(1, len(names) + 1):
        more = tuple(names[len(names) - k :])
        got = peak(more)
        if got > limit:
            break
        kept, best = more, got
    return ReshardRule(kept, best, limit)
