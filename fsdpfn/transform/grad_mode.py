"""``GradMode``: how ``value_and_grad`` (and ``compile_step``) ask one call to reduce the gradients of its tree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fsdpfn.core.traced import Collectives
from fsdpfn.ops.deferred import DeferredReductions

__all__ = ["GradMode"]


@dataclass(frozen=True)
class GradMode:
    """How ``value_and_grad`` wants the gradients of one tree reduced.

    ``scale`` overrides the ``fsdp`` reduction (``None`` keeps it); a ``sink`` defers the reduction: the
    full per-rank gradients are added into it instead of being reduce-scattered; a ``carry`` holds full
    gradients deferred earlier, which each unit's backward adds to its own and reduces with them.
    ``scales``: the reductions' factors the calls used (for what a carry still holds afterwards)."""

    scale: float | None = None
    sink: dict[str, torch.Tensor] | None = None
    carry: dict[str, torch.Tensor] | None = None
    scales: list[float] = field(default_factory=list)
    deferred: DeferredReductions | None = None  # reductions value_and_grad waits for and adds after autograd.grad
    traced: bool = False  # the whole step is being traced into one graph (fsdpfn.compile_step)
    collectives: Collectives = "native"  # how the traced step writes its collectives
