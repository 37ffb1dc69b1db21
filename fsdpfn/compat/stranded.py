"""Gradients accumulated without sync whose unit did not run in the backward that syncs.

With ``set_requires_gradient_sync(False)`` a unit's backward keeps its full gradients unreduced
(``RootContext.acc``); the next backward with sync on reduces them together with that backward's own
(``CallInfo.carry``), from the unit's gather node. A unit that ran in an accumulating microbatch but not in
the last one (a task head used on alternate microbatches, a branch the last batch skips) has no gather
node in that backward, so its accumulated gradients would stay unreduced: FSDP2 reduces them at the end
of the backward (its final callback runs every group's post-backward), and so does this, over the union of
what the ranks hold (``fsdpfn.ops.held.reduce_held``), only in a backward that follows accumulation, which
every rank knows alike.

Example:
    >>> model.set_requires_gradient_sync(False); model(x, task=0).backward()   # doctest: +SKIP
    >>> model.set_requires_gradient_sync(True); model(x, task=1).backward()    # doctest: +SKIP
    >>> # head 0's accumulated gradients are reduced into its .grad at the end of that backward
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fsdpfn.ops.held import reduce_held

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = ["reduce_stranded"]


def reduce_stranded(root: RootContext) -> dict[str, torch.Tensor]:
    """Reduce the accumulated gradients of the units with sync on that this backward did not reduce;
    their shard gradients by FQN (to add to ``.grad``). Every rank reduces the parameters any rank holds
    such gradients for (one count per parameter, summed over the mesh): a rank without one for a parameter
    gets the others' share, as one process would. A no-op returning ``{}`` unless a forward since the last
    such look ran with some unit's sync off.

    Example:
        >>> extra = reduce_stranded(root_context)        # doctest: +SKIP
    """
    if not root.accumulating:
        return {}
    plan = root.plan
    candidates = [  # the same list on every rank: the plan's trainable parameters whose units sync now
        (group.name, f)
        for group in plan.groups
        if not root.defers(group.name)
        for lay in group.reduce
        for f in lay.fqns
        if plan.requires_grad.get(f, False)
    ]
    root.accumulating = any(root.defers(g.name) for g in plan.groups)
    return reduce_held(plan, root.acc, candidates, lambda name: root.collective(plan.group(name)))
