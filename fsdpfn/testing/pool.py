"""Run a function on every rank of a CPU/gloo process group, on persistent worker pools.

:func:`spmd` is the entry point for multi-rank tests.  For each world size ``W`` a pool of
``W`` worker processes (``python -m fsdpfn.testing._worker``) is started on first use;
each worker joins a gloo process group once and then serves calls, so later calls with
the same ``W`` cost only the call itself.  Between calls, a worker holding more than a few
process groups that calls created (meshes, ``new_group``) destroys those nothing refers to any
more (idle gloo groups cost CPU); a group or mesh kept across calls stays.  Pools are stopped
at interpreter exit (or by :func:`shutdown_pools`).  After a call in which ranks raised but
every rank answered, the workers destroy all their process groups and join a fresh default
group (a second, not the seconds a new pool takes to start); so do they after a call every rank
returned from but that left a group's counters different between its ranks: its operation count (one
rank started a collective the others never joined; gloo counts sends and receives too, which may differ
legitimately), the tag fsdpfn's exchanges over it draw next, or the number of groups each rank created;
with a warning naming the call and the counters: the next call's first operation would otherwise pair
with a stray one. A failed call's report names the counters the answering ranks differed on, if any: they
had diverged (a timeout inside one collective with the counters equal is a fault of the transport). A
call in which a rank hung or died discards its pool, and the next call starts a fresh one.

``fn`` and ``args`` are sent with plain :mod:`pickle`, so ``fn`` must be a module-level
function (pickled by reference, imported by the workers) and ``args`` picklable.

Environment variables:

* ``FSDPFN_SPMD_TIMEOUT``: default per-call deadline in seconds (120).
* ``FSDPFN_SPMD_PG_TIMEOUT``: the process-group timeout inside workers in seconds (60).
* ``FSDPFN_SPMD_START_TIMEOUT``: deadline for starting a pool in seconds (60).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import subprocess
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from fsdpfn.testing._groups import groups_apart
from fsdpfn.testing._processes import MAX_WORLD_SIZE, WorkerPool, read_log
from fsdpfn.testing._wire import send
from fsdpfn.testing.failure import SpmdError, SpmdTimeout, failure

__all__ = ["SpmdError", "SpmdTimeout", "spmd", "shutdown_pools", "MAX_WORLD_SIZE"]

_GRACE_S = 2.0  # after a rank failed, how long to wait for the others
_POOLS: dict[int, WorkerPool] = {}


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


def _get_pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is not None and all(p.poll() is None for p in pool.procs):
        return pool
    if pool is not None:  # a worker died between calls
        _discard(world_size)
    why = ""
    codes: dict[int, int | None] = {}
    for _attempt in range(2):  # retry once: the free port may have been taken meanwhile
        deadline = time.monotonic() + _env_float("FSDPFN_SPMD_START_TIMEOUT", 60.0)
        pool = WorkerPool(world_size)
        try:
            why = pool.start(deadline) or ""
        except BaseException:
            pool.close(graceful=False)
            raise
        if not why:
            _POOLS[world_size] = pool
            return pool
        codes = {r: p.poll() for r, p in enumerate(pool.procs)}
        pool.close(graceful=False)
        if why == "start-up timed out":
            break
    raise SpmdError(
        f"spmd: start-up of a pool of {world_size} workers failed: {why}\n"
        f"worker exit codes (None = was still running): {codes}"
    )


def _discard(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close(graceful=False)


def shutdown_pools() -> None:
    """Stop all worker pools now (also registered with :mod:`atexit`).

    Example::

        spmd(2, my_fn)
        shutdown_pools()  # the next spmd(2, ...) starts a fresh pool
    """
    pools = [p for p in _POOLS.values() if p.owner_pid == os.getpid()]  # not a forked child's
    _POOLS.clear()
    for pool in pools:
        pool.ask_exit()  # all at once, so that they exit in parallel
    for pool in pools:
        pool.close(graceful=True)


atexit.register(shutdown_pools)


def _counters(reply: tuple | None) -> dict[str, int]:
    """The group counters a worker's reply ends with (``ok`` and ``error`` replies alike); ``{}`` for a
    rank that did not answer or an answer without them (shown as ``-``)."""
    if not reply:
        return {}
    state = reply[2] if reply[0] == "ok" else reply[5] if len(reply) > 5 else {}
    return state if isinstance(state, dict) else {}


def _describe_fn(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def spmd(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float | None = None,
    reraise: bool = True,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a gloo group of ``world_size`` processes.

    Returns the ranks' results, index = rank (tensors come back detached).  Inside ``fn``
    the default process group is the pool's: ``torch.distributed.get_rank()`` is the rank.
    ``fn`` must be a module-level function and ``args`` picklable (plain :mod:`pickle`).
    Process groups ``fn`` creates and drops (meshes, ``new_group``) are destroyed after some
    later call, once every rank has returned; groups and meshes kept alive across calls stay
    until a call fails (then every group is destroyed: a cache of meshes must notice that, e.g.
    by keying on ``torch.distributed.group.WORLD``).

    Failures (after one where every rank answered, the workers' process groups are destroyed
    and a fresh default group is made; otherwise the pool is discarded and the next call
    starts a fresh one):

    * Some ranks raised: if ``reraise`` and all of them raised the same exception type
      (and no rank died), a new exception of that type is raised, with message
      ``"rank R: <message>\\n<traceback of rank R>"`` plus the other failing ranks'
      reports, ``from`` the original; otherwise :class:`SpmdError`.  Ranks that have not
      answered ``2`` s after the first failure are reported as hung, with their stacks.
    * A worker died: :class:`SpmdError` naming the rank and its exit code.
    * No answer within ``timeout`` seconds (default: env ``FSDPFN_SPMD_TIMEOUT`` or 120):
      :class:`SpmdTimeout` with the stack dumps of the ranks that did not answer.

    Example::

        def _rank_and_sum():
            t = torch.ones(1)
            dist.all_reduce(t)
            return dist.get_rank(), t.item()

        assert spmd(2, _rank_and_sum) == [(0, 2.0), (1, 2.0)]
    """
    if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"spmd: world_size must be an int in 1..{MAX_WORLD_SIZE}, got {world_size!r}")
    if getattr(fn, "__module__", None) == "__main__":
        raise TypeError(
            f"spmd: fn {_describe_fn(fn)} is defined in __main__, which the workers cannot import; "
            "define it in an importable module"
        )
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"spmd: fn and args must be picklable (fn must be a module-level function; got fn={fn!r}): {exc}"
        ) from exc
    if timeout is None:
        timeout = _env_float("FSDPFN_SPMD_TIMEOUT", 120.0)

    pool = _get_pool(world_size)
    try:
        out, states = _call(pool, fn, payload, float(timeout), reraise)
    except BaseException as exc:
        # The groups may be out of sync now (unreceived messages, unequal collective counts). If
        # every rank answered, fresh groups in the same workers fix that; otherwise (a hang, a
        # death, Ctrl-C) the pool goes.
        renewed = False
        try:
            renewed = pool.all_answered and isinstance(exc, Exception) and pool.renew()
        finally:
            if not renewed:
                _discard(world_size)
        raise
    apart = groups_apart(states)
    if apart:
        # Every rank returned, but a group's counters differ between its members. gloo counts sends and
        # receives too, which may differ legitimately (no message for a peer's empty chunk); a collective
        # one rank started and the others never joined, or exchange tags one rank drew alone, would make
        # the next call's first operation on that group pair wrongly and time out (or read the wrong
        # data). Fresh groups start the next call in step either way (a second); the warning names the call.
        warnings.warn(
            f"spmd: {_describe_fn(fn)} returned on every rank, but left the ranks' process groups apart "
            f"({apart}): the groups were renewed",
            stacklevel=2,
        )
        if not pool.renew():
            _discard(world_size)
    return out


