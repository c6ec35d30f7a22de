"""The claim (THE CLAIM in queries.sql) and how many jobs it asks for.

One statement claims for every free slot and for the prefetch: short jobs
would otherwise leave slots idle for every claim's round trip, and larger
claims cost less per job.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..pools import RelayPool
from ..queries import sql
from ..sessions import in_autocommit
from ..stalls import WATCHDOG, cut_at
from .one_message import run_as_one_message

#: Jobs that typically finish faster than this are prefetched; longer ones are not.
PREFETCH_BELOW_SECONDS = 0.05
#: A slot holds about this much prefetched work: how long a prefetched job may wait in it.
PREFETCH_WORK_SECONDS = 0.01
#: ... and never more than this many jobs beyond the one it runs.
MAX_PREFETCH_PER_SLOT = 16
#: A prefetched job still waiting for a slot this long after its claim goes back to the queue:
#: a hundred times what prefetch means it to wait, so every slot is held by a longer job.
PREFETCH_HOLD_SECONDS = 1.0
#: The payload text a worker holds in prefetched jobs at most, in bytes (see ``Worker.prefetch``):
#: prefetch is sized by run time, and at concurrency 8 fast jobs of 250 KB payloads (within the
#: default RELAY_MAX_PAYLOAD_BYTES) held 136 of them, a worker of 80-120 MB.
PREFETCH_PAYLOAD_BYTES = 4 * 1024 * 1024
#: The key of a claimed row's payload size in bytes as the server sent it (see ``sized_rows``).
PAYLOAD_BYTES = "payload_bytes"
#: How long a claim waits for a pooled connection before the producer looks again whether
#: it should stop: a stop during an outage must not wait out the pool's whole timeout.
CLAIM_CONNECTION_WAIT_SECONDS = 1.0


def prefetch_per_slot(typical_run: float) -> int:
    """Jobs a slot holds beyond the one it runs, for handlers that typically take ``typical_run`` s.

    Each slot holds about PREFETCH_WORK_SECONDS of typical work (at least one
    job, at most MAX_PREFETCH_PER_SLOT), so a prefetched job waits about that
    long at most. Long jobs get no prefetch: a job held behind a long one
    while another worker sits idle would only wait longer.
    """
    if typical_run >= PREFETCH_BELOW_SECONDS:
        return 0
    return max(1, min(MAX_PREFETCH_PER_SLOT, int(PREFETCH_WORK_SECONDS / max(typical_run, 1e-6))))


def sized_rows(cursor: psycopg.Cursor[Any]) -> Callable[[Sequence[Any]], dict[str, Any]]:
    """psycopg's ``dict_row``, each row also holding its payload's size as sent (``PAYLOAD_BYTES``).

    The size is the length of the payload's text in the server's answer, read
    from the result itself (a copy of the bytes, briefly), so it costs neither
    the server nor a walk of the parsed payload. psycopg makes a result's rows
    in order (``fetchall``), so a count tells each row its number.
    """
    make = dict_row(cursor)
    result = cursor.pgresult
    names = [column.name for column in cursor.description or ()]
    if result is None or "payload" not in names:
        return make
    column = names.index("payload")
    numbers = itertools.count()

    def row(values: Sequence[Any]) -> dict[str, Any]:
        made = make(values)
        made[PAYLOAD_BYTES] = len(result.get_value(next(numbers), column) or b"")
        return made

    return row


#: How long a stop waits for the server to take a claim's cancel request.
CANCEL_WAIT_SECONDS = 1.0
#: How long returning the jobs of a claim whose answer was lost may take before its connection is cut.
HAND_BACK_UNHELD_LIMIT_SECONDS = 3.0
#: How long after a stop a claim still running has its connection cut (see ``stalls``): past
#: the wait for the cancel request, so a cancel the server took ends the claim first.
CUT_AFTER_STOP_SECONDS = 1.5
#: Behind a transaction pooler, how long each statement of a claim may run on the server.
#: No cancel is sent there (``ClaimInFlight``), and cutting a connection does not end its
#: statement on the server: a claim waiting for a lock (an index build, a migration) ran on
#: after the cut and claimed once the lock was let go, after its worker had returned what
#: it thought the claim took and exited. Its jobs waited for the sweeper, an attempt spent.
POOLED_CLAIM_STATEMENT_SECONDS = 1.0
#: Behind a transaction pooler, how long after its connection broke a claim may still commit
#: on the server: its two statements (the limits lock, the claim) each within their limit.
POOLED_CLAIM_ENDS_WITHIN_SECONDS = 2 * POOLED_CLAIM_STATEMENT_SECONDS + 0.2


class ClaimInFlight:
    """The connection a claim is running on, so a stop can cancel a claim the database holds up.

    A claim waits for nothing but the database: a table lock (an index build,
    VACUUM FULL, an ALTER TABLE) or a connection that stopped forwarding holds
    it for as long as that lasts, and a worker told to stop would not begin
    its shutdown, or use its drain window, until then. Cancelling is safe:
    the claim is one statement (or one transaction), rolled back whole, and a
    cancel that reaches the server after the claim ended is ignored by it
    (the lock keeps the connection from going back to the pool before then).
    Behind a transaction pooler it is not: the pooler may have lent the
    server connection to another client the moment the claim ended, so a
    late cancel could stop that client's statement, so none is sent there.

    A claim still running a moment after the stop (the cancel request did
    not get through, or none was sent) has its connection cut: a database
    that stopped answering altogether would otherwise hold the shutdown
    until it answered again. The claim is then one whose answer was lost,
    which the worker already returns.
    """

    def __init__(self, cancellable: bool = True) -> None:
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._cut: int | None = None  # the watchdog's handle for the claim's connection, once stopped
        self._stopped = False
        self._cancellable = cancellable

    @contextmanager
    def running_on(self, conn: psycopg.Connection) -> Iterator[None]:
        """Mark ``conn`` as running a claim for the block's length."""
        with self._lock:
            self._conn = conn
            if self._stopped:  # a claim begun just as the worker was told to stop
                self._cut = WATCHDOG.arm(conn, CUT_AFTER_STOP_SECONDS)
        try:
            yield
        finally:
            with self._lock:
                self._conn = None
                if self._cut is not None:
                    WATCHDOG.disarm(self._cut)
                    self._cut = None

    def cancel(self) -> bool:
        """Cancel the claim running now, if one is, and cut its connection if it runs on; whether one was."""
        with self._lock:
            self._stopped = True
            if self._conn is None:
                return False
            if self._cut is None:
                self._cut = WATCHDOG.arm(self._conn, CUT_AFTER_STOP_SECONDS)
            if self._cancellable:
                # Should the request not reach the server, the cut ends the claim.
                with suppress(psycopg.Error):
                    self._conn.cancel_safe(timeout=CANCEL_WAIT_SECONDS)
            return True


