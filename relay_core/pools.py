"""Relay's connection pools: JIT off, and a connection checked only when it may be stale.

Checking every checkout costs a round trip, doubling the cost of a one-statement
enqueue; never checking hands out connections that died while idle (a database
restart, a proxy's idle timeout). A connection returned less than a second ago
was working then, so only connections idle for longer are checked. The return
time is stamped in ``putconn`` itself: a pool ``reset`` callback would send
every returned connection through the pool's worker thread.

The check is bounded: a database that stopped answering while TCP still
acknowledges (see ``stalls``) would hold it, and the checkout, forever. A
connection that cannot answer an empty query within IDLE_CHECK_LIMIT_SECONDS,
or within what is left of the checkout's own timeout, is cut and replaced.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolClosed
from psycopg_pool.base import AttemptWithBackoff

from .jsonb import read_any_number
from .queries import sql
from .settings import transaction_pooling
from .stalls import SHORTEST_CUT_SECONDS, cut_after

#: A connection idle longer than this is checked before it is handed out.
IDLE_CHECK_SECONDS = 1.0
#: The longest an idle connection's check may take before the connection is cut.
IDLE_CHECK_LIMIT_SECONDS = 5.0
#: ... and the least, however little of the checkout's timeout is left: a database that answers
#: at all answers the check in milliseconds, and a shutdown's last writes, each given little
#: time once a stalled database used up theirs, must not each wait longer on it.
IDLE_CHECK_FLOOR_SECONDS = SHORTEST_CUT_SECONDS
#: The longest wait between the pool's attempts to reconnect to a database that went away.
RECONNECT_MAX_DELAY_SECONDS = 2.0


class CappedAttempt(AttemptWithBackoff):
    """The pool's reconnection backoff, but never more than RECONNECT_MAX_DELAY_SECONDS between tries.

    psycopg_pool doubles the delay after every failed try until it gives up
    (``reconnect_timeout``, 5 minutes): 1, 2, 4, 8, 16, 32 s ... So a worker
    learned that a database was back up to as long after its return as the
    outage itself had lasted, with nothing claimed or recorded meanwhile.
    """

    def update_delay(self, now: float) -> None:
        """Grow the delay as the pool does, up to the cap (and never past the give-up time)."""
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_MAX_DELAY_SECONDS)


#: Every pool this process opened, so that the ones still open are closed when it exits.
OPEN_POOLS: weakref.WeakSet[ReconnectingPool] = weakref.WeakSet()
#: How long closing one pool at exit may wait for its threads.
EXIT_CLOSE_SECONDS = 1.0


@atexit.register
def close_open_pools() -> None:
    """Close the pools still open as the process exits, while their threads can still be joined.

    A pool left open (``relay = Relay()`` at module level, never closed) is
    otherwise closed by its finaliser during interpreter shutdown, when, on
    Python 3.13 and newer, its threads can no longer be joined: the process
    then waited 5 s for each of them (20 s for a program that enqueued one
    job). A pool a forked process inherited is its parent's to close.
    """
    for pool in list(OPEN_POOLS):
        if not pool.closed and not pool.inherited:
            with contextlib.suppress(Exception):  # exiting anyway: one pool's failure must not keep the rest open
                pool.close(timeout=EXIT_CLOSE_SECONDS)


class ReconnectingPool(ConnectionPool):
    """A psycopg pool that tries to reconnect at least every RECONNECT_MAX_DELAY_SECONDS,
    and hands out the idle connection returned last.

    Every pool of Relay's is one, the admin web app's too: a worker or a web
    process must notice a database that came back within seconds.

    psycopg_pool hands out idle connections in turn (first returned, first
    out), so a thread that enqueues one job after another alternated between
    two server processes (the pool grows to two as soon as one request waits
    for the first connection), each woken cold. Taking the connection returned
    last keeps a steady load on as few server processes as it needs; the ones
    left idle are those the pool closes after ``max_idle``, and those that
    ``make_pool``'s check looks at before handing them out again.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: The process that opened the pool: a process forked from it makes its own
        #: (psycopg leaves the parent's connections alone when the child drops them).
        #: A pool made but not yet opened before a fork is the child's once it opens it.
        self.pid = os.getpid()
        super().__init__(*args, **kwargs)

    def _open(self, *args: Any, **kwargs: Any) -> None:
        # The pool's own hook for opening (open(), or open=True when it is made).
        self.pid = os.getpid()
        super()._open(*args, **kwargs)
        OPEN_POOLS.add(self)

    @property
    def inherited(self) -> bool:
        """Whether this process was forked from the one that opened the pool (whose connections it cannot use)."""
        return self.pid != os.getpid()

    def getconn(self, timeout: float | None = None) -> psycopg.Connection:
        """A connection; refused in a process forked from the pool's, which would hang or corrupt both."""
        if self.inherited:
            raise PoolClosed(f"the pool {self.name!r} was opened by process {self.pid}; a forked process opens its own")
        return super().getconn(timeout)

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # The pool's own hook for (re)connecting; its first try starts a capped attempt.
        super()._add_connection(attempt or CappedAttempt(timeout=self.reconnect_timeout), growing)

    def _get_ready_connection(self, timeout: float | None) -> psycopg.Connection | None:
        # The pool's own hook for taking an idle connection, called under its lock.
        # It takes the leftmost of its deque and returns connections to the right,
        # so idle connections serve in turn; moving the rightmost (the one
        # returned last) to the left first makes it take that one instead.
        self._pool.rotate(1)
        return super()._get_ready_connection(timeout)


