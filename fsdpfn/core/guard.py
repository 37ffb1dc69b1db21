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
import math
import os
import threading
import time
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpfn.core.c10d import all_gather_single
from fsdpfn.core.mesh import simulated_group

__all__ = [
    "CollectiveError",
    "CollectivePlanError",
    "CollectiveTimeout",
    "Fingerprint",
    "Guard",
    "check_collectives",
    "checking",
    "env_switch",
    "timeout_seconds",
]

# the label prefix of collectives that belong to fsdpfn itself (agreement, link probes), not to a unit
INTERNAL = "fsdpfn:"
DIGEST_MODULUS = 1_048_573  # a prime below 2**20: digests and their squares sum over ranks within int64


def env_switch(name: str, value: str) -> bool:
    """An on/off environment variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``/empty
    (any case); anything else is an error naming the variable (``false`` must never mean on).

    Example:
        >>> env_switch("FSDPFN_DEBUG", "off")
        False
    """
    v = value.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r} is neither on nor off: set it to 1 (on) or 0 (off)")


def timeout_seconds(value: Any, what: str = "FSDPFN_TIMEOUT") -> float:
    """A collective wait's timeout: a finite number of seconds > 0 (``what`` names where it came from).

    Example:
        >>> timeout_seconds("2.5")
        2.5
    """
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{what}={value!r}: a collective's timeout must be a number of seconds > 0 (default 600)")
    return seconds


# The debug switch, per thread: a rank may be a thread (PyTorch's threaded test group), and ranks must
# switch at the same point of their own programs, never when another rank-thread does. A thread that
# never set it follows, in turn, the thread that made the ``Comm`` (so CUDA autograd's worker threads
# check what the rank's thread checks), the main thread, then FSDPFN_DEBUG.
_DEFAULT = env_switch("FSDPFN_DEBUG", os.environ.get("FSDPFN_DEBUG", ""))
_SWITCH: weakref.WeakKeyDictionary[threading.Thread, bool] = weakref.WeakKeyDictionary()


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or left); the message names the unit and collective."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete in time; the message names the unit and the last completed one."""


class CollectivePlanError(CollectiveError):
    """Ranks were about to run different collectives; the message lists each rank's."""


def checking(owner: threading.Thread | None = None) -> bool:
    """Whether collective-plan checking is on for the calling thread (falling back to ``owner``'s
    setting, then the main thread's, then ``FSDPFN_DEBUG``)."""
    for thread in (threading.current_thread(), owner, threading.main_thread()):
        if thread is not None:
            on = _SWITCH.get(thread)
            if on is not None:
                return on
    return _DEFAULT


@contextlib.contextmanager
def _restoring(thread: threading.Thread, previous: bool | None) -> Iterator[None]:
    try:
        yield
    finally:
        if previous is None:
            _SWITCH.pop(thread, None)
        else:
            _SWITCH[thread] = previous


