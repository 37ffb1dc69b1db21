"""The worker processes of one world size behind :func:`fsdpfn.testing.spmd` (not a public API): started
together, joined to one gloo group, renewed, stopped, and asked for their stacks. What a call sends them
and how its answers are read is :mod:`fsdpfn.testing.pool`'s."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from fsdpfn.testing._groups import FLIGHT_RECORDER_ENV
from fsdpfn.testing._wire import receive, send, without_delay

__all__ = ["MAX_WORLD_SIZE", "WorkerPool", "read_log"]

MAX_WORLD_SIZE = 8
"""Largest supported world size."""

_DUMP_WAIT_S = 1.0  # how long to wait for SIGUSR1 stack dumps to appear
_EXIT_WAIT_S = 3.0  # clean shutdown: how long to wait for workers to exit
_RENEW_S = 10.0  # how long renewing the process groups may take (~1 s) before the pool is discarded
_AUTHKEY_ENV = "FSDPFN_SPMD_AUTHKEY"  # same name in _worker.py (not imported: runpy warns)


class WorkerPool:
    """The ``world_size`` workers of one process group, and their connections."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.owner_pid = os.getpid()
        self.tmpdir = tempfile.mkdtemp(prefix=f"fsdpfn-spmd-w{world_size}-")
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world_size)]
        self.conns: list[Connection | None] = [None] * world_size
        self.procs: list[subprocess.Popen] = []
        self.all_answered = False  # whether every rank answered the last call (set by _call)
        authkey = secrets.token_bytes(32)
        self.listener = Listener(("127.0.0.1", 0), backlog=2 * MAX_WORLD_SIZE, authkey=authkey)
        host, port = self.listener.address
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["OMP_NUM_THREADS"] = "1"
        env["MKL_NUM_THREADS"] = "1"
        env[_AUTHKEY_ENV] = authkey.hex()
        env.setdefault(FLIGHT_RECORDER_ENV, "64")  # a failed call's report lists each rank's last operations
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for r in range(world_size):
            cmd = [sys.executable, "-m", "fsdpfn.testing._worker", "--rank", str(r), "--world-size", str(world_size)]
            cmd += ["--parent", f"{host}:{port}", "--init-method", init_method, "--log", self.logs[r]]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))

    def start(self, deadline: float) -> str | None:
        """Wait for all hellos and readies; return None, or why start-up failed."""
        sock = self.listener._listener._socket  # type: ignore[union-attr]  # no public fileno
        accepted = 0
        ready: set[int] = set()
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                return "start-up timed out"
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and accepted < self.world_size:
                return f"rank(s) {dead} exited during start-up"
            waitables: list[Any] = [c for c in self.conns if c is not None]
            if accepted < self.world_size:
                waitables.append(sock)
            for obj in wait(waitables, timeout=0.1):
                if obj is sock:
                    conn = without_delay(self.listener.accept())
                    _tag, rank, _pid = receive(conn)
                    self.conns[rank] = conn
                    accepted += 1
                    continue
                rank = self.conns.index(obj)
                try:
                    msg = receive(obj)
                except (EOFError, OSError):
                    return f"rank {rank} exited during start-up"
                if msg[0] != "ready":
                    return f"rank {rank} failed to init the process group:\n{msg[3]}"
                ready.add(rank)
                self.conns[rank] = obj
        return None

    def renew(self) -> bool:
        """Have every worker destroy its process groups and join a fresh default group (after a
        call in which ranks raised and every rank answered); False if any did not within
        ``_RENEW_S`` seconds (the caller then discards the pool)."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        conns = [c for c in self.conns if c is not None]
        try:
            for conn in conns:
                send(conn, ("renew", init_method))
        except OSError:
            return False
        deadline = time.monotonic() + _RENEW_S
        pending = set(conns)
        while pending:
            if time.monotonic() > deadline:
                return False
            for conn in wait(list(pending), timeout=0.1):
                try:
                    msg = receive(conn)  # type: ignore[arg-type]
                except (EOFError, OSError):
                    return False
                if msg[0] != "renewed":
                    return False
                pending.discard(conn)  # type: ignore[arg-type]
        return True

    def ask_exit(self) -> None:
        """Ask the workers to leave their serving loop and exit."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                if conn is not None:
                    send(conn, ("exit",))

    def close(self, graceful: bool) -> None:
        """Stop the workers (asking them first if ``graceful``) and free resources."""
        if graceful:
            self.ask_exit()
            end = time.monotonic() + _EXIT_WAIT_S
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.listener.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def stack_dumps(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` to dump their Python stacks (SIGUSR1) and return the dumps."""
        if not hasattr(signal, "SIGUSR1"):
            return {r: "(no stack dump: SIGUSR1 unavailable)" for r in ranks}
        for r in ranks:
            if self.procs[r].poll() is None:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        end = time.monotonic() + _DUMP_WAIT_S
        while time.monotonic() < end and not all(read_log(self.logs[r]) for r in ranks):
            time.sleep(0.05)
        time.sleep(0.1)  # let a dump that is being written finish
        return {r: read_log(self.logs[r]) or "(no stack dump was written)" for r in ranks}


def read_log(path: str) -> str:
    """A worker's log file (its stack dumps, a fatal error), stripped; ``""`` when there is none."""
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