class RelayConnection(psycopg.Connection[Any]):
    """A connection of Relay's pools, keeping one cursor for Relay's one-row statements.

    ``Connection.execute`` builds a new cursor, with its own copy of the
    connection's adapters, for every statement. On the 2-core development
    machine that was 20 us of the ~75 us of client CPU a one-job enqueue's
    statement cost (psycopg alone, a held connection, 3,000 statements per
    round, the least of five rounds: 73 us with ``conn.execute``, 53 us on a
    kept cursor), and a one-job enqueue is that statement alone.

    One cursor per thread: a psycopg connection may be shared by threads (a
    transactional handler's, passed as ``conn=`` to enqueues from several
    threads), but a cursor's results are read after its statement, and another
    thread's statement in between would replace them.

    It reads json and jsonb numbers of any length (see ``relay_core.jsonb``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept = threading.local()
        read_any_number(self)

    def kept_cursor(self) -> psycopg.Cursor[Any]:
        """This thread's reusable cursor on this connection (tuple rows), made on first use or after it was closed.

        Relay's own kind of cursor and rows, whatever the connection's holder
        set (a transactional handler, or a caller of ``Relay.connect()``,
        choosing ``dict_row``): an enqueue reads its id after the insert ran,
        and that read must not fail.
        """
        cur: psycopg.Cursor[Any] | None = getattr(self._kept, "cursor", None)
        if cur is None or cur.closed:
            # The holder's kind of cursor (a tracing subclass sees Relay's statements too),
            # unless it binds parameters some other way than Relay's %(name)s, server-side.
            kind = self.cursor_factory
            if not issubclass(kind, psycopg.Cursor) or issubclass(kind, psycopg.RawCursor | psycopg.ClientCursor):
                kind = psycopg.Cursor
            cur = self._kept.cursor = kind(self, row_factory=tuple_row)
        return cur


class RelayPool(ReconnectingPool):
    """A pool that remembers when each connection came back, counts those checked out,
    and reconnects at a capped pace."""

    def __init__(self, *args: Any, transaction_pooling: bool = False, **kwargs: Any) -> None:
        self.returned_at: weakref.WeakKeyDictionary[psycopg.Connection, float] = weakref.WeakKeyDictionary()
        self._checked_out = 0
        self._checked_out_lock = threading.Lock()
        self._checkout = threading.local()  # when this thread's getconn gives up (monotonic)
        #: Whether the connections go through a pooler in transaction mode: a session's prepared
        #: statements do not last there (see ``worker.one_message``).
        self.transaction_pooling = transaction_pooling
        super().__init__(*args, **kwargs)

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """``ConnectionPool.connection``, replacing every connection once one finds its prepared statements outdated."""
        try:
            with super().connection(timeout) as conn:
                yield conn
        except psycopg.errors.FeatureNotSupported as exc:
            self.replace_if_outdated(exc)
            raise

    def replace_if_outdated(self, exc: BaseException) -> bool:
        """Replace all the pool's connections if ``exc`` says their prepared statements are outdated; whether it did.

        A column whose type changed under a prepared statement that returns it
        (an ``ALTER TABLE ... TYPE`` run by hand, a restored dump) makes the
        server refuse that statement on every connection that prepared it, and
        psycopg keeps sending the prepared one: a worker's claim failed that
        way every time until the process restarted. The refused statement ran
        nothing; fresh connections prepare it anew, so the next try works.
        """
        if not outdated_plan(exc):
            return False
        logging.getLogger("relay").warning(
            "a schema change outdated the statements prepared on pool %r: replacing its connections", self.name
        )
        self.drain()  # idle ones now; those checked out when they come back
        return True

    @property
    def checked_out(self) -> int:
        """Connections handed out and not yet returned."""
        return self._checked_out

    def getconn(self, timeout: float | None = None) -> psycopg.Connection:
        """A connection, counted as checked out until ``putconn``."""
        self._checkout.ends = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            conn = super().getconn(timeout)
        finally:
            self._checkout.ends = None
        with self._checked_out_lock:
            self._checked_out += 1
        return conn

    def check_limit(self) -> float:
        """How long an idle connection's check may take on this thread before the connection is cut."""
        ends = getattr(self._checkout, "ends", None)
        if ends is None:
            return IDLE_CHECK_LIMIT_SECONDS
        return min(IDLE_CHECK_LIMIT_SECONDS, max(ends - time.monotonic(), IDLE_CHECK_FLOOR_SECONDS))

    def putconn(self, conn: psycopg.Connection) -> None:
        """Stamp the return time, then return the connection (not counted out once the pool took it).

        How it makes rows and cursors goes back to psycopg's defaults, which
        Relay's own statements read: a transactional handler may have set
        ``conn.row_factory = dict_row`` on the connection it was lent.
        """
        conn.row_factory = tuple_row
        conn.cursor_factory = psycopg.Cursor
        self.returned_at[conn] = time.monotonic()
        super().putconn(conn)  # refuses a connection that is not this pool's, or returned twice
        with self._checked_out_lock:
            self._checked_out -= 1


