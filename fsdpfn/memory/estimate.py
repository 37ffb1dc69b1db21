"""``estimate``: a training step's per-rank peak memory under fsdpfn, predicted without running it.

Nothing here communicates or allocates the model: the plan is the one ``shard`` would build (same units,
buckets, fusion), the sizes come from ``ShardSpec`` arithmetic for every rank, and the activations from
one forward and its backward on fake tensors (``fsdpfn.memory.activations``). See docs/memory.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Union

import torch
from torch import nn

import fsdpfn.trees as trees
from fsdpfn.layout import ParamInfo, build_plan
from fsdpfn.layout.plan import FUSED, is_partition
from fsdpfn.layout.autobucket import FUSED_DEVICES, LinkCost
from fsdpfn.memory.activations import forward_cost
from fsdpfn.memory.rank import rank_phases
from fsdpfn.memory.result import PHASES, MemoryEstimate
from fsdpfn.ops.units import Units, owning_unit, recompute_reads_values, resolve_units
from fsdpfn.policy import MixedPrecisionPolicy, as_mp_policy

__all__ = ["OPTIMIZERS", "estimate"]

# Per-parameter state tensors (each the size of the shard) and whether the update needs a scratch tensor
# as large as the foreach group it runs on (AdamW's sqrt(v); SGD updates in place). fsdpfn.optim.adamw
# runs the fused kernel on FUSED_DEVICES, which needs no scratch at all.
OPTIMIZERS: dict[str, tuple[int, bool]] = {
    "adamw": (2, True),
    "adam": (2, True),
    "sgd": (0, False),
    "sgd_momentum": (1, False),
    "none": (0, False),
}

Optimizer = Union[Literal["adamw", "adam", "sgd", "sgd_momentum", "none"], None]


def estimate(
    model: nn.Module,
    world: int | Sequence[int],
    batch: Any,
    *,
    units: Units = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    optimizer: Optimizer = "adamw",
    prefetch: int = 1,
    reshard_after_forward: bool | Callable[[str], bool] = True,
    min_bucket_bytes: int | Literal["auto"] | None = "auto",
    link: LinkCost | None = None,
    replicate: int = 1,
    loss_fn: Callable[[Any], Any] | None = None,
    device: str | torch.device | None = None,
    group_sizes: Sequence[int] | None = None,
    forward_spans: Sequence[int] = (),
    kept_gathered: Sequence[str] = (),
    accumulating: bool = False,
    deferring: bool = False,
    pending_forwards: int = 0,
) -> MemoryEstimate | list[MemoryEstimate]:
    """Predict the per-rank peak memory of one training step of ``model`` sharded over ``world`` ranks.

    The step is what ``fsdpfn.shard(model, mesh, units=units, mp_policy=mp_policy,
    min_bucket_bytes=min_bucket_bytes)``, ``fsdpfn.fsdp(model, prefetch=prefetch,
    reshard_after_forward=reshard_after_forward)``, ``fsdpfn.value_and_grad`` and ``optimizer``'s update
    do on one rank's ``batch`` (a tensor, a tuple of positional arguments or a dict of keyword
    arguments, shaped as one rank sees it). ``model`` may live on ``meta``: only shapes and dtypes are
    read, the forward runs once on fake tensors to count activations (``loss_fn(output)`` too, if given),
    and nothing is communicated. ``world`` is the number of ranks one parameter is sharded over (a list of
    them gives one estimate each); ``replicate`` the HSDP replicas (it does not change per-rank memory).
    ``optimizer`` is ``"adamw"`` (two moments), ``"sgd"``, ``"sgd_momentum"`` or ``"none"``.

    ``min_bucket_bytes="auto"`` fuses as ``shard`` would on a link of cost ``link``; without one the
    planner assumes the memory cap is reached (the largest groups ``"auto"`` can pick: the worst case
    for memory). Off CPU, the first call's groups (predicted at world > 1) also stay within
    ``link.target_bytes()``, as ``fsdp`` caps them with the link it measures. ``group_sizes`` (instead of
    ``min_bucket_bytes``) fuses the units with parameters, in order, into consecutive groups of that many
    units each, as ``fsdp``'s first call may (see
    ``group_sizes_within``); ``forward_spans`` (with ``group_sizes``) gathers runs of that many consecutive
    groups in one collective each in forward, as the first call may too (``GroupSizes.forward_spans``;
    with ``"auto"``, what the first call would choose, including the last groups it may leave gathered
    after forward when ``reshard_after_forward`` is ``True``: ``GroupSizes.kept_gathered``);
    ``kept_gathered`` (with ``group_sizes``) names units left gathered from their forward to their backward
    whatever ``reshard_after_forward`` says, as the first call may keep its last groups (a ``GroupSizes``
    is estimated whole by passing its ``sizes``, ``forward_spans`` and ``kept_gathered``). Gradient
    accumulation (several backwards before one optimizer step) holds more: ``accumulating=True`` prices
    backwards that add into the shard gradients of earlier ones (gradient sync on;
    ``value_and_grad(into=grads)``, compat's ``.grad``), ``deferring=True`` backwards that keep full-size
    gradients for the last one to reduce (sync off; ``value_and_grad(reduce=False, into=acc)``, compat's
    ``set_requires_gradient_sync(False)``); ``"auto"`` then plans for that step, as the runtime does once it
    sees one. ``pending_forwards=N`` prices the graphs of ``N`` other forwards alive beside the step's
    forward and backward (their saved activations: every microbatch's forward before the backwards,
    pipeline schedules, two forwards summed into one loss), as the runtime does once a forward begins
    beside them. The result is a ``MemoryEstimate``: ``peak``, ``per_rank``, ``phase`` and ``breakdown``.

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        >>> est = estimate(model, 4, torch.zeros(8, 256), units=["0", "1", "2", "3"], min_bucket_bytes=None)
        >>> est.phase, est.breakdown.shards      # a quarter of each layer per rank; gathered layers peak
        ('backward', 263168)
    """
    worlds = _check_worlds(world)
    mp_policy = as_mp_policy(mp_policy, "fsdpfn.memory.estimate")  # torch's class too, as shard takes it
    if group_sizes is not None and min_bucket_bytes not in ("auto", None):
        raise ValueError("fsdpfn.memory.estimate: pass min_bucket_bytes or group_sizes, not both")
    one = step_estimator(model, batch, units=units, mp_policy=mp_policy, optimizer=optimizer, prefetch=prefetch,
                         reshard_after_forward=reshard_after_forward, link=link, replicate=replicate, loss_fn=loss_fn,
                         device=device, accumulating=accumulating, deferring=deferring, pending_forwards=pending_forwards)
    named = one.named
    if group_sizes is not None:
        if not is_partition(group_sizes, len(named)):
            raise ValueError(
                f"fsdpfn.memory.estimate: group_sizes must be ints >= 1 adding up to the {len(named)} units that own "
                f"parameters (in order: {named}), got {group_sizes!r}"
            )
        none = isinstance(forward_spans, (list, tuple)) and not forward_spans
        if not none and not is_partition(forward_spans, len(group_sizes)):
            raise ValueError(
                f"fsdpfn.memory.estimate: forward_spans must be ints >= 1 adding up to the {len(group_sizes)} groups of group_sizes "
                f"(or empty), got {forward_spans!r}"
            )
        if isinstance(kept_gathered, str) or not set(kept_gathered) <= set(named):
            raise ValueError(
                f"fsdpfn.memory.estimate: kept_gathered must name units that own parameters (of {named}), got {kept_gathered!r}"
            )
    elif forward_spans or kept_gathered:
        what = "forward_spans are runs of the groups group_sizes makes" if forward_spans else "kept_gathered is a choice made with group_sizes"
        raise ValueError(f"fsdpfn.memory.estimate: {what}; pass group_sizes too")

    def fusion(w: int) -> tuple[Any, tuple[int, ...]]:
        # "auto": what fsdp's first call regroups the plan to (transform/fusion.py) where it plans at all
        from fsdpfn.memory.fuse import first_call_fuses, group_sizes_within  # they plan with this function

        if group_sizes is not None:
            return tuple(group_sizes), tuple(forward_spans), frozenset(kept_gathered)
        if min_bucket_bytes != "auto" or not first_call_fuses(w, replicate, len(named)):
            return min_bucket_bytes, (), frozenset()
        # as the first call does: the units that own parameters, the module's forward alone (no loss_fn), and a
        # reshard_after_forward predicate as the fuse key too (fsdp never fuses a kept unit with a resharded one)
        fuse_key = reshard_after_forward if callable(reshard_after_forward) else None
        # and, where collectives overlap compute (not FUSED_DEVICES), no group past the link's target, if given
        overlaps = link is not None and torch.device(one.device).type not in FUSED_DEVICES
        got = group_sizes_within(model, w, batch, units=named, optimizer=optimizer, mp_policy=mp_policy, prefetch=prefetch,
                                 reshard_after_forward=reshard_after_forward, fuse_key=fuse_key, device=one.device,
                                 accumulating=accumulating, deferring=deferring, pending_forwards=pending_forwards,
                                 max_group_bytes=link.target_bytes() if overlaps else None)  # type: ignore[union-attr]
        return got.sizes, got.forward_spans, frozenset(got.kept_gathered)

    out = [one(w, *fusion(w)) for w in worlds]
    return out if not isinstance(world, int) else out[0]


# What a loss the planner does not see holds at most while its backward makes the output's gradient, in
# outputs' bytes: measured 2.4x for cross-entropy and 3.4x for a mean squared error over 8 MiB of fp32 logits
# (beyond the logits): kept groups are priced with it, as they sit on that moment (a small GPT kept its last
# block within the estimate's one output-sized gradient and measured 1.03x torch's peak)
UNSEEN_LOSS_OUTPUTS = 4


class _StepEstimator:
    """``estimate`` for one model, batch and step settings, at any world size and fusion: the forward is
    counted once (``step_estimator``), so a planner can price many fusions cheaply; ``units_run``: the
    units whose forward ran in it, in the order they started."""

    def __init__(self, one: Callable[..., MemoryEstimate], named: list[str], device: torch.device, units_run: tuple[str, ...] = ()):
        self._one, self.named, self.device, self.units_run = one, named, device, units_run

    def __call__(self, world: int, fusion: Any, forward_spans: tuple[int, ...] = (), kept: frozenset[str] = frozenset()) -> MemoryEstimate:
        """The estimate at ``world`` ranks with ``fusion``: ``min_bucket_bytes`` (an int, ``None`` or
        ``"auto"``) or a tuple of group sizes; ``forward_spans``: sizes of the runs of groups forward
        gathers in one collective each (``fsdpfn.layout.schedule``); ``kept``: units left gathered after
        their forward whatever ``reshard_after_forward`` says (the planner's choice, ``group_sizes_within``;
        without a ``loss_fn``, backward's start is then priced with ``UNSEEN_LOSS_OUTPUTS`` outputs)."""
        return self._one(world, fusion, False, forward_spans, kept)

    def fsdp2_backward(self, world: int) -> int:
        """A lower bound of the backward peak of torch's ``fully_shard`` on the same step with one group
        per unit (``fsdpfn.memory.phases.fsdp2_backward``), on the rank where it is largest."""
        return max(b.total for b in self._one(world, None, True).phases.values())


def step_estimator(
    model: nn.Module,
    batch: Any,
    *,
    units: Units = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    optimizer: Optimizer = "adamw",
    prefetch: int = 1,
    reshard_after_forward: bool | Callable[[str], bool] = True,
    link: LinkCost | None = None,
    replicate: int = 1,
    loss_fn: Callable[[Any], Any] | None = None,
    device: str | torch.device | None = None,
    accumulating: bool = False,
    deferring: bool = False,
    pending_forwards: int = 0,
) -> _StepEstimator:
    """Check ``estimate``'s arguments and count the forward once; the result estimates the step at any
    world size and fusion (``estimator(world, fusion)``, ``fusion`` as ``_StepEstimator`` says).
    ``accumulating``: the step is a backward after others before one optimizer step (gradient
    accumulation with gradient sync on), each adding its reduced gradients into the shard gradients the
    earlier ones left, in place, as the compat layer and FSDP2 add them into ``.grad``: those are resident
    from the forward on. ``deferring``: the step's backwards before its last defer their reductions
    (gradient sync off: ``set_requires_gradient_sync(False)``, ``value_and_grad(reduce=False)``) and keep
    every full-size gradient for the last one, which reduces them with its own. ``pending_forwards``: the
    graphs of that many other forwards, each saving what this one saves, stay alive through the step's
    forward and backward (not FSDP2's modelled backward, the default budget: torch's measured peaks with
    every microbatch's forward first stayed within 0.5% of its one-graph model, 6 LayerNorm-MLP blocks
    256 -> 1024, 3 microbatches, world 2; a budget that leaves them out only fuses less)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdpfn.memory.estimate: model must be an nn.Module, got {type(model).__name__}")
    mp_policy = as_mp_policy(mp_policy, "fsdpfn.memory.estimate")
    key = "none" if optimizer is None else optimizer
    if key not in OPTIMIZERS:
        raise ValueError(
            f"fsdpfn.memory.estimate: optimizer={optimizer!r} is not one the planner knows; use one of {sorted(OPTIMIZERS)}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fsdpfn.memory.estimate: prefetch must be an int >= 0 (groups gathered ahead), got {prefetch!r}")
    if not isinstance(reshard_after_forward, bool) and not callable(reshard_after_forward):
        raise TypeError(
            f"fsdpfn.memory.estimate: reshard_after_forward must be a bool or a predicate on unit names (as fsdp "
            f"takes), got {reshard_after_forward!r}"
        )
    if isinstance(pending_forwards, bool) or not isinstance(pending_forwards, int) or pending_forwards < 0:
        raise ValueError(
            f"fsdpfn.memory.estimate: pending_forwards must be an int >= 0 (other forwards awaiting backward), got {pending_forwards!r}"
        )
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"fsdpfn.memory.estimate: replicate must be an int >= 1 (HSDP replicas), got {replicate!r}")
    if link is not None and not isinstance(link, LinkCost):
        raise TypeError(f"fsdpfn.memory.estimate: link must be a fsdpfn.layout.autobucket.LinkCost, got {type(link).__name__}")
    policy = mp_policy or MixedPrecisionPolicy()
    unit_names = [""] + resolve_units(model, units)
    infos, buffer_bytes = _infos(model, unit_names)
    dev = torch.device(device) if device is not None else _device_of(model)
    # Planning a GPU step on a machine without one: fake CUDA tensors abort a CPU-only torch, so the
    # forward is counted on CPU (the same saved tensors, except kernels that only CUDA has, e.g. flash SDPA).
    counted_on = torch.device("cpu") if dev.type == "cuda" and not torch.cuda.is_available() else dev
    try:
        fwd = forward_cost(
            model,
            batch,
            device=counted_on,
            param_dtype=policy.gather_dtype,
            cast_inputs=policy.param_dtype if policy.cast_forward_inputs else None,
            loss_fn=loss_fn,
            units=unit_names,
        )
    except Exception as err:  # the user's forward: any error means this batch does not fit this model
        raise ValueError(
            f"fsdpfn.memory.estimate: the model's forward failed on batch ({type(err).__name__}: {err}); pass batch as "
            "what one rank's forward takes: a tensor, a tuple of positional arguments or a dict of keyword arguments"
        ) from err
    batch_bytes = _tensor_bytes(batch)
    slots, scratch = OPTIMIZERS[key]
    scratch = scratch and dev.type not in FUSED_DEVICES
    named = [n for n in unit_names if n and any(i.unit == n for i in infos)]  # units that own parameters

    needed = fwd.saved_params | _values_put_back(model, infos)

    def one(w: int, fusion: Any, fsdp2: bool = False, spans: tuple[int, ...] = (), kept: frozenset[str] = frozenset()) -> MemoryEstimate:
        reshard, output_grad = reshard_after_forward, fwd.output_grad
        if kept:  # left gathered until their backward: they sit on backward's start, where the loss's backward runs
            reshard = _keeping(reshard_after_forward, kept)
            if loss_fn is None:  # a loss the planner did not see: priced as a cross-entropy or a squared error
                output_grad = max(output_grad, UNSEEN_LOSS_OUTPUTS * fwd.output)
        return _estimate_one(infos, unit_names, w, replicate, policy, slots, scratch, prefetch, reshard,
                             fusion, link, buffer_bytes, batch_bytes, fwd.saved, output_grad, dev.type, fwd.last_unit_before,
                             needed, fwd.saved_before, fsdp2, spans, fwd.boundary, accumulating, deferring, fwd.working,
                             0 if fsdp2 else pending_forwards * fwd.saved, fwd.backward_peaks)

    return _StepEstimator(one, named, dev, tuple(fwd.saved_before))


def _keeping(rule: bool | Callable[[str], bool], kept: frozenset[str]) -> Callable[[str], bool]:
    """``rule`` (``reshard_after_forward``) with the units in ``kept`` left gathered."""
    return lambda unit: unit not in kept and (rule if isinstance(rule, bool) else rule(unit))


def _values_put_back(model: nn.Module, infos: list[ParamInfo]) -> frozenset[str]:
    """The parameters backward gathers again although autograd saved none of them: those of a unit with a
    trainable parameter (its backward runs) whose values a recompute could read (``recompute_reads_values``),
    as the runtime puts a unit's values back into its modules when its backward starts (so does FSDP2).
    A unit of a frozen block and a trainable one was priced without that gather, and passed torch's peak."""
    by_unit: dict[str, list[ParamInfo]] = {}
    for i in infos:
        by_unit.setdefault(i.unit, []).append(i)
    out: set[str] = set()
    for unit, members in by_unit.items():
        if not any(i.requires_grad for i in members):
            continue
        owners = [model.get_submodule(i.fqn.rpartition(".")[0]) for i in members]
        if recompute_reads_values([model.get_submodule(unit)], owners):
            out.update(i.fqn for i in members)
    return frozenset(out)


def _estimate_one(
    infos: list[ParamInfo],
    unit_names: list[str],
    world: int,
    replicate: int,
    policy: MixedPrecisionPolicy,
    slots: int,
    scratch: bool,
    prefetch: int,
    reshard: bool | Callable[[str], bool],
    min_bucket_bytes: Any,
    link: LinkCost | None,
    buffer_bytes: int,
    batch_bytes: int,
    activations: int,
    output_grad: int,
    device_type: str,
    last_unit_before: dict[str, str | None],
    saved_params: frozenset[str],
    saved_before: dict[str, int],
    fsdp2: bool = False,
    forward_spans: tuple[int, ...] = (),
    boundary: dict[str, int] | None = None,
    accumulating: bool = False,
    deferring: bool = False,
    working: dict[str, int] | None = None,
    pending: int = 0,
    backward_peaks: Sequence[tuple[str, int]] = (),
) -> MemoryEstimate:
    plan = build_plan(
        infos,
        [],
        unit_names,
        rank=0,
        world=world,
        gather_dtype=policy.gather_dtype,
        reduce_dtype=policy.grad_reduce_dtype,
        min_bucket_bytes=None if isinstance(min_bucket_bytes, tuple) else min_bucket_bytes,
        link=link if link is not None else LinkCost(0.0, math.inf),  # no link: the cap decides (worst case)
        device_type=device_type,
    )
    if isinstance(min_bucket_bytes, tuple):  # group sizes
        plan.regroup(sizes=min_bucket_bytes)
    item = {i.fqn: i.dtype.itemsize for i in infos}
    trainable = {i.fqn for i in infos if i.requires_grad}
    # Ranks with the same local shard sizes have the same peak: compute each distinct layout once.
    by_layout: dict[tuple[int, ...], dict[str, Any]] = {}
    per_rank = []
    by_unit: dict[str, int] = {}  # each unit's group's largest backward moment, on any rank
    named = [g for g in plan.groups if g.name]
    for r in range(world):
        numel = {f: math.prod(plan.specs[f].local_shape(r)) for f in plan.params}
        layout = tuple(numel[f] for f in plan.params)
        if layout not in by_layout:
            by_group: list[int] = []
            by_layout[layout] = rank_phases(plan, numel, item, trainable, world, slots, device_type, scratch, prefetch, reshard,
                                             buffer_bytes, batch_bytes, activations, output_grad, last_unit_before, saved_params, saved_before,
                                             fsdp2, forward_spans, boundary, accumulating, deferring, working, pending, by_group,
                                             backward_peaks)
            if fsdp2:  # only FSDP2's backward bound: the other phases are fsdpfn's
                by_layout[layout] = {"backward": by_layout[layout]["fsdp2"]}
            for g, most in zip(named, by_group):
                for u in g.name.split(FUSED):
                    by_unit[u] = max(by_unit.get(u, 0), most)
            if by_group:  # backward's start and the root's reduction, under the root's name
                by_unit[""] = max(by_unit.get("", 0), by_group[-1])
        per_rank.append(max(b.total for b in by_layout[layout].values()))
    rank = max(range(world), key=per_rank.__getitem__)
    numel = {f: math.prod(plan.specs[f].local_shape(rank)) for f in plan.params}
    phases = by_layout[tuple(numel[f] for f in plan.params)]
    phase = max((p for p in PHASES if p in phases), key=lambda p: phases[p].total)
    return MemoryEstimate(
        world=world,
        replicas=replicate,
        per_rank=tuple(per_rank),
        rank=rank,
        phase=phase,
        breakdown=phases[phase],
        phases=phases,
        groups=tuple(g.label for g in plan.groups),
        bucket_bytes=plan.bucket_bytes,
        backward_by_unit=by_unit,
    )


def _check_worlds(world: Any) -> list[int]:
    values = [world] if isinstance(world, int) and not isinstance(world, bool) else world
    ok = isinstance(values, (list, tuple)) and values and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in values
    )
    if not ok:
        raise ValueError(
            f"fsdpfn.memory.estimate: world must be an int >= 1 (the ranks a parameter is sharded over) or a "
            f"non-empty list of them, got {world!r}"
        )
    return list(values)


def _infos(model: nn.Module, unit_names: Sequence[str]) -> tuple[list[ParamInfo], int]:
    """One ``ParamInfo`` per distinct parameter (tied ones once, owned as ``shard`` decides) and the bytes
    of the buffers every rank keeps whole."""
    owners: dict[int, list[str]] = {}
    found: dict[int, nn.Parameter] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(fqn)
        found[id(p)] = p
    infos = [ParamInfo(names[0], tuple(found[k].shape), found[k].dtype, found[k].requires_grad, owning_unit(names, unit_names))
             for k, names in owners.items()]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return infos, buffers


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _tensor_bytes(batch: Any) -> int:
    leaves = trees.leaves(batch)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
