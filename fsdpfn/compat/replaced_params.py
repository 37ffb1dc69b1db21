"""An optimizer that holds parameters ``fully_shard`` replaced.

``fully_shard`` (and ``replicate``) registers a new ``nn.Parameter(DTensor)`` in place of each parameter
it shards, as torch's does (``model.to_empty(...)`` and ``model.to(...)`` afterwards keep those objects). An
optimizer made from ``model.parameters()`` before that holds the old tensors: they never get a gradient,
so every ``step()`` skips them and the model does not train, with no error (torch's ``fully_shard``
behaves exactly so). ``watch_optimizer_steps`` registers, once per process, a global optimizer step
pre-hook that refuses such a step and names the parameter. The check runs again only when an optimizer's
parameter groups change size or a sharded parameter was replaced since, so a step pays one tuple
comparison.

Example:
    >>> opt = torch.optim.AdamW(model.parameters())   # doctest: +SKIP
    >>> fully_shard(model)                            # doctest: +SKIP
    >>> model(x).sum().backward(); opt.step()         # doctest: +SKIP
    ValueError: optimizer step: AdamW's param_groups[0]['params'][0] is parameter 'weight' of Linear as it was before fully_shard replaced it ...
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdpfn.compat.state import sharded_as
from fsdpfn.compat.unreduced_step import check_unreduced

__all__ = ["note_replacement", "replaced_parameter_error", "watch_optimizer_steps"]

_CHECKED = "_fsdpfn_checked_groups"  # on an optimizer: the group sizes its parameters were checked at
_hook: RemovableHandle | None = None  # process-wide: torch's optimizer hooks are global
_lock = threading.Lock()  # ranks may be threads of one process
_replacements = [0]  # bumped whenever a sharded parameter is replaced: checked optimizers check again


def watch_optimizer_steps() -> None:
    """Make every ``torch.optim.Optimizer.step`` check, before it runs, that it holds no parameter that
    ``fully_shard`` has since replaced, nor one whose gradients accumulated without sync are unreduced
    (``unreduced_step.check_unreduced``) (idempotent; called by each ``fully_shard``, which replaces).

    Example:
        >>> watch_optimizer_steps()                   # doctest: +SKIP
    """
    global _hook
    with _lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_check_step)
    note_replacement()


def note_replacement() -> None:
    """Say that a parameter ``fully_shard`` manages was just replaced by a new object (``fully_shard``
    itself, or a new ``DTensor`` parameter assigned in its place): every optimizer checks again at its
    next step.

    Example:
        >>> note_replacement()                        # doctest: +SKIP
    """
    with _lock:
        _replacements[0] += 1


def _check_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    check_unreduced(optimizer)  # gradients accumulated without sync must be reduced first (unreduced_step.py)
    groups = optimizer.param_groups
    sizes = (_replacements[0], *(len(g["params"]) for g in groups))
    if optimizer.__dict__.get(_CHECKED) == sizes:
        return
    for i, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            managed = sharded_as(p)
            if managed is not None and managed.param is not p:
                raise replaced_parameter_error(optimizer, f"param_groups[{i}]['params'][{j}]", managed.where, p)
    optimizer.__dict__[_CHECKED] = sizes


def replaced_parameter_error(optimizer: Any, slot: str, where: str, param: Any) -> ValueError:
    """The error for ``optimizer`` holding ``param`` at ``slot``: ``where`` ("parameter 'weight' of
    Linear") was replaced by ``fully_shard`` (``param`` a plain tensor) or, after it, by a new sharded
    parameter assigned in its place (``param`` the earlier ``DTensor``)."""
    if isinstance(param, DTensor):
        what = "an earlier sharded parameter: a new one was registered in its place after this optimizer was made"
        fix = "Make the optimizer after replacing parameters, or add the new one (optimizer.param_groups[i]['params'][j] = new)"
    else:
        what = "as it was before fully_shard replaced it with a sharded DTensor parameter"
        fix = "Build the optimizer after fully_shard, from model.parameters()"
    return ValueError(
        f"optimizer step: {type(optimizer).__name__}'s {slot} is {where} {what}. That old tensor never gets a "
        f"gradient, so this step would skip it and the model would not train. {fix}"
    )