def unusable_setting(exc: psycopg.Error) -> bool:
    """Whether a failed connection attempt was refused for a setting libpq cannot use, before any network.

    psycopg raises ProgrammingError for a connect_timeout that is no number,
    and "connection is bad" when libpq refuses the options outright (an
    unknown sslmode, a port out of range, a keepalives that is no integer),
    each saying what is "invalid". A server that cannot be reached over TCP
    fails later, as "connection failed"; over a Unix socket libpq may call
    that connection bad at once too ("No such file or directory" while the
    server is down), which is an outage to wait out, not a setting.
    """
    if isinstance(exc, psycopg.ProgrammingError):
        return True
    text = str(exc)
    return isinstance(exc, psycopg.OperationalError) and text.startswith("connection is bad:") and "invalid " in text


def outdated_plan(exc: BaseException) -> bool:
    """Whether ``exc`` is the server refusing a prepared statement whose result's types changed since it was prepared.

    Told by the server function that refuses it, whose name no ``lc_messages``
    translates, or by its English message.
    """
    if not isinstance(exc, psycopg.errors.FeatureNotSupported):
        return False
    return (
        exc.diag.source_function == "RevalidateCachedQuery"
        or exc.diag.message_primary == "cached plan must not change result type"
    )


def all_in_use(pool: RelayPool) -> bool:
    """Whether every connection the pool may hold is checked out.

    A PoolTimeout then means the connections are held, not that the database
    is down. The pool's own ``pool_size`` cannot tell: it counts connections
    being (re)connected too, and stays at the maximum through an outage.
    """
    return pool.checked_out >= pool.max_size


