"""The web app's database connections: one small pool per process.

The pool opens on first use, not in ``create_app``: gunicorn forks workers
after importing the app, and a pool's threads and sockets do not survive a
fork. Waiting for a connection is bounded, so a database outage answers 503
in seconds instead of hanging every request. Each connection carries a
statement timeout so no admin query can run away with the database, and
waits for each answer at most that long plus the connection wait: a server
that stalls, or a network path that drops packets, keeps the socket open and
sends nothing, so no server-side timeout can end the wait.

An outage is logged once per process, not once per request that met it
(every probe, scrape and dashboard refresh): as it begins, every 30 s while
it lasts, and as the next connection comes (``outage``). While one is under
way a request waits OUTAGE_WAIT_SECONDS for a connection, not the full
RELAY_DB_WAIT_SECONDS: the web process has a few threads (four in the
Procfile), and probes, scrapes and dashboard refreshes that each held one
for 5 s left ``/healthz``, which needs no database, waiting behind them
(3-4 s, 9.5 s against a silent one) until a platform's liveness check failed
and restarted a process that was fine.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from flask import Flask, current_app, g, has_request_context, request
from psycopg.abc import RV, PQGen
from psycopg_pool import ConnectionPool, PoolTimeout

from relay_core import Relay, monitor
from relay_core.connect_options import connection_options
from relay_core.jsonb import read_any_number
from relay_core.outages import OutageLog, RepeatedWarning, Wording
from relay_core.pools import ReconnectingPool, all_in_use
from relay_core.sessions import in_autocommit
from relay_core.timestamps import read_any_timestamp

EXTENSION = "relay.db"
#: How long a request waits for a connection while an outage is under way (see the module's docstring).
OUTAGE_WAIT_SECONDS = 0.5
#: Counter deltas of each table a page folds before it reads (see monitor.fold_counters):
#: a share, so a pile left while no worker ran never runs a page into its statement timeout.
FOLD_ROWS_PER_READ = 50_000


class BoundedConnection(psycopg.Connection):
    """A connection that gives up on an answer after ``answer_timeout`` seconds and closes.

    psycopg waits for every server answer (a statement, a commit, the pool's
    check) in :meth:`wait`; past the bound it raises ``OperationalError``,
    which the app answers with 503. A connection left mid-statement cannot be
    used again, so it is closed and the pool replaces it.
    """

    answer_timeout: float | None = None

    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        """Consume ``gen`` as psycopg does, within ``answer_timeout`` when no timeout is given."""
        bounded = timeout is None and self.answer_timeout is not None
        try:
            return super().wait(gen, interval, self.answer_timeout if bounded else timeout)
        except psycopg.errors._WaitTimeout:
            if not bounded:
                raise
            self.close()
            raise psycopg.OperationalError(f"the database did not answer within {self.answer_timeout:g} s") from None


#: What the web app says of an outage (a request that meets one is answered 503).
UNAVAILABLE = Wording(
    "database unavailable; answering 503",
    "database still unavailable; answering 503",
    "database available again",
    "statement cancelled by the server (its statement_timeout?); answering 503",
)
#: What the web app says of a write the database refused for being read-only (a failover, a standby).
REFUSING_WRITES = "database refuses writes (read-only: a failover or a standby?); answering 503"
#: What the web app says of a page that read the counters without folding their changes first: the fold
#: is a write, and the page answers all the same, its counts exact (they sum what is left unfolded).
FOLD_REFUSED = "database refuses writes (read-only: a failover or a standby?); counters read without folding"
#: What the web app says of a request that found every connection of its pool checked out by
#: others (more requests at once than RELAY_WEB_POOL_SIZE): no outage, and the wait for a
#: connection stays whole. Said at most once per REPEAT_SECONDS, with how often since: under
#: such a load checkouts that fail and succeed take turns, and an account that ended at each
#: success said it twice a second.
POOL_EXHAUSTED = (
    "no free database connection: every connection of this process's pool was in use (RELAY_WEB_POOL_SIZE); "
    "answered 503"
)


class Database:
    """A lazily opened, fork-aware connection pool and the Relay used to enqueue."""

    def __init__(
        self, dsn: str, *, size: int, wait_seconds: float, statement_timeout_ms: int, max_payload_bytes: int
    ) -> None:
        self.dsn = dsn
        self.relay = Relay(dsn, db_wait=wait_seconds, max_payload_bytes=max_payload_bytes)
        #: The requests that met the database away, said once (the error handlers report through ``unavailable``).
        self.outage = OutageLog(wording=UNAVAILABLE)
        self.exhaustion = RepeatedWarning(POOL_EXHAUSTED)
        self.refusing_writes = RepeatedWarning(REFUSING_WRITES)
        self.fold_refused = RepeatedWarning(FOLD_REFUSED)
        self._size = size
        self._wait = wait_seconds
        self._statement_timeout_ms = statement_timeout_ms
        # The server cancels a statement at its timeout; past that plus the connection
        # wait, it is not answering at all. No statement timeout: no client bound either.
        self._answer_timeout = statement_timeout_ms / 1000 + wait_seconds if statement_timeout_ms else None
        self._pool: ReconnectingPool | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _configure(self, conn: psycopg.Connection) -> None:
        if isinstance(conn, BoundedConnection):
            conn.answer_timeout = self._answer_timeout
        # A job a program wrote with SQL may hold numbers too long for int (shown as their
        # digits) and times no datetime holds (shown as the nearest one that does).
        read_any_number(conn, as_text=True)
        read_any_timestamp(conn)
        conn.autocommit = True
        # JIT off, as on every Relay session (README, Performance): a listing or a scrape of
        # many queues costs enough on paper to be compiled, and spent most of its time so.
        # Behind a transaction pooler a session's settings would stay on the server
        # connection for whoever uses it next (workers, the application): the database's
        # defaults cover JIT there (README), the answer timeout above every wait.
        if not self.relay.transaction_pooling:
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), set_config('jit', 'off', false)",
                (str(self._statement_timeout_ms),),
            )
        # Times come back in UTC whatever the server's zone: see relay_core.sessions.configure_session.
        conn.execute("SELECT set_config('TimeZone', 'UTC', false)")
        # READ COMMITTED whatever the database's default, as every Relay connection: under a
        # stricter level a cancel or bulk action that waited for a worker's row lock (a
        # heartbeat, a claim) would fail with a serialization error. Asked for in each BEGIN,
        # so nothing stays on a server connection behind a transaction pooler.
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.autocommit = False

    def pool(self) -> ConnectionPool:
        """This process's pool, opened on first use (and again after a fork)."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # Reconnects at Relay's capped pace: after an outage, ready again within seconds.
                self._pool = ReconnectingPool(
                    self.dsn,
                    min_size=1,
                    max_size=self._size,
                    open=False,
                    name="relay-web",
                    connection_class=BoundedConnection,
                    configure=self._configure,
                    check=ConnectionPool.check_connection,
                    timeout=self._wait,
                    kwargs=connection_options(
                        self.relay.dsn, self.relay.transaction_pooling, application_name="relay-web"
                    ),
                )
                self._pool.open(wait=False)
                self._pid = os.getpid()
            return self._pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A connection for one unit of work: committed when the block ends, rolled back on error."""
        wait = min(OUTAGE_WAIT_SECONDS, self._wait) if self.outage.under_way() else None
        if has_request_context():
            g.relay_db_began = time.monotonic()  # a failure of a call begun before an outage ended is that outage's
        with self.pool().connection(timeout=wait) as conn:
            self.outage.succeeded()  # the pool checked it: the database answers (ends an outage, with a line)
            yield conn

    def unavailable(self, during: str, error: BaseException) -> None:
        """Tell the log of a request (``during``: its path) that met the database away, or every connection in use.

        A pool timeout while other requests hold every connection of the pool
        is no outage. Told by the connections checked out (``all_in_use``), not
        by the pool's last attempt to connect: against a database that stalled,
        that attempt hangs for its connect timeout, and its last word was still
        a success.
        """
        began = g.get("relay_db_began") if has_request_context() else None
        pool = self._pool
        if isinstance(error, psycopg.errors.ReadOnlySqlTransaction):
            # The database answers, and reads go on: no outage (every page's checkout would end it
            # and the next write begin it anew), but a warning at most once per REPEAT_SECONDS.
            self.refusing_writes.happened(during=during, error=str(error))
            return
        if isinstance(error, PoolTimeout) and pool is not None and all_in_use(pool):
            self.exhaustion.happened(during=during)
        else:
            self.outage.failed(during, error, began=began)

    def close(self) -> None:
        """Close the pool (tests and shutdown)."""
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None
        self.relay.close()


def init_app(app: Flask) -> Database:
    """Attach a :class:`Database` built from the app's settings."""
    database = Database(
        app.config["RELAY_DATABASE_URL"],
        size=app.config["RELAY_WEB_POOL_SIZE"],
        wait_seconds=app.config["RELAY_DB_WAIT_SECONDS"],
        statement_timeout_ms=app.config["RELAY_STATEMENT_TIMEOUT_MS"],
        max_payload_bytes=app.config["RELAY_MAX_PAYLOAD_BYTES"],
    )
    app.extensions[EXTENSION] = database
    return database


