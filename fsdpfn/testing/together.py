"""``decided_together``: ranks that decide together, as threads of one process.

``fsdp``'s first call plans groups on ranks whose batches differ in size together: each fit the planner's
search decides is counted over the ranks (``fsdpfn.core.tally``) and every rank takes the combined answer
(``fsdpfn.memory.group_sizes_within(everywhere=...)``). A test's single-process reference for that runs each
rank's search in a thread of its own, the threads meeting at every decision.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["decided_together"]

T = TypeVar("T")


def decided_together(calls: Sequence[Callable[[Callable[[bool], bool]], T]]) -> list[T]:
    """Run each of ``calls`` in a thread of its own, each given ``everywhere(fits) -> bool``: whether every
    call's ``fits`` at that decision (the n-th of each) was true. The calls' results in order; the first
    exception (by call) is raised once every thread has stopped (the others are released, their decisions
    then refused with ``threading.BrokenBarrierError``).

    Example:
        >>> decided_together([lambda every: [every(True), every(True)], lambda every: [every(False), every(True)]])
        [[False, True], [False, True]]
    """
    barrier = threading.Barrier(len(calls))
    votes: list[bool] = [True] * len(calls)
    results: list[T | None] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def everywhere_for(i: int) -> Callable[[bool], bool]:
        def everywhere(fits: bool) -> bool:
            votes[i] = bool(fits)
            barrier.wait()  # every thread has voted
            decided = all(votes)
            barrier.wait()  # every thread has read the votes before the next decision writes them
            return decided

        return everywhere

    def run(i: int) -> None:
        try:
            results[i] = calls[i](everywhere_for(i))
        except BaseException as error:  # noqa: BLE001 (re-raised by the caller's thread)
            errors[i] = error
            barrier.abort()  # the others' next decision cannot be made

    threads = [threading.Thread(target=run, args=(i,), name=f"fsdpfn-together-{i}") for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results  # type: ignore[return-value]
