"""Automatic collective groups (``min_bucket_bytes="auto"``): how many bytes a fused group should gather.

A collective of ``b`` bytes costs about ``latency + b / bandwidth``. Many small units pay the latency once
each; fusing consecutive units into groups of ``b`` bytes pays it once per group. The target is the size at
which the latency is at most ``1 / LATENCY_SHARE`` of the transfer; beyond it fusing saves little.

Fusing costs memory: a group is gathered (and re-gathered in backward) as a whole, so the gathered window
of a step grows from a few units to a few groups. The cap bounds that growth: a group gathers at most
``max(largest unit, shard bytes / CAP_PARTS)``, the size of one optimizer temporary where ``fsdpfn.optim``
runs foreach kernels (over groups of at most 1/8 of the shard bytes; torch's own AdamW takes a copy of all
of them), so a model whose units are already large is never fused. On CPU (``FUSED_DEVICES``) neither
fsdpfn's fused AdamW nor torch's default for-loop AdamW has such a temporary: the cap is the largest unit,
and ``fsdp``'s first call fuses what the planner, seeing the batch, finds free (transform/fusion.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # plan.py imports this module
    from fsdpfn.layout.grouping import UnitPlan

__all__ = ["CAP_PARTS", "FOREACH_PARTS", "FUSED_DEVICES", "LATENCY_SHARE", "LinkCost", "auto_bucket_bytes"]

LATENCY_SHARE = 4  # target: latency <= 1/4 of a group's transfer time
# fsdpfn.optim runs each foreach kernel over groups of at most this fraction of the shard bytes (or the
# largest shard), so one optimizer temporary is bounded by it; the planner (fsdpfn.memory) predicts with it.
FOREACH_PARTS = 8
# Device types on which fsdpfn.optim.adamw runs torch's fused AdamW kernel (contiguous shards): one pass
# over each shard, no temporaries. On CPU it takes 3.2 ms against foreach's 10.2 ms for bench ln_mlp's
# shards (world 2, one thread). CUDA keeps foreach: fused there wants its step counters on the GPU, and it
# has not run on one. The planner (fsdpfn.memory) counts no optimizer scratch on these devices.
FUSED_DEVICES = frozenset({"cpu"})
CAP_PARTS = FOREACH_PARTS  # cap: a group gathers at most 1/8 of the model's bytes on this rank (or the largest unit)


class LinkCost(NamedTuple):
    """The measured cost of one all-gather on a mesh: ``latency_s + gathered_bytes / bytes_per_s``.

    Example:
        >>> LinkCost(latency_s=1e-4, bytes_per_s=2e9).seconds(1 << 20)   # doctest: +ELLIPSIS
        0.00062...
    """

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        """Predicted time of one all-gather that gathers ``nbytes`` bytes in all."""
        return self.latency_s + nbytes / self.bytes_per_s

    def target_bytes(self) -> int | None:
        """The gathered bytes at which the latency is ``1 / LATENCY_SHARE`` of the transfer: past it,
        fusing saves little (``None`` for a link with no transfer time, such as one rank's).

        Example:
            >>> LinkCost(latency_s=1e-4, bytes_per_s=2e9).target_bytes()
            800000
        """
        if self.bytes_per_s == float("inf"):
            return None
        return max(1, int(LATENCY_SHARE * self.latency_s * self.bytes_per_s))


def auto_bucket_bytes(
    units: Sequence["UnitPlan"], world: int, link: LinkCost | Callable[[], LinkCost], device_type: str | None = None
) -> int | None:
    """The most bytes one fused group may gather under ``min_bucket_bytes="auto"`` on these (unfused)
    units (groups are filled up to it, never past it), or ``None`` when no group could hold two units.
    ``link`` may be a function that measures it: it is called only when the memory cap leaves room to fuse.
    On ``FUSED_DEVICES`` (``device_type``) the cap is the largest unit: neither ``fsdpfn.optim.adamw``'s
    fused kernel nor torch's default AdamW there (the for-loop kernel) allocates a temporary that a
    larger gathered window could hide behind, so without the batch nothing is fused (``fsdp``'s first
    call can still fuse what the planner finds free).

    Example:
        >>> import torch
        >>> from fsdpfn.layout.plan import ParamInfo, build_plan
        >>> infos = [ParamInfo(f"b{i}.w", (64, 64), torch.float32, True, f"b{i}") for i in range(48)]
        >>> plan = build_plan(infos, [], [f"b{i}" for i in range(48)], rank=0, world=2)
        >>> auto_bucket_bytes(plan.units, 2, LinkCost(1e-4, 2e9))   # 1/8 of this rank's 384 KiB: 3 blocks
        49152
    """
    sizes = [u.gathered_bytes(world) for u in units if u.name]
    if len(sizes) < 2:
        return None
    shard_bytes = sum(lay.nbytes for u in units for lay in u.gather)  # this rank's share, padded
    cap = max(sizes) if device_type in FUSED_DEVICES else max(max(sizes), shard_bytes // CAP_PARTS)
    smallest_pair = 2 * min(sizes)
    if cap < smallest_pair:
        return None
    if not isinstance(link, LinkCost):
        link = link()
    target = link.target_bytes()
    chosen = cap if target is None else min(target, cap)
    return chosen if chosen >= smallest_pair else None
