"""What one rank holds during a step, group by group: the byte model ``estimate`` walks.

``rank_phases`` turns a plan and one rank's local shard sizes into ``GroupBytes`` per collective group
(what its gather allocates, its gradients, what its reduction packs and holds, on the path the
communication core takes for it) and hands them to ``fsdpfn.memory.phases``: fsdpfn's own step
(``phase_peaks``) or FSDP2's backward on the same groups (``fsdp2_backward``, the fusion budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fsdpfn.core.comm import EXCHANGE_MIN_BYTES
from fsdpfn.core.exchange import PACK_BELOW, direct_route
from fsdpfn.layout.autobucket import FOREACH_PARTS
from fsdpfn.layout.plan import FUSED
from fsdpfn.memory.phases import GroupBytes, backward_alive, fsdp2_backward, phase_peaks
from fsdpfn.ops.fold import FOLD_MIN_BYTES

__all__ = ["rank_phases"]


def rank_phases(plan: Any, numel: dict[str, int], item: dict[str, int], trainable: set[str], world: int, slots: int,
                 device_type: str, scratch: bool, prefetch: int, reshard: bool | Callable[[str], bool], buffer_bytes: int, batch_bytes: int, activations: int,
                 output_grad: int, last_unit_before: dict[str, str | None], saved_params: frozenset[str], saved_before: dict[str, int],
                 fsdp2: bool = False, forward_spans: tuple[int, ...] = (), boundary: dict[str, int] | None = None,
                 accumulating: bool = False, deferring: bool = False, working: dict[str, int] | None = None, pending: int = 0,
                 by_group: list[int] | None = None, backward_peaks: Sequence[tuple[str, int]] = ()) -> Any:
    """The phase peaks (``phase_peaks``'s dict) of one rank whose local shards have ``numel`` elements
    each, or with ``fsdp2`` ``{"fsdp2": Breakdown}``, FSDP2's backward on the same groups;
    ``accumulating``: a backward after others of the same step (every trainable shard's gradient there);
    ``deferring``: backwards before the step's last one defer their reductions (gradient sync off);
    ``working``: per unit, the most bytes its forward's activations and intermediates hold at once;
    ``pending``: what other forwards' graphs awaiting their backward hold through the step's forward and
    backward (fsdpfn's phases only: the FSDP2 model stays one graph's, see ``step_estimator``);
    ``by_group``: filled with each named group's largest backward moment (``phase_peaks``);
    ``backward_peaks``: what the backward on fake tensors held in each unit's backward
    (``ForwardCost.backward_peaks``; empty: modelled from the forward's counts instead).

    Example:
        >>> rank_phases(plan, numel, item, trainable, 2, 2, "cpu", False, 1, True, 0, 0, 0, 0, {}, frozenset(), {})  # doctest: +SKIP
    """
    shard_bytes = {f: numel[f] * item[f] for f in plan.params}
    grad_sizes = [shard_bytes[f] for f in plan.params if f in trainable]
    accumulated = sum(grad_sizes) if accumulating else 0

    def group_bytes(g: Any, as_fsdp2: bool = False) -> GroupBytes:
        shard_grads = sum(shard_bytes[f] for f in g.fqns if f in trainable)
        own = {f: lay.dtype == plan.dtypes[f] for lay in g.reduce for f in lay.fqns}
        # each trainable member's full-size gradient in the reduction's dtype
        member_grads = [math.prod(plan.specs[f].shape) * lay.dtype.itemsize for lay in g.reduce for f in lay.fqns if f in trainable]
        unreduced = sum(member_grads)  # kept for a later reduction (gradient sync off)
        # with accumulators, the new gradients alive at once: the largest folded one and the small ones,
        # which wait for the group's node (fsdpfn/ops/fold.py)
        largest = max((b for b in member_grads if b >= FOLD_MIN_BYTES), default=0) + sum(b for b in member_grads if b < FOLD_MIN_BYTES)
        # backward gathers a resharded group again when it needs its parameters (saved_params: see estimate)
        regathered = any(f in saved_params for f in g.fqns)
        if world == 1:  # the collectives are the identity: only a dtype cast allocates
            cast = [(f, lay.dtype) for lay in g.gather for f in lay.fqns if lay.dtype != plan.dtypes[f]]
            full_grads = sum(numel[f] * lay.dtype.itemsize for lay in g.reduce for f in lay.fqns)
            cast_bytes = sum(numel[f] * d.itemsize for f, d in cast)
            if all(own.values()):  # autograd's gradients are the reduced ones (cast members': compute dtype first)
                return GroupBytes(cast_bytes, cast_bytes, 0, shard_grads, regathered=regathered, unreduced=unreduced, largest_grad=largest)
            return GroupBytes(cast_bytes, full_grads, 0, shard_grads, regathered=regathered, unreduced=unreduced, largest_grad=largest)
        padded = sum(lay.nbytes for lay in g.reduce)
        full = padded * world
        computed = {f: lay.dtype for lay in g.gather for f in lay.fqns}  # autograd's gradients: compute dtype
        same = all(computed[f] == lay.dtype for lay in g.reduce for f in lay.fqns)
        # sent from the gradients themselves (FSDP2 always copies them into its reduce-scatter input)
        # (the runtime's route, fsdpfn.core.Comm.direct, per layout)
        direct = (all(own.values()) and same and not as_fsdp2
                  and all(direct_route(lay, world, gather=False, device_type=device_type, min_bytes=EXCHANGE_MIN_BYTES) for lay in g.reduce))
        # A gather sends from its own result (flat: our row, packed in place, as FSDP2 does; direct: our rows
        # of each member) except a direct exchange's small members (PACK_BELOW): our rows of them packed
        # to send and the peers' inboxes, world times a rank's small rows.
        direct_gather = [not as_fsdp2 and direct_route(lay, world, gather=True, device_type=device_type, min_bytes=EXCHANGE_MIN_BYTES)
                         for lay in g.gather]
        gather_small = sum(_small(lay) for lay, d in zip(g.gather, direct_gather) if d)
        # a flat gather of several members copies them out of its rank-major buffer (both alive a moment)
        copy_out = 0 if as_fsdp2 else sum(lay.nbytes * world for lay, d in zip(g.gather, direct_gather) if len(lay.specs) > 1 and not d)
        return GroupBytes(
            copy_out=copy_out,
            gathered=g.gathered_bytes(world),
            full_grads=sum(math.prod(plan.specs[f].shape) * computed[f].itemsize for lay in g.reduce for f in lay.fqns),
            packed=2 * (world - 1) * sum(_small(lay) for lay in g.reduce) if direct else full,
            reduce_out=padded if all(own.values()) else shard_grads,
            reduce_cast=0 if all(own.values()) else padded,  # reduced in another dtype, then cast
            reduce_scratch=padded if direct and world > 2 else 0,  # a direct reduction's later peers land in one segment
            regathered=regathered,
            gather_input=world * gather_small,
            unreduced=unreduced,
            largest_grad=largest,
        )

    root = next((g for g in plan.groups if not g.name), None)
    cpu = device_type != "cuda"
    others = [g for g in plan.groups if g.name]
    index = {g.name: k for k, g in enumerate(others)}
    # A parameter first used after a later group started (the root's; an outer unit's around inner ones)
    # has its gradient from that group's backward on, until its own group is reduced (gather nodes made
    # earlier run later in backward).
    root_early = [0] * len(others)
    compute = {f: lay.dtype for g in plan.groups for lay in g.gather for f in lay.fqns}
    for g in plan.groups:
        mine = index.get(g.name, -1) if g.name else -1
        for lay in g.reduce:
            for f in lay.fqns:
                unit = last_unit_before.get(f)
                if unit is None or plan.group_of.get(unit) not in index:
                    continue
                nbytes = math.prod(plan.specs[f].shape) * compute[f].itemsize if world > 1 else shard_bytes[f]
                for k in range(mine + 1, index[plan.group_of[unit]] + 1):
                    root_early[k] += nbytes
    enclosing = [[j for j, o in enumerate(others) if j < k and _encloses(o.name, g.name)] for k, g in enumerate(others)]
    # the gradients flowing into and out of each group's backward (its members run one after another)
    known = boundary or {}
    between = [max(known.get(u, 0) for u in g.name.split(FUSED)) for g in others]
    running = [max((working or {}).get(u, 0) for u in g.name.split(FUSED)) for g in others]
    alive = backward_alive(backward_peaks, plan.group_of, [g.name for g in others])  # (None where not measured)
    if fsdp2:
        return {"fsdp2": fsdp2_backward(
            shards=sum(shard_bytes.values()) + buffer_bytes,
            state=slots * sum(grad_sizes),
            batch=batch_bytes,
            activations=activations,
            output_grad=output_grad,
            root=group_bytes(root, True) if root is not None else GroupBytes(0, 0, 0, 0),
            groups=[group_bytes(g, True) for g in others],
            saved_until=_saved_until(others, saved_before, activations),
            between=between,
            accumulated=accumulated,
            deferring=deferring,
            alive=alive,
        )}
    return phase_peaks(
        shards=sum(shard_bytes.values()) + buffer_bytes,
        state=slots * sum(grad_sizes),
        batch=batch_bytes,
        activations=activations,
        output_grad=output_grad,
        root=group_bytes(root) if root is not None else GroupBytes(0, 0, 0, 0),
        groups=[group_bytes(g) for g in plan.groups if g.name],
        prefetch=prefetch,
        reshard=[_reshards(plan, g.name, reshard) for g in others],
        temporary=_largest_foreach_group(grad_sizes) if scratch else 0,
        root_early=root_early,
        enclosing=enclosing,
        saved_until=_saved_until(others, saved_before, activations),
        prefetch_at_release=cpu,
        forward_spans=forward_spans,
        running=running,
        between=between,
        accumulated=accumulated,
        deferring=deferring,
        pending=pending,
        by_group=by_group,
        alive=alive,
    )


def _small(layout: Any) -> int:
    """Per-rank bytes of ``layout``'s members that a direct CPU exchange packs into one message per peer
    (``fsdpfn.core.exchange.PACK_BELOW``)."""
    item = layout.dtype.itemsize
    return sum(spec.padded_numel * item for spec in layout.specs if spec.padded_numel * item < PACK_BELOW)


def _reshards(plan: Any, group: str, rule: bool | Callable[[str], bool]) -> bool:
    """Whether ``fsdp(reshard_after_forward=rule)`` drops group ``group`` after its forward: the flag, or
    the predicate said yes for one of its units (a fused group is gathered, and dropped, as one)."""
    if isinstance(rule, bool):
        return rule
    wants = []
    for unit in plan.members(group):
        got = rule(unit)
        if not isinstance(got, bool):
            raise TypeError(
                f"fsdpfn.memory.estimate: the reshard_after_forward predicate returned {got!r} for unit {unit!r}; "
                "it must return a bool"
            )
        wants.append(got)
    return any(wants)


def _encloses(outer: str, inner: str) -> bool:
    """Whether a unit of (fused) group ``outer`` contains a unit of group ``inner``."""
    return any(i.startswith(o + ".") for o in outer.split(FUSED) for i in inner.split(FUSED))


def _saved_until(groups: Sequence[Any], saved_before: dict[str, int], total: int) -> list[int]:
    """Activations alive during each group's backward (what forward saved until the next group started),
    and last the root's (what was saved before the first group)."""
    starts = [min((saved_before[u] for u in g.name.split(FUSED) if u in saved_before), default=None) for g in groups]
    out = []
    for k in range(len(groups)):
        nxt = next((s for s in starts[k + 1 :] if s is not None), total)
        out.append(nxt)
    out.append(next((s for s in starts if s is not None), total))
    return out


def _largest_foreach_group(sizes: Sequence[int]) -> int:
    """The bytes of the largest run ``fsdpfn.optim``'s ``foreach_groups`` cuts ``sizes`` into."""
    if not sizes:
        return 0
    cap = max(sum(sizes) / FOREACH_PARTS, max(sizes))
    best = held = 0
    for n in sizes:
        if held and held + n > cap:
            held = 0
        held += n
        best = max(best, held)
    return best
