"""The arithmetic of a step's memory over time: pure functions of byte counts, no tensors.

A step on one rank walks through its collective groups: forward in plan order, backward in reverse,
then the optimizer. What is alive at each moment is

* always: the shards (and buffers), the optimizer state and the batch;
* forward: the root group gathered for the whole call, the gathered window (the running group and the
  ``prefetch`` groups after it, or every group so far without ``reshard_after_forward``) and the
  activations saved so far;
* backward of group ``k``: the reduced shard gradients of the groups already done, the root group, the
  re-gathered window (``k`` and the ``prefetch`` groups before it; every group not yet reduced without
  resharding), ``k``'s full-size gradients, and the activations;
* optimizer step: every reduced gradient and one foreach group's temporary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from fsdpfn.memory.result import Breakdown

__all__ = ["GroupBytes", "phase_peaks"]


class GroupBytes(NamedTuple):
    """One collective group on one rank: ``gathered`` full-size parameter bytes, ``full_grads`` full-size
    gradient bytes (reduction dtype), ``shard_grads`` this rank's reduced gradient bytes."""

    gathered: int
    full_grads: int
    shard_grads: int


def phase_peaks(
    *,
    shards: int,
    state: int,
    batch: int,
    activations: int,
    root: GroupBytes,
    groups: Sequence[GroupBytes],
    prefetch: int,
    reshard: bool,
    temporary: int,
) -> dict[str, Breakdown]:
    """The largest ``Breakdown`` of each phase (``forward``, ``backward``, ``optimizer step``).

    Example:
        >>> g = GroupBytes(gathered=8, full_grads=8, shard_grads=4)
        >>> peaks = phase_peaks(shards=8, state=16, batch=0, activations=0, root=GroupBytes(0, 0, 0),
        ...                     groups=[g, g], prefetch=1, reshard=True, temporary=1)
        >>> peaks["optimizer step"].total
        33
    """
    n = len(groups)
    gathered_fwd = 0
    for k in range(n):
        window = groups[: k + 1] if not reshard else groups[k : k + 1 + prefetch]
        gathered_fwd = max(gathered_fwd, sum(g.gathered for g in window))
    forward = Breakdown(shards, state, 0, root.gathered + gathered_fwd, activations + batch, 0)

    backward = Breakdown(shards, state, root.full_grads, root.gathered + (0 if reshard else sum(g.gathered for g in groups)), activations + batch, 0)
    backward = backward._replace(gradients=sum(g.shard_grads for g in groups) + root.full_grads)
    for k in reversed(range(n)):
        done = sum(g.shard_grads for g in groups[k + 1 :])
        window = groups[: k + 1] if not reshard else groups[max(0, k - prefetch) : k + 1]
        here = Breakdown(
            shards, state, done + groups[k].full_grads, root.gathered + sum(g.gathered for g in window), activations + batch, 0
        )
        if here.total > backward.total:
            backward = here
    optimizer = Breakdown(shards, state, root.shard_grads + sum(g.shard_grads for g in groups), 0, batch, temporary)
    return {"forward": forward, "backward": backward, "optimizer step": optimizer}