def claim_rows(pool: RelayPool, params: dict[str, Any], in_flight: ClaimInFlight) -> tuple[list[dict[str, Any]], float]:
    """The claimed jobs' rows, and when the claim was sent (monotonic), the start of its leases by this clock.

    While no job type has a limit (``params["locked"]`` false) the claim is one
    autocommit statement that itself refuses to claim once a limit exists.
    When limits exist, the limits lock and the claim travel together in one
    transaction sent as one message, one round trip.

    The send time is taken once a pooled connection is in hand: after an
    outage, or while handlers hold every connection, the wait for one can
    outlast the lease, and a lease counted from before it would be told it
    had run out the moment its handler started.
    """
    with pool.connection(timeout=CLAIM_CONNECTION_WAIT_SECONDS) as conn, in_flight.running_on(conn):
        sent = time.monotonic()
        if pool.transaction_pooling:
            rows = claim_within_time_limit(conn, params)
        elif params["locked"]:
            rows = claim_under_limits_lock(conn, params)
        else:
            with in_autocommit(conn), conn.cursor(row_factory=sized_rows) as cur:
                rows = cur.execute(sql("job_claim"), params, prepare=True).fetchall()
    return rows, sent


def claim_under_limits_lock(conn: psycopg.Connection, params: dict[str, Any]) -> list[dict]:
    """The limits lock and the claim in one transaction, sent as one message (see ``one_message``),
    by the session's prepared statements (behind a transaction pooler: ``claim_within_time_limit``).

    A worker frozen while its claim waited for the lock, or ran, would
    otherwise hold the lock every limited claim, on every queue, waits for.
    """
    _lock, rows = run_as_one_message(
        conn, [("claim_limits_lock", {}), ("job_claim", params)], prepared=True, row_factory=sized_rows
    )
    return rows


def claim_within_time_limit(conn: psycopg.Connection, params: dict[str, Any]) -> list[dict]:
    """The claim behind a transaction pooler: its statements, written out, each bounded on the server.

    One message, as ``claim_under_limits_lock``: the time limit
    (``claim_time_limit``), the limits lock when limits exist, the claim.
    """
    statements: list[tuple[str, dict[str, Any]]] = [
        ("claim_time_limit", {"ms": str(int(POOLED_CLAIM_STATEMENT_SECONDS * 1000))})
    ]
    if params["locked"]:
        statements.append(("claim_limits_lock", {}))
    statements.append(("job_claim", params))
    return run_as_one_message(conn, statements, prepared=False, row_factory=sized_rows)[-1]


def hand_back_unheld(
    pool: RelayPool, worker_id: str, held: dict[int, int], seconds: float = HAND_BACK_UNHELD_LIMIT_SECONDS
) -> list[int]:
    """Return the jobs claimed under ``worker_id`` whose leases are not in ``held`` (id -> token); their ids.

    After a claim failed on a broken connection: it may have committed, and
    its jobs would wait for the sweeper with an attempt spent. Bounded like
    the claim (a stop neither cancels nor waits for it): the wait for a
    connection and the statement end within ``seconds`` (a database that
    stopped answering gets its connection cut), and the next try, or the
    sweeper, returns the jobs.
    """
    end = time.monotonic() + seconds
    with (
        pool.connection(timeout=min(CLAIM_CONNECTION_WAIT_SECONDS, seconds)) as conn,
        cut_at(conn, end),
        conn.transaction(),  # the commit is bounded too
    ):
        rows = conn.execute(
            sql("job_hand_back_unheld"),
            {"worker_id": worker_id, "ids": list(held), "tokens": list(held.values())},
        ).fetchall()
    return [row[0] for row in rows]
