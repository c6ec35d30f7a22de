"""Relay's connection pools: JIT off, and a connection checked only when it may be stale.

Checking every checkout costs a round trip, doubling the cost of a one-statement
enqueue; never checking hands out connections that died while idle (a database
restart, a proxy's idle timeout). A connection returned less than a second ago
was working then, so only connections idle for longer are checked.
"""

from __future__ import annotations

import time
import weakref

import psycopg
from psycopg_pool import ConnectionPool

#: A connection idle longer than this is checked before it is handed out.
IDLE_CHECK_SECONDS = 1.0


def make_pool(dsn: str, *, name: str, min_size: int, max_size: int, timeout: float = 30.0) -> ConnectionPool:
    """An opened pool whose connections are checked when idle for over a second."""
    returned_at: weakref.WeakKeyDictionary[psycopg.Connection, float] = weakref.WeakKeyDictionary()

    def remember_return(conn: psycopg.Connection) -> None:
        returned_at[conn] = time.monotonic()

    def check_if_idle(conn: psycopg.Connection) -> None:
        last = returned_at.get(conn)
        if last is None or time.monotonic() - last > IDLE_CHECK_SECONDS:
            ConnectionPool.check_connection(conn)

    return ConnectionPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        name=name,
        open=False,
        timeout=timeout,
        configure=configure_session,
        check=check_if_idle,
        reset=remember_return,
    )


def configure_session(conn: psycopg.Connection) -> None:
    """Session settings for Relay's own connections.

    JIT off: the claim's plan can look expensive to the planner (a small
    settings table never analyzed is assumed to hold hundreds of rows), and
    compiling it costs ~25 ms for a statement that runs in ~1 ms. Queue
    statements are short OLTP work that JIT never speeds up.
    """
    conn.execute("SET jit = off")
    conn.commit()
