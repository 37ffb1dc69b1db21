"""``compile_step``: a whole training step traced into one graph, gathers and reductions included.

The loss function (its ``fsdp`` applies included) is compiled with ``fullgraph=True`` in the traced
executor: every all-gather is a functional collective in the forward graph and every reduce-scatter one
in the backward graph that AOTAutograd derives from it, so the compiler, not Python, orders them against
the computation (and may fuse them). The optimizer update, when given, runs on the reduced shard
gradients after it, as ``fsdpfn.optim`` always does: locally on this rank's shards.
"""

from __future__ import annotations

import functools
import typing
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

from fsdpfn.core.traced import Collectives
from fsdpfn.layout import Sharded, ShardPlan
from fsdpfn.ops.traced import warm
from fsdpfn.transform.grad_mode import GradMode
from fsdpfn.transform.grad import _scale, finish, grad_inputs, shard_grads, split_value, value_and_grad

__all__ = ["compile_step"]


# The unit hooks swap parameters in and out (Python side effects). Inside a checkpointed region dynamo
# refuses side effects it could not replay when the region is recomputed in backward; ours need no
# replay: the recompute is the graph's own (gathers included), never the Python hooks.
_TRACE_CONFIG = functools.partial(torch._dynamo.config.patch, skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def compile_step(
    loss_fn: Callable[..., Any],
    optimizer: Any = None,
    *,
    has_aux: bool = False,
    reduce_op: str | None = None,
    divide_by: float | None = None,
    check_finite: bool = False,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
    collectives: Collectives = "native",
) -> Callable[..., Any]:
    """Compile a training step whole: the forward with its all-gathers, the backward with its
    reduce-scatters, as graphs the compiler schedules (``torch.compile(fullgraph=True)``).

    ``loss_fn(params, *args, **kwargs)`` is what ``value_and_grad`` takes: a scalar loss (and an aux
    with ``has_aux``) computed through ``fsdp`` applies. Without ``optimizer`` the step is
    ``step(params, *args, **kwargs) -> (loss, grads)``, with the gradients reduced exactly as
    ``value_and_grad(loss_fn, reduce_op=..., divide_by=...)`` reduces them; with an ``fsdpfn.optim``
    optimizer it is ``step(params, opt_state, *args, **kwargs) -> (loss, params, opt_state)``, the update
    applied after the backward. ``backend``, ``mode``, ``options`` and ``dynamic`` go to
    ``torch.compile``.

    ``collectives`` says how the graph writes gathers and reduce-scatters: ``"native"`` (the default) as
    torch's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which the compiler recognises and may
    reorder or bucket; ``"all_to_all"`` as ``all_to_all_single``, the faster choice on gloo (CPU), whose
    all-to-all moves the same bytes about twice as fast as its all-gather and reduce-scatter, at one more
    full-size temporary per collective (docs/compile.md has the measurements).

    The first call on a plan runs eagerly (``value_and_grad``): it installs the unit hooks, checks the
    module against the plan and builds the bucket collectives that the compiled step reads; the second
    call compiles, and later calls reuse the graph. Units are gathered where they first run and, with
    ``reshard_after_forward``, gathered again in backward by recomputation instead of being kept.
    Not supported inside the compiled step (each raises when traced): ``torch.func`` transforms, and
    ``value_and_grad(reduce=False)``-style deferred reduction (use ``value_and_grad`` for those).
    Needs torch >= 2.13: on older torch it raises ``RuntimeError`` (on 2.11 the traced step was measured
    off the eager step's loss by up to 2.4%, cause not found; value_and_grad and compiled blocks work there).

    Example:
        >>> apply = fsdpfn.fsdp(model)                                                       # doctest: +SKIP
        >>> opt = fsdpfn.optim.adamw(lr=1e-3)                                                # doctest: +SKIP
        >>> step = fsdpfn.compile_step(lambda p, x, y: F.mse_loss(apply(p, x), y), opt)      # doctest: +SKIP
        >>> state = opt.init(params)                                                         # doctest: +SKIP
        >>> for x, y in batches:                                                             # doctest: +SKIP
        ...     loss, params, state = step(params, state, x, y)
    """
    if collectives not in typing.get_args(Collectives):
        raise ValueError(f"compile_step: collectives must be one of {typing.get_args(Collectives)}, got {collectives!r}")
    if optimizer is not None and not callable(getattr(optimizer, "update", None)):
        raise TypeError(
            f"compile_step: optimizer must be an fsdpfn.optim transformation (with init/update), got {type(optimizer).__name__}"
        )
    if TorchVersion(torch.__version__) < (2, 13):
        # Wrong numbers are worse than none: the cause of the difference was not found on 2.11.
        raise RuntimeError(
            f"compile_step needs torch >= 2.13 (this is torch {torch.__version__}): on torch 2.11 its steps were "
            "measured 0.8-2.4% off the eager step's loss (fp32, world 1; plain torch.compile of the same model "
            "matched exactly). Use torch >= 2.13, or value_and_grad (eager), or compiled blocks (block.compile())"
        )
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend, mode=mode, options=options, dynamic=dynamic)
    eager = value_and_grad(loss_fn, has_aux=has_aux, reduce_op=reduce_op, divide_by=divide_by, check_finite=check_finite)
    warmed: weakref.WeakSet[ShardPlan] = weakref.WeakSet()

    def grads_of(params: Sharded[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if torch.is_inference_mode_enabled():  # autograd records nothing there: differentiate as value_and_grad does
            with torch.inference_mode(False):
                return grads_of(params, args, kwargs)
        plan = params.plan
        if plan not in warmed:  # the first call: eager, and it leaves everything the trace reads built
            out = eager(params, *args, **kwargs)
            _warm(plan)
            warmed.add(plan)
            return out
        tree, inputs = grad_inputs(params, "compile_step")
        tree._mode = GradMode(scale=_scale(plan, reduce_op, divide_by), traced=True, collectives=collectives)
        with torch.enable_grad(), _TRACE_CONFIG():
            out = compiled(tree, *args, **kwargs)
        value, aux = split_value(out, has_aux, "compile_step")
        found = torch.autograd.grad(value, inputs, allow_unused=True) if value.requires_grad and inputs else (None,) * len(inputs)
        return finish(plan, value, aux, shard_grads(plan, found, inputs), has_aux=has_aux, check_finite=check_finite)

    if optimizer is None:

        def step(params: Sharded[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            return grads_of(params, args, kwargs)

    else:

        def step(params: Sharded[torch.Tensor], opt_state: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
            value, grads = grads_of(params, args, kwargs)
            params, opt_state = optimizer.update(grads, opt_state, params)
            return value, params, opt_state

    return step


def _warm(plan: ShardPlan) -> None:
    """Build what the trace only reads: each apply's schedule for the order the eager call ran, the
    per-rank caches of every bucket collective it built (see ``ops.traced.warm``)."""
    for apply in list(plan.memo.get(("applies",), ())):
        apply.schedule(plan)
    for key, value in list(plan.memo.items()):
        if isinstance(key, tuple) and key and key[0] == "gather":
            warm(value)