def make_pool(
    dsn: str,
    *,
    name: str,
    min_size: int,
    max_size: int,
    timeout: float = 30.0,
    autocommit: bool = False,
    application_name: str = "relay",
) -> RelayPool:
    """An unopened pool whose connections are checked when idle for over a second.

    ``autocommit`` pools suit one-statement work (an enqueue is its own
    transaction): no BEGIN/COMMIT round trips and no switching per checkout;
    multi-statement work on them opens ``conn.transaction()`` explicitly.
    ``application_name``: see ``connection_options``.
    """
    pool: RelayPool | None = None
    pooling = transaction_pooling()

    def check_if_idle(conn: psycopg.Connection) -> None:
        last = pool.returned_at.get(conn) if pool is not None else None
        if last is None or time.monotonic() - last > IDLE_CHECK_SECONDS:
            with cut_after(conn, pool.check_limit() if pool is not None else IDLE_CHECK_LIMIT_SECONDS):
                ConnectionPool.check_connection(conn)

    pool = RelayPool(
        dsn,
        min_size=min_size,
        max_size=max_size,
        name=name,
        open=False,
        timeout=timeout,
        connection_class=RelayConnection,
        configure=configure_session,
        check=check_if_idle,
        kwargs={"autocommit": autocommit, **connection_options(dsn, pooling, application_name=application_name)},
        transaction_pooling=pooling,
    )
    return pool


#: libpq settings that bound how long a connection can hang on a network path
#: that went silent, where the DSN (or PGCONNECT_TIMEOUT) does not set them.
#: Seconds, but tcp_user_timeout, in milliseconds. See ``liveness_options``.
LIVENESS_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def liveness_options(dsn: str, *, user_timeout: bool = True) -> dict[str, int]:
    """Time limits on a dead network path, for the settings ``dsn`` leaves to libpq's defaults.

    A database that fails over to another address, or a proxy or NAT that
    forgets a connection, leaves the old path silent: nothing refuses,
    packets just vanish. libpq's defaults then wait on it for a very long
    time: a connection attempt 130 s (psycopg's default), a statement sent on
    an established connection until the kernel gives up retransmitting (about
    15 minutes on Linux), an idle LISTEN connection until the first keepalive
    (two hours). A worker meanwhile claims nothing. With these, a connection
    attempt gives up after 10 s, data unacknowledged for 15 s breaks the
    connection, and an idle connection is probed after 10 s; the worker's
    retry loops then reconnect on a path that works.

    ``tcp_user_timeout`` also breaks a connection whose server stops reading
    while the client still has data to send (a pipelined bulk insert queued
    behind a statement waiting on a lock), so it is left out with
    ``user_timeout=False``: for connections that carry other code's work.
    Relay's own statements are short and read as soon as they arrive.

    Settings the DSN names win, as do ``PGCONNECT_TIMEOUT`` and the service
    file section a ``service`` names; when that section cannot be found here,
    nothing is added. Unix-socket connections ignore the TCP settings.
    """
    given: dict[str, Any] = conninfo_to_dict(dsn)
    if os.environ.get("PGCONNECT_TIMEOUT"):
        given["connect_timeout"] = os.environ["PGCONNECT_TIMEOUT"]
    service = given.get("service") or os.environ.get("PGSERVICE")
    if service:
        section = service_settings(str(service))
        if section is None:
            _warn_service_unread(str(service))
            return {}
        given = {**section, **given}
    return {
        name: value
        for name, value in LIVENESS_DEFAULTS.items()
        if name not in given and (user_timeout or name != "tcp_user_timeout")
    }


#: Where libpq builds commonly look for the system-wide service file when
#: PGSYSCONFDIR is unset (Debian's packages and psycopg's bundled libpq use
#: the first); a section found in one that libpq does not read would only make
#: Relay add fewer defaults.
SYSCONF_DIRS = ("/etc/postgresql-common", "/etc/postgresql", "/usr/local/pgsql/etc")


def service_settings(service: str) -> dict[str, str] | None:
    """The settings of ``service`` in the connection service files, or None if no file has it.

    Read as libpq reads them: PGSERVICEFILE (else ~/.pg_service.conf), then
    the system-wide pg_service.conf; the first file with a ``[service]``
    section wins; lines are stripped, ``#`` lines and blank ones skipped,
    the section ends at the next ``[``, and each line in it is
    ``key=value``.
    """
    user_file = os.environ.get("PGSERVICEFILE")
    files = [Path(user_file) if user_file is not None else Path.home() / ".pg_service.conf"]
    sysconf = os.environ.get("PGSYSCONFDIR")
    files += [Path(folder) / "pg_service.conf" for folder in ([sysconf] if sysconf else SYSCONF_DIRS)]
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        section = _service_section(text, service)
        if section is not None:
            return section
    return None


