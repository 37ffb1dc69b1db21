"""The planner's answer: per-rank peaks, the breakdown at the peak, and the phase it happens in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Breakdown", "MemoryEstimate", "PHASES"]

PHASES = ("forward", "backward", "optimizer step")


class Breakdown(NamedTuple):
    """Bytes one rank holds at one moment, by kind (``total`` is their sum).

    ``shards``: this rank's parameter shards and the (replicated) buffers; ``optimizer_state``: the
    optimizer's per-parameter state (AdamW's two moments); ``gradients``: reduced shard gradients plus the
    full-size gradients of the group being reduced; ``gathered``: full parameters of the groups gathered at
    that moment; ``activations``: what the forward saved for backward, their gradients and the batch;
    ``temporaries``: the optimizer kernels' scratch (one foreach group's worth).

    Example:
        >>> Breakdown(1, 2, 1, 0, 0, 0).total
        4
    """

    shards: int
    optimizer_state: int
    gradients: int
    gathered: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        """The sum of every term."""
        return sum(self)


@dataclass(frozen=True)
class MemoryEstimate:
    """A training step's predicted per-rank peak for one world size.

    ``per_rank[r]`` is rank ``r``'s peak in bytes; ``peak`` the largest, reached on ``rank`` in ``phase``
    (one of ``PHASES``) with ``breakdown`` the terms at that moment; ``state`` is the rank's resident state
    between steps (shards, optimizer state). ``backward_by_unit[u]``: the most bytes a rank holds in
    backward while the group of unit ``u`` runs, ``""``: at backward's start and while the root's runs
    (what the fusion planner compares plans by, moment by moment). ``str()`` is a table to print.

    Example:
        >>> est = fsdpfn.memory.estimate(model, 8, batch)        # doctest: +SKIP
        >>> est.peak, est.phase, est.breakdown.gathered          # doctest: +SKIP
    """

    world: int
    replicas: int
    per_rank: tuple[int, ...]
    rank: int
    phase: str
    breakdown: Breakdown
    phases: dict[str, Breakdown]
    groups: tuple[str, ...]
    bucket_bytes: int | None
    backward_by_unit: Mapping[str, int] = field(default_factory=dict, hash=False)

    @property
    def peak(self) -> int:
        """The largest per-rank peak, in bytes."""
        return max(self.per_rank)

    @property
    def state(self) -> int:
        """Bytes resident on the peak rank between steps: shards (and buffers) plus optimizer state."""
        return self.breakdown.shards + self.breakdown.optimizer_state

    def __str__(self) -> str:
        mesh = f"{self.replicas} x {self.world}" if self.replicas > 1 else str(self.world)
        lines = [
            f"fsdpfn memory estimate: world {mesh}, {len(self.groups)} collective groups"
            + (f" (fused up to {_fmt(self.bucket_bytes)})" if self.bucket_bytes else ""),
            f"peak {_fmt(self.peak)} on rank {self.rank}, during the {self.phase}",
            "",
            f"{'term':<18}" + "".join(f"{p:>16}" for p in PHASES),
        ]
        for i, term in enumerate(Breakdown._fields):
            lines.append(f"{term:<18}" + "".join(f"{_fmt(self.phases[p][i]):>16}" for p in PHASES))
        lines.append(f"{'total':<18}" + "".join(f"{_fmt(self.phases[p].total):>16}" for p in PHASES))
        return "\n".join(lines)


def _fmt(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
