"""SGD (with momentum, dampening, Nesterov, weight decay) on sharded parameters, built on
``torch.optim``'s functional foreach kernel. Each rank updates its own shards; nothing is communicated.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.optim.sgd import sgd as _torch_sgd

from fsdpfn.layout import Sharded
from fsdpfn.layout.plan import OPTIMIZER_MEMO
from fsdpfn.optim._common import (
    DecayMask,
    GradientTransformation,
    LearningRate,
    check_grads,
    check_lr,
    check_mask,
    check_number,
    check_params,
    check_state_tree,
    check_state_type,
    clone_tree,
    follow_plan,
    foreach_groups,
    new_count,
    new_step,
    next_count,
    prepare_params,
    real,
    resolve_lr,
    split_by_decay,
    state_tree,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of ``sgd``: trees like ``params`` (``None`` at frozen parameters and buffers).

    ``count`` is the number of ``update`` calls (an ``int``). ``momentum_buffer`` holds a buffer per
    trainable parameter when ``momentum > 0`` (allocated by ``init``); ``torch.optim.SGD`` starts a buffer
    as the parameter's first gradient itself, which a zeroed buffer gives exactly unless ``dampening``
    scales that gradient, so only with ``dampening != 0`` does ``step`` count the updates each parameter
    received (a ``None`` gradient skips it: its buffer starts at its first gradient). Otherwise ``step`` is
    all ``None``, and with ``momentum == 0`` so is ``momentum_buffer``: no state per parameter beyond
    ``torch.optim.SGD``'s.

    Example:
        >>> state = fsdpfn.optim.sgd(0.1, momentum=0.9).init(params)   # doctest: +SKIP
        >>> state.momentum_buffer["0.weight"].shape                    # doctest: +SKIP
    """

    count: int
    step: Sharded[Any]
    momentum_buffer: Sharded[Any]


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    inplace: bool = True,
    weight_decay_mask: DecayMask = None,
) -> GradientTransformation:
    """``torch.optim.SGD`` as an optax-shaped transformation over ``Sharded`` parameters.

    ``lr`` is a number or a schedule ``lr(step) -> float``, called once per ``update`` with ``step`` =
    the number of the update being made, counted from 1. Only trainable parameters whose gradient is
    not ``None`` are updated; frozen parameters, buffers and ``None`` gradients are skipped. With
    ``inplace=True`` (the default) parameter shards and momentum buffers are updated in place and
    returned in new containers (the inputs are donated); with ``inplace=False`` they are cloned first
    and the inputs stay untouched. Gradients are never modified (torch's foreach Nesterov path adds into
    the gradients; here it works on a copy). Runs ``torch.optim.sgd.sgd(..., foreach=True)`` on this
    rank's shards, in groups of at most an eighth of their bytes (or the largest shard: bounded temporaries); complex parameters are viewed as real pairs (SGD is elementwise, so this is exact).
    ``weight_decay_mask`` says which parameters ``weight_decay`` applies to, as in ``adamw``.

    Example:
        >>> opt = fsdpfn.optim.sgd(lr=0.1, momentum=0.9, nesterov=True)   # doctest: +SKIP
        >>> state = opt.init(params)                                       # doctest: +SKIP
        >>> params, state = opt.update(grads, state, params)               # doctest: +SKIP
    """
    what = "fsdpfn.optim.sgd"
    lr = check_lr(what, lr)
    momentum = check_number(what, "momentum", momentum)
    dampening = check_number(what, "dampening", dampening)
    weight_decay = check_number(what, "weight_decay", weight_decay)
    nesterov, maximize, inplace = bool(nesterov), bool(maximize), bool(inplace)
    mask = check_mask(what, weight_decay_mask)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{what}: nesterov=True requires momentum > 0 and dampening == 0")
    counted = momentum != 0 and dampening != 0  # per-parameter step counters (see SGDState)

    zeros = functools.partial(torch.zeros_like, memory_format=torch.preserve_format)
    makers = {
        "step": (lambda p: new_step()) if counted else None,  # only a dampened buffer's first step needs it
        "momentum_buffer": zeros if momentum != 0 else None,
    }

    def init(params: Sharded[torch.Tensor]) -> SGDState:
        """Zeroed momentum buffers for trainable parameters when ``momentum > 0``, and step counters when
        ``dampening != 0`` too (``None`` otherwise).

        Example:
            >>> state = fsdpfn.optim.sgd(0.1, momentum=0.9).init(params)   # doctest: +SKIP
        """
        check_params(params, f"{what}.init")
        params.plan.memo[OPTIMIZER_MEMO] = "sgd_momentum" if momentum != 0 else "sgd"  # for fsdp's first call
        return SGDState(new_count(), **{name: state_tree(params, make) for name, make in makers.items()})

    def update(
        grads: Sharded[Any], state: SGDState, params: Sharded[torch.Tensor]
    ) -> tuple[Sharded[torch.Tensor], SGDState]:
        """One SGD step on this rank's shards: returns ``(new_params, new_state)``.

        Example:
            >>> params, state = opt.update(grads, state, params)   # doctest: +SKIP
        """
        where = f"{what}.update"
        check_params(params, where)
        check_state_type(state, SGDState, where)
        state = follow_plan(state, params, makers)  # made before fsdpfn.freeze/unfreeze: onto params' plan
        fqns = check_grads(grads, params, where)
        check_state_tree(state.step, "step", params, fqns if counted else (), where, scalar=True)
        check_state_tree(state.momentum_buffer, "momentum_buffer", params, fqns if momentum != 0 else (), where)
        new_params = prepare_params(params, fqns, inplace)
        if not inplace:
            state = SGDState(state.count, clone_tree(state.step), clone_tree(state.momentum_buffer))
        number = next_count(state.count)  # of the update being made, counted from 1
        lr_now = resolve_lr(where, lr, number)
        decayed, plain = split_by_decay(where, mask, params, fqns)
        with torch.no_grad():
            for part, wd in ((decayed, weight_decay), (plain, 0.0)):
                for group in foreach_groups(part, [new_params[f] for f in part]) if part else ():  # bounded temporaries
                    _step(group, new_params, grads, state, lr_now, momentum, dampening, wd, nesterov, maximize, counted)
        if inplace:
            params.donate(where)  # its leaves are new_params' now: reading the old tree raises
        return new_params, state._replace(count=number)

    return GradientTransformation(init, update)


