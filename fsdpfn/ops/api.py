"""The pure, differentiable primitives: ``unshard``, ``reshard`` and ``reduce``.

``unshard`` all-gathers (one collective per unit bucket) and its backward is ``reduce``; ``reduce``
reduce-scatters and its backward is ``unshard``; ``reshard`` takes this rank's slice locally. The
reduction semantics are always explicit: ``op="sum"`` sums over the data-parallel ranks, ``op="avg"``
divides that sum by their number, and ``divide_by=F`` divides the sum by ``F`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fsdpfn.core.custom import CustomComms
from fsdpfn.layout import Sharded, ShardPlan, UnitPlan, Unreduced, shard_tensor
from fsdpfn.layout.plan import ParamInfo, bucket_by_dtype
from fsdpfn.ops.buckets import Buckets, collective_pair, reduce_collective
from fsdpfn.ops.functions import apply_buckets

__all__ = [
    "accumulate", "check_shards", "gather_collective", "is_positive_number", "reduce", "reduce_scale", "reshard", "storage_address",
    "unshard",
]


def is_positive_number(value: Any) -> bool:
    """Whether ``value`` is an int or float above 0 (not a bool, not NaN): a divisor of summed gradients.

    Example:
        >>> is_positive_number(2), is_positive_number(0.0), is_positive_number(True)
        (True, False, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def reduce_scale(plan: ShardPlan, op: str = "avg", divide_by: float | None = None) -> float:
    """The factor a summed gradient is multiplied by for ``op``/``divide_by`` on ``plan``'s mesh.

    Example:
        >>> reduce_scale(params.plan, "avg")   # 1 / data-parallel ranks   # doctest: +SKIP
    """
    if op not in ("avg", "sum"):
        raise ValueError(f"op={op!r} is not a reduction fsdpfn knows; use op='avg' or op='sum'")
    if divide_by is not None:
        if not is_positive_number(divide_by):
            raise ValueError(f"divide_by={divide_by!r} must be a positive number")
        return 1.0 / float(divide_by)
    return 1.0 / (plan.world * plan.replicas) if op == "avg" else 1.0


def _check_tree(params: Any, what: str) -> ShardPlan:
    if not isinstance(params, Sharded):
        raise TypeError(f"{what}: expected a fsdpfn.Sharded (from fsdpfn.shard), got {type(params).__name__}")
    return params.plan


def _select_units(plan: ShardPlan, units: Sequence[str] | None) -> tuple[UnitPlan, ...]:
    if units is None:
        return plan.groups  # fused units travel together
    if isinstance(units, str):
        units = [units]
    return tuple(plan.unit(u) for u in units)


def check_shards(params: Sharded[Any], fqns: Sequence[str]) -> list[torch.Tensor]:
    """The leaves ``fqns`` of ``params``, checked to be this rank's shards (tensor, shape, dtype)."""
    plan = params.plan
    want = plan.memo.get(("local_shapes",))
    if want is None:
        want = plan.memo[("local_shapes",)] = {f: (torch.Size(plan.specs[f].local_shape(plan.rank)), plan.dtypes[f]) for f in plan.params}
    out = []
    for fqn in fqns:
        leaf = params[fqn]
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"leaf {fqn!r} is {type(leaf).__name__}, expected this rank's shard (a Tensor)")
        want_shape, want_dtype = want[fqn]
        if leaf.shape != want_shape or leaf.dtype != want_dtype:
            raise ValueError(
                f"leaf {fqn!r} is {tuple(leaf.shape)} {leaf.dtype} but rank {plan.rank} of this plan holds "
                f"{tuple(want_shape)} {want_dtype}; it does not belong to this plan (another model, world "
                f"size or dtype?)"
            )
        out.append(leaf)
    return out


def gather_collective(plan: ShardPlan, units: tuple[UnitPlan, ...], scale: float, custom: CustomComms | None = None) -> Buckets:
    """The (cached) differentiable gather of ``units``, whose backward reduces with ``scale``; ``custom``:
    the user's collectives and all-reduce hook for these units (``fsdpfn.compat``'s ``set_custom_*``)."""
    key = ("gather", tuple(u.name for u in units), scale, custom)
    b = plan.memo.get(key)
    if b is None:
        b = plan.memo[key] = collective_pair(
            plan.comm,
            plan.rank,
            fqns=[f for u in units for f in u.fqns],
            gather=[lay for u in units for lay in u.gather],
            reduce_fqns=[f for u in units for lay in u.reduce for f in lay.fqns],
            reduce=[lay for u in units for lay in u.reduce],
            dtypes=dict(plan.dtypes),
            scale=scale,
            label=",".join(u.label for u in units),
            custom=custom,
            transforms=plan.transforms,
        )
    return b


