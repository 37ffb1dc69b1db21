"""Reductions a backward leaves in flight, and where their results wait.

A unit's reduce-scatter in backward need not be waited for before the next unit's backward runs (on
CUDA that wait would serialise the compute stream behind the reduce stream). Its result must then stay
out of autograd: the engine adds the gradients that meet at one tensor as soon as they arrive (a shard
also read by an L2 penalty, a unit gathered twice, fast weights made from the shards), and it would read
a buffer the reduction has not filled yet. So a deferred result is kept here, by parameter, and whoever
owns the backward (``value_and_grad``, a compat root's ``LocalShards``) waits for every handle and then
adds the kept results to what autograd returned. FSDP2 likewise assigns its reduced gradients outside
autograd.

Deferral is for the owner's own backward only (``active``): a backward the user starts inside the
differentiated function (``torch.autograd.grad`` for a sharpness-aware step, a gradient norm) must get
finished values, so its reductions are waited for where they run.

Example:
    >>> deferred = DeferredReductions()               # doctest: +SKIP
    >>> run_backward()  # reduce-scatters append their handles, keep their results   # doctest: +SKIP
    >>> deferred.wait()                               # doctest: +SKIP
    >>> grad = deferred.add_to("blocks.0.weight", grad_from_autograd)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeferredReductions"]


class DeferredReductions:
    """The handles of reductions left in flight (``handles``: anything with ``wait()``) and their results
    by parameter FQN, to be added to the autograd gradients once every handle was waited for; with
    ``into`` (shard gradients by FQN, donated), each finished result is added into them in place at every
    wait instead (gradient accumulation: no second shard gradient is held)."""

    __slots__ = ("active", "grads", "handles", "into")

    def __init__(self, active: bool = True, into: dict[str, torch.Tensor] | None = None):
        self.handles: list[Any] = []
        self.grads: dict[str, list[torch.Tensor]] = {}
        self.active = active  # False: reductions run now wait for themselves (a backward the owner did not start)
        self.into = into

    def keep(self, fqn: str, grad: torch.Tensor) -> None:
        """Keep ``grad``, a reduced shard gradient of ``fqn`` not yet waited for."""
        self.grads.setdefault(fqn, []).append(grad)

    def wait(self) -> None:
        """Wait for every reduction in flight (in launch order)."""
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
        if self.into is not None:
            for fqn in list(self.grads):
                target = self.into.get(fqn)
                if target is not None:
                    self.fold(fqn, target)

    def fold(self, fqn: str, target: torch.Tensor) -> None:
        """Add the kept results of ``fqn`` into ``target`` in place and forget them (call after ``wait``),
        where they are its shape, dtype and device; otherwise they stay for ``add_to``."""
        kept = self.grads.get(fqn, ())
        if all(k.shape == target.shape and k.dtype == target.dtype and k.device == target.device for k in kept):
            for k in self.grads.pop(fqn, ()):
                target.add_(k)

    def add_to(self, fqn: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad`` (``None``: autograd returned none) plus the kept results of ``fqn``, which are then
        forgotten. Call after ``wait``."""
        for kept in self.grads.pop(fqn, ()):
            grad = kept if grad is None else grad + kept
        return grad
