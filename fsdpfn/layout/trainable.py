"""Which parameters train: ``freeze`` and ``unfreeze`` a sharded model's parameters between steps.

A ``Sharded`` tree's plan says which parameters take gradients: a frozen parameter's gathered copy takes
none and its unit reduces nothing for it. Setting ``requires_grad`` on the module after ``shard`` changes
nothing there (``apply`` refuses it, naming the parameter), so freezing a backbone for the first epochs,
or unfreezing layers one by one, goes through these two functions. They return the tree on a plan that
differs from the one ``shard`` built (its ``origin``) only in those flags and the reduce buckets that follow
from them; the shards are shared, not copied. One derived plan per pattern of flags is kept on the origin,
so every tree moved to the same flags (parameters, an EMA copy) gets the same plan, and moving back to
the original flags gives the original plan. ``fsdpfn.optim`` takes a state made for any plan of the same
origin: a parameter that starts to train gets fresh state at its first update, as ``torch.optim`` creates
it at a parameter's first gradient; a frozen one keeps its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar, Union

import torch  # noqa: F401 - the doctests' namespace

from fsdpfn.layout.grouping import FUSED, ParamInfo, UnitPlan, bucket_by_dtype, fuse_runs
from fsdpfn.layout.plan import FORWARD_SPANS_MEMO, KEPT_GATHERED_MEMO, ShardPlan, _PLAN_STATE
from fsdpfn.layout.sharded import Sharded

__all__ = ["Selection", "freeze", "same_origin", "select", "unfreeze", "with_requires_grad"]

T = TypeVar("T")

Selection = Union[str, Iterable[str], Callable[[str], bool]]
"""Which parameters: a name or names (a parameter's FQN, or a module's, meaning every parameter under it,
as ``module.get_submodule(name).parameters()``), or a predicate on each parameter's FQN."""

# origin.memo[(_DERIVED, flags)]: the plan derived for that requires_grad pattern (plan state: kept by regroup)
_DERIVED = "requires_grad"
# plan state that a derived plan shares with its origin's at derivation; "validated" and "applies" are
# left out: apply checks the module against the new flags, and registers itself on its first call
_SHARED_STATE = (_PLAN_STATE - {"validated", "applies", _DERIVED}) | {FORWARD_SPANS_MEMO[0], KEPT_GATHERED_MEMO[0]}


def freeze(tree: Sharded[T], which: Selection) -> Sharded[T]:
    """``tree`` with the parameters ``which`` selects frozen: they take no gradient (``None`` in
    ``value_and_grad``'s grads) and their units reduce nothing for them. The leaves are shared.

    Example:
        >>> params = fsdpfn.freeze(params, "backbone")          # doctest: +SKIP
        >>> loss, grads = fsdpfn.value_and_grad(loss_fn)(params, batch)   # no gradient for backbone.*  # doctest: +SKIP
        >>> params = fsdpfn.unfreeze(params, "backbone")        # doctest: +SKIP
    """
    return _set(tree, which, False, "freeze")


def unfreeze(tree: Sharded[T], which: Selection) -> Sharded[T]:
    """``tree`` with the parameters ``which`` selects trainable again (or for the first time: a
    parameter frozen when ``shard`` ran). The leaves are shared.

    Example:
        >>> params = fsdpfn.unfreeze(params, ["layers.10", "layers.11"])   # doctest: +SKIP
    """
    return _set(tree, which, True, "unfreeze")


def _set(tree: Sharded[T], which: Selection, value: bool, what: str) -> Sharded[T]:
    if not isinstance(tree, Sharded):
        raise TypeError(f"fsdpfn.{what}: expected a fsdpfn.Sharded tree, got {type(tree).__name__}")
    plan = tree.plan
    chosen = select(plan, which, f"fsdpfn.{what}")
    flags = {f: value if f in chosen else plan.requires_grad[f] for f in plan.params}
    for f in chosen if value else ():
        if not (plan.dtypes[f].is_floating_point or plan.dtypes[f].is_complex):
            raise ValueError(
                f"fsdpfn.{what}: parameter {f!r} is {plan.dtypes[f]}; only floating-point and complex parameters "
                "can take gradients"
            )
    new = with_requires_grad(plan, flags)
    if new is plan:
        return tree
    return Sharded._from_children([tree[k] for k in plan.keys], new)


