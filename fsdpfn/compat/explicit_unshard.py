"""An explicit ``unshard()``: its launch and ``UnshardHandle``, and what it gathered when the shards change
after it: a forward gathers again, and ``state_dict``/``load_state_dict`` drop it first.

``FSDPModule.unshard(async_op=True)`` launches a unit's all-gather ahead of its forward. Launched before
the optimizer step (to overlap the gather with the update), the gathered copy holds the weights from
before the step while the shards hold the new ones: the next forward silently ran on the old weights
(0.004-0.005 off one process after three SGD steps at worlds 1-2), and ``state_dict()`` returned the
registered full tensors, old values as plain tensors, where FSDP2 returns the sharded ``DTensor``s (its
state-dict hooks reshard first). Each unshard notes its shards' version counters; the forward that would
use it compares them, the ranks agree on which units went stale (one small all-reduce, only in forwards
that find an explicit unshard pending), and those units are gathered again by the forward itself, with a
warning that the prefetch was wasted. ``state_dict``/``load_state_dict`` drop a unit's explicit unshard,
as FSDP2's hooks do.

Example:
    >>> model.unshard(async_op=True); optimizer.step()   # doctest: +SKIP
    >>> model(x)      # warns; x meets the updated weights     # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

from fsdpfn.compat.state import UnitState, drop_unsharded
from fsdpfn.core import tally
from fsdpfn.messages import user_stacklevel
from fsdpfn.ops.slots import set_parameter

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = ["UnshardHandle", "discard_unshard", "launch_unshard", "shard_versions", "stale_unshards"]


class UnshardHandle:
    """A handle on an ``FSDPModule.unshard(async_op=True)``; ``wait()`` (idempotent) registers the
    unsharded parameters on the module.

    Example:
        >>> handle = model.layers[1].unshard(async_op=True)     # doctest: +SKIP
        >>> handle.wait()                                        # doctest: +SKIP
    """

    def __init__(self, state: UnitState | None = None):
        self._state = state

    def wait(self) -> None:
        """Wait for the all-gather and register the full parameters on the module (once)."""
        st, self._state = self._state, None
        if st is None or st.unsharded is None or st.unsharded[1] is not None:
            return
        handles, _, b, versions = st.unsharded
        full = dict(zip(b.fqns, b.finish(handles)))
        st.unsharded = (handles, full, b, versions)
        for fqn, m in st.root.managed.items():
            if fqn in full:
                value = full[fqn] if m.tp is None else m.tp.wrap(full[fqn])
                unsharded = nn.Parameter(value, requires_grad=m.param.requires_grad)
                for mod, attr in m.slots:
                    set_parameter(mod, attr, unsharded)


def launch_unshard(ctx: RootContext, st: UnitState) -> UnshardHandle:
    """Launch the all-gather of ``st``'s unit for ``FSDPModule.unshard`` (nothing when an unshard is already
    pending, or the unit's copy is kept gathered since a forward or backward, or it owns no parameter) and
    return the handle that registers the result."""
    kept = ctx.kept.get(ctx, ctx.plan.group_of.get(st.name, st.name)) is not None  # unsharded already
    if st.unsharded is None and not kept and any(u.name == st.name for u in ctx.plan.units):
        params = ctx.params()
        b = ctx.collective(ctx.plan.unit(st.name))
        st.unsharded = (b.launch([params[f].detach() for f in b.fqns]), None, b, shard_versions(ctx, b.fqns))
    return UnshardHandle(st if st.unsharded is not None else None)


def shard_versions(ctx: RootContext, fqns: Iterable[str]) -> tuple[tuple[int, int, int], ...]:
    """The identity and version counters of each ``DTensor`` parameter of ``fqns`` and of its local shard:
    an in-place update moves one of them (an optimizer step, on the ``DTensor``: its dispatch runs the
    local op below autograd, which leaves the local counter alone; ``to_local().mul_()``, on the local
    shard), ``load_state_dict(assign=True)`` the identity."""
    out = []
    for f in fqns:
        param = ctx.managed[f].param
        out.append((id(param), param._version, param._local_tensor._version))
    return tuple(out)


def stale_unshards(ctx: RootContext) -> set[str]:
    """The units whose explicit ``unshard()`` gathered shards that changed since, on any rank; each is
    dropped (its gather finished and discarded, the sharded parameters registered again) so the forward
    gathers it anew. A collective over ``ctx``'s mesh when some unit has an unshard pending (every rank
    has the same ones: ``unshard`` is called alike everywhere)."""
    pending = [(name, st) for name, st in ctx.states.items() if st.unsharded is not None]
    if not pending:
        return set()
    changed = [shard_versions(ctx, st.unsharded[2].fqns) != st.unsharded[3] for _, st in pending]
    counts = tally(ctx.plan.comm, changed)
    stale = {name for (name, _), n in zip(pending, counts) if n}
    for name, st in pending:
        if name in stale:
            discard_unshard(st)
    if stale:
        warnings.warn(
            f"fully_shard: the parameters of {', '.join(repr(n or '<root>') for n in sorted(stale))} changed (an "
            "optimizer step, a load) after unshard() gathered them: gathered again for this forward, so the "
            "prefetch was wasted. Call unshard() after the update",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return stale


def discard_unshard(state: UnitState) -> None:
    """Drop ``state``'s explicit unshard, if any: its gather finished (every rank launched it, so it
    completes everywhere; the result is not used) and the sharded parameters registered again."""
    if state.unsharded is None:
        return
    handles, full, b, _ = state.unsharded
    if full is None:
        b.finish(handles)
    drop_unsharded(state)
