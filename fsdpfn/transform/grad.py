"""``value_and_grad`` and ``grad`` over functions of a ``Sharded`` tree.

The function runs with the trainable shards marked as requiring grad; differentiating it reaches the
shards through each unit's gather, whose backward is the reduce-scatter, so the gradients come back
already reduced (as the ``fsdp`` apply inside the function says) and shaped like the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdpfn.core.pass_check import check_pass
from fsdpfn.layout import Sharded, Unreduced
from fsdpfn.messages import listing
from fsdpfn.ops.api import check_shards, gather_collective, is_positive_number, reduce_scale
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.held import reduce_held
from fsdpfn.ops.span import agreement_comm
from fsdpfn.transform.grad_mode import GradMode
from fsdpfn.transform.fusion import note_accumulation
from fsdpfn.transform.reentrant import has_reentrant_checkpoint, reentrant_error

__all__ = ["grad", "value_and_grad"]


def value_and_grad(
    fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    reduce: bool = True,
    reduce_op: str | None = None,
    divide_by: float | None = None,
    check_finite: bool = False,
    into: Unreduced | Sharded[torch.Tensor] | None = None,
) -> Callable[..., Any]:
    """Return ``g(params, *args, **kwargs) -> (value, grads)`` (``((value, aux), grads)`` with ``has_aux``).

    ``fn(params, *args, **kwargs)`` must return a scalar tensor (or ``(scalar, aux)``). ``grads`` is a
    ``Sharded`` with ``params``' plan: reduced shard gradients in each parameter's own dtype (zeros for a
    trainable parameter ``fn`` did not use, as ``torch.func.grad`` gives, whatever the plan's buckets),
    ``None`` for frozen parameters and buffers. ``value`` is detached.

    The reduction is the one of the ``fsdp`` apply inside ``fn`` unless ``reduce_op`` (``"avg"`` or
    ``"sum"``) or ``divide_by`` say otherwise here. With ``reduce=False`` nothing is communicated in
    backward: ``grads`` is an ``Unreduced`` tree of this rank's full gradients (in the reduction dtype), to
    pass back as ``into=`` (below), or to sum with ``fsdpfn.accumulate`` and reduce with ``fsdpfn.reduce``.

    ``into``: gradient accumulation, adding into the gradients of earlier calls (donated: updated in place
    and returned). An ``Unreduced`` (gradient sync off, as FSDP2's ``set_requires_gradient_sync(False)``):
    with ``reduce=False`` the full gradients are added into it; with ``reduce=True`` each unit's backward
    adds it to its own and reduces the sum (the unit's entries are taken out; those of units this call did
    not reach are reduced after the backward, on every rank alike), so ``grads`` covers every microbatch
    and ``into`` is left empty. A ``Sharded`` of reduced gradients (sync on): each reduction's result is
    added into it as it finishes. Either way no second set of gradients is held: a fresh tree per
    microbatch summed afterwards (``fsdpfn.accumulate`` and ``fsdpfn.reduce``, or a ``tree_map``) holds two
    or three at once.

    ``fn`` may read the shards itself (a penalty on them) and take gradients of its own; called on a tree
    that an enclosing differentiation tracks, the gradients keep their graph (nested, as JAX's ``grad``).
    Differentiating fast weights made from such gradients needs ``reduce_op="sum"`` (docs/functional.md).

    ``check_finite=True`` checks every gradient for NaN/Inf (one small all-reduce, so that every rank
    agrees) and raises ``FloatingPointError`` on every rank naming the leaves and the ranks affected.

    Example:
        >>> apply = fsdpfn.fsdp(model)                                           # doctest: +SKIP
        >>> loss_fn = lambda p, x, y: torch.nn.functional.mse_loss(apply(p, x), y)
        >>> loss, grads = fsdpfn.value_and_grad(loss_fn)(params, x, y)          # doctest: +SKIP
        >>> _, acc = fsdpfn.value_and_grad(loss_fn, reduce=False)(params, x, y)   # accumulate ...   # doctest: +SKIP
        >>> _, grads = fsdpfn.value_and_grad(loss_fn, into=acc)(params, x2, y2)    # ... and reduce  # doctest: +SKIP
        >>> _, grads = fsdpfn.value_and_grad(loss_fn, into=grads)(params, x3, y3)  # sync on: add in  # doctest: +SKIP
    """

    if reduce_op is not None and reduce_op not in ("avg", "sum"):
        raise ValueError(f"value_and_grad: reduce_op={reduce_op!r} is not a reduction fsdpfn knows; use 'avg', 'sum' or None (the apply's)")
    if divide_by is not None and not is_positive_number(divide_by):
        raise ValueError(f"value_and_grad: divide_by={divide_by!r} must be a positive number (or None)")
    if into is not None and not isinstance(into, (Unreduced, Sharded)):
        raise TypeError(
            f"value_and_grad: into is {type(into).__name__}; it takes the gradients of an earlier value_and_grad call (an "
            "Unreduced with reduce=False, or a Sharded of reduced ones), or None, to add this call's gradients into"
        )

    def g(params: Sharded[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # autograd records nothing there: all gradients were zeros
            with torch.inference_mode(False):  # as torch.func.grad, which works under inference_mode
                return differentiate(params, *args, **kwargs)
        return differentiate(params, *args, **kwargs)

    def differentiate(params: Sharded[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        nested = inside_a_graph(params)  # differentiated again by an enclosing gradient (MAML, a penalty)
        tree, inputs = grad_inputs(params, "value_and_grad", keep_graph=nested)
        plan = params.plan
        trainable = [k for k in plan.params if plan.requires_grad[k]]
        sink, carry, fold = _accumulators(into, reduce, plan, nested, trainable)
        # Reductions are left in flight only in the backward below (a backward fn itself runs, e.g.
        # torch.autograd.grad for a sharpness-aware step, gets finished values); their results are added
        # to autograd's here, after the wait (fsdpfn.ops.deferred), or into fold's at each wait.
        deferred = DeferredReductions(active=False, into=fold)
        mode = GradMode(scale=_scale(plan, reduce_op, divide_by), sink=sink, carry=carry, deferred=deferred if sink is None else None)
        tree._mode = mode
        with torch.enable_grad():
            out = fn(tree, *args, **kwargs)
        value, aux = split_value(out, has_aux, "value_and_grad")
        deferred.active = True
        try:
            found = _differentiate(value, inputs, create_graph=nested)
        finally:
            deferred.active = False
            deferred.wait()  # reduce-scatters left in flight by backward: done before any read
        if carry is not None:  # what units this backward did not reach hold: reduced on every rank alike
            found = _with_held(plan, trainable, found, carry, mode.scales[-1] if mode.scales else reduce_scale(plan))
            into._grads = dict.fromkeys(trainable)  # type: ignore[union-attr]  # every gradient it held is in grads now
        check_pass(plan.comm)  # every rank reduced the same units (else they were mixed): before any use
        found = [deferred.add_to(k, g) for k, g in zip(trainable, found)]
        grads: Any
        if sink is not None:
            _check_only_through_units(trainable, found)
            grads = into if into is not None else Unreduced(sink, plan)
        elif fold is not None:  # what autograd returned (a penalty on the shards, reductions it waited for)
            for k, g in zip(trainable, found):
                if g is not None:
                    fold[k].add_(g)
            grads = into
        else:
            grads = shard_grads(plan, found, inputs)
        return finish(plan, value, aux, grads, has_aux=has_aux, check_finite=check_finite, detach=not nested)

    return g


def finish(plan: Any, value: torch.Tensor, aux: Any, grads: Any, *, has_aux: bool, check_finite: bool, detach: bool = True) -> Any:
    """The result of a differentiated step: ``(value, grads)`` or ``((value, aux), grads)``, ``value``
    detached (unless ``detach=False``: a nested gradient), the gradients checked for NaN/Inf when asked;
    counts the step for the collective guard."""
    if check_finite:
        check_grads_finite(grads, plan)
    plan.comm.guard.steps += 1
    if detach:
        value = value.detach()
    return ((value, aux), grads) if has_aux else (value, grads)


def grad_inputs(params: Sharded[torch.Tensor], what: str, *, keep_graph: bool = False) -> tuple[Sharded[torch.Tensor], list[torch.Tensor]]:
    """A tree like ``params`` whose trainable leaves are fresh autograd leaves (``inputs``, in
    ``plan.params`` order), to differentiate a function of ``params`` by. With ``keep_graph`` a leaf that
    an enclosing graph tracks stays connected to it (a view of it), so the gradient can be differentiated
    again."""
    if not isinstance(params, Sharded):
        raise TypeError(f"{what}: the first argument must be a fsdpfn.Sharded, got {type(params).__name__}")
    plan = params.plan
    trainable = [k for k in plan.params if plan.requires_grad[k]]
    live = dict(params.items())
    for k, leaf in zip(trainable, check_shards(params, trainable)):  # named errors, not torch's
        if leaf.is_inference():
            raise RuntimeError(
                f"{what}: leaf {k!r} is an inference tensor (made under torch.inference_mode(): fsdpfn.shard or an "
                "optimizer update inside it), which autograd cannot differentiate. Make the tree outside "
                "inference_mode, or copy it there: params = torch.utils._pytree.tree_map(torch.clone, params)"
            )
        live[k] = leaf.view_as(leaf) if keep_graph and leaf.requires_grad else leaf.detach().requires_grad_()
    return Sharded._from_children(list(live.values()), plan), [live[k] for k in trainable]


def inside_a_graph(params: Sharded[torch.Tensor]) -> bool:
    """Whether ``params`` are tracked by an enclosing differentiation (``value_and_grad`` called inside a
    function being differentiated, on its parameters or on fast weights made from them): the gradient
    must then stay differentiable, as JAX's nested ``grad`` is."""
    if not isinstance(params, Sharded) or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return False  # not a tree: grad_inputs names the mistake
    if params._mode is not None:  # the very tree an enclosing value_and_grad passed to its function
        return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in params.values())
    # a tree computed from one (fast weights): non-leaf tensors. A tree of leaves that merely require
    # grad (set by the user) is not nested: building a graph for it would only cost memory.
    return any(isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None for leaf in params.values())


def split_value(out: Any, has_aux: bool, what: str) -> tuple[torch.Tensor, Any]:
    """``(value, aux)`` of a differentiated function's result, checking ``value`` is a scalar tensor."""
    if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else (
            f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__)
        raise TypeError(f"{what}(has_aux=True): fn must return a pair (value, aux), got {got}; return (loss, aux) or drop has_aux")
    value, aux = out if has_aux else (out, None)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{what}: fn must return a scalar tensor{' (and aux)' if has_aux else ''}, got {got}")
    return value, aux


def _accumulators(into: Any, reduce: bool, plan: Any, nested: bool, trainable: Sequence[str]) -> tuple[Any, Any, Any]:
    """Where a call's gradients go, as ``(sink, carry, fold)``: ``sink``, full gradients kept unreduced
    (``reduce=False``: a fresh dict, or ``into``'s); ``carry``, full gradients deferred earlier that the
    reductions add to theirs (``into`` an ``Unreduced``, ``reduce=True``); ``fold``, shard gradients the
    reduced ones are added into in place (``into`` a ``Sharded``). Tells the planner of backwards that
    defer or accumulate."""
    if into is not None and into.plan is not plan:
        raise ValueError("value_and_grad: into holds the gradients of another plan than params'; pass this model's")
    if not reduce:
        if isinstance(into, Sharded):
            raise ValueError(
                "value_and_grad: into holds reduced gradients (a Sharded) but reduce=False keeps full ones; pass the Unreduced "
                "of an earlier value_and_grad(reduce=False) call, or reduce=True to add reduced gradients into it"
            )
        note_accumulation(plan, "deferring")  # the planner priced backwards that reduce: plan for these too
        return ({} if into is None else into._grads), None, None
    if into is None:
        return None, None, None
    if isinstance(into, Unreduced):
        return None, into._grads, None
    if nested:
        raise ValueError(
            "value_and_grad: into adds the reduced gradients into its tensors in place, which a differentiation of the "
            "gradients (a nested value_and_grad, create_graph) cannot follow; add them out of place instead"
        )
    check_shards(into, trainable)  # (named errors: a tree of another shape or dtype)
    note_accumulation(plan, "accumulating")
    return None, None, {k: into[k] for k in trainable}


def _with_held(plan: Any, trainable: Sequence[str], found: Sequence[torch.Tensor | None], held: dict[str, torch.Tensor | None],
               scale: float) -> list[torch.Tensor | None]:
    """``found`` (the shard gradients of ``trainable``) plus the reductions, with ``scale``, of the full
    gradients ``held`` still holds after a reducing backward took its units' (``fsdpfn.ops.held``)."""
    kept = {f: g for f, g in held.items() if g is not None}
    candidates = [(group.name, f) for group in plan.groups for lay in group.reduce for f in lay.fqns if plan.requires_grad.get(f, False)]
    extra = reduce_held(plan, kept, candidates, lambda name: gather_collective(plan, (plan.group(name),), scale))
    return [g if f not in extra else extra[f] if g is None else g + extra[f] for f, g in zip(trainable, found)]


def shard_grads(plan: Any, found: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]) -> Sharded[torch.Tensor | None]:
    """The gradients of the trainable leaves ``inputs`` (in ``plan.params`` order) as a tree like the
    parameters: zeros where the function did not use a leaf.

    Zeros, not autograd's ``None``: whether backward reaches an unused parameter depends on the plan (a
    member of a bucket whose other members were used gets the bucket's reduced zeros; a unit never
    gathered gets nothing), and a ``None`` would make the optimizer skip the parameter (no weight decay, no
    moment decay) where a zero does not, so the update would change with ``min_bucket_bytes``. Zeros are
    what ``torch.func.grad`` and ``reduce(value_and_grad(reduce=False)(...))`` give too."""
    trainable = [k for k in plan.params if plan.requires_grad[k]]
    by_name = {k: torch.zeros_like(x) if g is None else g for k, g, x in zip(trainable, found, inputs)}
    return Sharded._from_children([by_name.get(k) for k in plan.keys], plan)


def _check_only_through_units(trainable: Sequence[str], found: Sequence[torch.Tensor | None]) -> None:
    """``reduce=False`` keeps each rank's full gradients for a later reduction, whose op is chosen then;
    a gradient that reached a shard directly (``fn`` read the shards itself, an L2 term on them) has no
    place among them and would be dropped: refused by name."""
    direct = [k for k, g in zip(trainable, found) if g is not None]
    if direct:
        listed = listing(direct)
        raise ValueError(
            f"value_and_grad(reduce=False): fn's value depends on the shards of {listed} directly, not only through "
            "an fsdp apply (a penalty on the parameters, say). Their gradient is a shard gradient, with no place "
            "among the unreduced full gradients, and would be lost. Add that term's gradient after fsdpfn.reduce "
            "(or use the optimizer's weight_decay), or differentiate with reduce=True"
        )


def _differentiate(value: torch.Tensor, inputs: list[torch.Tensor], *, create_graph: bool = False) -> Sequence[torch.Tensor | None]:
    if value.requires_grad and inputs:
        if has_reentrant_checkpoint(value):  # autograd.grad would lose its parameters' gradients
            raise reentrant_error("value_and_grad")
        return torch.autograd.grad(value, inputs, allow_unused=True, create_graph=create_graph)
    return (None,) * len(inputs)


def _scale(plan: Any, reduce_op: str | None, divide_by: float | None) -> float | None:
    """The reduction asked for here (``None``: the ``fsdp`` apply's own)."""
    return reduce_scale(plan, reduce_op or "avg", divide_by) if (reduce_op or divide_by is not None) else None


def grad(
    fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    reduce: bool = True,
    reduce_op: str | None = None,
    divide_by: float | None = None,
    check_finite: bool = False,
) -> Callable[..., Any]:
    """Like ``value_and_grad`` but returns only ``grads`` (``(grads, aux)`` with ``has_aux``).

    Example:
        >>> grads = fsdpfn.grad(loss_fn)(params, x, y)    # doctest: +SKIP
    """
    vg = value_and_grad(fn, has_aux=has_aux, reduce=reduce, reduce_op=reduce_op, divide_by=divide_by, check_finite=check_finite)

    def g(params: Sharded[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        (value_aux, grads) = vg(params, *args, **kwargs)
        return (grads, value_aux[1]) if has_aux else grads

    return g


def check_grads_finite(grads: Any, plan: Any) -> None:
    """Raise on every rank if any rank has a non-finite gradient, naming the leaves and (global) ranks.
    With tensor parallelism every dp x tp rank takes part: each holds other slices."""
    names = [k for k in plan.params if plan.requires_grad[k]]
    flags, me, comm = _rank_flags(plan, len(names))
    for i, k in enumerate(names):
        g = grads[k]
        if g is not None and not bool(torch.isfinite(g).all()):
            flags[i, me] = 1.0
    if flags.shape[1] > 1:
        comm.all_reduce_sum(flags, label="check_finite").wait()
    ranks = comm.mesh.mesh.flatten().tolist() if comm is not None else [0]
    bad = [(names[i], ranks[r]) for i, r in flags.nonzero().tolist()]
    if bad:
        where = ", ".join(f"{leaf!r} on rank {r}" for leaf, r in bad)
        raise FloatingPointError(f"value_and_grad(check_finite=True): non-finite gradient in {where}")


def _rank_flags(plan: Any, rows: int) -> tuple[torch.Tensor, int, Any]:
    """Zero flags ``(rows, ranks)`` over the ranks holding the tree, this rank's column, and the ``Comm``
    that sums them (column ``c`` is global rank ``comm.mesh.mesh.flatten()[c]``)."""
    comm = agreement_comm(plan)
    if comm is None:
        return torch.zeros(rows, 1, dtype=torch.float64), 0, None
    groups = comm.groups
    me = groups.rank + groups.world * (torch.distributed.get_rank(groups.replicate_group) if groups.replicas > 1 else 0)
    return torch.zeros(rows, groups.world * groups.replicas, dtype=torch.float64), me, comm