def unshard(
    params: Sharded[torch.Tensor],
    *,
    units: Sequence[str] | None = None,
    op: str = "sum",
    divide_by: float | None = None,
) -> dict[str, torch.Tensor]:
    """All-gather ``params`` into full tensors, keyed like ``module.named_parameters()`` (plus buffers).

    One all-gather per unit bucket (all launched before any is waited for); full tensors are views of
    the gathered buffers, never of the shards (at world 1 they are copies), so they keep their values
    when the optimizer updates the shards in place. Differentiable: the backward is ``reduce`` with ``op``/``divide_by``
    (``op="sum"``, the exact adjoint, by default). ``units`` restricts the gather to some units.
    Tensor-parallel parameters are gathered over the data-parallel mesh only and come back as the
    ``DTensor``s on the TP mesh the TP module expects (their local tensor is this rank's TP slice).

    Example:
        >>> full = fsdpfn.unshard(params)                               # doctest: +SKIP
        >>> out = torch.func.functional_call(model, full, (x,))         # doctest: +SKIP
    """
    plan = _check_tree(params, "unshard")
    chosen = _select_units(plan, units)
    b = gather_collective(plan, chosen, reduce_scale(plan, op, divide_by))
    shards = check_shards(params, b.fqns)
    full = dict(zip(b.fqns, apply_buckets(b, shards)))
    if plan.world == 1:  # nothing moved: the full tensors would be the shards, and follow in-place updates
        full = {f: t.clone() if _same_storage(t, s) else t for (f, t), s in zip(full.items(), shards)}
    for fqn in [f for f in b.fqns if f in plan.tp]:  # tensor-parallel: the TP module's DTensor over the gathered TP-local tensor
        full[fqn] = plan.tp[fqn].tp.wrap(full[fqn])
    if units is None:
        full.update(params.buffers())
    return full


def storage_address(t: Any) -> int | None:
    """The address of plain tensor ``t``'s storage; ``None`` for anything else: a subclass or a tensor with
    no storage to compare (``torch.func``'s wrappers, fake tensors: under those no in-place update can
    follow).

    Example:
        >>> x = torch.zeros(4)
        >>> storage_address(x[1:]) == storage_address(x), storage_address(3)
        (True, None)
    """
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    address = storage_address(a)
    return a is b or (address is not None and address == storage_address(b))


def reshard(full: Mapping[str, torch.Tensor], like: Sharded[Any]) -> Sharded[torch.Tensor]:
    """This rank's slice of every full tensor, as a ``Sharded`` like ``like`` (no communication).

    Buffers missing from ``full`` are taken from ``like``. Differentiable (the backward pads with zeros).

    Example:
        >>> params = fsdpfn.reshard(fsdpfn.unshard(params), params)    # a round trip  # doctest: +SKIP
    """
    plan = _check_tree(like, "reshard")
    leaves: dict[str, Any] = {}
    for fqn in plan.params:
        t = _lookup(full, fqn, plan)
        if t is None:
            raise KeyError(f"reshard: no full tensor for parameter {fqn!r}")
        spec = plan.specs[fqn]
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"reshard: {fqn!r} has shape {tuple(t.shape)}, the plan says {spec.shape}")
        leaves[fqn] = shard_tensor(t, spec, plan.rank)  # narrow + clone: differentiable
    for fqn in plan.buffers:
        leaves[fqn] = full.get(fqn, like[fqn])
    return Sharded._from_children([leaves[k] for k in plan.keys], plan)