def select(plan: ShardPlan, which: Selection, what: str) -> set[str]:
    """The parameters (owning FQNs) ``which`` selects in ``plan``; a name that selects nothing raises,
    listing some that exist. A tied parameter is selected by any of its names.

    Example:
        >>> from fsdpfn.layout.plan import build_plan
        >>> infos = [ParamInfo(f"b{i}.w", (2,), torch.float32, True, "") for i in range(3)]
        >>> sorted(select(build_plan(infos, [], [""], rank=0, world=1), ["b0", "b2.w"], "demo"))
        ['b0.w', 'b2.w']
    """
    names = {f: plan.names(f) for f in plan.params}
    if callable(which):
        return {f for f, ns in names.items() if any(bool(which(n)) for n in ns)}
    given = [which] if isinstance(which, str) else list(which)
    out: set[str] = set()
    for name in given:
        if not isinstance(name, str):
            raise TypeError(f"{what}: names must be strings (parameter or module FQNs), got {type(name).__name__}")
        hit = {f for f, ns in names.items() if any(_under(n, name) for n in ns)}
        if not hit:
            known = sorted({n.rpartition(".")[0] or n for ns in names.values() for n in ns})
            raise ValueError(
                f"{what}: {name!r} names no parameter or module of this tree ({plan.module_type}); "
                f"modules with parameters include {known[:8]}{' ...' if len(known) > 8 else ''}"
            )
        out |= hit
    return out


def _under(fqn: str, name: str) -> bool:
    return name == "" or fqn == name or fqn.startswith(name + ".")


def with_requires_grad(plan: ShardPlan, flags: Mapping[str, bool]) -> ShardPlan:
    """The plan of ``plan``'s origin with ``requires_grad`` set to ``flags`` (owning FQN -> bool, every
    parameter): the origin itself when the flags are its own, else the one derived plan kept for them.

    Example:
        >>> from fsdpfn.layout.plan import build_plan
        >>> infos = [ParamInfo(f"b{i}.w", (2,), torch.float32, True, f"b{i}") for i in range(2)]
        >>> plan = build_plan(infos, [], ["b0", "b1"], rank=0, world=1)
        >>> frozen = with_requires_grad(plan, {"b0.w": False, "b1.w": True})
        >>> [len(u.reduce) for u in frozen.units], frozen.origin is plan
        ([0, 1], True)
        >>> with_requires_grad(frozen, {"b0.w": True, "b1.w": True}) is plan
        True
    """
    origin = plan.origin or plan
    pattern = tuple(bool(flags[f]) for f in origin.params)
    if pattern == tuple(origin.requires_grad[f] for f in origin.params):
        return origin
    key = (_DERIVED, pattern)
    found = origin.memo.get(key)
    if found is None:
        found = origin.memo[key] = _derive(origin, dict(zip(origin.params, pattern)))
    return found


def same_origin(a: ShardPlan, b: ShardPlan) -> bool:
    """Whether plans ``a`` and ``b`` come from one ``shard`` call (they differ at most in which
    parameters train)."""
    return (a.origin or a) is (b.origin or b)


def _derive(origin: ShardPlan, requires_grad: dict[str, bool]) -> ShardPlan:
    units = tuple(_reduce_for(u, origin, requires_grad) for u in origin.units)
    sizes = [len(g.name.split(FUSED)) for g in origin.groups if g.name]
    fused = any(k > 1 for k in sizes)
    groups = fuse_runs(units, origin.specs, sizes) if fused else units
    memo = {k: v for k, v in origin.memo.items() if isinstance(k, tuple) and k and k[0] in _SHARED_STATE}
    return dataclasses.replace(
        origin,
        requires_grad=requires_grad,
        units=units,
        groups=groups,
        group_of=dict(origin.group_of),
        origin=origin,
        memo=memo,
        _by_name={},
        _by_group={},
    )


def _reduce_for(unit: UnitPlan, plan: ShardPlan, requires_grad: Mapping[str, bool]) -> UnitPlan:
    """``unit`` with reduce buckets for the members that train under ``requires_grad``, each in the
    reduction dtype its unit's mixed-precision policy gives (as ``build_plan`` made them)."""
    policy = plan.policy(unit.name)
    to_reduce = policy.grad_reduce_dtype if policy is not None else (lambda d: d)
    trains = [f for f in unit.fqns if requires_grad[f]]
    members = [ParamInfo(f, plan.specs[f].shape, plan.dtypes[f], True, unit.name) for f in trains]
    return dataclasses.replace(unit, reduce=bucket_by_dtype(members, plan.specs, to_reduce))
