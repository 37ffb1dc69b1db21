"""Shared plumbing of ``fsdpfn.optim``: the transformation tuple, learning rates, tree validation.

Everything here is local to one rank: optimizers update this rank's shards and never communicate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Union

import torch

from fsdpfn.layout import Unreduced, Sharded, ShardPlan
from fsdpfn.layout.autobucket import FOREACH_PARTS
from fsdpfn.layout.trainable import same_origin

__all__ = ["DecayMask", "GradientTransformation", "LearningRate"]

LearningRate = Union[float, Callable[[int], float]]
"""A constant learning rate, or a schedule ``lr(step) -> float`` called once per ``update`` with
``step`` = the number of updates made so far including this one (``1`` on the first ``update``)."""

DecayMask = Union[Callable[[str, tuple[int, ...]], bool], Mapping[str, bool], None]
"""Which parameters weight decay applies to: a predicate on (FQN, full shape), or FQN -> bool (names it
leaves out decay); ``None``: every trainable parameter."""


class GradientTransformation(NamedTuple):
    """An optax-shaped optimizer: ``init(params) -> state`` and ``update(grads, state, params) ->
    (params, state)``.

    Example:
        >>> opt = fsdpfn.optim.adamw(lr=1e-3)                     # doctest: +SKIP
        >>> state = opt.init(params)                              # doctest: +SKIP
        >>> params, state = opt.update(grads, state, params)      # doctest: +SKIP
    """

    init: Callable[[Sharded[torch.Tensor]], Any]
    update: Callable[[Sharded[Any], Any, Sharded[torch.Tensor]], tuple[Sharded[torch.Tensor], Any]]


# --- hyper-parameters ---------------------------------------------------------------------------
def check_number(what: str, name: str, value: Any, *, low: float = 0.0, high: float | None = None) -> float:
    """``value`` as a float in ``[low, high)`` (``high`` open), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {name} must be a number, got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or v < low or (high is not None and v >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{what}: invalid {name}={value!r}; it must be {bound}")
    return v


def check_lr(what: str, lr: LearningRate) -> LearningRate:
    """A non-negative number or a callable schedule."""
    if callable(lr):
        return lr
    return check_number(what, "lr", lr)


def resolve_lr(what: str, lr: LearningRate, step: int) -> float:
    """The learning rate of update number ``step`` (counted from 1)."""
    if not callable(lr):
        return float(lr)
    value = lr(step)
    if isinstance(value, torch.Tensor):
        value = value.item()
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{what}: the lr schedule returned {value!r} for step {step}; a learning rate must be >= 0")
    return value


def new_count() -> int:
    """The global update counter: a Python ``int``, so the state's tensors are exactly ``torch.optim``'s
    (a 0-d tensor here put a step's peak 8 bytes above FSDP2's wherever the rest tied)."""
    return 0


def new_step() -> torch.Tensor:
    """A per-leaf step counter exactly as ``torch.optim`` keeps it (0-d CPU float tensor)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.zeros((), dtype=dtype)


# --- trees --------------------------------------------------------------------------------------
def check_params(params: Any, what: str) -> ShardPlan:
    """``params`` must be a ``Sharded`` whose trainable leaves are this rank's shards."""
    if not isinstance(params, Sharded):
        raise TypeError(f"{what}: params must be a fsdpfn.Sharded (from fsdpfn.shard), got {type(params).__name__}")
    plan = params.plan
    for fqn in trainable(plan):
        leaf = params[fqn]
        want = plan.specs[fqn].local_shape(plan.rank)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what}: params leaf {fqn!r} is {type(leaf).__name__}, expected this rank's shard (a Tensor)"
            )
        if tuple(leaf.shape) != want or leaf.dtype != plan.dtypes[fqn]:
            raise ValueError(
                f"{what}: params leaf {fqn!r} is {tuple(leaf.shape)} {leaf.dtype} but rank {plan.rank} of its plan "
                f"holds {want} {plan.dtypes[fqn]}"
            )
    return plan


def trainable(plan: ShardPlan) -> list[str]:
    """Parameters that take gradients, in plan order."""
    return [f for f in plan.params if plan.requires_grad[f]]


def state_tree(params: Sharded[torch.Tensor], make: Callable[[torch.Tensor], Any] | None) -> Sharded[Any]:
    """A tree like ``params``: ``make(shard)`` on trainable parameters, ``None`` elsewhere."""
    plan = params.plan
    train = set(trainable(plan)) if make is not None else set()
    return Sharded({k: make(params[k]) if k in train else None for k in plan.keys}, plan)  # type: ignore[misc]


Maker = Union[Callable[[torch.Tensor], Any], None]
"""What an optimizer's ``init`` fills one state tree with at a trainable parameter (``None``: nothing)."""


