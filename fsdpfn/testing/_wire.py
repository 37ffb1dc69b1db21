"""The pool's wire (``fsdpfn.testing.pool`` and its workers, ``fsdpfn.testing._worker``): one pickled
message per ``send_bytes``, over TCP connections that send each message at once (not a public API)."""

from __future__ import annotations

import os
import pickle
import socket
from multiprocessing.connection import Connection
from typing import Any


def send(conn: Connection, obj: Any) -> None:
    """Send ``obj``, pickled, as one message."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next message, unpickled."""
    return pickle.loads(conn.recv_bytes())


def without_delay(conn: Connection) -> Connection:
    """``conn`` (a TCP connection) set to send each message at once (``TCP_NODELAY``). Otherwise Nagle's
    algorithm holds a small message while the one before it is unacknowledged, and the peer delays that
    acknowledgement (up to 40 ms on Linux): the parent sends ``("tidy",)`` and then the next call, so every
    call waited about 40 ms (44 ms per ``spmd`` of a function that does nothing; 0.2-0.5 ms now)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:  # a second descriptor of the same socket
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn
