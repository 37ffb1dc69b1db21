"""The counters of a worker's process groups that must be equal on every rank of a group for its next
operation to pair up (not a public API): each worker reports them with every answer
(``groups_state``), and the pool compares them (``groups_apart``) after every call, to renew groups a call
left apart, and in a failed call's report, to say whether the ranks had diverged.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["groups_apart", "groups_state"]


def groups_state() -> dict[str, int]:
    """What must be equal on every rank of a group for its next operation to pair up, by what it is:
    each live group's operation count (gloo's sequence number: its collectives, which every member
    issues alike, and its sends and receives, which may differ), the tag fsdpfn's exchanges over it
    draw next (``fsdpfn.core.exchange``; drawn alike on every rank, sent or not), and how many
    groups this process has created (a later group's name and rendezvous keys). Nothing the
    installed torch does not expose."""
    state: dict[str, int] = {}
    try:
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        names = dict(world.pg_names)
        state["groups created"] = int(world.group_count)
    except Exception:  # noqa: BLE001 - a torch that keeps its groups elsewhere: nothing to compare
        return state
    exchange = sys.modules.get("fsdpfn.core.exchange")
    tags = getattr(exchange, "_GROUP_TAGS", {})
    for group, name in names.items():
        with contextlib.suppress(Exception):  # a backend without the count
            state[f"operations on group {name!r}"] = int(group._get_sequence_number_for_group())
        state[f"fsdpfn exchange tags on group {name!r}"] = tags.get(group, [0])[0]  # none drawn yet: 0
    return state


def groups_apart(states: list[dict[str, int]]) -> str:
    """The counters (``groups_state``) on which the ranks that report them differ, with each
    rank's value (``-`` where a rank has no such group), or ``""`` when they agree.

    Example:
        >>> groups_apart([{"groups created": 1}, {"groups created": 2}])
        'groups created [1, 2], by rank'
    """
    apart = []
    for key in sorted({k for state in states for k in state}):
        values = [state.get(key) for state in states]
        if len({v for v in values if v is not None}) > 1:
            shown = ", ".join("-" if v is None else str(v) for v in values)
            what = f"{key} [{shown}], by rank"
            if key.startswith("operations"):
                what += "; collectives, sends and receives: counted different numbers of operations"
            apart.append(what)
    return "; ".join(apart)
