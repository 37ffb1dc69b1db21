"""How a call of an ``FSDPModule`` (its forward, or a method registered with
``register_fsdp_forward_method``) reaches its root's ``RootContext``.

A call from outside a running root starts a root call (the first module called becomes the root, lazily);
a unit called while its root runs goes straight to its forward, whose unit hooks gather it; during an
activation-checkpoint recompute in backward the hooks alone supply the values. Traceable by
``torch.compile``: the decision is made eagerly (a graph break), the forward itself is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdpfn.compat.root import RootContext
from fsdpfn.compat.state import UnitState, state_of
from fsdpfn.transform.eager import eager, in_backward

__all__ = ["dispatch", "unit_state"]


def unit_state(module: Any) -> UnitState:
    """The ``UnitState`` of a ``fully_shard`` module (``RuntimeError`` for any other module)."""
    st = state_of(module)
    if st is None:  # pragma: no cover - only reachable by calling the methods unbound
        raise RuntimeError(f"{type(module).__name__} is not a fully_shard module")
    return st


def dispatch(module: nn.Module, fn: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``module``'s forward (``fn=None``) or a registered forward method ``fn`` under FSDP.

    Traceable by ``torch.compile``: a unit below a running root goes straight to its forward (its hooks
    break the graph); everything else is decided by ``_entry``, eagerly."""
    st = unit_state(module)
    ctx = st.root
    if ctx is not None and ctx.planning:  # the fusion planner's forward on fake tensors: a plain module
        return nn.Module.__call__(module, *args, **kwargs) if fn is None else fn(*args, **kwargs)
    if ctx is None or not ctx.running or st is ctx.state:
        ctx, start = _entry_eagerly(module, st) if torch.compiler.is_compiling() else _entry(module, st)
        if ctx is None:  # an activation-checkpoint recompute in backward: the unit hooks supply the values
            call = functools.partial(nn.Module.__call__, module) if fn is None else fn
            root = st.root
            if root is not None and st is root.state:  # a root called inside the checkpointed region
                return root.apply.run_recomputed_root(call, args, kwargs)
            return call(*args, **kwargs)
        if start:
            return ctx.run(functools.partial(_inside_call, ctx, st, module, fn), args, kwargs)
    return _inside(ctx, st, module, fn, args, kwargs)


def _inside(ctx: RootContext, st: UnitState, module: nn.Module, fn: Callable[..., Any] | None, args: Any, kwargs: Any) -> Any:
    if fn is None:
        return nn.Module.__call__(module, *args, **kwargs)  # the unit hooks gather around forward
    if st is ctx.state:
        return fn(*args, **kwargs)  # the root unit is gathered for the whole call
    return ctx.apply.run_unit(st.name, module, fn, args, kwargs)


def _inside_call(ctx: RootContext, st: UnitState, module: nn.Module, fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    return _inside(ctx, st, module, fn, args, kwargs)


def _entry(module: nn.Module, st: UnitState) -> tuple[RootContext | None, bool]:
    """Where a call from outside a running root (or into the root itself) goes: ``(None, _)`` for an
    activation-checkpoint recompute, ``(root, True)`` to start a root call, ``(root, False)`` when the
    root is already running (a root method calling its own forward)."""
    ctx = st.root
    if ctx is not None:
        ctx.close_stale()  # an earlier compiled forward that raised
        if not ctx.running and in_backward():
            return None, False
    ctx = ctx if ctx is not None else RootContext(module, st)
    return ctx, not ctx.running


_entry_eagerly = eager(_entry)
