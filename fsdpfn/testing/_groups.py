"""The counters of a worker's process groups that must be equal on every rank of a group for its next
operation to pair up (not a public API): each worker reports them with every answer
(``groups_state``), and the pool compares them (``groups_apart``) after every call, to renew groups a call
left apart, and in a failed call's report, to say whether the ranks had diverged. A rank that raised
also reports its last operations (``last_operations``, from torch's flight recorder, which the pool
switches on in its workers' environment: ``FLIGHT_RECORDER_ENV``), so the report shows which collective a diverged rank ran alone.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["FLIGHT_RECORDER_ENV", "groups_apart", "groups_state", "last_operations"]

# How many operations torch's flight recorder keeps (read once, before it records the first); the pool
# sets it in the environment it starts its workers with. Recording cost nothing measurable next to a gloo collective here.
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


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


def last_operations(count: int = 8) -> str:
    """This process's last ``count`` operations on any process group, oldest first, one line each: the
    group, its collective (or point-to-point) number, the operation, its input sizes and dtypes, its
    state, and where it was issued (the innermost frame outside torch's c10d wrappers and
    ``fsdpfn.core``, which only relays). ``""`` when torch recorded none (``FLIGHT_RECORDER_ENV`` unset
    before the group's first operation, or a torch without the recorder).

    Example:
        >>> isinstance(last_operations(), str)
        True
    """
    try:
        import pickle

        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(includeStackTraces=True)).get("entries", [])
    except Exception:  # noqa: BLE001 - no recorder in this torch, or nothing recorded
        return ""
    lines = []
    for e in entries[-count:]:
        group = e.get("process_group", ("?", "?"))[0]
        number = f"p2p #{e.get('p2p_seq_id')}" if e.get("is_p2p") else f"#{e.get('collective_seq_id')}"
        sizes = ", ".join(f"{list(s)} {d}" for s, d in zip(e.get("input_sizes", []), e.get("input_dtypes", [])))
        lines.append(f"group {group!r} {number}: {e.get('profiling_name')}({sizes}) {e.get('state')}{_issued_at(e.get('frames', []))}")
    return "\n".join(lines)


_RELAYS = ("/torch/distributed/distributed_c10d.py", "/torch/distributed/c10d_logger.py", "/fsdpfn/core/")


def _issued_at(frames: list) -> str:
    for f in frames:  # innermost first
        path = str(f.get("filename", "")).replace("\\", "/")
        if not any(r in path for r in _RELAYS):
            return f" at {path.rsplit('/', 1)[-1]}:{f.get('line')} ({f.get('name')})"
    return ""
