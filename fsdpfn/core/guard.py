"""Collective guard: fingerprints that catch ranks diverging, and waits that time out with an explanation.

The most costly failure of sharded training is a hang: one rank takes another branch and the others
wait in a collective until a watchdog fires, minutes later, with no hint of where. Every collective the
core issues gets a ``Fingerprint`` (sequence number, kind, unit, dtype, size). With checking on
(``FSDPFN_DEBUG=1`` or ``fsdpfn.debug.check_collectives()``) the ranks of the group compare
fingerprints before each collective (one small all-gather), and on a mismatch every rank raises
``CollectivePlanError`` naming, for each rank, the collective it was about to run. Independently of
checking, waits time out after ``Guard.timeout`` seconds (``FSDPFN_TIMEOUT``, default 600) with a
``CollectiveTimeout`` naming the unit and the last collective that completed, and a collective that fails
because a peer died raises ``CollectiveError`` with the same context.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpfn.core.c10d import all_gather_single

__all__ = [
    "CollectiveError",
    "CollectivePlanError",
    "CollectiveTimeout",
    "Fingerprint",
    "Guard",
    "check_collectives",
    "checking",
]

# Debug switch for the whole process (off unless FSDPFN_DEBUG=1); read by every Guard before a collective.
_CHECK = {"on": os.environ.get("FSDPFN_DEBUG", "") not in ("", "0")}


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or left); the message names the unit and collective."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete in time; the message names the unit and the last completed one."""


class CollectivePlanError(CollectiveError):
    """Ranks were about to run different collectives; the message lists each rank's."""


def checking() -> bool:
    """Whether collective-plan checking is on."""
    return _CHECK["on"]


@contextlib.contextmanager
def _restoring(previous: bool) -> Iterator[None]:
    try:
        yield
    finally:
        _CHECK["on"] = previous


def check_collectives(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Turn collective-plan checking on (or off); as a context manager, restore the previous setting.

    Costs one small all-gather per collective while on (see docs/errors.md for the measured cost).

    Example:
        >>> fsdpfn.debug.check_collectives()            # from now on   # doctest: +SKIP
        >>> with fsdpfn.debug.check_collectives():      # for a block   # doctest: +SKIP
        ...     loss, grads = step(params, batch)
    """
    previous = _CHECK["on"]
    _CHECK["on"] = enabled
    return _restoring(previous)


@dataclass(frozen=True)
class Fingerprint:
    """What one collective is: its sequence number on this ``Comm``, kind, unit, dtype and size."""

    seq: int
    kind: str
    label: str
    dtype: str
    numel: int

    def describe(self) -> str:
        """``#7 all_gather of unit 'blocks.1' (4096 x torch.float32)``."""
        return f"#{self.seq} {self.kind} of unit {self.label or '<root>'!r} ({self.numel} x {self.dtype})"

    def code(self) -> int:
        """A 63-bit summary of everything but the sequence number, for a cheap comparison."""
        return zlib.crc32(f"{self.kind}|{self.label}|{self.dtype}|{self.numel}".encode()) & 0x7FFFFFFF


class Guard:
    """Fingerprints, plan checks and explaining waits for one ``Comm``.

    ``steps`` counts completed forward/backward passes (the transform bumps it) for error messages.
    """

    def __init__(self, rank: int, timeout: float | None = None):
        self.rank = rank
        self.timeout = float(timeout if timeout is not None else os.environ.get("FSDPFN_TIMEOUT", "600"))
        self.seq = 0
        self.steps = 0
        self.last_done: Fingerprint | None = None

    def begin(self, kind: str, label: str, t: torch.Tensor, group: Any) -> Fingerprint:
        """Fingerprint the next collective; with checking on, compare it across ``group`` first."""
        self.seq += 1
        fp = Fingerprint(self.seq, kind, label, str(t.dtype), t.numel())
        if checking() and dist.get_world_size(group) > 1:
            self._verify(fp, group)
        return fp

    def _verify(self, fp: Fingerprint, group: Any) -> None:
        world = dist.get_world_size(group)
        mine = torch.tensor([fp.seq, fp.code()], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            mine = mine.cuda()
        everyone = mine.new_empty(world * 2)
        work = all_gather_single(everyone, mine, group=group, async_op=True)
        self.wait(work, Fingerprint(fp.seq, "plan check before", fp.label, fp.dtype, fp.numel))
        pairs = everyone.view(world, 2).tolist()
        if all(p == pairs[0] for p in pairs):
            return
        described: list[Any] = [None] * world
        dist.all_gather_object(described, f"{fp.describe()} after {self.steps} completed passes", group=group)
        lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(described))
        raise CollectivePlanError(
            f"ranks diverged: they were about to run different collectives (rank {dist.get_rank(group)} of "
            f"this group is raising; every rank raises the same error):\n{lines}\n"
            "A unit ran on some ranks only (data-dependent control flow, uneven batches, an exception "
            "caught on one rank). Make every rank run the same units in the same order."
        )

    def wait(self, work: Any, fp: Fingerprint) -> None:
        """Wait for ``work`` with the timeout; failures become errors that say what and where."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            last = self.last_done.describe() if self.last_done else "none yet"
            where = f"{fp.describe()} on rank {self.rank} (after {self.steps} completed passes; last completed collective: {last})"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise CollectiveTimeout(
                    f"collective {where} did not complete within {self.timeout:g} s: another rank is not running "
                    "it (it diverged, hangs or died). Set FSDPFN_DEBUG=1 to find where ranks diverge."
                ) from e
            raise CollectiveError(f"collective {where} failed: {e}. A peer rank probably failed or exited.") from e
        self.last_done = fp