def _call(
    pool: WorkerPool, fn: Callable[..., Any], payload: bytes, timeout: float, reraise: bool
) -> tuple[list[Any], list[dict[str, int]]]:
    """Each rank's result of ``fn``, and each rank's group counters after it (``fsdpfn.testing._groups.groups_state``);
    raises the call's failure."""
    world = pool.world_size
    pool.all_answered = False
    conns: list[Connection] = [c for c in pool.conns if c is not None]
    replies: dict[int, tuple] = {}
    dead: dict[int, int | None] = {}
    pending = set(range(world))
    for r, conn in enumerate(conns):
        try:
            send(conn, ("call", payload))
        except OSError:
            dead[r] = pool.procs[r].poll()
            pending.discard(r)
    start = time.monotonic()
    deadline = start + timeout
    first_fail = start if dead else None
    while pending:
        now = time.monotonic()
        if now >= deadline or (first_fail is not None and now >= first_fail + _GRACE_S):
            break
        for conn in wait([conns[r] for r in pending], timeout=0.1):
            r = conns.index(conn)  # type: ignore[arg-type]
            pending.discard(r)
            try:
                data = conn.recv_bytes()  # type: ignore[union-attr]
            except (EOFError, OSError):
                try:
                    dead[r] = pool.procs[r].wait(timeout=2)
                except subprocess.TimeoutExpired:
                    dead[r] = None
                continue
            try:
                replies[r] = pickle.loads(data)
            except Exception as exc:
                why_not = f"the parent could not unpickle rank {r}'s reply: {exc}"
                replies[r] = ("error", type(exc).__name__, why_not, "", None)
        for r in list(pending):  # exited without its connection reporting EOF (yet)
            if pool.procs[r].poll() is not None and not conns[r].poll():
                dead[r] = pool.procs[r].returncode
                pending.discard(r)
        if first_fail is None and (dead or any(v[0] != "ok" for v in replies.values())):
            first_fail = time.monotonic()
    if not pending and not dead and all(v[0] == "ok" for v in replies.values()):
        for conn in conns:  # every rank is done with the call's process groups: they may go
            with contextlib.suppress(OSError):  # a worker that died now is found by the next call
                send(conn, ("tidy",))
        return [replies[r][1] for r in range(world)], [replies[r][2] for r in range(world)]

    # --- failure: build the report --------------------------------------------------------
    hung = sorted(pending)
    pool.all_answered = not hung and not dead
    waited = time.monotonic() - (start if first_fail is None else first_fail)
    dumps = pool.stack_dumps(hung) if hung else {}
    dead_logs = {r: read_log(pool.logs[r]) for r in dead}
    apart = groups_apart([_counters(replies.get(r)) for r in range(world)])  # apart: the ranks had diverged
    exc, cause = failure(_describe_fn(fn), world, replies, dead, dead_logs, hung, dumps, waited, first_fail is None, reraise, apart)
    raise exc from cause
