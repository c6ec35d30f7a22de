"""The session settings of Relay's connections, and undoing those a transactional handler left.

Every connection of Relay's pools starts with them (``configure_session``);
a connection lent to a transactional handler gets them back after the
handler's transaction (``reset_session``), and the settings that must end
with that transaction are written into it (``handler_settings_end_with_transaction``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from .connect_options import LIVENESS_DEFAULTS
from .queries import sql
from .settings import transaction_pooling


def configure_session(conn: psycopg.Connection, lock_timeout_ms: int | None = None) -> None:
    """Session settings for Relay's own connections; with ``lock_timeout_ms``, a bound on every lock wait.

    JIT off: the claim's plan can look expensive to the planner (a small
    settings table never analyzed is assumed to hold hundreds of rows), and
    compiling it costs ~25 ms for a statement that runs in ~1 ms. Queue
    statements are short OLTP work that JIT never speeds up.

    READ COMMITTED whatever the database's default: the claim's ``FOR UPDATE
    SKIP LOCKED`` and the fenced updates fail with serialization errors under
    REPEATABLE READ whenever another worker got to a row first, and the
    limits lock must be followed by a fresh snapshot, not one taken before
    the wait. A transactional handler can begin with ``SET TRANSACTION
    ISOLATION LEVEL ...``, but only one that ends within a heartbeat
    interval gets its success written (see ``executor.STRICTER_ISOLATION``).

    The server's TCP keepalives as the client's (``LIVENESS_DEFAULTS``),
    where the server's configuration does not set them: a worker whose host
    died, or whose network path went silent, in the middle of a transaction
    (a transactional handler's, a schedule's tick, a shutdown's hand-back)
    kept that transaction open on the server, its locks held, until the
    server's first keepalive probe, two hours later on Linux's defaults.

    TimeZone UTC: psycopg reads a timestamptz in the session's time zone, and
    an instant Relay accepts (years 1 to 9999 in UTC) may fall outside what a
    datetime can hold in another zone (9999-12-31 20:00 UTC is year 10000 in
    Tokyo), which would break every listing that shows the job.

    Behind a transaction pooler (``RELAY_TRANSACTION_POOLING``) a session
    setting would stay on a server connection other clients use next, so only
    TimeZone is set (PgBouncer tracks it per client and restores each client's
    own); READ COMMITTED is asked for in every transaction Relay begins
    instead, and the database's defaults (README) cover the rest.
    """
    if transaction_pooling():
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    settings = own_session_settings(conn)
    if lock_timeout_ms is not None and not transaction_pooling():
        settings += f"; SET lock_timeout = {int(lock_timeout_ms)}"
    conn.execute(settings)  # type: ignore[arg-type]
    conn.commit()


def own_session_settings(conn: psycopg.Connection) -> str:
    """The statements of Relay's session settings (``configure_session``), one simple-protocol message."""
    if transaction_pooling():
        return "SET TimeZone = 'UTC'"
    keepalives = psycopg.ClientCursor(conn).mogrify(sql("session_server_keepalives"), LIVENESS_DEFAULTS)
    return f"SET jit = off; SET default_transaction_isolation = 'read committed'; {keepalives}; SET TimeZone = 'UTC'"


def reset_session(conn: psycopg.Connection) -> None:
    """Undo whatever session settings a transactional handler left on one of Relay's connections.

    A plain ``SET`` in the handler's transaction commits with its success and
    stays on the pooled connection: ``SET default_transaction_read_only = on``
    made every later claim on it fail. RESET ALL leaves the role alone, so it
    is reset too; then Relay's own settings (``configure_session``) are made
    again, in the same round trip.
    """
    if conn.closed or conn.broken or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return  # the pool discards or rolls back such a connection itself
    conn.execute("RESET SESSION AUTHORIZATION; RESET ROLE; RESET ALL; " + own_session_settings(conn))  # type: ignore[arg-type]
    conn.commit()


def handler_settings_end_with_transaction(idle_limit_seconds: float) -> str:
    """What runs in a transactional handler's transaction before Relay writes its success there.

    The role back to the one the worker logged in as: a role the handler
    took (``SET LOCAL ROLE``, as row-level security asks) may not reach
    relay.jobs. Behind a transaction pooler, also every setting the handler
    made turned into one that ends with the transaction (its value kept
    until then, ``SET LOCAL`` or not: ``synchronous_commit``, a deferred
    trigger's ``search_path``): the pooler lends the server connection to
    another client at COMMIT, so ``reset_session`` after it would reach
    whichever connection is free, and a plain ``SET`` would stay for the next
    client. Without a pooler ``reset_session`` undoes it on this connection.
    Then the transaction's idle limit, as a setting that ends with it: only
    the success UPDATE and the COMMIT are left, sent a moment apart, so a
    pause longer than ``idle_limit_seconds`` (the lease) is a process frozen
    between them (stopped, a stalled VM), holding the job's row where the
    sweeper (it skips locked rows) and an admin's cancel (it waits) cannot
    reach it. The server then ends the session: the handler's work rolls back
    with the success, and the job runs again.
    """
    idle_limit = f"SET LOCAL idle_in_transaction_session_timeout = {max(int(idle_limit_seconds * 1000), 1)}"
    if transaction_pooling():
        return f"{sql('handler_settings_end_with_transaction').rstrip().rstrip(';')}; {idle_limit}"
    return f"RESET SESSION AUTHORIZATION; RESET ROLE; {idle_limit}"


@contextmanager
def in_autocommit(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """``conn`` in autocommit for the block, then back to transactions.

    For a one-statement shortcut, a VACUUM, a message that carries its own
    BEGIN and COMMIT, or a transactional handler's run (see
    ``executor._run_transactional``). A closed or broken connection is left
    as it is: setting the attribute would raise and hide the error that broke
    it, and the pool discards such connections. One still in a transaction
    (a ROLLBACK that failed) is closed rather than lent on in autocommit.
    """
    conn.autocommit = True
    try:
        yield conn
    finally:
        if not conn.closed:
            try:
                conn.autocommit = False
            except psycopg.Error:
                conn.close()
