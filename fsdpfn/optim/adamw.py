"""AdamW on sharded parameters, built on ``torch.optim``'s functional kernels (fused on CPU, foreach
elsewhere).

Each rank updates only its own shards (Adam is elementwise, so the shards of the result are the result
on the full tensors); nothing is communicated.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.optim.adam import adam as _torch_adam

from fsdpfn.layout import Sharded
from fsdpfn.layout.autobucket import FUSED_DEVICES
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

__all__ = ["AdamWState", "FUSED_DEVICES", "adamw"]

_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _fusable(tensors: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether torch's fused kernel can take these: on a ``FUSED_DEVICES`` device, of ``dtype`` (one the
    kernel has) and contiguous (it walks memory linearly: on a strided view it updates wrong elements)."""
    return all(t.device.type in FUSED_DEVICES and t.dtype == dtype and t.is_contiguous() for t in tensors)


def _pick_kernel() -> Callable[..., None]:
    """``torch.optim.adam.adam(..., decoupled_weight_decay=True)`` where torch has that argument (recent
    releases, where ``AdamW`` is ``Adam`` with decoupled decay), else ``torch.optim.adamw.adamw``."""
    if "decoupled_weight_decay" in inspect.signature(_torch_adam).parameters:
        return functools.partial(_torch_adam, decoupled_weight_decay=True)
    from torch.optim.adamw import adamw as torch_adamw  # pragma: no cover - older torch

    return torch_adamw  # pragma: no cover


_ADAMW = _pick_kernel()


