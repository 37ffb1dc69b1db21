"""Which threads are inside an ``apply`` call of a module: one module, one thread at a time.

``apply`` puts each unit's gathered values (and, outside the unit's forward, ``Placeholder``s) into the
module's own parameter slots for the length of a call, and its unit hooks act for the innermost open call.
Two threads running forwards of one module at once would read each other's values: rank-threads sharing a
module, or a thread pool serving two parameter trees through one ``apply``, would get wrong numbers with no
error. So a call records its thread on the module, and a call from a second thread while the first is
open is refused with an error saying what to do. Calls one after another from different threads are fine.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

__all__ = ["enter_module", "leave_module"]

_LOCK = threading.Lock()
_OPEN: weakref.WeakKeyDictionary[nn.Module, dict[int, int]] = weakref.WeakKeyDictionary()  # module -> thread -> depth


def enter_module(module: nn.Module) -> int:
    """Record that the calling thread opens an ``apply`` call on ``module``; returns the thread's ident for
    ``leave_module``. Raises ``RuntimeError`` if another thread has a call on ``module`` open.

    Example:
        >>> me = enter_module(model)            # doctest: +SKIP
        >>> leave_module(model, me)             # doctest: +SKIP
    """
    me = threading.get_ident()
    with _LOCK:
        depth = _OPEN.setdefault(module, {})
        others = [t for t, n in depth.items() if n and t != me]
        if others:  # a thread that ended with a call left open (a compiled forward that raised) holds nothing
            alive = {t.ident: t.name for t in threading.enumerate()}
            for t in [t for t in others if t not in alive]:
                del depth[t]
            others = sorted(t for t in others if t in alive)
        if not others:
            depth[me] = depth.get(me, 0) + 1
            return me
    busy = ", ".join(repr(alive[t]) for t in others)
    raise RuntimeError(
        f"apply: {type(module).__name__} is in an apply call in another thread ({busy}) and thread "
        f"{threading.current_thread().name!r} started one on the same module. A call swaps each unit's gathered "
        "parameters into the module itself, so two threads cannot run one module at once (they would compute "
        "with each other's weights): give each thread its own module (copy.deepcopy(model) before "
        "fsdpfn.shard, and fsdpfn.fsdp on that copy), or make the calls one after another"
    )


def leave_module(module: nn.Module, thread: int) -> None:
    """Undo one ``enter_module(module)`` made in ``thread``.

    Example:
        >>> leave_module(model, me)             # doctest: +SKIP
    """
    with _LOCK:
        depth = _OPEN.get(module)
        if depth is not None and depth.get(thread):
            depth[thread] -= 1
            if not depth[thread]:
                del depth[thread]
