"""Periodic duties of a worker: heartbeats, the sweeper, the registry.

Each duty is a plain function or method that tests call directly
(``run_once``); the threads only decide when to call them. Heartbeats have a
thread and a connection of their own: a long prune, fold or vacuum, or
handlers holding every pooled connection, must never delay the lease
renewals that keep other workers from taking running jobs. (Handlers'
timeouts are checked by the worker's lease watch, which waits on no
connection: a heartbeat that hangs must not delay them either.)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..connect_options import connection_options, worker_application_name
from ..logs import event
from ..monitor import fold_counters_in_chunks
from ..outages import REPEAT_SECONDS, RETRYABLE, OutageLog
from ..queries import sql
from ..sessions import configure_session, in_autocommit
from .limits import forget_old_starts
from .outage import PooledCallLog
from .retention import hit_cap

SWEEP_BATCH = 1000
#: A sweep that waited longer than this before it could read (a table lock) returns no lease: see
#: job_rescue_expired. Far below any lease a lock must outlast to let one run out under a live worker.
SWEEP_STALL_SECONDS = 2.0
#: Seconds between folds of the admin counters' change rows.
FOLD_INTERVAL = 30.0
#: Seconds to the next retention pass while expired jobs are still piled up.
PRUNE_CATCH_UP_SECONDS = 1.0
#: How far past the database clock's whole second each periodic check runs: a
#: check's ``now()`` must fall inside the second it is meant for, after the
#: round trip and the other duties of the same wake.
PERIODIC_CHECK_PHASE = 0.1
#: The longest the duties thread sleeps between looks at its duties.
DUTY_WAKE_SECONDS = 0.2
#: Seconds between checks whether Relay's tables need a vacuum autovacuum will not run.
VACUUM_CHECK_INTERVAL = 15.0
#: The longest the sweeper holds off after the server starts. Leases only run out
#: unrenewed in an outage longer than the lease, and then heartbeats were failing
#: and retry every second: live workers renew within seconds of the return. A
#: whole long lease (hours are allowed) would hold dead workers' jobs that long.
RESTART_GRACE_MAX_SECONDS = 60.0
#: How long the registry keeps a worker that stopped or went quiet (a week of deploys to look back on).
REGISTRY_KEEP_SECONDS = 7 * 86400.0
#: How long a heartbeat whose own connection the server refused waits for one of the pool's instead.
POOLED_HEARTBEAT_WAIT_SECONDS = 1.0


def sweep_once(
    conn: psycopg.Connection,
    limit: int = SWEEP_BATCH,
    restart_grace: float = 0.0,
    held: Mapping[int, int] | None = None,
) -> dict[str, int]:
    """Return expired leases to the queue (or to dead, or to cancelled when an
    admin had asked the job to stop); count per new status.

    Safe to run from every worker at once: the statement skips rows another
    sweeper holds and re-checks the lease in its own WHERE. Within
    ``restart_grace`` seconds of the server's start it returns nothing, so
    live workers renew the leases an outage let run out (workers pass their
    lease, at most RESTART_GRACE_MAX_SECONDS). The leases in ``held``
    (id -> token) are the sweeping worker's own, left to it to renew or end.
    ``conn`` is in autocommit, or idle: a sweep in a transaction begun over
    SWEEP_STALL_SECONDS before returns nothing, as one held up that long by a
    table lock does (see job_rescue_expired).
    """
    counts = {"queued": 0, "dead": 0, "cancelled": 0}
    own = dict(held or {})
    params = {
        "limit": limit,
        "restart_grace": restart_grace,
        "stall_seconds": SWEEP_STALL_SECONDS,
        "held_ids": list(own),
        "held_tokens": list(own.values()),
    }
    while True:
        rows = conn.execute(sql("job_rescue_expired"), params).fetchall()
        conn.commit()
        for job_id, status, job_type, attempt, worker in rows:
            counts[status] += 1
            # One line per job, as for every other end of an attempt: which job, and where it went.
            event(
                logging.WARNING,
                "job lease expired",
                job_id=job_id,
                type=job_type,
                attempt=attempt,
                worker_id=worker,
                ended=status,
            )
        if len(rows) < limit:
            return counts


def heartbeat_once(
    conn: psycopg.Connection, held: dict[int, int], lease_seconds: float
) -> tuple[dict[int, int], dict[int, int], set[int]]:
    """Extend the leases in ``held`` (id -> token).

    Returns the leases renewed, the leases no longer ours, and the ids an
    admin asked to cancel. A lease whose row another transaction holds just
    now is neither renewed nor lost: it is tried again next time
    (``job_heartbeat_many``).
    """
    if not held:
        return {}, {}, set()
    ids = list(held)
    rows = conn.execute(
        sql("job_heartbeat_many"),
        {"ids": ids, "tokens": [held[i] for i in ids], "lease_seconds": lease_seconds},
    ).fetchall()
    conn.commit()
    ours = {row[0] for row in rows}
    renewed = {row[0]: held[row[0]] for row in rows if row[2]}
    lost = {jid: token for jid, token in held.items() if jid not in ours}
    return renewed, lost, {row[0] for row in rows if row[1]}


def forget_old_workers(conn: psycopg.Connection, keep_seconds: float = REGISTRY_KEEP_SECONDS) -> int:
    """Delete the registry rows of workers last heard from over ``keep_seconds`` ago and not alive; how many.

    Apart from retention, which a worker may have switched off: the registry
    is the workers' bookkeeping, not the jobs' history.
    """
    deleted = conn.execute(sql("worker_registry_prune"), {"keep_seconds": keep_seconds}).rowcount
    conn.commit()
    return deleted


def register(
    conn: psycopg.Connection,
    worker_id: str,
    queues: tuple[str, ...],
    concurrency: int,
    heartbeat_seconds: float,
    schedule_definitions: str = "[]",
) -> datetime:
    """Record this worker process in the registry; return its registration (``started_at``).

    The heartbeat interval goes with it: a worker that beats every 100 s is
    not gone after 60 s of silence (relay.worker_state). So do the schedules
    it checks (``schedule_definitions``, a JSON array, whose types fill the
    ``schedules`` column): only a worker that had a schedule saw its ticks
    fall due (periodic.enqueue_due), and a worker whose schedule is the one
    published holds it against another's take-over.
    """
    (started_at,) = conn.execute(
        sql("worker_register"),
        {
            "id": worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "queues": list(queues),
            "concurrency": concurrency,
            "heartbeat_seconds": heartbeat_seconds,
            "schedule_definitions": schedule_definitions,
        },
    ).fetchone()
    conn.commit()
    return started_at


class Maintenance:
    """A thread that runs the periodic duties on their intervals."""

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        dsn: str,
        worker_id: str,
        lease_seconds: float,
        heartbeat_interval: float,
        sweep_interval: float,
        held_leases: Callable[[], dict[int, int]],
        on_lost: Callable[[dict[int, int]], None],
        on_cancel: Callable[[set[int]], None],
        on_renewed: Callable[[dict[int, int], float], None] | None = None,
        on_limits: Callable[[bool], None] | None = None,
        in_flight: Callable[[], int],
        periodic: Callable[[psycopg.Connection], object] | None = None,
        prune: Callable[[psycopg.Connection], dict[str, int]] | None = None,
        prune_interval: float = 60.0,
        vacuum: Callable[..., list[str]] | None = None,
        outage: OutageLog | None = None,
        pooled_calls: OutageLog | PooledCallLog | None = None,
    ) -> None:
        self._pool = pool
        self._outage = outage or OutageLog()
        # The duties wait for pooled connections; the heartbeat has its own.
        self._pooled_calls = pooled_calls or self._outage
        self._dsn = dsn
        self._heartbeat_conn: psycopg.Connection | None = None
        self._pooled_heartbeat_said = float("-inf")  # when a pooled heartbeat was last logged (monotonic)
        self._worker_id = worker_id
        self._lease_seconds = lease_seconds
        self._heartbeat_interval = heartbeat_interval
        self._sweep_interval = sweep_interval
        self._held_leases = held_leases
        self._on_lost = on_lost
        self._on_cancel = on_cancel
        self._on_renewed = on_renewed
        self._on_limits = on_limits
        self._periodic = periodic
        self._prune = prune
        self._prune_interval = prune_interval
        self._vacuum = vacuum
        self._in_flight = in_flight
        self._stop_heartbeats = threading.Event()
        self._stop_duties = threading.Event()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="relay-heartbeat", daemon=True)
        self._duties_thread = threading.Thread(target=self._loop, name="relay-maintenance", daemon=True)
        self.sweeps = 0
        #: This process's registration (from :func:`register`): heartbeats touch the registry row only while it holds.
        self.registered_at: datetime | None = None

    def start(self) -> None:
        """Start the duties."""
        self._heartbeat_thread.start()
        self._duties_thread.start()

    def stop(self) -> None:
        """Stop after the current duty."""
        self.stop_duties()
        self.stop_heartbeats()

    def stop_duties(self, timeout: float = 5.0) -> None:
        """Stop sweeping, pruning and the rest; heartbeats go on (a shutdown still holds leases).

        Waits up to ``timeout`` s for the duty in progress; one waiting for a
        database that is down ends on its own and finds the loop stopped.
        """
        self._stop_duties.set()
        self._duties_thread.join(timeout)

    def duties_running(self) -> bool:
        """Whether a duty is still in progress after :meth:`stop_duties` (or the duties never stopped)."""
        return self._duties_thread.is_alive()

    def stop_heartbeats(self, timeout: float = 5.0) -> None:
        """Stop renewing leases: the worker has nothing left to hold."""
        self._stop_heartbeats.set()
        self._heartbeat_thread.join(timeout)

    def heartbeat(self) -> None:
        """Renew leases and the registry entry; report leases that were taken over.

        On its own connection, never the pool's: transactional handlers hold
        pooled connections for as long as they run (past their timeout too),
        and a heartbeat waiting for one would let the leases expire.

        In autocommit: each statement commits as it runs. The renewal locks
        every lease the worker holds, and with its COMMIT a round trip later
        a worker frozen in between (SIGSTOP, a paused container, whose kernel
        still answers keepalives) kept them locked: the sweepers skip locked
        rows, so its jobs stayed claimed for as long as it was frozen.

        When its own connection cannot be made again while the server takes no
        new sessions (``too many clients``, a role's connection limit) but the
        pool's open ones still work, one of those renews the leases, waited for
        at most ``POOLED_HEARTBEAT_WAIT_SECONDS``: the worker went on claiming
        and running jobs through its pool while every lease it held ran out, and
        another worker ran them beside its handlers.

        A session the server ended while it sat idle between two heartbeats
        (``idle_session_timeout``, a restart) is replaced at once: the renewal
        waited a second for the next try, and each such end was logged as an
        outage, then as its end.
        """
        reused = self._heartbeat_conn is not None and not self._heartbeat_conn.closed
        try:
            self._heartbeat_on_its_own_connection()
        except psycopg.OperationalError as exc:
            if not reused or isinstance(exc, psycopg.errors.QueryCanceled):
                raise
            self._heartbeat_on_its_own_connection()  # a new one: this one had ended while idle

    def _heartbeat_on_its_own_connection(self) -> None:
        if self._heartbeat_conn is None or self._heartbeat_conn.closed:
            try:
                self._heartbeat_conn = psycopg.connect(
                    self._dsn,
                    autocommit=True,
                    **connection_options(self._dsn, application_name=worker_application_name(self._worker_id)),
                )
            except psycopg.OperationalError as refused:
                self._heartbeat_on_a_pooled_connection(refused)
                return
            configure_session(self._heartbeat_conn)
        conn = self._heartbeat_conn
        try:
            self._renew(conn)
        except psycopg.Error:
            conn.close()  # reconnect next time rather than reuse a connection in an unknown state
            raise

    def _heartbeat_on_a_pooled_connection(self, refused: psycopg.OperationalError) -> None:
        """The heartbeat on one of the pool's connections; ``refused`` (why its own could not be made) if none comes."""
        try:
            with self._pool.connection(timeout=POOLED_HEARTBEAT_WAIT_SECONDS) as conn, in_autocommit(conn):
                self._renew(conn)
        except PoolTimeout:
            raise refused from None
        # Said once per REPEAT_SECONDS: the server refusing new sessions (too many clients) is the
        # operator's to hear of, though the leases are safe; a line per heartbeat would bury the rest.
        now = time.monotonic()
        if now - self._pooled_heartbeat_said >= REPEAT_SECONDS:
            self._pooled_heartbeat_said = now
            event(logging.WARNING, "heartbeat sent on a pooled connection: its own was refused", error=str(refused))

    def _renew(self, conn: psycopg.Connection) -> None:
        """One renewal of the held leases and the registry row on ``conn``, then tell the worker what it found."""
        held = self._held_leases()
        sent = time.monotonic()  # the renewed leases run at least lease_seconds from here
        renewed, lost, cancel = heartbeat_once(conn, held, self._lease_seconds)
        conn.execute(
            sql("worker_heartbeat"),
            {"id": self._worker_id, "started_at": self.registered_at, "in_flight": self._in_flight()},
        )
        conn.commit()
        if self._on_renewed is not None:
            self._on_renewed(renewed, sent)
        if lost:
            self._on_lost(lost)
        if cancel:
            self._on_cancel(cancel)

    def sweep(self) -> dict[str, int]:
        """Run the sweeper once, each batch committed as it runs (autocommit: see ``heartbeat``).

        Not within the restart grace of this worker's own last long outage
        ending, as not within that of the server's start (see ``sweep_once``): the
        server's start time comes before its crash recovery, which can take
        longer than the grace (7.7 s of WAL replayed in a review's run, past a
        6 s lease), so the first sweeper through took the leases of live
        workers that had had no chance to renew them, and a job whose
        success waited to be written ran again. Every worker connected to a
        server that restarted saw the outage.
        """
        if self.in_restart_grace():
            return {"queued": 0, "dead": 0, "cancelled": 0}
        with self._pool.connection() as conn, in_autocommit(conn):
            counts = sweep_once(conn, restart_grace=self._restart_grace, held=self._held_leases())
        self.sweeps += 1
        if any(counts.values()):
            event(
                logging.WARNING,
                "rescued jobs with expired leases",
                requeued=counts["queued"],
                dead=counts["dead"],
                cancelled=counts["cancelled"],
            )
        return counts

    @property
    def _restart_grace(self) -> float:
        return min(self._lease_seconds, RESTART_GRACE_MAX_SECONDS)

    def in_restart_grace(self) -> bool:
        """Whether an outage that may have let leases run out is under way or ended within the restart grace.

        One that long lasted at least a lease less a heartbeat interval: a
        live worker renews at most that long before it began. Shorter ones
        (a session an idle-session timeout ended, a lost packet) hold nothing
        off: counting those, a worker whose listener was cut every few
        seconds never swept, and a dead worker's jobs stayed claimed.
        """
        long_enough = max(self._lease_seconds - self._heartbeat_interval, 0.0)
        return self._outage.long_one_within(self._restart_grace, longer_than=long_enough)

    def run_periodic(self) -> float:
        """Learn whether any job type has a limit, then run the periodic duties (due ticks, limits nobody holds).

        The limits first: a worker that missed the first limit row of a
        deploy would claim nothing at all, so no schedule may hold it up.
        Returns when (``time.monotonic()``) the database clock reaches its next
        whole second: the loop runs the next check just after it, so each
        second of the database's clock gets one check and an every-second
        schedule has none of its ticks passed over.
        """
        with self._pool.connection() as conn:
            started = time.monotonic()
            limits_exist, until_next_second = conn.execute(sql("periodic_check")).fetchone()
            if self._on_limits is not None:
                self._on_limits(bool(limits_exist))
            if self._periodic is not None:
                self._periodic(conn)
        return started + until_next_second

    def prune(self) -> dict[str, int]:
        """Run retention once (if this worker prunes); forget old rate-limit starts and long-gone workers.

        In autocommit, as the heartbeat: each delete is one statement that
        commits with it, so a worker frozen between two of them holds no row.
        """
        with self._pool.connection() as conn, in_autocommit(conn):
            deleted = self._prune(conn) if self._prune is not None else {}
            forget_old_starts(conn)
            forget_old_workers(conn)
        if any(deleted.values()):
            event(logging.INFO, "pruned finished jobs", **deleted)
        return deleted

    def vacuum(self) -> list[str]:
        """Vacuum Relay's tables where autovacuum is off (see worker/vacuum.py)."""
        if self._vacuum is None:
            return []
        with self._pool.connection() as conn:
            return self._vacuum(conn, untimed=not self._pool.transaction_pooling)

    def fold(self) -> bool:
        """Fold the admin counters' change rows so they never pile up while nobody reads them."""
        with self._pool.connection() as conn:
            return fold_counters_in_chunks(conn)

    def _heartbeat_loop(self) -> None:
        try:
            self._heartbeat_until_stopped()
        finally:
            if self._heartbeat_conn is not None:
                self._heartbeat_conn.close()

    def _heartbeat_until_stopped(self) -> None:
        # Each renewal is due one interval after the last was due, and the wait ends then:
        # woken on a fixed tick and counted from the wake, each gap grew by up to that tick.
        next_heartbeat = time.monotonic() + self._heartbeat_interval
        while not self._stop_heartbeats.wait(max(next_heartbeat - time.monotonic(), 0.0)):
            now = time.monotonic()
            next_heartbeat += self._heartbeat_interval
            if next_heartbeat <= now:  # the last one took longer than the interval: one now, not a burst
                next_heartbeat = now + self._heartbeat_interval
            try:
                self.heartbeat()
                self._outage.succeeded()
            except RETRYABLE as exc:
                self._outage.failed("heartbeat", exc, began=now)
                next_heartbeat = now + 1.0
            except Exception as exc:  # a bug, not an outage: keep the worker alive and say so
                event(logging.ERROR, "heartbeat failed", error=repr(exc))

    def _loop(self) -> None:
        now = time.monotonic()
        # Spread sweepers (and pruners) of workers started together.
        spread = 0.5 + (os.getpid() % 100) / 200
        next_sweep = now + self._sweep_interval * spread
        next_prune = now + min(self._prune_interval * spread, 10.0)
        next_periodic = now
        next_fold = now + FOLD_INTERVAL * spread
        next_vacuum = now + VACUUM_CHECK_INTERVAL * spread
        while True:
            # Wake when the next duty is due (a periodic check must not drift
            # past its second), and at least every DUTY_WAKE_SECONDS.
            next_duty = min(next_sweep, next_periodic, next_prune, next_fold, next_vacuum)
            if self._stop_duties.wait(min(DUTY_WAKE_SECONDS, max(0.0, next_duty - time.monotonic()))):
                return
            now = time.monotonic()
            # Whether a duty that always sends a statement on a pooled connection runs now.
            due = now >= min(next_sweep, next_periodic, next_prune, next_fold)
            try:
                if now >= next_sweep:
                    next_sweep = now + self._sweep_interval
                    if self.in_restart_grace():
                        # Held off, so it sends nothing: not a call that got through an outage.
                        due = now >= min(next_periodic, next_prune, next_fold)
                    else:
                        self.sweep()
                if now >= next_periodic:
                    next_periodic = now + 1.0  # if the check fails
                    next_periodic = self.run_periodic() + PERIODIC_CHECK_PHASE
                if now >= next_prune:
                    next_prune = now + self._prune_interval
                    if hit_cap(self.prune()):
                        # A backlog of expired jobs: keep pruning in short passes until it is gone.
                        next_prune = now + PRUNE_CATCH_UP_SECONDS
                if now >= next_fold:
                    next_fold = now + FOLD_INTERVAL
                    self.fold()
                if now >= next_vacuum:
                    next_vacuum = now + VACUUM_CHECK_INTERVAL
                    self.vacuum()
                if due:
                    self._pooled_calls.succeeded(wrote=False)  # its duties may have found nothing to write
            except RETRYABLE as exc:
                self._pooled_calls.failed("maintenance", exc, began=now)
            except psycopg.Error as exc:  # a bug, not an outage: keep the worker alive and say so
                event(logging.ERROR, "maintenance statement failed", error=str(exc))
            except Exception as exc:  # a bug in a duty: the others (the sweeper first) must go on
                event(logging.ERROR, "maintenance duty failed", error=repr(exc))