def reduce(
    grads: Mapping[str, torch.Tensor | None],
    like: Sharded[Any],
    *,
    op: str = "avg",
    divide_by: float | None = None,
    dtype: torch.dtype | None = None,
) -> Sharded[torch.Tensor | None]:
    """Reduce-scatter full per-rank gradients into this rank's shard gradients.

    ``op="avg"`` divides the sum over data-parallel ranks by their number, ``op="sum"`` does not,
    ``divide_by=F`` divides the sum by ``F``. ``dtype`` is the dtype the collective moves (the result is
    in each parameter's own dtype). One reduce-scatter per unit bucket; HSDP adds one all-reduce over
    the replicate group. The result never shares memory with ``grads`` (at world 1 it is a copy), so
    the caller may reuse its buffers. A missing or ``None`` gradient counts as zero (another rank may have one);
    frozen parameters and buffers come back as ``None``. Differentiable: the backward is ``unshard``.

    Example:
        >>> g = fsdpfn.reduce({"0.weight": full_grad}, params, op="sum")   # doctest: +SKIP
    """
    plan = _check_tree(like, "reduce")
    if isinstance(grads, Sharded):
        raise TypeError(
            "reduce: these gradients are a Sharded tree, i.e. already reduced; only full per-rank gradients "
            "(a mapping, or the Unreduced tree of value_and_grad(reduce=False)) can be reduced"
        )
    if isinstance(grads, Unreduced) and grads.plan is not plan:
        raise ValueError("reduce: the Unreduced gradients were computed for another plan than `like`'s")
    if not isinstance(grads, (Mapping, Unreduced)):
        raise TypeError(f"reduce: grads must be a mapping of parameter name to full gradient, got {type(grads).__name__}")
    by_name: dict[str, torch.Tensor | None] = {}
    for key, g in grads.items():
        if key in plan.buffers:
            continue
        fqn = plan.aliases.get(key, key)
        if fqn not in plan.specs:
            raise KeyError(f"reduce: {key!r} is not a parameter of this plan ({plan.describe()})")
        if g is None:
            continue
        if not plan.requires_grad[fqn]:
            raise ValueError(f"reduce: parameter {fqn!r} is frozen (requires_grad=False) and takes no gradient")
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"reduce: the gradient of {key!r} is {type(g).__name__}, expected a full-size Tensor (or None)")
        if tuple(g.shape) != tuple(plan.specs[fqn].shape):  # a transposed one has the same numel
            raise ValueError(
                f"reduce: gradient of {key!r} has shape {tuple(g.shape)}, expected {tuple(plan.specs[fqn].shape)} "
                "(the parameter's: reduce takes each rank's full-size gradient, shaped as the parameter)"
            )
        prev = by_name.get(fqn)
        by_name[fqn] = g if prev is None else prev + g  # tied names share one gradient
    r = _reduce_collective(plan, reduce_scale(plan, op, divide_by), dtype)
    given = [by_name.get(f) for f in r.fqns]
    out = dict(zip(r.fqns, apply_buckets(r, given)))
    if plan.world == 1:  # nothing moved: the result would be the caller's gradient itself (one reused later)
        out = {f: t.clone() if t is not None and g is not None and _same_storage(t, g) else t for (f, t), g in zip(out.items(), given)}
    return Sharded._from_children([out.get(k) for k in plan.keys], plan)


def _reduce_collective(plan: ShardPlan, scale: float, dtype: torch.dtype | None) -> Buckets:
    key = ("reduce", scale, dtype)
    r = plan.memo.get(key)
    if r is None:
        fqns, layouts = [], []
        for u in plan.groups:
            if dtype is None:
                chosen = u.reduce
            else:
                infos = [ParamInfo(f, plan.specs[f].shape, plan.dtypes[f], True, u.name) for lay in u.reduce for f in lay.fqns]
                chosen = bucket_by_dtype(infos, plan.specs, lambda d: d if d.is_complex else dtype)
            layouts.extend(chosen)
            fqns.extend(f for lay in chosen for f in lay.fqns)
        grad_dtypes = {f: lay.dtype for u in plan.units for lay in u.gather for f in lay.fqns}
        r = plan.memo[key] = reduce_collective(
            plan.comm, plan.rank, fqns, layouts, dict(plan.dtypes), scale, "reduce", grad_dtypes=grad_dtypes
        )
    return r


def _lookup(full: Mapping[str, Any], fqn: str, plan: ShardPlan) -> Any:
    return next((full[n] for n in plan.names(fqn) if n in full), None)


def accumulate(acc: Unreduced | None, grads: Unreduced) -> Unreduced:
    """Add one microbatch's unreduced gradients to an accumulator (``None`` starts one). Local, no
    communication; ``None`` gradients count as zero.

    Example:
        >>> acc = None                                                                    # doctest: +SKIP
        >>> for mb in microbatches:                                                       # doctest: +SKIP
        ...     loss, g = fsdpfn.value_and_grad(loss_fn, reduce=False)(params, mb)
        ...     acc = fsdpfn.accumulate(acc, g)
        >>> grads = fsdpfn.reduce(acc, params)        # one reduce-scatter per bucket       # doctest: +SKIP
    """
    for what, tree in (("grads", grads), ("acc", acc)):
        if tree is not None and not isinstance(tree, Unreduced):
            kind = "already reduced (a Sharded)" if isinstance(tree, Sharded) else type(tree).__name__
            raise TypeError(
                f"accumulate: {what} is {kind}; only the Unreduced gradients of value_and_grad(reduce=False) "
                "accumulate (mixing reduced and unreduced gradients would scale them wrongly)"
            )
    if acc is None:
        return grads
    if acc.plan is not grads.plan:
        raise ValueError("accumulate: the two gradient trees belong to different plans")
    out = {}
    for k, a in acc.items():
        g = grads[k]
        out[k] = g if a is None else a if g is None else a + g
    return Unreduced(out, acc.plan)
