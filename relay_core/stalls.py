"""Cutting a connection whose database stopped answering, from another thread.

A server that hangs (storage that stopped, a stopped process) or a proxy in
front of it that stops forwarding while its kernel still acknowledges leaves
a connection that is healthy to TCP: keepalives and ``tcp_user_timeout``
never fire, a cancel request stalls on its way like everything else, and the
server's ``statement_timeout`` never arrives. A statement on it waits until
the database answers again, however long that takes.

Shutting the socket down ends that wait: libpq sees the connection closed,
the statement raises ``OperationalError``, and a pool discards the
connection when it comes back. The statement itself is rolled back by the
server, unless it had committed and only its answer is lost, which callers
that cut must already handle (a connection can break that way at any time).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import psycopg


def cut(conn: psycopg.Connection) -> None:
    """Shut down ``conn``'s socket, so whatever waits on it ends with a broken connection."""
    # A duplicate of the descriptor: shutting it down shuts the socket, and closing
    # it leaves the connection's own descriptor for libpq to close.
    with suppress(OSError, psycopg.Error), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _Deadline:
    at: float
    conn: psycopg.Connection


class Watchdog:
    """One thread that cuts connections whose deadline passed before they were disarmed.

    Arming and disarming take the same lock as the cut, so a connection is
    never cut once its caller has moved on (its descriptor may by then be
    another socket's).
    """

    def __init__(self) -> None:
        self._reset()
        # A forked child starts with none of the parent's deadlines (its copies of the parent's
        # sockets are the parent's to cut), no watchdog thread, and a lock nobody holds.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._deadlines: dict[int, _Deadline] = {}
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection, seconds: float) -> int:
        """Cut ``conn`` in ``seconds`` unless :meth:`disarm` is called with the returned handle first."""
        with self._lock:
            handle = next(self._ids)
            self._deadlines[handle] = _Deadline(time.monotonic() + seconds, conn)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._watch, name="relay-stall-watchdog", daemon=True)
                self._thread.start()
            self._lock.notify()
            return handle

    def disarm(self, handle: int) -> None:
        """Leave the connection armed under ``handle`` alone (a no-op once it was cut)."""
        with self._lock:
            self._deadlines.pop(handle, None)

    def _watch(self) -> None:
        with self._lock:
            while True:
                if not self._deadlines:
                    self._lock.wait()
                    continue
                handle, first = min(self._deadlines.items(), key=lambda item: item[1].at)
                wait = first.at - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                del self._deadlines[handle]
                cut(first.conn)


#: The least time a statement gets before its connection is cut, however little of its time was
#: left: a database that answers at all answers the statements cut this way (a hand-back, a
#: shutdown's last writes) in a few milliseconds, and one that stopped answering is not waited on.
SHORTEST_CUT_SECONDS = 0.05


def seconds_until(end: float) -> float:
    """Seconds from now to ``end`` (a ``time.monotonic()``), never under ``SHORTEST_CUT_SECONDS``."""
    return max(end - time.monotonic(), SHORTEST_CUT_SECONDS)


#: The process's watchdog: one thread, started the first time a connection is armed.
WATCHDOG = Watchdog()


@contextmanager
def cut_after(conn: psycopg.Connection, seconds: float) -> Iterator[None]:
    """Cut ``conn`` if the block is still running ``seconds`` from now."""
    handle = WATCHDOG.arm(conn, seconds)
    try:
        yield
    finally:
        WATCHDOG.disarm(handle)


@contextmanager
def cut_at(conn: psycopg.Connection, end: float | None) -> Iterator[None]:
    """Cut ``conn`` if the block is still running at ``end`` (see ``seconds_until``); None: never."""
    if end is None:
        yield
        return
    with cut_after(conn, seconds_until(end)):
        yield