def follow_plan(state: Any, params: Sharded[torch.Tensor], makers: Mapping[str, Maker]) -> Any:
    """``state`` (a NamedTuple whose trees ``makers`` names, each with what ``init`` fills it with) on
    ``params``' plan. A state made for another plan of the same ``shard`` call (before ``fsdpfn.freeze``
    or ``fsdpfn.unfreeze``) moves onto it: a parameter that trains now and has no state gets
    ``make(shard)``, as ``torch.optim`` creates state at a parameter's first gradient; every other leaf is
    kept (a frozen parameter keeps its state, as under ``torch.optim``). Any other state is returned as it
    is, for the checks that follow to name what is wrong with it."""
    plan = params.plan
    trees = {name: getattr(state, name) for name in makers}
    if not all(isinstance(t, Sharded) and t.plan is not plan and same_origin(t.plan, plan) for t in trees.values()):
        return state
    moved = {}
    for name, tree in trees.items():
        make = makers[name]
        fresh = {k for k in plan.params if plan.requires_grad[k] and tree[k] is None}
        leaves = {k: make(params[k]) if make is not None and k in fresh else tree[k] for k in plan.keys}
        moved[name] = Sharded(leaves, plan)
    return state._replace(**moved)


def plan_mismatch(other: ShardPlan, plan: ShardPlan) -> str:
    """Why ``other`` is not ``plan``, naming a leaf where one differs."""
    missing = [k for k in plan.params if k not in other.specs]
    extra = [k for k in other.params if k not in plan.specs]
    if missing or extra:
        parts = ([f"it lacks {missing}"] if missing else []) + ([f"it has {extra} that params lack"] if extra else [])
        return "; ".join(parts)
    for k in plan.params:
        a, b = other.specs[k], plan.specs[k]
        if a != b or other.dtypes[k] != plan.dtypes[k]:
            return (
                f"leaf {k!r} is {a.shape} {other.dtypes[k]} over {a.world} ranks there but "
                f"{b.shape} {plan.dtypes[k]} over {b.world} ranks in params"
            )
    first = repr(plan.params[0]) if plan.params else "<none>"
    return f"the same leaves ({first}, ...) but from another fsdpfn.shard call"


def check_grads(grads: Any, params: Sharded[torch.Tensor], what: str) -> list[str]:
    """Validate ``grads`` against ``params``; return the names of the leaves to update
    (trainable parameters whose gradient is not ``None``). Buffer leaves of ``grads`` are ignored."""
    plan = params.plan
    if isinstance(grads, Unreduced):
        raise TypeError(
            f"{what}: grads are Unreduced (value_and_grad(reduce=False)); reduce them first with "
            "fsdpfn.reduce(grads, params)"
        )
    if not isinstance(grads, Sharded):
        raise TypeError(f"{what}: grads must be a fsdpfn.Sharded like params, got {type(grads).__name__}")
    if grads.plan is not plan:
        raise ValueError(
            f"{what}: grads were built for another plan than params ({plan_mismatch(grads.plan, plan)}); "
            f"compute them from these params (fsdpfn.value_and_grad / fsdpfn.reduce(..., like=params))"
        )
    fqns = []
    for fqn in plan.params:
        g = grads[fqn]
        if g is None:
            continue
        if not plan.requires_grad[fqn]:
            raise ValueError(
                f"{what}: grads leaf {fqn!r} is a {type(g).__name__} but parameter {fqn!r} is frozen "
                f"(requires_grad=False); its gradient must be None"
            )
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{what}: grads leaf {fqn!r} is {type(g).__name__}, expected a Tensor or None")
        p = params[fqn]
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(
                f"{what}: grads leaf {fqn!r} has shape {tuple(g.shape)} {g.dtype} on {g.device} but the param "
                f"shard is {tuple(p.shape)} {p.dtype} on {p.device}"
            )
        fqns.append(fqn)
    return fqns


def check_state_tree(
    tree: Any, field: str, params: Sharded[torch.Tensor], fqns: Sequence[str], what: str, *, scalar: bool = False
) -> None:
    """``state.<field>`` must be a ``Sharded`` of ``params``'s plan holding a tensor for every leaf in
    ``fqns``: shaped like the param shard, or a 0-d step counter when ``scalar``."""
    plan = params.plan
    if not isinstance(tree, Sharded):
        raise TypeError(f"{what}: state.{field} must be a fsdpfn.Sharded, got {type(tree).__name__}")
    if tree.plan is not plan:
        raise ValueError(
            f"{what}: state.{field} was built for another plan than params ({plan_mismatch(tree.plan, plan)}); "
            f"create the state with init(params) for these params"
        )
    for fqn in fqns:
        t = tree[fqn]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: state.{field} leaf {fqn!r} is {type(t).__name__}, expected a Tensor")
        p = params[fqn]
        if scalar:
            if t.dim() != 0:
                raise ValueError(f"{what}: state.{field} leaf {fqn!r} has shape {tuple(t.shape)}, expected a 0-d step")
        elif t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(
                f"{what}: state.{field} leaf {fqn!r} has shape {tuple(t.shape)} {t.dtype} on {t.device} but the "
                f"param shard is {tuple(p.shape)} {p.dtype} on {p.device}"
            )


