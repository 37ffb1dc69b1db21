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

__all__ = ["REASON", "eager", "stable_graph_choice", "under_compile"]

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


def stable_graph_choice() -> None:
    """Make dynamo try a code object's compiled graphs in the order they were compiled, not most recently
    used first (process-wide; torch's own advice for checkpointed compiled code).

    A block that breaks its graph at a unit inside it and a block of the same class that does not share
    the code of their forward, and the guards of the graph before the break do not see the unit's hooks.
    Tried most-recent-first, one block can take the other's graph at one step and its own at the next —
    one more compilation in the second step, and, when an activation-checkpoint recompute takes another
    graph than its forward did, torch's CheckpointError. In compile order the choice never changes.

    Example:
        >>> stable_graph_choice()
    """
    setter = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "_set_lru_cache", None)
    if setter is not None:
        setter(False)