def check_collectives(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Turn collective-plan checking on (or off) for the calling thread — the rank — and the threads
    that follow it; as a context manager, restore the previous setting. Every rank must make the same
    call at the same point of its program (under a threaded process group, each rank-thread its own).

    Costs one small all-gather per collective while on (see docs/errors.md for the measured cost).

    Example:
        >>> fsdpfn.debug.check_collectives()            # from now on   # doctest: +SKIP
        >>> with fsdpfn.debug.check_collectives():      # for a block   # doctest: +SKIP
        ...     loss, grads = step(params, batch)
    """
    thread = threading.current_thread()
    previous = _SWITCH.get(thread)
    _SWITCH[thread] = enabled
    return _restoring(thread, previous)


@dataclass(frozen=True)
class Fingerprint:
    """What one collective is: its sequence number on this ``Comm``, kind, unit, dtype and size."""

    seq: int
    kind: str
    label: str
    dtype: str
    numel: int

    def describe(self) -> str:
        """``#7 all_gather of unit 'blocks.1' (4096 x torch.float32)``; a label ``fsdpfn:<what>`` (a
        collective of fsdpfn's own, not of a unit) reads ``#2 all_reduce of fsdpfn's <what> (...)``."""
        what = f"fsdpfn's {self.label[len(INTERNAL):]}" if self.label.startswith(INTERNAL) else f"unit {self.label or '<root>'!r}"
        return f"#{self.seq} {self.kind} of {what} ({self.numel} x {self.dtype})"

    def code(self) -> int:
        """A 63-bit summary of everything but the sequence number, for a cheap comparison."""
        return zlib.crc32(f"{self.kind}|{self.label}|{self.dtype}|{self.numel}".encode()) & 0x7FFFFFFF


class Guard:
    """Fingerprints, plan checks and explaining waits for one ``Comm``.

    ``steps`` counts completed forward/backward passes (the transform bumps it) for error messages.
    """

    def __init__(self, rank: int, timeout: float | None = None):
        self.rank = rank
        self.timeout = (
            timeout_seconds(timeout, "timeout") if timeout is not None else timeout_seconds(os.environ.get("FSDPFN_TIMEOUT", "600"))
        )
        self.owner = threading.current_thread()  # the rank's thread, whose debug switch we follow
        self.seq = 0
        self.steps = 0
        self.last_done: Fingerprint | None = None
        # of the collectives since the last pass check (fsdpfn.core.pass_check): equal on every rank unless
        # the ranks ran different units (matching sizes pair up anyway, mixing the units' data, silently)
        self.digest = 0
        self.pending_check: Any = None  # CUDA: the last check's sums on their way to the host
        # an error this rank found in a backward that the other ranks cannot see (a parameter used on some
        # ranks only): raised at the next pass check, where every rank learns that some rank refused
        self.refusal: BaseException | None = None
        # compat's parameters without a gradient on this rank since the last pass check (gradient None,
        # FSDP2's answer when no rank used them): equal on every rank unless some used them and some not
        self.missing = 0
        self.missing_names: list[str] = []
        # this rank asks every rank to plan the fused groups again (fsdpfn.transform.fusion: a training batch
        # larger than the one they were planned for); sent with the next pass check that runs
        self.replan_asked = False
        # the pass checks at which some rank asked (equal on every rank): a plan planned before the last
        # of them plans again at its next call
        self.replans = 0

    def note_missing(self, names: list[str]) -> None:
        """Fold parameters that got no gradient on this rank into ``missing`` (``check_pass`` compares it)."""
        for name in names:
            self.missing = (self.missing * 1_000_003 + zlib.crc32(name.encode())) % DIGEST_MODULUS
        self.missing_names.extend(names)

    def begin(self, kind: str, label: str, t: torch.Tensor, group: Any) -> Fingerprint:
        """Fingerprint the next collective; with checking on, compare it across ``group`` first."""
        self.seq += 1
        fp = Fingerprint(self.seq, kind, label, str(t.dtype), t.numel())
        self.digest = (self.digest * 1_000_003 + fp.code()) % DIGEST_MODULUS
        if checking(self.owner) and dist.get_world_size(group) > 1 and not simulated_group(group):  # nothing to compare
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
        start = time.monotonic()
        try:
            _wait(work, self.timeout)
        except RuntimeError as e:
            last = self.last_done.describe() if self.last_done else "none yet"
            where = f"{fp.describe()} on rank {self.rank} (after {self.steps} completed passes; last completed collective: {last})"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                # the process group's own timeout may fire first: say how long it was waited for
                waited = time.monotonic() - start
                within = f"{self.timeout:g} s" if waited >= self.timeout * 0.99 else f"{waited:.0f} s (the process group's timeout)"
                raise CollectiveTimeout(
                    f"collective {where} did not complete within {within}: another rank is not running "
                    "it (it diverged, hangs or died). A sharded model's forward and backward, and fsdpfn.save, "
                    "load and full_state_dict, are collective: every rank runs each of them (an evaluation or a "
                    "save under `if rank == 0:` is a usual cause: call them on every rank; full_state_dict keeps "
                    "the copy on rank 0). Set FSDPFN_DEBUG=1 to find where ranks diverge."
                ) from e
            raise CollectiveError(
                f"collective {where} failed: {e}. A peer rank probably failed or exited: look for its own error "
                "first. If it has none (it was aborted inside gloo, or crashed), the ranks may have diverged (a "
                "unit run on some ranks only); FSDPFN_DEBUG=1 names each rank's collective where they part."
            ) from e
        self.last_done = fp


def _wait(work: Any, timeout: float) -> None:
    """``work.wait`` with a timeout, also for works that cannot wait with one (those made from a future,
    as PyTorch's threaded test group returns, raise "wait() with finite timeout not implemented")."""
    done = getattr(work, "is_completed", None)
    if done is not None and done():
        work.wait()  # raises the collective's error, if any
        return
    try:
        work.wait(datetime.timedelta(seconds=timeout))
        return
    except RuntimeError as e:
        if "finite timeout not implemented" not in str(e):
            raise
    future = work.get_future()
    deadline = time.monotonic() + timeout
    pause = 1e-4
    while not future.done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"wait timed out after {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    work.wait()