class AdamWState(NamedTuple):
    """State of ``adamw``: trees like ``params`` (``None`` at frozen parameters and buffers).

    ``count`` is the number of ``update`` calls (an ``int``); ``step`` holds ``torch.optim``'s
    per-parameter step counters (a parameter whose gradient was ``None`` in an update is not stepped);
    ``max_exp_avg_sq`` is all ``None`` unless ``amsgrad``. The whole state is a pytree.

    Example:
        >>> state = fsdpfn.optim.adamw().init(params)                      # doctest: +SKIP
        >>> state.exp_avg["0.weight"].shape == params["0.weight"].shape   # doctest: +SKIP
        True
    """

    count: int
    step: Sharded[Any]
    exp_avg: Sharded[Any]
    exp_avg_sq: Sharded[Any]
    max_exp_avg_sq: Sharded[Any]


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    inplace: bool = True,
    weight_decay_mask: DecayMask = None,
) -> GradientTransformation:
    """``torch.optim.AdamW`` as an optax-shaped transformation over ``Sharded`` parameters.

    ``lr`` is a number or a schedule ``lr(step) -> float``, called once per ``update`` with ``step`` =
    the number of the update being made, counted from 1 (the same ``step`` Adam's bias correction uses
    for a parameter that received a gradient in every update).
    Only trainable parameters whose gradient is not ``None`` are updated; frozen parameters, buffers and
    ``None`` gradients are skipped (as ``torch.optim`` skips parameters whose ``.grad`` is ``None``).
    With ``inplace=True`` (the default) the parameter shards and the state tensors are updated in place
    and returned in new containers, so a step allocates no second copy (the inputs are donated); with
    ``inplace=False`` they are cloned first and the inputs stay untouched. Gradients are never modified.
    Runs ``torch.optim``'s functional Adam kernel on this rank's shards: fused (``fused=True``, one pass and
    no temporaries) when every shard, gradient and moment is contiguous and on a device of
    ``FUSED_DEVICES`` (CPU), else ``foreach=True`` in groups of at most an eighth of the shard bytes (or
    the largest shard), so its temporaries never add a whole copy of the shards to the step's peak as one
    call over every shard would. Complex parameters
    are viewed as real pairs, exactly as ``torch.optim.AdamW`` does; the fused and foreach kernels agree
    to rounding (a few ulps).

    ``weight_decay_mask`` says which parameters ``weight_decay`` applies to, as ``torch.optim`` parameter
    groups with ``weight_decay=0.0`` for the rest do: a function ``(fqn, shape) -> bool`` of each
    parameter's name and full (unsharded) shape, e.g. ``lambda fqn, shape: len(shape) >= 2`` (no decay for
    biases and norms, the GPT recipe), or a mapping ``fqn -> bool`` (parameters it leaves out decay).

    Example:
        >>> opt = fsdpfn.optim.adamw(lr=lambda step: 1e-3 * min(1.0, step / 100))   # doctest: +SKIP
        >>> state = opt.init(params)                                               # doctest: +SKIP
        >>> loss, grads = step_fn(params, batch)                                   # doctest: +SKIP
        >>> params, state = opt.update(grads, state, params)                       # doctest: +SKIP
    """
    what = "fsdpfn.optim.adamw"
    lr = check_lr(what, lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{what}: betas must be a pair (beta1, beta2), got {betas!r}")
    beta1 = check_number(what, "betas[0]", betas[0], high=1.0)
    beta2 = check_number(what, "betas[1]", betas[1], high=1.0)
    eps = check_number(what, "eps", eps)
    weight_decay = check_number(what, "weight_decay", weight_decay)
    amsgrad, maximize, inplace = bool(amsgrad), bool(maximize), bool(inplace)
    mask = check_mask(what, weight_decay_mask)

    zeros = functools.partial(torch.zeros_like, memory_format=torch.preserve_format)
    makers = {
        "step": lambda p: new_step(),
        "exp_avg": zeros,
        "exp_avg_sq": zeros,
        "max_exp_avg_sq": zeros if amsgrad else None,
    }

    def init(params: Sharded[torch.Tensor]) -> AdamWState:
        """Zero moments (and step counters) for every trainable parameter; ``None`` elsewhere.

        Example:
            >>> state = fsdpfn.optim.adamw().init(params)   # doctest: +SKIP
        """
        check_params(params, f"{what}.init")
        params.plan.memo[OPTIMIZER_MEMO] = "adamw"  # what fsdp's first call plans the step's memory for
        return AdamWState(new_count(), **{name: state_tree(params, make) for name, make in makers.items()})

    def update(
        grads: Sharded[Any], state: AdamWState, params: Sharded[torch.Tensor]
    ) -> tuple[Sharded[torch.Tensor], AdamWState]:
        """One AdamW step on this rank's shards: returns ``(new_params, new_state)``.

        Example:
            >>> params, state = opt.update(grads, state, params)   # doctest: +SKIP
        """
        where = f"{what}.update"
        check_params(params, where)
        check_state_type(state, AdamWState, where)
        state = follow_plan(state, params, makers)  # made before fsdpfn.freeze/unfreeze: onto params' plan
        fqns = check_grads(grads, params, where)
        check_state_tree(state.step, "step", params, fqns, where, scalar=True)
        check_state_tree(state.exp_avg, "exp_avg", params, fqns, where)
        check_state_tree(state.exp_avg_sq, "exp_avg_sq", params, fqns, where)
        check_state_tree(state.max_exp_avg_sq, "max_exp_avg_sq", params, fqns if amsgrad else (), where)
        new_params = prepare_params(params, fqns, inplace)
        if not inplace:
            state = AdamWState(state.count, *(clone_tree(t) for t in state[1:]))
        number = next_count(state.count)  # of the update being made, counted from 1
        lr_now = resolve_lr(where, lr, number)
        tensors = [real(new_params[f]) for f in fqns]
        moments = [state.exp_avg, state.exp_avg_sq, *([state.max_exp_avg_sq] if amsgrad else [])]
        fused = all(
            t.dtype in _FUSED_DTYPES and _fusable([t, real(grads[f]), *(real(m[f]) for m in moments)], t.dtype)
            for f, t in zip(fqns, tensors)
        )
        # fused: one call per weight decay, nothing temporary; foreach: groups that bound its temporaries
        decayed, plain = split_by_decay(where, mask, params, fqns)
        size = dict(zip(fqns, tensors))
        groups = [
            (group, wd)
            for part, wd in ((decayed, weight_decay), (plain, 0.0)) if part
            for group in ([part] if fused else foreach_groups(part, [size[f] for f in part]))
        ]  # fmt: skip
        with torch.no_grad():
            for group, wd in groups:
                _ADAMW(
                    [real(new_params[f]) for f in group],
                    [real(grads[f]) for f in group],
                    [real(state.exp_avg[f]) for f in group],
                    [real(state.exp_avg_sq[f]) for f in group],
                    [real(state.max_exp_avg_sq[f]) for f in group] if amsgrad else [],
                    [state.step[f] for f in group],
                    foreach=not fused,
                    fused=fused or None,
                    amsgrad=amsgrad,
                    beta1=beta1,
                    beta2=beta2,
                    lr=lr_now,
                    weight_decay=wd,
                    eps=eps,
                    maximize=maximize,
                )
        if inplace:
            params.donate(where)  # its leaves are new_params' now: reading the old tree raises
        return new_params, state._replace(count=number)

    return GradientTransformation(init, update)