def _step(
    fqns: list[str],
    params: Sharded[torch.Tensor],
    grads: Sharded[Any],
    state: SGDState,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    counted: bool,
) -> None:
    """Run torch's foreach SGD kernel on the leaves ``fqns`` (in place on ``params`` and ``state``)."""
    steps = [state.step[f] for f in fqns] if counted else []
    grad_list = [real(grads[f]) for f in fqns]
    fresh = [False] * len(fqns)
    bufs: list[torch.Tensor | None] = [None] * len(fqns)
    if momentum != 0:
        # torch.optim.SGD starts a buffer as a copy of the first gradient. Undampened, the zeroed buffer
        # gives that exactly (0 * momentum + grad); dampened, hand the kernel None for a parameter's first
        # step, then copy the buffer it made into our preallocated one.
        fresh = torch.stack(steps).eq(0).tolist() if counted else fresh
        bufs = [None if new else real(state.momentum_buffer[f]) for f, new in zip(fqns, fresh)]
        if nesterov and not maximize and weight_decay == 0:
            grad_list = [g.clone() for g in grad_list]  # the foreach kernel would add into the caller's grads
    _torch_sgd(
        [real(params[f]) for f in fqns],
        grad_list,
        bufs,
        foreach=True,
        weight_decay=weight_decay,
        momentum=momentum,
        lr=lr,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
    )
    for f, new, b in zip(fqns, fresh, bufs):
        if new:
            real(state.momentum_buffer[f]).copy_(b)
    if steps:
        torch._foreach_add_(steps, 1.0)