def get_database() -> Database:
    """The current app's database."""
    return current_app.extensions[EXTENSION]


@contextmanager
def connection() -> Iterator[psycopg.Connection]:
    """A pooled connection of the current app."""
    with get_database().connection() as conn:
        yield conn


@contextmanager
def counters_read() -> Iterator[psycopg.Connection]:
    """A pooled connection for a page that reads the counters and then relay.jobs, counters folded first.

    Each statement commits on its own (autocommit), so no lock outlives the
    statement that took it: a transaction that held the counters while it went
    on to read relay.jobs would deadlock with TRUNCATE relay.jobs, which holds
    relay.jobs and then empties the counters. The reads gain nothing from one
    transaction anyway: at READ COMMITTED each statement has its own snapshot.
    """
    database = get_database()
    with database.connection() as conn, in_autocommit(conn):
        try:
            monitor.fold_counters(conn, rows=FOLD_ROWS_PER_READ)
        except psycopg.errors.ReadOnlySqlTransaction as refused:
            # The fold is a write, the reads are exact without it: during a failover the page still
            # answers. The sessions are left as they are (a refused write replaces them): a database
            # that stays read-only would have had every session replaced at each refresh.
            during = request.path if has_request_context() else "a counters read"
            database.fold_refused.happened(during=during, error=str(refused))
        yield conn
