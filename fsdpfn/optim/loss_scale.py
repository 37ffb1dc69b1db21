"""Dynamic loss scaling for float16 training, ``torch.amp.GradScaler``'s rule as a pure function pair.

float16 gradients underflow unless the loss is scaled up before differentiation and the gradients scaled
back down after; a step whose gradients overflowed (Inf/NaN on any rank) is skipped and the scale backed
off, and after ``growth_interval`` good steps in a row it grows. Every rank must make the same decision,
so ``unscale`` sums one flag over the ranks holding the tree (one small all-reduce; with tensor
parallelism, every dp x tp rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fsdpfn.layout import Sharded, Unreduced
from fsdpfn.ops.span import agreement_comm
from fsdpfn.optim._common import real

__all__ = ["LossScale", "LossScaleState", "loss_scale"]


class LossScaleState(NamedTuple):
    """State of ``loss_scale``: the current ``scale`` (a ``float``) and the number of finite steps since
    it last changed (``good_steps``, an ``int``). Plain numbers, so ``fsdpfn.save`` writes them to its JSON
    sidecar and ``load`` restores them.

    Example:
        >>> loss_scale().init()
        LossScaleState(scale=65536.0, good_steps=0)
    """

    scale: float
    good_steps: int


class LossScale(NamedTuple):
    """What ``loss_scale`` returns: ``init() -> state``, ``scale(value, state) -> value * state.scale`` and
    ``unscale(grads, state) -> (grads, finite, state)`` (see ``loss_scale``)."""

    init: Callable[[], LossScaleState]
    scale: Callable[[torch.Tensor, LossScaleState], torch.Tensor]
    unscale: Callable[[Sharded[Any], LossScaleState], tuple[Sharded[Any], bool, LossScaleState]]


def loss_scale(
    init_scale: float = 2.0**16,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> LossScale:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults and update rule.

    ``scale(loss, state)`` multiplies the loss to differentiate. ``unscale(grads, state)`` divides the
    ``Sharded`` gradients by the scale **in place** (they are donated, as optimizer inputs are), checks them
    for Inf/NaN on every rank that holds the tree (one all-reduce of one number), and returns ``(grads,
    finite, new_state)``: ``finite`` is the same ``bool`` on every rank; skip the optimizer update when it
    is ``False``. The new state backs the scale off by ``backoff_factor`` after a non-finite step, and
    grows it by ``growth_factor`` after ``growth_interval`` finite steps in a row. The value
    ``value_and_grad`` returns is the scaled loss: divide it by ``state.scale`` to log it.

    Example:
        >>> ls = fsdpfn.optim.loss_scale()                                               # doctest: +SKIP
        >>> ls_state = ls.init()                                                         # doctest: +SKIP
        >>> scaled = lambda p, x: ls.scale(loss_fn(p, x), ls_state)                     # doctest: +SKIP
        >>> loss, grads = fsdpfn.value_and_grad(scaled)(params, x)                       # doctest: +SKIP
        >>> grads, finite, ls_state = ls.unscale(grads, ls_state)                        # doctest: +SKIP
        >>> if finite:                                                                   # doctest: +SKIP
        ...     params, opt_state = opt.update(grads, opt_state, params)
    """

    def number(name: str, value: Any, ok: Callable[[float], bool], bound: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(float(value)):
            raise ValueError(f"loss_scale: invalid {name}={value!r}; it must be {bound}")
        return float(value)

    init_scale = number("init_scale", init_scale, lambda v: 0 < v < math.inf, "a finite number > 0")
    growth_factor = number("growth_factor", growth_factor, lambda v: 1 <= v < math.inf, "a finite number >= 1")
    backoff_factor = number("backoff_factor", backoff_factor, lambda v: 0 < v < 1, "in (0, 1)")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"loss_scale: invalid growth_interval={growth_interval!r}; it must be an int >= 1")

    def init() -> LossScaleState:
        return LossScaleState(init_scale, 0)

    def scale(value: torch.Tensor, state: LossScaleState) -> torch.Tensor:
        return value * _checked(state).scale

    def unscale(grads: Sharded[Any], state: LossScaleState) -> tuple[Sharded[Any], bool, LossScaleState]:
        state = _checked(state)
        if isinstance(grads, Unreduced) or not isinstance(grads, Sharded):
            hint = " (reduce them first: fsdpfn.reduce)" if isinstance(grads, Unreduced) else ""
            raise TypeError(
                "loss_scale.unscale: grads must be the fsdpfn.Sharded gradients value_and_grad returns, got "
                f"{type(grads).__name__}{hint}"
            )
        finite = _unscale_and_agree(grads, 1.0 / state.scale)
        if not finite:
            return grads, False, LossScaleState(state.scale * backoff_factor, 0)
        good = state.good_steps + 1
        if good >= growth_interval:
            return grads, True, LossScaleState(state.scale * growth_factor, 0)
        return grads, True, LossScaleState(state.scale, good)

    return LossScale(init, scale, unscale)


def _checked(state: Any) -> LossScaleState:
    if not isinstance(state, LossScaleState):
        raise TypeError(f"loss_scale: state must be the LossScaleState init() made, got {type(state).__name__}")
    return state


def _unscale_and_agree(grads: Sharded[Any], inv_scale: float) -> bool:
    """Multiply every gradient by ``inv_scale`` in place; whether all are finite on every rank."""
    plan = grads.plan
    found = torch.zeros(1, dtype=torch.float32)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for k in plan.params:
        g = grads[k]
        if g is not None and plan.requires_grad[k] and g.numel():
            g = real(g)
            by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in by_kind.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        found += flag.cpu()
    comm = agreement_comm(plan)
    if comm is not None and comm.groups.world * comm.groups.replicas > 1:
        flag = found.to(comm.groups.device)
        comm.all_reduce_sum(flag, label="loss_scale").wait()
        found = flag.cpu()
    return bool(found.item() == 0)
