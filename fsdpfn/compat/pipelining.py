"""What ``torch.distributed.pipelining`` reads of a stage sharded by ``fully_shard``, for fsdpfn's modules.

A pipeline schedule runs a stage's microbatch backwards itself. For a stage that is an ``FSDPModule`` it
turns gradient sync off around each of them (FSDP2's ``set_requires_gradient_sync(False)``: the gradients
accumulate unreduced) and, after the last, turns it on and runs FSDP2's post-backward by hand, reaching
into FSDP2's state: ``fully_shard.state(stage)._state_ctx.all_states[..]._fsdp_param_groups[..]
.post_backward()``, then ``._root_post_backward_final_callback()``. fsdpfn's ``FSDPModule`` derives from
torch's (so the schedule sees a sharded stage) and each module ``fully_shard`` returns carries, where torch's
contract keeps FSDP2's state, a ``PipelineState`` answering those calls: its post-backward reduces the
gradients the microbatches accumulated (``reduce_stranded``, one reduction per unit and step instead of
one per unit and microbatch) into the parameters' ``.grad``.

Example:
    >>> fully_shard(stage_module, mesh=mesh["dp"])                       # doctest: +SKIP
    >>> stage = PipelineStage(stage_module, i, n, device, group=pp)     # doctest: +SKIP
    >>> ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss).step(x)    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdpfn.compat.executor import dtensor_gradient
from fsdpfn.compat.state import state_of
from fsdpfn.compat.stranded import reduce_stranded

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = ["PipelineState", "register_pipeline_state"]


class PipelineState:
    """The part of FSDP2's per-module state that a pipeline schedule calls, for ``module``: one state whose
    one parameter group's ``post_backward`` reduces what every unit of ``module``'s root (and of the roots
    nested in it) accumulated while gradient sync was off."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._state_ctx = self  # FSDP2: the root's context, whose all_states are every unit's state
        self.all_states = [self]
        self._fsdp_param_groups = [self]

    def post_backward(self) -> None:
        """Reduce the accumulated gradients of units whose sync is on now into their parameters' ``.grad``."""
        st = state_of(self.module)
        if st is None or st.top().root is None:
            return  # never ran a forward: nothing accumulated
        for root in st.top().root.family():
            _add_to_grads(root, reduce_stranded(root))

    def _root_post_backward_final_callback(self) -> None:
        """Nothing left in flight: ``post_backward`` waited for its reductions."""


def _add_to_grads(root: RootContext, reduced: dict[str, torch.Tensor]) -> None:
    for fqn, g in reduced.items():
        p = root.managed[fqn].param
        grad = dtensor_gradient(g.to(p.dtype), p._spec, False)
        p.grad = grad if p.grad is None else p.grad + grad
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(p)  # as after autograd's accumulation (optimizer-in-backward, FSDP2 calls them too)


def _fully_shard_state_key() -> Callable[..., Any] | None:
    """The key torch's contract keeps ``fully_shard``'s per-module state under (the function it decorates,
    closed over by ``fully_shard.state``); ``None`` if this torch keeps it otherwise."""
    from torch.distributed.fsdp import fully_shard

    for cell in getattr(fully_shard.state, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and getattr(value, "__name__", "") == "fully_shard":
            return value
    return None


def register_pipeline_state(module: nn.Module) -> None:
    """Give ``module`` a ``PipelineState`` where ``fully_shard.state(module)`` (torch's) looks for FSDP2's.

    Example:
        >>> register_pipeline_state(stage_module)     # fully_shard does this      # doctest: +SKIP
    """
    from torch.distributed._composable.contract import STATE_KEY

    key = _fully_shard_state_key()
    if key is not None:
        module.__dict__.setdefault(STATE_KEY, {})[key] = PipelineState(module)
