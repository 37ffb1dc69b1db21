"""What a failed :func:`~fsdpfn.testing.spmd` call raises: :class:`SpmdError`, :class:`SpmdTimeout`,
or the failing ranks' own exception type, with every rank's report (traceback, exit code or stacks)."""

from __future__ import annotations

import contextlib
import pickle
import signal

__all__ = ["SpmdError", "SpmdTimeout", "failure"]


class SpmdError(RuntimeError):
    """A :func:`spmd` call failed on one or more ranks (raised, died, or did not start).

    ``rank_errors`` maps each failing rank to a text report (traceback, exit code or stack
    dump); ``original`` is the first failing rank's exception when it could be unpickled.

    Example::

        try:
            spmd(2, my_fn)
        except SpmdError as e:
            print(sorted(e.rank_errors))
    """

    def __init__(self, message: str, rank_errors: dict[int, str] | None = None, original: BaseException | None = None):
        super().__init__(message)
        self.rank_errors: dict[int, str] = dict(rank_errors or {})
        self.original: BaseException | None = original

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.rank_errors, self.original))


class SpmdTimeout(SpmdError, TimeoutError):
    """Some rank(s) did not answer a :func:`spmd` call in time; the message has their stacks.

    Example::

        with pytest.raises(SpmdTimeout, match="rank 0"):
            spmd(2, waits_forever, timeout=3)
    """


def failure(
    fn: str,
    world: int,
    replies: dict[int, tuple],
    dead: dict[int, int | None],
    dead_logs: dict[int, str],
    hung: list[int],
    dumps: dict[int, str],
    waited: float,
    timed_out: bool,
    reraise: bool,
    apart: str = "",
) -> tuple[BaseException, BaseException | None]:
    """The exception a failed call of ``fn`` (its name) raises, and its cause.

    ``replies`` are the ranks' answers (``("ok", result)`` or the worker's error tuples), ``dead`` the
    exit codes of ranks that died (``dead_logs`` their log files), ``hung`` the ranks that did not
    answer within ``waited`` seconds (``dumps`` their stacks; ``timed_out``: the call's timeout ran
    out rather than the grace period after the first failure); ``apart``: the counters of the process
    groups on which the answering ranks differed (``fsdpfn.testing._groups.groups_apart``): they had
    diverged, a collective or exchange one rank ran without the others.

    Example:
        >>> exc, cause = failure("m.f", 2, {0: ("ok", 1)}, {}, {}, [1], {1: "<stack>"}, 3.0, True, True)
        >>> type(exc).__name__, cause is None
        ('SpmdTimeout', True)
    """
    raised = {r: v for r, v in sorted(replies.items()) if v[0] != "ok"}
    rank_errors: dict[int, str] = {}
    for r, v in raised.items():
        rank_errors[r] = f"rank {r} raised {v[1]}: {v[2]}\n{v[3]}".rstrip()
    for r, code in sorted(dead.items()):
        log = dead_logs.get(r, "")
        rank_errors[r] = f"rank {r} died ({_exit_text(code)})" + (f"\n{log}" if log else "")
    why = "(the call's timeout)" if timed_out else "after the first failure"
    for r in hung:
        rank_errors[r] = f"rank {r} did not answer within {waited:.1f} s {why}; its stacks:\n{dumps[r]}"
    sections = "\n\n".join(f"--- {rank_errors[r]}" for r in sorted(rank_errors))
    summary = []
    if dead:
        summary.append("rank(s) " + ", ".join(f"{r} ({_exit_text(c)})" for r, c in sorted(dead.items())) + " died")
    if raised:
        summary.append("rank(s) " + ", ".join(f"{r} ({v[1]})" for r, v in raised.items()) + " raised")
    if hung:
        summary.append(f"rank(s) {', '.join(map(str, hung))} did not answer within {waited:.1f} s {why}")
    if apart:
        summary.append(f"when they answered, the ranks' process groups were apart ({apart})")
    header = f"spmd({fn}, world_size={world}): " + "; ".join(summary)
    message = f"{header}\n\n{sections}"

    original: BaseException | None = None
    first = next(iter(raised.values()), None)
    if first is not None and first[4] is not None:
        with contextlib.suppress(Exception):
            original = pickle.loads(first[4])
    if not raised and not dead:
        return SpmdTimeout(message, rank_errors, None), None
    if reraise and original is not None and not dead and len({v[1] for v in raised.values()}) == 1:
        r0 = next(iter(raised))
        others = "\n\n".join(f"--- {rank_errors[r]}" for r in sorted(rank_errors) if r != r0)
        text = f"rank {r0}: {first[2]}\n{first[3]}".rstrip()  # type: ignore[index]
        text += f"\n\n({header})" + (f"\n\n{others}" if others else "")
        new = None
        with contextlib.suppress(Exception):
            new = type(original)(text)
        if isinstance(new, BaseException):
            with contextlib.suppress(Exception):
                new.rank_errors, new.original = rank_errors, original  # type: ignore[attr-defined]
            return new, original
    return SpmdError(message, rank_errors, original), original


def _exit_text(code: int | None) -> str:
    if code is None:
        return "its connection closed but it has not exited"
    killed = ""
    with contextlib.suppress(ValueError):
        killed = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
    return f"exit code {code}{killed}"
