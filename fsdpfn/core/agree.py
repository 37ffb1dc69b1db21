"""``agree``: whether every rank of a mesh reached the same integer (a decision taken rank by rank);
``tally``: how many ranks raised each of a list of flags; ``every_rank``: one integer of each rank.

A plan chosen on each rank from its own inputs (``fsdp``'s first call fuses units from the batch it sees)
must be the same on every rank, or their collectives stop matching: a hang. Two sums settle it without a
MIN/MAX reduction, which not every backend has: the values (every rank checks that the total is ``W``
times its own) and then the checks themselves. Like ``measure_link``, it runs ``comm.untracked()``. In a
simulated world (torch's ``fake`` backend, ``MeshGroups.simulated``) the one real rank agrees with itself.
"""

from __future__ import annotations

import torch

from fsdpfn.core.comm import Comm

__all__ = ["agree", "every_rank", "tally"]


def agree(comm: Comm, value: int) -> bool:
    """Whether every rank of ``comm``'s mesh passed the same ``value`` (a collective: all ranks call it).

    Example:
        >>> agree(Comm(fsdpfn.init_mesh()), 3)      # doctest: +SKIP
        True
    """
    ranks = comm.dp_world
    if ranks == 1 or comm.groups.simulated:
        # In a fake world this process stands for every rank, and each would reach the same value from the
        # same inputs; the fake group's sum moves nothing (it would read as a disagreement).
        return True
    (total,) = _summed(comm, [value], "agreement between ranks")
    (same,) = _summed(comm, [int(total == ranks * value)], "agreement between ranks")
    return same == ranks


def tally(comm: Comm, flags: list[bool]) -> list[int]:
    """How many ranks of ``comm``'s mesh set each of ``flags`` (a collective: all ranks call it with lists of
    the same length). In a world of one, or a simulated one, this rank's flags as counts.

    Example:
        >>> tally(Comm(fsdpfn.init_mesh()), [True, False])      # doctest: +SKIP
        [2, 0]
    """
    if comm.dp_world == 1 or comm.groups.simulated or not flags:
        return [int(f) for f in flags]
    return _summed(comm, [int(f) for f in flags], "count of ranks")


def every_rank(comm: Comm, value: int) -> list[int]:
    """``value`` as each rank of ``comm``'s mesh passed it, in rank order (a collective: all ranks call it).
    In a world of one, or a simulated one, this rank's value for every rank.

    Example:
        >>> every_rank(Comm(fsdpfn.init_mesh()), 5)      # doctest: +SKIP
        [5, 7]
    """
    ranks = comm.dp_world
    if ranks == 1 or comm.groups.simulated:
        return [value] * ranks
    return _summed(comm, [value if r == comm.rank else 0 for r in range(ranks)], "values of the ranks")


def _summed(comm: Comm, values: list[int], what: str) -> list[int]:
    """``values`` (int64) summed element-wise over the ranks of ``comm``'s mesh, outside its stats and
    collective plan (``comm.untracked()``); ``what`` names the all-reduce in errors."""
    with comm.untracked():
        t = torch.tensor(values, dtype=torch.int64, device=comm.groups.device)
        comm.all_reduce_sum(t, label=f"fsdpfn:{what}").wait()
        return [int(v) for v in t.tolist()]
