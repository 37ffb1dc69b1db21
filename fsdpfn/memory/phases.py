"""The arithmetic of a step's memory over time: pure functions of byte counts, no tensors.

A step on one rank walks through its collective groups: forward in plan order, backward in reverse,
then the optimizer. What is alive at each moment is

* always: the shards (and buffers), the optimizer state and the batch;
* forward: the root group gathered for the whole call, the gathered window (the running group and the
  ``prefetch`` groups after it), every group so far that is kept gathered (not resharded after its
  forward) and the activations saved so far;
* backward's start: the loss's backward down to the model's output (its gradient and temporaries) and the
  gradients of root parameters used last (an LM head's), before any group is gathered again: only the root
  group and the kept groups are gathered (a language model's peak is often here);
* backward of group ``k``: the reduced shard gradients of the groups already done, the root group, the
  kept groups not yet reduced, the re-gathered window (``k`` and the ``prefetch`` groups before it, which
  on CPU start only when ``k``'s reduction does), ``k``'s full-size gradients, and the activations;
* optimizer step: every reduced gradient and one foreach group's temporary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from fsdpfn.layout.plan import is_partition
from fsdpfn.memory.result import Breakdown

__all__ = ["GroupBytes", "backward_alive", "forward_with_spans", "fsdp2_backward", "phase_peaks"]


class GroupBytes(NamedTuple):
    """One collective group on one rank, in bytes.

    ``gathered``: the full-size parameters its gather allocates (0 where the gather aliases the shards:
    one rank, no cast); ``full_grads``: the full-size gradients autograd makes for it; ``packed``: the
    flat copy of them the reduction sends (0 where it sends the gradients themselves); ``reduce_out``:
    this rank's reduced gradients (they stay until the optimizer step); ``reduce_scratch``: what the
    reduction holds besides its input and output (CPU, direct exchanges at three ranks or more: one
    segment the peers beyond the first land in, in turn, while it finishes); ``regathered``: whether backward
    needs its parameters (autograd saved some, or its backward runs: a unit's values are put back for
    a recompute), so a resharded group is gathered again; ``gather_input``:
    what a gather holds besides its result while a backward prefetch of the group is in flight (a CPU
    direct exchange's small members packed: our rows and the peers' inboxes; the others send from
    their own result, as FSDP2's gathers do);
    ``reduce_cast``: the reduction's output in its own dtype when the gradients are then cast to the
    parameters' dtype (mixed precision: the reduction finishes at once, and ``reduce_out`` is the cast);
    ``copy_out``: what finishing a gather holds besides its result for a moment (a flat gather of several
    members: the rank-major buffer it copies them out of, as FSDP2's gathers do too); ``unreduced``: its
    trainable parameters' full-size gradients in the reduction's dtype (what a backward that defers its
    reduction, gradient sync off, accumulates for a later one); ``largest_grad``: the largest of its
    members' full-size gradients and the small ones (where each is folded into an accumulator as it is
    made, the most of the new ones alive at once: ``fsdpfn/ops/fold.py``; 0: as ``full_grads``).
    """

    gathered: int
    full_grads: int
    packed: int
    reduce_out: int
    reduce_scratch: int = 0
    regathered: bool = True
    gather_input: int = 0
    reduce_cast: int = 0
    copy_out: int = 0
    unreduced: int = 0
    largest_grad: int = 0


def phase_peaks(
    *,
    shards: int,
    state: int,
    batch: int,
    activations: int,
    root: GroupBytes,
    output_grad: int = 0,
    groups: Sequence[GroupBytes],
    prefetch: int,
    reshard: bool | Sequence[bool],
    temporary: int,
    root_early: Sequence[int] = (),
    saved_until: Sequence[int] = (),
    enclosing: Sequence[Sequence[int]] = (),
    prefetch_at_release: bool = False,
    forward_spans: Sequence[int] = (),
    between: Sequence[int] = (),
    accumulated: int = 0,
    deferring: bool = False,
    running: Sequence[int] = (),
    pending: int = 0,
    by_group: list[int] | None = None,
    alive: Sequence[int | None] = (),
) -> dict[str, Breakdown]:
    """The largest ``Breakdown`` of each phase (``forward``, ``backward``, ``optimizer step``).

    Backward visits the groups in reverse (the root last) and looks at three moments of each: its
    gradients computed (the group still gathered), the previous group's reduction finishing while they
    exist (without resharding; with it, the re-gather finishes that reduction before the gradients are
    made), and its own reduction launched (the group released; gradients, their packed copy, the
    reduction's output and scratch alive at once). ``root_early[k]`` is the root's gradients already
    made during group ``k``'s backward (root parameters used after ``k`` in forward): the root is reduced
    last, so they wait. ``saved_until[k]`` is the activations still saved during group ``k``'s backward
    (what the forward saved up to the end of ``k``; ``saved_until[-1]``, one more entry, the root's);
    without it every activation is assumed alive throughout backward. ``enclosing[k]``: the groups whose
    units contain group ``k``'s (nested units): they stay gathered while ``k`` runs, in both directions.
    ``output_grad``: the most bytes the loss's backward holds while it makes the gradient of the model's
    output, at backward's first moment, before any group is gathered again (counted with the activations;
    the root's gradients made then, ``root_early`` of the last group, with the gradients).
    ``reshard``: one flag for every group, or one per group (``fsdp``'s per-unit predicate): a group kept
    gathered holds its parameters from its forward to its backward and is not gathered again.
    ``prefetch_at_release``: backward's prefetch of the groups before ``k`` starts when ``k``'s reduction
    does (CPU) rather than when ``k`` is re-gathered (CUDA): while ``k``'s gradients are made only the
    ``prefetch - 1`` nearest are in flight (launched at the release before), all of them from ``k``'s.
    ``forward_spans``: sizes of runs of groups that forward gathers in one shared collective each; the
    forward is then priced group by group (``forward_with_spans``, as it is wherever ``saved_until`` is
    known) instead of as every activation beside the largest window; ``running[k]``: the most bytes the
    forward holds while group ``k`` runs (saved activations and intermediates: a frozen group saves none).
    ``between[k]``: the gradients flowing through group ``k``'s backward (of its output, received, and of
    its input, made), beside its activations at each of its moments. ``pending``: what the graphs of
    other forwards awaiting their backward hold (their saved tensors) through this forward and backward
    (counted with the activations; gone by the optimizer step). ``by_group``, when given, is filled with
    the largest backward moment of each group, in ``groups``' order, then one more: the largest of
    backward's start and the root's moments (the fusion planner compares plans moment by moment with it:
    ``fsdpfn.memory.room.Room``). ``alive[k]``, where known, replaces ``saved_until[k]`` and ``between[k]``:
    the activations and gradients measured alive during group ``k``'s backward (``backward_alive``),
    gradients waiting for an earlier group included (a skip connection's), the parameters' own gradients
    taken off (each moment adds the group's).

    Example:
        >>> g = GroupBytes(gathered=8, full_grads=8, packed=8, reduce_out=4)
        >>> peaks = phase_peaks(shards=8, state=16, batch=0, activations=0, root=GroupBytes(0, 0, 0, 0),
        ...                     groups=[g, g], prefetch=1, reshard=True, temporary=1)
        >>> peaks["optimizer step"].total
        33
    """
    n = len(groups)
    rs = [reshard] * n if isinstance(reshard, bool) else [bool(r) for r in reshard]
    if len(rs) != n:
        raise ValueError(f"phase_peaks: reshard has {len(rs)} entries for {n} groups")
    step_batch, batch = batch, batch + pending  # (the other graphs counted with the batch until the optimizer step)
    if any(size > 1 for size in forward_spans) or saved_until:
        # group by group: early groups' gathers beside the few activations saved by then
        forward = forward_with_spans(shards=shards, state=state, batch=batch, activations=activations, root=root, groups=groups,
                                     prefetch=prefetch, reshard=rs, saved_until=saved_until, enclosing=enclosing,
                                     spans=forward_spans or (1,) * n, running=running)
        forward = forward._replace(gradients=forward.gradients + accumulated)
    else:  # no saved bytes per group: the largest gathered window beside every activation
        gathered_fwd = 0
        for k in range(n):
            # groups kept from their forward to their backward, the running window, the enclosing groups
            kept = {j for j in range(k) if not rs[j]} | (set(enclosing[k]) if k < len(enclosing) else set())
            live = kept | set(range(k, min(n, k + 1 + prefetch)))
            gathered_fwd = max(gathered_fwd, sum(groups[j].gathered for j in live))
            # finishing group k's gather (before it launches the next prefetch): its copy out beside it
            finishing = kept | set(range(k, min(n, k + max(prefetch, 1))))
            gathered_fwd = max(gathered_fwd, sum(groups[j].gathered for j in finishing) + groups[k].copy_out)
        gathered_fwd = max(gathered_fwd, root.copy_out)  # the root's gather, the first of the forward
        forward = Breakdown(shards, state, accumulated, root.gathered + gathered_fwd, activations + batch, 0)
    folds = accumulated and prefetch_at_release  # each result added in place once its reduction finished
    unreduced = sum(g.unreduced for g in groups) + root.unreduced if deferring else 0
    forward = forward._replace(gradients=forward.gradients + unreduced)

    # backward's start: the output's gradient is made, no group has been gathered again yet
    held0 = root.gathered + sum(g.gathered for g, r in zip(groups, rs) if not r)
    early0 = root_early[n - 1] if 0 < n <= len(root_early) else 0
    moments = [Breakdown(shards, state, accumulated + unreduced + early0, held0, activations + batch + output_grad, 0)]
    done = 0  # reduced gradients of the groups finished so far (accumulating and folded: not held)
    in_flight: GroupBytes | None = None  # the reduction still running when the next group's gradients exist
    order = [(k, groups[k]) for k in reversed(range(n))] + [(-1, root)]
    largest: dict[int, int] = {}  # each group's largest backward moment (k = -1: the root's), for by_group
    for k, g in order:
        first = len(moments)
        if k >= 0:
            kept = {j for j in range(k) if not rs[j]}  # still gathered since their forward
            ahead = [j for j in range(k) if rs[j] and groups[j].regathered][-prefetch:] if prefetch else []
            outer = [j for j in (enclosing[k] if k < len(enclosing) else ()) if j not in kept and j not in ahead]
            held = root.gathered + sum(groups[j].gathered for j in kept) + sum(groups[j].gathered for j in outer)
            prefetched = sum(groups[j].gathered + groups[j].gather_input for j in ahead)
            # launched at the previous group's release: the nearest prefetch - 1 (none before the first)
            early_ahead = ahead[len(ahead) - (prefetch - 1) :] if prefetch > 1 and k < n - 1 else []
            during = prefetched if not prefetch_at_release else sum(groups[j].gathered + groups[j].gather_input for j in early_ahead)
            mine = g.gathered if g.regathered or not rs[k] else 0
            # a re-gather finishes the reduction in flight before this group's gradients exist (CPU);
            # a kept group, one that saved nothing, and the root start their backward without one
            finishes = rs[k] and g.regathered
        else:
            held, prefetched, during, mine, finishes = 0, 0, 0, g.gathered, False
        early = root_early[k] if 0 <= k < len(root_early) else 0
        saved = _saved_in_backward(k, batch, activations, saved_until, between, alive)
        # with accumulators each new gradient is folded into them as it is made (fsdpfn/ops/fold.py)
        new = (g.largest_grad or g.full_grads) if deferring else g.full_grads
        if deferring:  # a deferring backward: every group's sums, this one's new gradients, no reduction
            moments.append(Breakdown(shards, state, unreduced + new + early, held + during + mine, saved, 0))
            moments.append(Breakdown(shards, state, unreduced + early, held + prefetched, saved, 0))
        # the reducing one: the sums of this group and of those reduced after it (the earlier ones, the root)
        carried = root.unreduced + sum(groups[j].unreduced for j in range(k + 1)) if deferring else 0
        pending = early + accumulated + carried
        if in_flight is not None and not finishes:
            pending += in_flight.packed + in_flight.reduce_scratch + (in_flight.reduce_out if folds else 0)
        moments.append(Breakdown(shards, state, done + new + pending, held + during + mine, saved, 0))
        if k >= 0 and rs[k] and g.regathered and g.copy_out:  # its re-gather finishing, before its gradients exist
            moments.append(Breakdown(shards, state, done + pending, held + during + mine + g.copy_out, saved, 0))
        launched = (0 if deferring else g.full_grads) + g.packed + (g.reduce_cast or g.reduce_out) + g.reduce_scratch + early + accumulated + carried
        moments.append(Breakdown(shards, state, done + launched, held + prefetched, saved, 0))
        if g.reduce_cast:
            cast = g.packed + g.reduce_cast + g.reduce_out + early + accumulated + carried
            moments.append(Breakdown(shards, state, done + cast, held + prefetched, saved, 0))
        done += 0 if folds else g.reduce_out
        in_flight = None if g.reduce_cast else g
        largest[k] = max(b.total for b in moments[first:])
    if by_group is not None:
        by_group[:] = [largest[k] for k in range(n)] + [max(moments[0].total, largest[-1])]
    backward = max(moments, key=lambda b: b.total)
    optimizer = Breakdown(shards, state, accumulated or done, 0, step_batch, temporary)
    return {"forward": forward, "backward": backward, "optimizer step": optimizer}


def fsdp2_backward(
    *,
    shards: int,
    state: int,
    batch: int,
    activations: int,
    root: GroupBytes,
    output_grad: int = 0,
    groups: Sequence[GroupBytes],
    saved_until: Sequence[int] = (),
    between: Sequence[int] = (),
    accumulated: int = 0,
    deferring: bool = False,
    alive: Sequence[int | None] = (),
) -> Breakdown:
    """A lower bound of the backward peak torch's ``fully_shard`` reaches on the same step and groups
    (every group resharded after forward, torch's default backward prefetch of one group, AdamW's
    gradients kept), from what FSDP2 (torch 2.11-2.13) is known to hold; ``groups[k].packed`` must be the
    full-size reduce-scatter input, which FSDP2 always copies the gradients into.

    Two moments per group ``k`` (backward runs the groups in reverse): its gradients made, while it is
    still gathered, group ``k - 1`` is being gathered (prefetched when ``k``'s backward started) and the
    reduce-scatter input of the group before (``k + 1``) is still held (FSDP2 keeps one in flight and
    drops it in the next group's post-backward); then ``k``'s copy-in, after it was resharded and that
    input dropped: its gradients and their copy at once; ``between[k]``, the gradients flowing through
    ``k``'s backward, beside both (as ``phase_peaks``, and ``alive`` instead where known); ``accumulated``,
    the shard gradients earlier backwards left, beside all of them (FSDP2 adds each group's reduced
    gradients into them in its post-backward); with ``deferring`` (gradient sync off in the step's earlier backwards), every group's
    full-size gradients (``GroupBytes.unreduced``) from backward's start on, each dropped once its group is
    reduced (FSDP2 accumulates them in the unsharded parameters' ``.grad``, in place), and a deferring
    backward's moments too (those gradients beside the gathered groups). Whatever else FSDP2 allocates (padding, its
    reduce-scatter output before the gradients are freed, collective scratch) only adds to its peak.

    Example:
        >>> g = GroupBytes(gathered=8, full_grads=8, packed=8, reduce_out=4)
        >>> fsdp2_backward(shards=8, state=16, batch=0, activations=0, root=GroupBytes(0, 0, 0, 0), groups=[g, g]).total
        52
    """
    n = len(groups)
    unreduced = sum(g.unreduced for g in groups) + root.unreduced if deferring else 0
    moments = [Breakdown(shards, state, accumulated + unreduced, root.gathered, activations + batch + output_grad, 0)]
    done = accumulated
    held_input = 0  # the previous group's reduce-scatter input, dropped at this group's post-backward
    for k in reversed(range(n)):
        g = groups[k]
        prefetched = groups[k - 1].gathered if k > 0 else 0
        saved = _saved_in_backward(k, batch, activations, saved_until, between, alive)
        if deferring:  # a deferring backward; then the reducing one: the groups not reduced yet, beyond this one's .grad
            moments.append(Breakdown(shards, state, unreduced, root.gathered + g.gathered + prefetched, saved, 0))
        carried = sum(groups[j].unreduced for j in range(k)) + root.unreduced + max(0, g.unreduced - g.full_grads) if deferring else 0
        moments.append(Breakdown(shards, state, done + carried + g.full_grads + held_input, root.gathered + g.gathered + prefetched, saved, 0))
        moments.append(Breakdown(shards, state, done + carried + g.full_grads + g.packed, root.gathered + prefetched, saved, 0))
        done += 0 if accumulated else g.reduce_out
        held_input = g.packed
    return max(moments, key=lambda b: b.total)


def forward_with_spans(
    *,
    shards: int,
    state: int,
    batch: int,
    activations: int,
    root: GroupBytes,
    groups: Sequence[GroupBytes],
    prefetch: int,
    reshard: Sequence[bool],
    saved_until: Sequence[int],
    enclosing: Sequence[Sequence[int]] = (),
    spans: Sequence[int],
    running: Sequence[int] = (),
) -> Breakdown:
    """The forward's largest moment when runs of groups (``spans``, sizes summing to ``len(groups)``) are
    gathered in one shared collective each, priced group by group: while group ``k`` runs, the groups kept
    since their forward, its enclosing groups, its own copy, the shared buffer of its span (alive until
    its last group is unpacked, which happens before that group's prefetch starts) and every span the
    prefetch window reaches beyond it (whole), beside what forward saved up to the end of the group after
    ``k`` (``saved_until``; without it, every activation) or what it holds while ``k`` runs (``running[k]``,
    its intermediates too), whichever is more.

    Example:
        >>> g = GroupBytes(gathered=8, full_grads=8, packed=8, reduce_out=4)
        >>> forward_with_spans(shards=8, state=16, batch=0, activations=0, root=GroupBytes(0, 0, 0, 0), groups=[g, g],
        ...                    prefetch=1, reshard=[True, True], saved_until=[0, 0, 0], spans=[2]).total
        48
    """
    n = len(groups)
    if not is_partition(tuple(spans), n):
        raise ValueError(f"forward_with_spans: spans {tuple(spans)} must be sizes >= 1 summing to the {n} groups")
    span_of: list[tuple[int, int]] = []
    for size in spans:
        start = len(span_of)
        span_of += [(start, start + size)] * size
    worst = Breakdown(shards, state, 0, root.gathered, batch, 0)
    for k in range(n):
        start, stop = span_of[k]
        live = {j for j in range(k) if not reshard[j]} | ({k} if stop - start == 1 else set())
        live |= set(enclosing[k]) if k < len(enclosing) else set()
        held = sum(groups[j].gathered for j in live)
        reached = {span_of[j] for j in range(k + 1, min(n, k + 1 + prefetch))} - {(start, stop)}
        ahead = sum(sum(groups[j].gathered for j in range(a, b)) + (groups[a].gathered if b - a > 1 else 0) for a, b in reached)
        if stop - start > 1:  # the shared buffer and our own copy out of it
            shared = sum(groups[j].gathered for j in range(start, stop)) + groups[k].gathered
            # the last group's unpacking drops the shared buffer before its prefetch starts the next span
            held += max(shared, groups[k].gathered + ahead) if k == stop - 1 else shared + ahead
        else:
            held += max(ahead, groups[k].copy_out)
        saved = max(saved_until[min(k + 1, n - 1)] if saved_until else activations, running[k] if k < len(running) else 0)
        moment = Breakdown(shards, state, 0, root.gathered + held, saved + batch, 0)
        worst = max(worst, moment, key=lambda b: b.total)
    return worst


def backward_alive(peaks: Sequence[tuple[str, int]], group_of: dict[str, str], groups: Sequence[str]) -> list[int | None]:
    """For each group (``groups``: their names), the most bytes of activations and gradients alive in its
    units' backward, up to the next unit's (its own done: the gradient of its input made); ``peaks`` is
    ``ForwardCost.backward_peaks`` (``(unit, bytes)`` in backward order) and ``group_of`` maps units to
    group names. ``None`` for a group whose units the backward never reached.

    Example:
        >>> backward_alive([("b", 10), ("a", 7), ("b", 12)], {"a": "a", "b": "b"}, ["a", "b"])
        [7, 12]
    """
    index = {name: k for k, name in enumerate(groups)}
    alive: list[int | None] = [None] * len(groups)
    for unit, most in peaks:
        k = index.get(group_of.get(unit, ""))
        if k is not None:
            alive[k] = max(alive[k] or 0, most)
    return alive


def _saved_in_backward(k: int, batch: int, activations: int, saved_until: Sequence[int], between: Sequence[int],
                       alive: Sequence[int | None]) -> int:
    """What group ``k``'s backward moments hold besides parameters and their gradients (``k = -1``: the
    root's): ``alive[k]`` where measured, else the activations saved until the group and the gradients at its
    boundary; the batch beside either."""
    measured = alive[k] if 0 <= k < len(alive) else None
    if measured is not None:
        return measured + batch
    saved = (saved_until[k] if k >= 0 else saved_until[-1]) if saved_until else activations
    return saved + batch + (between[k] if 0 <= k < len(between) else 0)
