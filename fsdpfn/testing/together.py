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
    exception (by call) is raised once every thread has stopped. A call that raised takes no later
    decision: the others' next one raises ``threading.BrokenBarrierError`` (a real rank would wait forever).

    Example:
        >>> decided_together([lambda every: [every(True), every(True)], lambda every: [every(False), every(True)]])
        [[False, True], [False, True]]
    """
    n = len(calls)
    cond = threading.Condition()
    ballots: list[dict[int, bool]] = []  # per decision: each call's vote
    taken = [0] * n  # decisions each call has taken part in
    departed = [False] * n
    results: list[T | None] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def everywhere_for(i: int) -> Callable[[bool], bool]:
        def everywhere(fits: bool) -> bool:
            with cond:
                r = taken[i]
                taken[i] += 1
                if r == len(ballots):
                    ballots.append({})
                ballots[r][i] = bool(fits)
                cond.notify_all()
                while len(ballots[r]) < n:
                    if any(departed[j] and j not in ballots[r] for j in range(n)):
                        raise threading.BrokenBarrierError
                    cond.wait()
                return all(ballots[r].values())

        return everywhere

    def run(i: int) -> None:
        try:
            results[i] = calls[i](everywhere_for(i))
        except BaseException as error:  # noqa: BLE001 (re-raised by the caller's thread)
            errors[i] = error
        finally:
            with cond:
                departed[i] = True  # (after its last vote: decisions it took part in still complete)
                cond.notify_all()

    threads = [threading.Thread(target=run, args=(i,), name=f"fsdpfn-together-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results  # type: ignore[return-value]
