"""Relay's connection pools: a connection checked only when it may be stale, reconnection at a capped pace.

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

How each connection is opened is ``connect_options``'s; the settings its
session starts with, ``sessions``'.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from .connect_options import connection_options
from .jsonb import read_any_number
from .logs import throttle_pool_connect_warnings
from .sessions import configure_session
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
#: After a connection failed its check, how long a checkout waits before it takes the next (doubled
#: after each further failure, up to a second).
CHECK_RETRY_SECONDS = 0.01
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


#: How often, at most, a pool replaces its connections for a server that refuses writes.
READ_ONLY_REPLACE_SECONDS = 1.0


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
        #: Why the pool's last attempt to connect failed, in the server's or libpq's words;
        #: None once one succeeds. A checkout that times out says it (see ``getconn``).
        self.last_connect_error: str | None = None
        self._checked_out = 0
        self._checked_out_lock = threading.Lock()
        self._replaced_for_read_only_at = float("-inf")  # monotonic
        self._replacing_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """``ConnectionPool.connection``, replacing the connections once one meets a server that refuses writes."""
        with super().connection(timeout) as conn:
            try:
                yield conn
            except psycopg.errors.ReadOnlySqlTransaction:
                self.replace_for_read_only()
                raise

    def replace_for_read_only(self) -> None:
        """Replace every connection, at most once a second: one of them met a server that refuses writes.

        After a failover the pool's sessions may still be on the demoted
        primary, or on a standby an old DNS answer named, and stay there for
        their whole lifetime (an hour): every claim and completion was refused
        until then, long after the new primary took writes. New connections
        go where the address leads now; a session a handler left read-only
        (``SET SESSION CHARACTERISTICS``) is replaced too. Those checked out
        are closed when they come back.
        """
        with self._replacing_lock:
            now = time.monotonic()
            if now - self._replaced_for_read_only_at < READ_ONLY_REPLACE_SECONDS:
                return
            self._replaced_for_read_only_at = now
        self.drain()

    def _open(self, *args: Any, **kwargs: Any) -> None:
        # The pool's own hook for opening (open(), or open=True when it is made).
        throttle_pool_connect_warnings()
        self.pid = os.getpid()
        super()._open(*args, **kwargs)
        OPEN_POOLS.add(self)

    @property
    def inherited(self) -> bool:
        """Whether this process was forked from the one that opened the pool (whose connections it cannot use)."""
        return self.pid != os.getpid()

    def getconn(self, timeout: float | None = None) -> psycopg.Connection:
        """A connection; refused in a process forked from the pool's, which would hang or corrupt both.

        A checkout that times out while the pool cannot connect says why: the
        pool's own PoolTimeout said only that it waited ("couldn't get a
        connection after 5.00 sec"), and the cause (a database that does not
        exist, a wrong password, a server that is down) went to a log line.
        """
        if self.inherited:
            raise PoolClosed(f"the pool {self.name!r} was opened by process {self.pid}; a forked process opens its own")
        try:
            conn = super().getconn(timeout)
        except PoolTimeout as exc:
            cause = self.last_connect_error
            if cause is None:
                raise
            raise PoolTimeout(f"{exc}; the pool's last attempt to connect failed: {cause}") from exc
        with self._checked_out_lock:
            self._checked_out += 1
        return conn

    def putconn(self, conn: psycopg.Connection) -> None:
        """Return the connection (not counted out once the pool took it)."""
        super().putconn(conn)  # refuses a connection that is not this pool's, or returned twice
        with self._checked_out_lock:
            self._checked_out -= 1

    @property
    def checked_out(self) -> int:
        """Connections handed out and not yet returned."""
        return self._checked_out

    def _connect(self, timeout: float | None = None) -> psycopg.Connection:
        # The pool's own hook for making a connection: remember why it failed, or that it worked.
        try:
            conn = super()._connect(timeout)
        except Exception as exc:
            self.last_connect_error = str(exc)
            raise
        self.last_connect_error = None
        return conn

    def _add_connection(self, attempt: AttemptWithBackoff | None, growing: bool = False) -> None:
        # The pool's own hook for (re)connecting; its first try starts a capped attempt.
        super()._add_connection(attempt or CappedAttempt(timeout=self.reconnect_timeout), growing)

    def _getconn_with_check_loop(self, deadline: float) -> psycopg.Connection:
        # The pool's own loop for a checkout whose connections are checked. It sleeps 1 s (then
        # 2, 4 ...) after the second connection that fails its check; after a restart or a
        # server's idle_session_timeout every idle connection is dead, so a checkout waited a
        # second for a live one, and a claim (given 1 s) failed on a database that was back,
        # logged as an outage. Here a failed check is followed by the next idle connection, or
        # a new one the pool makes meanwhile, after CHECK_RETRY_SECONDS, doubled at each failure
        # up to a second (new connections that fail their check too are made no faster than
        # that), until the checkout's deadline.
        pause = CHECK_RETRY_SECONDS
        while True:
            conn = self._getconn_unchecked(deadline - time.monotonic())
            try:
                self._check_connection(conn)
            except Exception:
                self._putconn(conn, from_getconn=True)  # closed, and a new one made in its place
            except BaseException:
                self._putconn(conn, from_getconn=True)
                raise
            else:
                return conn
            if time.monotonic() + pause >= deadline:
                raise PoolTimeout()
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

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
    """A pool that remembers when each connection came back, and reconnects at a capped pace."""

    def __init__(self, *args: Any, transaction_pooling: bool = False, **kwargs: Any) -> None:
        self.returned_at: weakref.WeakKeyDictionary[psycopg.Connection, float] = weakref.WeakKeyDictionary()
        self._checkout = threading.local()  # when this thread's getconn gives up (monotonic)
        #: Whether the connections go through a pooler in transaction mode: a session's prepared
        #: statements do not last there (see ``worker.one_message``).
        self.transaction_pooling = transaction_pooling
        super().__init__(*args, **kwargs)
        #: Whether every connection is handed out in autocommit (``make_pool``'s choice).
        self.autocommit: bool = self.kwargs.get("autocommit", False)

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

    def getconn(self, timeout: float | None = None) -> psycopg.Connection:
        """A connection (counted as checked out until ``putconn``).

        A checkout that timed out while every connection was checked out says
        so: "couldn't get a connection" alone reads as a database that is down.
        """
        self._checkout.ends = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            conn = super().getconn(timeout)
        except PoolTimeout as exc:
            if not all_in_use(self):
                raise
            raise PoolTimeout(f"{exc}: all {self.max_size} of the pool's connections were in use") from exc
        finally:
            self._checkout.ends = None
        if conn.autocommit is not self.autocommit:
            # Given back so by a borrower of the (public) pool: an enqueue would have run in a
            # transaction nobody commits, rolled back as the connection came back, its id returned.
            try:
                conn.autocommit = self.autocommit
            except BaseException:
                self.putconn(conn)  # not lent: the pool takes it back (and drops it if broken)
                raise
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
        super().putconn(conn)


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


def all_in_use(pool: ReconnectingPool) -> bool:
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
    lock_wait_seconds: float | None = None,
) -> RelayPool:
    """An unopened pool whose connections are checked when idle for over a second.

    ``autocommit`` pools suit one-statement work (an enqueue is its own
    transaction): no BEGIN/COMMIT round trips and no switching per checkout;
    multi-statement work on them opens ``conn.transaction()`` explicitly.
    ``application_name``: see ``connection_options``. ``lock_wait_seconds``: the
    sessions' ``lock_timeout``, unless behind a transaction pooler, where a session
    setting would outlive its client.
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
        configure=(
            configure_session
            if lock_wait_seconds is None
            else functools.partial(configure_session, lock_timeout_ms=round(lock_wait_seconds * 1000))
        ),
        check=check_if_idle,
        kwargs={"autocommit": autocommit, **connection_options(dsn, pooling, application_name=application_name)},
        transaction_pooling=pooling,
    )
    return pool
