"""An optimizer step while gradients accumulated without sync are still unreduced.

With ``set_requires_gradient_sync(False)`` a backward keeps each parameter's gradient unreduced, outside
``.grad`` (``RootContext.acc``), until a backward with sync on reduces it into ``.grad``. An
``optimizer.step()`` before that (the last microbatch's backward ran without sync, or sync was never turned
back on) sees ``.grad`` without those microbatches, or ``None``: it skips or half-updates the parameter and
the model silently trains on less than it was given (torch's ``fully_shard`` behaves so). ``watch_unreduced``
registers each root; ``check_unreduced``, run by compat's global optimizer step pre-hook
(``replaced_params.watch_optimizer_steps``, registered by the ``fully_shard`` calls that precede every root),
refuses a step that holds a parameter with unreduced gradients, naming it. A step pays one look at each live
root's accumulator (empty outside accumulation).

Example:
    >>> model.set_requires_gradient_sync(False)        # doctest: +SKIP
    >>> model(x).sum().backward(); opt.step()         # doctest: +SKIP
    ValueError: optimizer step: AdamW holds parameter 'blocks.0.weight', whose gradient was accumulated ...
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from fsdpfn.messages import listing

__all__ = ["check_unreduced", "unreduced_step_error", "watch_unreduced"]

_roots: weakref.WeakSet[Any] = weakref.WeakSet()  # every compat root alive, of every rank thread
_lock = threading.Lock()  # ranks may be threads of one process


def watch_unreduced(root: Any) -> None:
    """Check at every optimizer step that no parameter it holds has gradients ``root`` accumulated
    without sync and has not reduced yet (``root.acc``, keyed by FQN; ``root.managed[fqn].param``).

    Example:
        >>> watch_unreduced(root_context)              # doctest: +SKIP
    """
    with _lock:
        _roots.add(root)


def check_unreduced(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``unreduced_step_error`` if ``optimizer`` holds a parameter with unreduced accumulated gradients.

    Example:
        >>> check_unreduced(opt)                       # doctest: +SKIP
    """
    with _lock:
        pending = [r for r in _roots if r.acc]
    if not pending:
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for root in pending:  # another rank's thread, or another model, holds other parameters
        names = [f for f, m in root.managed.items() if f in root.acc and id(m.param) in held]  # model order
        if names:
            frozen = [f for f in names if not root.managed[f].param.requires_grad]
            raise unreduced_step_error(optimizer, names, frozen)


def unreduced_step_error(optimizer: Any, names: list[str], frozen: list[str] = ()) -> ValueError:
    """The error for ``optimizer`` stepping parameters ``names`` whose accumulated gradients are unreduced
    (``frozen``: those of them frozen when the last backward ran, which therefore did not reduce them)."""
    why = (
        f" {listing(frozen)} were frozen (requires_grad_(False)) during the backward with sync on, which "
        "therefore did not reduce them: unfreeze them for that backward."
        if frozen else ""
    )
    return ValueError(
        f"optimizer step: {type(optimizer).__name__} holds parameter(s) {listing(names)}, whose gradients were "
        "accumulated with set_requires_gradient_sync(False) and are not reduced yet: .grad does not hold them, "
        f"so this step would skip them or use part of the batch.{why} Run the last microbatch's backward with "
        "set_requires_gradient_sync(True) (every rank's accumulated gradients are then reduced into .grad) "
        "before optimizer.step(), or drop them with model.zero_grad()"
    )
