"""``eager``: mark a piece of fsdpfn's unit machinery to run outside ``torch.compile``'s graphs.

The eager executor (gathers, swaps, resharding, reductions, prefetch) runs in module hooks and around
``apply``; under ``torch.compile`` every such function is a graph break by design, so compiled code is the
units' own compute. The reason dynamo reports says so, and names the one mode without breaks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["REASON", "eager", "under_compile"]

F = TypeVar("F", bound=Callable[..., Any])

REASON = (
    "fsdpfn runs each unit's gather, swap and reshard eagerly, so compiled code breaks at unit boundaries by "
    "design; to trace a whole training step into one graph (fullgraph=True) use fsdpfn.compile_step"
)
_HAS_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters


def eager(fn: F) -> F:
    """``torch.compiler.disable(fn)`` with fsdpfn's reason.

    Example:
        >>> @eager
        ... def gather_unit(): ...
    """
    if _HAS_REASON:
        return torch.compiler.disable(fn, reason=REASON)  # type: ignore[return-value]
    return torch.compiler.disable(fn)  # type: ignore[return-value]  # pragma: no cover - torch without reason=


def under_compile() -> bool:
    """Whether this eager code runs inside a ``torch.compile``'d call (dynamo's frame callback is set, so
    the functions it calls are compiled in turn).

    Example:
        >>> under_compile()
        False
    """
    get = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    get = getattr(get, "get_eval_frame_callback", None)
    return bool(get is not None and get() not in (None, False))