def _service_section(text: str, service: str) -> dict[str, str] | None:
    """The ``key=value`` lines of section ``[service]`` in a service file's text, or None."""
    settings: dict[str, str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            if settings is not None:
                break  # the next section: ours is over
            if line == f"[{service}]":
                settings = {}
        elif settings is not None:
            key, sep, value = line.partition("=")
            if sep:
                settings[key.strip()] = value.strip()
    return settings


@functools.cache
def _warn_service_unread(service: str) -> None:
    """Say once per process that a service's settings could not be read, so Relay added none of its own."""
    logging.getLogger("relay").warning(
        "connection service %r not found in the service files Relay reads; "
        "its connections get no connect_timeout, keepalives or tcp_user_timeout of Relay's",
        service,
    )


def connection_options(
    dsn: str, pooling: bool | None = None, *, user_timeout: bool = True, application_name: str | None = "relay"
) -> dict[str, Any]:
    """psycopg options for every connection Relay opens to ``dsn``.

    Time limits on a dead network path (``liveness_options``; without
    ``tcp_user_timeout`` unless ``user_timeout``). Behind a transaction pooler
    (``pooling``; RELAY_TRANSACTION_POOLING when None) nothing is prepared:
    ``prepare_threshold=None`` also overrides the ``prepare=True`` of Relay's
    hot statements. Elsewhere psycopg's defaults hold (those statements are
    prepared on first use).

    ``application_name`` names the connection in ``pg_stat_activity`` and a
    pooler's client list, so a session holding a lock or a server connection
    can be traced to its process. It is libpq's fallback: an
    ``application_name`` the DSN, ``PGAPPNAME`` or a service file gives wins.
    """
    pooling = transaction_pooling() if pooling is None else pooling
    options: dict[str, Any] = dict(liveness_options(dsn, user_timeout=user_timeout))
    if pooling:
        options["prepare_threshold"] = None
    if application_name:
        options["fallback_application_name"] = application_name[:APPLICATION_NAME_MAX]
    return options


#: The longest application_name PostgreSQL keeps (NAMEDATALEN - 1 bytes; Relay's names are ASCII).
APPLICATION_NAME_MAX = 63


def worker_application_name(worker_id: str) -> str:
    """What a worker's connections are called: its registry id, as ``relay.workers`` and its log show it.

    An id too long for the name keeps its start (the host) and its end (the
    process id and the random suffix that tell workers on one host apart).
    Behind a transaction pooler every worker shares one name: the pooler sets
    a client's ``application_name`` on the server connection it lends
    whenever it differs from the previous client's, a round trip each time.
    """
    prefix = "relay-worker"
    if transaction_pooling():
        return prefix
    room = APPLICATION_NAME_MAX - len(prefix) - 1
    if len(worker_id) > room:
        worker_id = f"{worker_id[: room - 21]}~{worker_id[-20:]}"
    return f"{prefix} {worker_id}"


@contextmanager
def without_user_timeout(conn: psycopg.Connection) -> Iterator[None]:
    """Lift the ``tcp_user_timeout`` Relay set on ``conn``'s socket while other code's work runs on it.

    A transactional handler gets a connection of the worker's pool, whose
    Relay statements want the limit (see ``liveness_options``); the
    handler's own work may queue more data than the socket holds behind a
    statement that waits on a lock. Restored afterwards; nothing to do on a
    Unix socket or where the platform has no such option.
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock: socket.socket | None = None
    before = 0
    if option is not None:
        try:
            sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            before = sock.getsockopt(socket.IPPROTO_TCP, option)
            sock.setsockopt(socket.IPPROTO_TCP, option, 0)
        except (OSError, psycopg.Error):  # a Unix socket, or a connection already closed
            if sock is not None:
                sock.close()
            sock = None
    try:
        yield
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, before)
            sock.close()


def configure_session(conn: psycopg.Connection) -> None:
    """Session settings for Relay's own connections.

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
    conn.execute(own_session_settings(conn))  # type: ignore[arg-type]
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
