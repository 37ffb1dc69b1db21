"""Reducing full gradients held back for a backward that did not reach their unit.

Gradients kept unreduced across backwards (gradient sync off; ``value_and_grad(reduce=False, into=acc)``) are
reduced by the next reducing backward from each unit's gather node, together with that backward's own. A
unit that backward did not run (a task head used on alternate microbatches, a branch the last batch skips)
has no gather node in it, so its held gradients would stay unreduced. Which units those are is a rank's own
view (a branch on data may differ per rank), so the ranks first count, per parameter, how many of them hold
such gradients (one sum over the mesh, ``fsdpfn.core.tally``) and all reduce the union: a rank without one
for a parameter contributes zeros, as one process would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fsdpfn.core import tally
from fsdpfn.layout import ShardPlan
from fsdpfn.ops.buckets import Buckets

__all__ = ["reduce_held"]


def reduce_held(
    plan: ShardPlan, held: dict[str, torch.Tensor], candidates: Sequence[tuple[str, str]], collective: Callable[[str], Buckets]
) -> dict[str, torch.Tensor]:
    """Reduce the gradients in ``held`` (by FQN; taken out of it) of the ``candidates`` (``(group, fqn)``
    pairs, the same list on every rank) that some rank holds; their shard gradients by FQN. A collective
    on every rank (one small all-reduce, then one reduction per group any rank holds gradients for);
    ``collective(group)`` is the group's gather, whose adjoint reduces.

    Example:
        >>> extra = reduce_held(plan, acc, [(g.name, f) for g in plan.groups for f in g.fqns], lambda n: gather_of(n))  # doctest: +SKIP
    """
    counts = tally(plan.comm, [f in held for _, f in candidates])
    by_group: dict[str, set[str]] = {}
    for (name, f), count in zip(candidates, counts):
        if count:
            by_group.setdefault(name, set()).add(f)
    out: dict[str, torch.Tensor] = {}
    for name, fqns in by_group.items():
        reduce = collective(name).adjoint
        assert reduce is not None, "a gather without its reduce"
        picked = [held.pop(f, None) if f in fqns else None for f in reduce.fqns]
        for f, g in zip(reduce.fqns, reduce.run(picked)):
            if f in fqns:
                out[f] = g
    return out