def check_state_type(state: Any, cls: type, what: str) -> None:
    """``state`` must be a ``cls`` whose ``count`` is an ``int`` (or, from states made before it was one,
    a 0-d tensor)."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{what}: state must be the {cls.__name__} that init(params) returned, got {type(state).__name__}"
        )
    count = state.count
    if isinstance(count, bool) or not (isinstance(count, int) or (isinstance(count, torch.Tensor) and count.dim() == 0)):
        raise TypeError(f"{what}: state.count must be an int (the number of updates made), got {count!r}")


# --- updates ------------------------------------------------------------------------------------
def clone_tree(tree: Sharded[Any]) -> Sharded[Any]:
    """A copy of ``tree`` with every tensor leaf cloned (``None`` stays ``None``)."""
    return Sharded({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tree.items()}, tree.plan)


def prepare_params(params: Sharded[torch.Tensor], fqns: Sequence[str], inplace: bool) -> Sharded[torch.Tensor]:
    """The tree to update: ``params`` in a new container, with the updated leaves cloned unless ``inplace``."""
    return params.replace({} if inplace else {f: params[f].clone() for f in fqns})


# A foreach kernel allocates temporaries as large as the tensors it is given (Adam's denominator, SGD's
# Nesterov copy): given every shard at once, one more copy of all of them at the optimizer step, the
# step's peak. Calls over groups of at most 1/FOREACH_PARTS of the bytes (or the largest tensor) bound
# that temporary, at a few more kernel launches.


def foreach_groups(fqns: Sequence[str], tensors: Sequence[torch.Tensor], parts: int = FOREACH_PARTS) -> list[list[str]]:
    """``fqns`` cut, in order, into runs of at most ``max(total / parts, largest)`` bytes of ``tensors``.

    Example:
        >>> [len(g) for g in foreach_groups(["a", "b", "c"], [torch.zeros(4)] * 3, parts=3)]
        [1, 1, 1]
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    if not sizes:
        return []
    cap = max(sum(sizes) / parts, max(sizes))
    groups: list[list[str]] = [[]]
    held = 0
    for f, n in zip(fqns, sizes):
        if groups[-1] and held + n > cap:
            groups.append([])
            held = 0
        groups[-1].append(f)
        held += n
    return groups


def real(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as real pairs when complex (what ``torch.optim`` does for complex parameters)."""
    return torch.view_as_real(t) if t.is_complex() else t


def next_count(count: int | torch.Tensor) -> int:
    """``count + 1`` as an ``int``: the number of the update being made, and the count after it (a 0-d
    tensor from an older state is read once)."""
    return int(count) + 1


def check_mask(what: str, mask: Any) -> DecayMask:
    """``weight_decay_mask`` as given: ``None``, a callable or a mapping of bools (else TypeError)."""
    if mask is None or callable(mask):
        return mask
    if isinstance(mask, Mapping):
        bad = [k for k, v in mask.items() if not isinstance(v, bool)]
        if bad:
            raise TypeError(f"{what}: weight_decay_mask[{bad[0]!r}] must be True or False, got {mask[bad[0]]!r}")
        return mask
    raise TypeError(
        f"{what}: weight_decay_mask must be None, a function (fqn, shape) -> bool or a mapping fqn -> bool, "
        f"got {type(mask).__name__}"
    )


def split_by_decay(what: str, mask: DecayMask, params: Sharded[Any], fqns: Sequence[str]) -> tuple[list[str], list[str]]:
    """``fqns`` (in order) split into those weight decay applies to and the others, as ``mask`` says.

    Example:
        >>> split_by_decay("adamw", lambda fqn, shape: len(shape) >= 2, params, ["0.weight", "0.bias"])   # doctest: +SKIP
        (['0.weight'], ['0.bias'])
    """
    if mask is None:
        return list(fqns), []
    if isinstance(mask, Mapping):
        unknown = [k for k in mask if k not in params.plan.specs]
        if unknown:
            raise ValueError(f"{what}: weight_decay_mask names {unknown[0]!r}, which is not a parameter of this tree")
        flags = [mask.get(f, True) for f in fqns]
    else:
        flags = []
        for f in fqns:
            got = mask(f, tuple(params.plan.specs[f].shape))
            if not isinstance(got, bool):
                raise TypeError(f"{what}: weight_decay_mask({f!r}, shape) must return True or False, got {got!r}")
            flags.append(got)
    return [f for f, d in zip(fqns, flags) if d], [f for f, d in zip(fqns, flags) if not d]
