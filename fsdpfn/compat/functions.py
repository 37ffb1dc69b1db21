"""FSDP2's free functions over ``FSDPModule``s: ``register_fsdp_forward_method`` (another method that gathers
like ``forward``) and ``share_comm_ctx`` (several roots on one communication context)."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from fsdpfn.compat.dispatch import dispatch, unit_state
from fsdpfn.compat.module import FSDPModule

__all__ = ["register_fsdp_forward_method", "share_comm_ctx"]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` gather and reshard like ``forward`` (e.g. ``generate``). A no-op
    for a module that is not an ``FSDPModule``.

    Example:
        >>> register_fsdp_forward_method(model, "generate")   # doctest: +SKIP
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self, orig, args, kwargs)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make the roots of ``modules`` (e.g. pipeline-parallel chunks, each its own root) run on one
    ``Comm``: one set of side streams (CUDA) and one collective guard, as FSDP2 shares its comm context.
    Roots already initialised switch at their next forward; roots on another mesh keep their own.

    Example:
        >>> share_comm_ctx([stage0, stage1])   # doctest: +SKIP
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    if not modules:
        return
    tops = list({id(t): t for t in (unit_state(m).top() for m in modules)}.values())
    first = next((t.root.comm for t in tops if t.root is not None), None)
    box: list[Any] = [first]
    for top in tops:
        top.comm_box = box
        ctx = top.root
        if ctx is not None and ctx.comm is not first and first is not None and ctx.comm.mesh == first.mesh:
            ctx.comm = None
            ctx._build()
