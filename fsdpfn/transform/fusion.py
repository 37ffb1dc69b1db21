"""Fusing units on ``fsdp``'s first call, when ``shard`` was left at ``min_bucket_bytes="auto"``.

``shard`` sees neither the batch nor the optimizer, so its ``"auto"`` fuses only up to 1/8 of the shard
bytes. The first call of ``apply`` sees the batch, and ``fsdpfn.optim``'s ``init`` noted the optimizer on
the plan: the planner (``fsdpfn.memory.group_sizes_within``) then prices larger groups against the peak
torch's ``fully_shard`` needs for the same step with that optimizer (FSDP2's backward holds a copy of
each group's gradients, and on CUDA torch's foreach AdamW a temporary, that fsdpfn does not) and the plan
is regrouped in place to that choice, more fused or less than ``shard``'s (whose cap, without the batch,
may not fit). The groups may differ in size: the last units, whose backward runs before most gradients
exist, can afford larger ones. Every collective costs a CPU step more than its bytes (a synchronisation
of the ranks, thread wake-ups on cores that compute), so on CPU fusing is worth what memory allows (bench
ln_mlp, world 2: 12 groups -> 8, 0.60 -> 0.55 of torch's step, under its peak; bench/RESULTS.md run24).
On GPUs, whose collectives overlap compute on streams of their own, no group or forward span grows past
the mesh's latency-bound size (``LinkCost.target_bytes``): a larger one only delays the compute that
waits for it (for gpt1b in a world of 8 the uncapped planner would gather up to four 1B-model blocks
per group and twelve in a forward span; docs/memory.md).
Every rank must choose alike. Each rank plans for its own batch and the ranks must agree
(``fsdpfn.core.agree``: ranks whose forwards ran different units disagree). Where the ranks' batches differ
in size (sequences of other lengths per rank; ``fsdpfn.core.every_rank`` tells each rank), they plan
together: each fit the search decides is counted over the ranks (``fsdpfn.core.tally``), so the groups fit
every rank's batch within its own budget and every rank chooses them. Where the ranks disagree, or the
forward cannot run on fake tensors, the plan stays as ``shard`` made it, on every rank.

The groups are priced for the batch the planner saw, and activations grow with the batch: a shape check
on one row before training (``model(x[:1])``) planned groups that raised training's peak past torch's
(1.04-1.05x, 8 LayerNorm-MLP blocks, world 2), and even a batch 1.25x the planned one can pass it (by up
to 0.9% in the planner's estimate, over 24 random MLP stacks). So a training forward (autograd on) whose
batch has more elements than its rank planned for asks every rank to plan again (``note_batch``); the
request rides the next pass check's all-reduce (``fsdpfn.core.pass_check``), so every rank learns it alike,
and the next call plans, each rank for its largest batch so far, once no call on the plan has a backward
still to run (a regroup under one would change the groups its backward gathers). The groups so follow each
rank's largest training batch, whose step is that rank's peak: a batch whose size varies plans again at each
new largest one (a fake forward and backward and a few small all-reduces each; a few times over a run, as new maxima of
random sizes grow rare).

The first call prices one forward and one backward per optimizer step. Gradient accumulation holds more:
with sync on every shard gradient from the second backward on (the later backwards add into them), with
sync off every full-size gradient. Groups priced for one backward measured 1.06-1.12x torch's peak there.
So a backward of such a kind (``STEP_KINDS``; compat's backward sees a ``.grad`` or a unit with sync off,
``value_and_grad`` is given ``into=`` or ``reduce=False``) asks every rank to plan again the same way
(``note_accumulation``), priced for it from then on. Forwards that run before earlier ones' backwards
(every microbatch's forward first, pipeline schedules, two forwards summed into one loss) keep those graphs'
saved activations alive through the later forward and backwards: with each forward's backward after all
of them, planned groups measured 1.023x torch's peak (6 LayerNorm-MLP blocks 256 -> 1024, 3 microbatches,
compat, world 2). A training forward that begins while more calls await their backward than planned for
asks the same way (``note_batch``), and the planner prices that many graphs beside the step
(``step_estimator(pending_forwards=)``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Hashable
from typing import Any, ContextManager, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from fsdpfn.core import agree, every_rank, link_of, tally
from fsdpfn.layout import ShardPlan
from fsdpfn.layout.autobucket import FUSED_DEVICES
from fsdpfn.layout.plan import FUSION_PLANNED_MEMO, OPTIMIZER_MEMO, PLANNED_BATCH_MEMO
from fsdpfn.memory.fuse import GroupSizes, first_call_fuses, group_sizes_within

__all__ = ["STEP_KINDS", "PlannedBatch", "note_accumulation", "note_batch", "open_calls", "plan_fusion"]


class PlannedBatch(NamedTuple):
    """What a plan's groups were last planned for on this rank (``plan.memo[PLANNED_BATCH_MEMO]``): the
    most ``elements`` of this rank's batches planned so far, ``Guard.replans`` then, and this rank's largest
    ``batch`` (its arguments, tensors as ``meta`` ones of their shapes, and its elements): the one planned
    for, or a larger training batch that asked to plan again since (planned for when the call that plans
    has a smaller one: the request reaches the ranks one check later, and another rank's request plans
    this one's groups too). A step's peak grows with its batch, so each rank plans for its largest.
    ``pattern``: the kinds of step beyond one forward and backward the groups were planned for
    (``STEP_KINDS``), ``seen``: those a backward on this rank met since (``note_accumulation``), which
    ask to plan again when they are not planned for. ``pending``: the most earlier calls awaiting their
    backward while a training forward began, planned for (their graphs' saved activations stay alive
    through that forward and the backwards before theirs); ``pending_seen``: the most met since (``note_batch``).
    Neither the batch nor ``pending`` ever falls: a pattern met once tends to recur (a validation graph
    held each epoch), and groups planned lower would pass torch's peak, and plan again, each time it did.

    Example:
        >>> PlannedBatch(elements=64, replans=0).asked
        False
    """

    elements: int
    replans: int
    batch: tuple[tuple[Any, ...], dict[str, Any], int] | None = None
    pattern: frozenset[str] = frozenset()
    seen: frozenset[str] = frozenset()
    pending: int = 0
    pending_seen: int = 0

    @property
    def asked(self) -> bool:
        """Whether a training batch larger than the planned one, a backward of a kind not planned for, or
        a forward beside more graphs awaiting backward than planned for, asked to plan again since."""
        return (self.batch is not None and self.batch[2] > self.elements) or not self.seen <= self.pattern or self.pending_seen > self.pending


# Steps the planner prices beyond one forward and backward: "accumulating", backwards that add into the
# shard gradients earlier ones of the step left (gradient accumulation with sync on); "deferring",
# backwards that keep full-size gradients for a later one to reduce (sync off, reduce=False).
STEP_KINDS = ("accumulating", "deferring")


def open_calls(plan: ShardPlan) -> list[Any]:
    """The calls on ``plan`` that are in their forward or await their backward, of every ``fsdp`` apply
    that ran on it (``Apply.calls_on``, over the applies the plan's memo registers): the graphs a new
    forward begins beside, and what a regroup must wait for.

    Example:
        >>> open_calls(params.plan)     # doctest: +SKIP
        []
    """
    return [c for a in plan.memo.get(("applies",), ()) for c in a.calls_on(plan)]


def note_batch(plan: ShardPlan, args: tuple[Any, ...], kwargs: dict[str, Any], pending: int = 0) -> None:
    """Before a forward's pass check: ask every rank to plan ``plan``'s groups again when this is a training
    forward (autograd on) whose batch (``args``/``kwargs``) has more elements than its groups were planned
    for, or that begins while more earlier calls on ``plan`` await their backward (``pending``) than they
    were planned for. Communication-free: the request travels with the next pass check.

    Example:
        >>> note_batch(params.plan, (x,), {})     # doctest: +SKIP
    """
    planned: PlannedBatch | None = plan.memo.get(PLANNED_BATCH_MEMO)
    if planned is None or plan.comm is None or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return
    elements = _elements(args, kwargs)
    if planned.batch is None or elements > planned.batch[2]:  # (asked once)
        plan.comm.guard.replan_asked = True
        planned = planned._replace(batch=_shapes(args, kwargs, elements))
    if pending > max(planned.pending, planned.pending_seen):
        plan.comm.guard.replan_asked = True
        planned = planned._replace(pending_seen=pending)
    plan.memo[PLANNED_BATCH_MEMO] = planned


def note_accumulation(plan: ShardPlan, kind: str) -> None:
    """A backward on ``plan`` is of ``kind`` (``STEP_KINDS``): ``"accumulating"``, it found the gradients of
    an earlier backward of the same step and adds its own into them (gradient accumulation with sync on:
    the compat layer tells it, once per backward); ``"deferring"``, it keeps its full-size gradients for a
    later backward to reduce (sync off; ``value_and_grad(reduce=False)``). Asks every rank to plan the groups
    again, priced for such steps (every shard gradient, or every full-size one, resident from the forward
    on), if they were not planned so. Communication-free: the request travels with the next pass check.

    Example:
        >>> note_accumulation(params.plan, "deferring")     # doctest: +SKIP
    """
    planned: PlannedBatch | None = plan.memo.get(PLANNED_BATCH_MEMO)
    if planned is None or plan.comm is None or kind in planned.pattern or kind in planned.seen:
        return
    plan.comm.guard.replan_asked = True
    plan.memo[PLANNED_BATCH_MEMO] = planned._replace(seen=planned.seen | {kind})


def plan_fusion(
    module: nn.Module,
    plan: ShardPlan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    prefetch: int,
    reshard_after_forward: bool | Callable[[str], bool],
    fuse_key: Callable[[str], Hashable] | None = None,
    keep_gathered: bool | None = None,
    eligible: bool = True,
    planning: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    regrouped: Callable[[], None] = lambda: None,
) -> None:
    """On the first call on ``plan`` (an ``"auto"`` plan that ``first_call_fuses``), regroup its units as
    ``group_sizes_within`` chooses for this batch (``args``/``kwargs``, what ``module``'s forward takes). A
    collective on every rank; ``eligible=False`` (a call under ``torch.func`` or ``torch.compile``, where no
    fake forward can run) keeps the plan as it is. The planner runs ``module``'s forward (and its backward) on fake tensors
    inside ``planning()`` (compat: with its FSDP dispatch turned off); units whose ``fuse_key`` differ
    never share a group (compat: units with different ``FSDPModule`` settings); ``keep_gathered`` is
    ``group_sizes_within``'s (compat: on where every unit reshards after forward); ``regrouped()`` runs when
    the groups changed (compat drops the copies it kept gathered under the old groups' names). Later calls
    plan again when some rank's training batch outgrew the planned one (``note_batch``)."""
    if not plan.auto_fusion:
        return
    if plan.memo.get(FUSION_PLANNED_MEMO):
        if not eligible or not _plans_again(plan):
            return
    else:
        plan.memo[FUSION_PLANNED_MEMO] = True
    units = [u.name for u in plan.units if u.name]
    if not eligible or plan.tp or plan.transforms or plan.comm is None or not first_call_fuses(plan.world, plan.replicas, len(units)):
        return  # the same on every rank
    # Where collectives overlap compute (GPUs: their own streams), a group or forward span past the link's
    # latency-bound size only delays the compute waiting for it; on CPU, gloo shares the cores with compute
    # and each collective's synchronisation is the cost, so memory alone bounds the groups there.
    overlaps = plan.comm.groups.device_type not in FUSED_DEVICES
    max_group_bytes = link_of(plan.comm).target_bytes() if overlaps else None  # a collective, on every rank
    planned: PlannedBatch = plan.memo.get(PLANNED_BATCH_MEMO, PlannedBatch(0, 0))
    elements = _elements(args, kwargs)
    if planned.batch is not None and planned.batch[2] > elements:
        args, kwargs, elements = planned.batch  # this rank's largest: planned for before, or asked since
    batch = args if not kwargs else kwargs if not args else None
    per_rank = every_rank(plan.comm, elements if batch is not None else -1)
    if max(per_rank) < 0:
        return  # no rank's batch can be priced (positional and keyword tensors): shard's groups stay
    pattern = planned.pattern | planned.seen  # (the same on every rank: _plans_again)
    pending = max(planned.pending, planned.pending_seen)
    plan.memo[PLANNED_BATCH_MEMO] = PlannedBatch(elements, plan.comm.guard.replans, _shapes(args, kwargs, elements), pattern, pending=pending)
    # Batches of different sizes plan together: the same groups do not fit every batch (fewer rows leave
    # less room under torch's lower peak), so each fit is decided on every rank, one count each.
    together = None if len(set(per_rank)) == 1 else lambda fits: not tally(plan.comm, [not fits])[0]
    with planning(), torch.inference_mode(False), torch.enable_grad():
        options = {**_options(plan, prefetch, reshard_after_forward, pattern, pending), "keep_gathered": keep_gathered}
        choice = _choose(module, plan.world, batch, units, options, fuse_key, max_group_bytes, together)
    # Ranks whose forwards ran different units (a divergence the next pass check names) choose differently
    # and keep shard's groups, whose collectives stay alike in order and size more often than fused ones
    # (gloo aborts the process on a size mismatch).
    if not agree(plan.comm, _digest(choice)) or choice is None:
        return  # the forward could not run on fake tensors, or the ranks differ: shard's groups stay, on every rank
    sizes, spans, kept = choice.sizes, choice.forward_spans, choice.kept_gathered
    if plan.regroup(sizes=sizes):  # a no-op where the current groups are already the choice
        regrouped()
    # (after regroup, which forgets what was derived from the groups; planned again, the spans may go)
    plan.set_planned_schedule(spans if spans and sum(spans) == sum(1 for g in plan.groups if g.name) else None, kept)


def _choose(
    module: nn.Module,
    world: int,
    batch: Any,
    units: list[str],
    options: dict[str, Any],
    fuse_key: Callable[[str], Hashable] | None,
    max_group_bytes: int | None,
    together: Callable[[bool], bool] | None,
) -> GroupSizes | None:
    """``group_sizes_within``'s choice for ``batch`` (priced for a training step even when the call is an
    evaluation: the groups serve every later call, and training saves activations an evaluation does
    not; with ``together``, its fits decided on every rank), or ``None`` where the forward cannot run on
    fake tensors (on some rank, with ``together``) or the planner saw other units."""
    try:
        choice = group_sizes_within(
            module, world, batch, units=units, fuse_key=fuse_key, max_group_bytes=max_group_bytes, everywhere=together, **options
        )
    except Exception:  # the user's forward on fake tensors: the other ranks learn it from the agreement
        return None
    kept = len(choice.kept_gathered)
    if sum(choice.sizes) != len(units) or tuple(choice.kept_gathered) != tuple(units[len(units) - kept :]):
        return None  # the planner saw other units than the plan has
    return choice


def _options(
    plan: ShardPlan, prefetch: int, reshard_after_forward: bool | Callable[[str], bool], pattern: frozenset[str], pending: int
) -> dict[str, Any]:
    """The planner's step: the optimizer ``fsdpfn.optim``'s ``init`` noted, the plan's policy and device,
    the kinds of backward it has (``pattern``, of ``STEP_KINDS``) and the most graphs awaiting their
    backward beside it (``pending``)."""
    assert plan.comm is not None
    return {
        "optimizer": plan.memo.get(OPTIMIZER_MEMO, "none"), "mp_policy": plan.mp_policy, "prefetch": prefetch,
        "reshard_after_forward": reshard_after_forward, "device": plan.comm.groups.device,
        **{kind: kind in pattern for kind in STEP_KINDS}, "pending_forwards": pending,
    }  # fmt: skip


def _digest(choice: GroupSizes | None) -> int:
    """One int64 equal on two ranks when their choices' groups, spans and kept units are, and their planning
    forwards ran the same units: ranks whose forwards skip different units (LayerDrop) can choose alike,
    and a group kept gathered that one of them skips leaves their collectives unpaired (gloo aborted
    before the pass check could name the divergence)."""
    what = None if choice is None else (choice.sizes, choice.forward_spans, choice.kept_gathered, choice.units_run)
    digest = hashlib.sha256(repr(what).encode()).digest()
    return int.from_bytes(digest[:7], "little")  # 56 bits: the ranks' sum stays within int64


def _plans_again(plan: ShardPlan) -> bool:
    """Whether a plan planned before should plan again now (a collective when some rank asked since: the
    same on every rank, as ``Guard.replans`` is). Only if this plan asked on some rank, for its batch or
    a kind of backward (the ranks' requests are one count per mesh, and several plans may share it: another
    plan's request must not plan this one for a smaller batch), and no rank has a call on it whose
    backward is still to run (the request then waits for a later call). Every rank then plans for the
    kinds of backward any rank met."""
    planned: PlannedBatch | None = plan.memo.get(PLANNED_BATCH_MEMO)
    assert plan.comm is not None
    if planned is None or planned.replans >= plan.comm.guard.replans:
        return False
    busy = bool(open_calls(plan))
    busy_ranks, asking_ranks, *kind_ranks = tally(plan.comm, [busy, planned.asked, *(kind in planned.seen for kind in STEP_KINDS)])
    if not asking_ranks:  # another plan's request: this one is planned for its batches still
        plan.memo[PLANNED_BATCH_MEMO] = planned._replace(replans=plan.comm.guard.replans)
        return False
    # every rank plans for the kinds of backward some rank met, and for the most graphs awaiting backward
    seen = frozenset(k for k, n in zip(STEP_KINDS, kind_ranks) if n)
    plan.memo[PLANNED_BATCH_MEMO] = planned._replace(seen=seen, pending_seen=max(every_rank(plan.comm, planned.pending_seen)))
    return not busy_ranks


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any], elements: int) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """A call's arguments with its tensors as ``meta`` ones of their shapes (what the planner needs of a
    batch, holding no memory), and its ``elements``."""
    shapes = tree_map(lambda x: x.detach().to("meta") if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return (*shapes, elements)


def _elements(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The elements of the tensors in a call's arguments: how large its batch is."""
    return sum(t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
