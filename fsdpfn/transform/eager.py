"""``eager``: mark a piece of fsdpfn's unit machinery to run outside ``torch.compile``'s graphs.

The eager executor (gathers, swaps, resharding, reductions, prefetch) runs in module hooks and around
``apply``; under ``torch.compile`` every such function is a graph break by design, so compiled code is the
units' own compute. The reason dynamo reports says so, and names the one mode without breaks.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["REASON", "caller_frame", "eager", "eager_frame", "functorch_active", "in_backward", "on_stack", "stable_graph_choice", "under_compile", "uncompiled_forward"]

F = TypeVar("F", bound=Callable[..., Any])

REASON = (
    "fsdpfn runs each unit's gather, swap and reshard eagerly, so compiled code breaks at unit boundaries by "
    "design; to trace a whole training step into one graph (fullgraph=True) use fsdpfn.compile_step; to compile "
    "one unit with fullgraph=True use unit.compile(fullgraph=True), or torch.compile(unit) before fully_shard"
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


def eager_frame(fn: F) -> F:
    """Have dynamo's frame callback run ``fn``'s frames as they are, untraced, while a caller dynamo is
    tracing still inlines ``fn``. fsdpfn's unit hooks run between a compiled unit's ``_call_impl`` and its
    forward (``block.compile(fullgraph=True)``): traced as frames of their own, they met the ``eager``
    machinery as a graph break, an error under ``fullgraph=True``, where FSDP2's hooks (disabled functions
    themselves) are run as they are; ``compile_step``'s and a compiled root's traces inline them as before.
    (``torch._dynamo.skip`` would also refuse inlining; a torch without ``skip_code`` keeps the break.)

    Example:
        >>> def hook(mod, args): ...
        >>> hook = eager_frame(hook)
    """
    skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip is not None:
        skip(fn.__code__)
    return fn


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform is running.

    Example:
        >>> functorch_active()
        False
    """
    return torch._C._functorch.maybe_current_level() is not None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread.

    Example:
        >>> in_backward()
        False
    """
    return torch._C._current_graph_task_id() != -1


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


_INBUILT = ("torch.nn.", "torch.ao.")


def uncompiled_forward(module: nn.Module) -> None:
    """Have dynamo never compile ``module``'s forward as a frame of its own: a unit that is one of torch's
    own module classes then runs eagerly between the compiled pieces around it, in every forward and in
    every activation-checkpoint recompute alike (torch's ``fully_shard`` units do the same: their classes
    are not ``torch.nn``'s).

    Dynamo compiles the forward of a ``torch.nn`` class as its own frame only when that module has hooks
    (a unit does), and stops compiling that code for good the first time it meets an instance without
    hooks (every ``nn.Linear`` shares one ``forward``). Between a forward and its recompute that switch
    can flip, and the recompute then saves other tensors than the forward did: torch's CheckpointError.
    Marking the code skipped from the start makes the choice the same every time. Other classes' forwards
    are left alone (they compile whether hooked or not). Process-wide and idempotent, as dynamo's own mark.

    Example:
        >>> uncompiled_forward(torch.nn.Linear(2, 2))
    """
    cls = type(module)
    if not cls.__module__.startswith(_INBUILT) or _skip_code is None:
        return
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is not None:
        _skip_code(code)


_skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)

_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep for f in (os.path.dirname(__file__), torch._dynamo.__file__)
)


def caller_frame() -> FrameType:
    """The nearest frame outside fsdpfn and torch's compile wrappers: it lives exactly as long as the
    outermost call into fsdpfn does, however dynamo split that call into compiled pieces.

    Example:
        >>> on_stack(caller_frame())
        True
    """
    f = sys._getframe(1)
    while f.f_back is not None and os.path.abspath(f.f_code.co_filename).startswith(_INTERNAL):
        f = f.f_back
    return f


def on_stack(frame: FrameType) -> bool:
    """Whether ``frame`` is still running (on the calling thread's stack): a traced call whose
    frame is gone raised, and can be closed.

    Example:
        >>> import sys
        >>> on_stack(sys._getframe())
        True
    """
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False
