"""The ranks that hold a whole tree: the ``Comm`` a step concerning all of it must run over.

A plan's own ``Comm`` spans its data-parallel mesh. With tensor parallelism each data-parallel group
holds one TP slice, so a decision every rank must share (a checkpoint, "is any gradient non-finite?")
needs the dp x tp ranks; with pipeline stages on sub-meshes it needs those ranks and no others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsdpfn.core import Comm, span_mesh

__all__ = ["agreement_comm", "span_comm"]


def span_comm(plans: Sequence[Any]) -> Comm:
    """A ``Comm`` over every rank holding a part of ``plans``' trees (``ShardPlan``s with a ``Comm``):
    each plan's mesh and its tensor-parallel parameters' dp + tp meshes, and no other rank. The first
    plan's own ``Comm`` when that is already all of them (1-D, no TP); else a 1-D one made once per span
    and kept on the first plan (``fsdpfn.core.span_mesh``: collective over those ranks the first time).

    Example:
        >>> comm = span_comm([params.plan])            # dp x tp ranks of a TP plan  # doctest: +SKIP
        >>> comm.groups.world                                                         # doctest: +SKIP
        4
    """
    meshes = [plan.comm.mesh for plan in plans]
    meshes += [layout.mesh for plan in plans for layout in (getattr(plan, "tp", None) or {}).values()]
    ranks = tuple(sorted({int(r) for mesh in meshes for r in mesh.mesh.flatten().tolist()}))
    key = ("span_comm", ranks)
    comm = plans[0].memo.get(key)
    if comm is None:
        span = span_mesh(meshes)
        own = next((plan.comm for plan in plans if plan.comm.mesh is span), None)
        comm = plans[0].memo[key] = own if own is not None else Comm(span)
    return comm


def agreement_comm(plan: Any) -> Any:
    """The ``Comm`` over which every rank holding ``plan``'s tree reaches one decision (a non-finite
    gradient anywhere, a step to skip): the plan's own (both dims of HSDP; ``None`` for a single process
    without one) unless tensor-parallel parameters put other slices on other dp groups, then ``span_comm``.

    Example:
        >>> agreement_comm(params.plan).all_reduce_sum(flags).wait()   # doctest: +SKIP
    """
    return span_comm([plan]) if plan.tp and plan.comm is not None else plan.comm
