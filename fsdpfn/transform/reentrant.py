"""Reentrant activation checkpoints (``torch.utils.checkpoint(..., use_reentrant=True)``): found, and
carried or refused.

A reentrant checkpoint runs its region under ``no_grad`` in forward and, in backward, runs it again and
calls a backward of its own on that second graph. Around a unit (the checkpoint calls the unit's module,
or is the unit's output node: ``checkpoint_wrapper``) the recompute gathers the unit differentiably
(``in_reentrant_recompute``, ``is_reentrant_node``; ``Call.gather_for_reentrant``), so that inner backward
reduces it as the forward's gather would. Inside a unit's forward, the recompute reads the values swapped
in for the unit's backward as fresh leaves and the inner backward leaves the gradients on them: the unit's
reduction adds them when the outer backward reaches it (``BackwardSwaps.leave``, ``CallInfo.extra``), which
it does not when every parameter of the unit is used only inside the region (the parameters got ``None``
without an error): that is refused. ``value_and_grad`` has a second
reason: it differentiates with ``torch.autograd.grad``, which skips a reentrant checkpoint whose inputs
lead to no parameter (torch's own single-process ``autograd.grad`` then gives ``None`` for every parameter
inside, silently). Those are refused by name, pointing at the non-reentrant checkpoint:

- ``value_and_grad`` walks the loss's graph before differentiating (``has_reentrant_checkpoint``; ~0.1 ms
  for a few hundred autograd nodes) and raises before any reduction runs, on every rank alike;
- a plain ``backward()`` (the compat layer) raises at its end, once every reduction has run, when a unit
  the forward gathered without gradients is recomputed with them outside a reentrant recompute
  (``untracked``) or a recompute's values came back holding gradients (``took_gradients``: one inside
  it); nothing extra is kept alive for it, and no peer is left waiting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

__all__ = ["has_reentrant_checkpoint", "in_reentrant_recompute", "is_reentrant_node", "reentrant_error", "took_gradients", "untracked"]

_REENTRANT_NODE = CheckpointFunction._backward_cls
_USE = (
    "pass use_reentrant=False to torch.utils.checkpoint.checkpoint (with Hugging Face models: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})); the "
    "non-reentrant checkpoint recomputes inside this backward and works with fsdpfn"
)


def has_reentrant_checkpoint(value: torch.Tensor) -> bool:
    """Whether ``value``'s autograd graph holds a reentrant ``torch.utils.checkpoint`` region.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> has_reentrant_checkpoint(torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True).sum())
        True
    """
    root = value.grad_fn
    if root is None:
        return False
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        if type(node) is _REENTRANT_NODE:
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def untracked(values: dict[str, torch.Tensor], requires_grad: Mapping[str, bool]) -> bool:
    """Whether a recompute's ``values`` hold trainable parameters (``requires_grad``, by FQN) that the
    forward gathered without gradients: recomputed with gradients on, that is a reentrant checkpoint's
    region (run under ``no_grad`` in forward); a non-reentrant one runs as the forward did."""
    return any(requires_grad.get(f, False) for f in values) and not any(v.requires_grad for v in values.values())


def took_gradients(values: dict[str, torch.Tensor]) -> bool:
    """Whether a backward left gradients on a recompute's ``values``: only a reentrant checkpoint's inner
    backward differentiates the recompute itself (a non-reentrant recompute feeds saved tensors to the
    original graph, whose gradients flow to the unit's gather)."""
    return any(v.is_leaf and v.grad is not None for v in values.values())


def is_reentrant_node(node: Any) -> bool:
    """Whether ``node`` is a reentrant checkpoint's backward node.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> is_reentrant_node(torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=True).grad_fn)
        True
    """
    return type(node) is _REENTRANT_NODE


def in_reentrant_recompute() -> bool:
    """Whether this code runs inside a reentrant checkpoint's backward (its recompute, with gradients on).

    Example:
        >>> in_reentrant_recompute()
        False
    """
    return torch.is_grad_enabled() and type(torch._C._current_autograd_node()) is _REENTRANT_NODE


def reentrant_error(where: str, units: Any = None) -> RuntimeError:
    """The error both layers raise for a reentrant checkpoint (``units``: the units it recomputed)."""
    if units:
        named = ", ".join(repr(u or "<root>") for u in units)
        return RuntimeError(
            f"{where}: unit(s) {named} were recomputed by torch.utils.checkpoint(..., use_reentrant=True) in "
            "this backward; a reentrant checkpoint differentiates its region in a backward of its own, whose "
            f"gradients never reach fsdpfn's reduction, so these parameters would get no gradient: {_USE}"
        )
    return RuntimeError(
        f"{where}: the function's graph holds a torch.utils.checkpoint(..., use_reentrant=True) region; "
        "value_and_grad differentiates with torch.autograd.grad, which a reentrant checkpoint does not "
        f"support (its parameters would get no gradient, or torch would refuse the backward): {_USE}"
    )
