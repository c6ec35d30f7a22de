"""The worker process: claim, run, complete, heartbeat, shut down gracefully.

Threads: the producer (the caller's thread) claims as many jobs as there are
free slots in one statement; ``concurrency`` slot threads run handlers; the
completer writes outcomes in batches; the heartbeat thread renews leases and
enforces timeouts; the maintenance thread sweeps, prunes and runs cron; the
listener turns NOTIFY into wake-ups.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from .. import migrate as migrator
from ..errors import ConfigurationError, JobTimeout
from ..handlers import HandlerSpec
from ..job import Job
from ..logs import event
from ..pools import all_in_use, make_pool, restore_transactions, worker_application_name
from ..queries import sql
from ..signals import ShutdownSignals
from . import executor, limits, periodic
from .aio import SlotLoop
from .completer import Completer
from .config import WorkerConfig
from .listener import Listener
from .maintenance import Maintenance, register
from .outage import POOL_EXHAUSTED, OutageLog, PooledCallLog, next_retry_delay
from .outcome import Kind, Outcome, describe
from .retention import prune_once
from .vacuum import vacuum_if_needed

#: How long the producer lets freed slots gather before claiming for them.
CLAIM_COALESCE_SECONDS = 0.002
#: Jobs that typically finish faster than this are prefetched; longer ones are not.
PREFETCH_BELOW_SECONDS = 0.05
#: A slot holds about this much prefetched work: how long a prefetched job may wait in it.
PREFETCH_WORK_SECONDS = 0.01
#: ... and never more than this many jobs beyond the one it runs.
MAX_PREFETCH_PER_SLOT = 16
#: A job handed back at shutdown while its handler thread still ran waits this
#: long before another worker may start it: the thread stops only when the
#: worker process exits, a moment after the hand-back.
HAND_BACK_GRACE_SECONDS = 2.0
#: After the in-flight wait of a shutdown, what is left to write (outcomes, hand-backs, the
#: registry's stop) shares this many seconds: with the database down none of it can be
#: written, and waiting for each in turn would outlast a platform's drain window.
SHUTDOWN_WRITES_SECONDS = 3.0
#: How long a claim waits for a pooled connection before the producer looks again whether
#: it should stop: a stop during an outage must not wait out the pool's whole timeout.
CLAIM_CONNECTION_WAIT_SECONDS = 1.0
#: How long one try at registering waits for a connection before it logs and tries again.
REGISTER_WAIT_SECONDS = 2.0
#: Why a prefetched job went back to the queue unstarted (see ``_flag_unrenewed``).
NOT_STARTED = "not started: its lease ran out unrenewed while it waited for a slot"
#: How often the lease watch compares unrenewed leases with the local clock.
LEASE_WATCH_SECONDS = 0.2


def prefetch_per_slot(typical_run: float) -> int:
    """Jobs a slot holds beyond the one it runs, for handlers that typically take ``typical_run`` s."""
    if typical_run >= PREFETCH_BELOW_SECONDS:
        return 0
    return max(1, min(MAX_PREFETCH_PER_SLOT, int(PREFETCH_WORK_SECONDS / max(typical_run, 1e-6))))


@dataclass
class Slot:
    """One handler thread; abandoned when its job timed out or was handed back."""

    index: int
    abandoned: threading.Event = field(default_factory=threading.Event)


@dataclass
class Running:
    """A job in a slot, with its deadline (monotonic) if its handler has a timeout."""

    job: Job
    slot: Slot | None = None  # None until a slot thread takes the job
    deadline: float | None = None
    started: float = 0.0
    #: When the lease surely ran out (monotonic) unless a heartbeat renewed it since:
    #: counted from before the claim or the renewing heartbeat was sent.
    lease_expires: float = float("inf")


@dataclass
class Counters:
    """Totals since the worker started, for logs and exporters."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    snoozed: int = 0
    cancelled: int = 0
    lost: int = 0


class Worker:
    """Runs the handlers of one Relay app until told to stop."""

    def __init__(self, dsn: str, handlers: Mapping[str, HandlerSpec], config: WorkerConfig | None = None) -> None:
        self.dsn = dsn
        self.handlers = dict(handlers)
        self.config = config or WorkerConfig()
        self.id = self.config.worker_id
        self.counters = Counters()
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[int, Running] = {}
        self._awaiting_write: dict[int, int] = {}  # id -> token: finished, not yet recorded
        # id -> (run, decided outcome): past their timeout, handler thread still running.
        self._overdue: dict[int, tuple[Running, Outcome]] = {}
        self._closing: dict[int, int] = {}  # id -> token: shutting down, not yet handed back
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._slots: list[Slot] = []
        # Whether any job type has a limit: decides how the claim runs (see claim()).
        self.limits_exist = True
        # Moving average of handler run time; starts "long" so nothing is prefetched until jobs prove short.
        self._typical_run = PREFETCH_BELOW_SECONDS * 2
        self.pool = make_pool(
            dsn,
            name=f"relay-worker-{self.id}",
            min_size=2,
            max_size=self.config.concurrency + 4,
            timeout=10.0,
            application_name=worker_application_name(self.id),
        )
        # One account of a database outage for all of this worker's threads; the calls
        # that wait for a pooled connection also tell a pool whose every connection
        # is checked out apart from it.
        self.outage = OutageLog()
        self.pooled_calls = PooledCallLog(self.outage, OutageLog(wording=POOL_EXHAUSTED), self._exhaustion_cause)
        self.completer = Completer(self.pool, self._on_written, self.pooled_calls)
        self.maintenance = Maintenance(
            self.pool,
            dsn=dsn,
            worker_id=self.id,
            lease_seconds=self.config.lease_seconds,
            heartbeat_interval=self.config.heartbeat_interval,
            sweep_interval=self.config.sweep_interval,
            held_leases=self.held_leases,
            on_lost=self._on_lost,
            on_cancel=self._on_cancel,
            on_renewed=self._on_renewed,
            on_limits=self._set_limits_exist,
            in_flight=self.in_flight,
            check_timeouts=self._check_timeouts,
            periodic=self._enqueue_periodic if any(s.cron for s in self.handlers.values()) else None,
            prune=(lambda conn: prune_once(conn, self.config.retention)) if self.config.retention else None,
            vacuum=vacuum_if_needed if self.config.self_vacuum else None,
            outage=self.outage,
            pooled_calls=self.pooled_calls,
        )
        self.listener = (
            Listener(
                dsn, self.config.queues, self._wake.set, self.outage, application_name=worker_application_name(self.id)
            )
            if self.config.listen
            else None
        )

    # -- bookkeeping -------------------------------------------------------

    def in_flight(self) -> int:
        """Jobs whose handlers are running now."""
        with self._lock:
            return len(self._running)

    def held_leases(self) -> dict[int, int]:
        """Every lease this worker must keep alive: running, overdue or awaiting its write."""
        with self._lock:
            held = dict(self._awaiting_write)
            held.update(self._closing)
            held.update((jid, r.job.lease_token) for jid, (r, _) in self._overdue.items())
            # Last, so a job claimed again has its newest lease renewed, not the earlier run's.
            held.update((jid, r.job.lease_token) for jid, r in self._running.items())
            return held

    def _on_written(self, batch: list[Outcome], written: dict[int, str]) -> None:
        with self._lock:
            for outcome in batch:
                if self._awaiting_write.get(outcome.job.id) == outcome.job.lease_token:
                    del self._awaiting_write[outcome.job.id]
        for outcome in batch:
            self._tell(outcome, written.get(outcome.job.id))

    def _tell(self, outcome: Outcome, status: str | None) -> None:
        """Count and log what was written for one run (``status`` None: the lease was taken over)."""
        duration_ms = round(outcome.duration * 1000, 3)
        if status is None and outcome.message == NOT_STARTED:
            self._count("lost", logging.WARNING, "unstarted job not handed back: its lease was taken over", outcome)
        elif status is None:
            self._count(
                "lost",
                logging.WARNING,
                "job outcome discarded: lease was taken over",
                outcome,
                outcome=outcome.kind.value,
            )
        elif status == "cancelled":
            self._count(
                "cancelled", logging.INFO, "job cancelled", outcome, ended=outcome.kind.value, error=outcome.message
            )
        elif outcome.kind in (Kind.SUCCEEDED, Kind.COMMITTED):
            self._count("succeeded", logging.INFO, "job succeeded", outcome, duration_ms=duration_ms)
        elif outcome.kind is Kind.RETRY:
            self._count(
                "retried",
                logging.WARNING,
                "job failed; will retry",
                outcome,
                duration_ms=duration_ms,
                retry_in_s=round(outcome.delay, 3),
                error=outcome.message,
            )
        elif outcome.kind is Kind.DEAD:
            self._count("dead", logging.ERROR, "job dead", outcome, duration_ms=duration_ms, error=outcome.message)
        elif outcome.message == NOT_STARTED:
            self._count("snoozed", logging.INFO, "job handed back", outcome, reason=NOT_STARTED)
        else:
            self._count("snoozed", logging.INFO, "job snoozed", outcome, snooze_s=outcome.delay)

    def _count(self, counter: str, level: int, message: str, run: Outcome, **fields: object) -> None:
        setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        event(level, message, job_id=run.job.id, type=run.job.type, attempt=run.job.attempt, **fields)

    def _on_renewed(self, renewed: Mapping[int, int], sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) extended these leases (id -> token)."""
        expires = sent + self.config.lease_seconds
        with self._lock:
            for jid, token in renewed.items():
                running = self._running.get(jid)
                if running is not None and running.job.lease_token == token:
                    running.lease_expires = max(running.lease_expires, expires)

    def _watch_leases(self) -> None:
        """Tell handlers whose leases ran out unrenewed to stop, by this process's own clock.

        A heartbeat that hangs (a database that stalls, a network path that
        drops packets) learns nothing until its socket gives up, minutes later,
        while another worker's sweeper returns the job and runs it again. This
        thread waits on nothing but a lock, so a handler hears ``lease_lost``
        once its lease has surely ended even when every connection hangs.
        """
        while not self.stopped.wait(LEASE_WATCH_SECONDS):
            self._flag_unrenewed(time.monotonic())

    def _flag_unrenewed(self, now: float) -> None:
        """Set ``lease_lost`` on every run whose lease surely ended before ``now`` (monotonic).

        A job claimed ahead of a free slot goes back to the queue at once
        instead: nobody is known to have taken it, so it is handed back,
        fenced, with the attempt it never used. Left to the sweeper, that
        attempt would count, and a job with one attempt would end dead
        without ever running (unless another worker's sweeper gets to it
        first, as it must when this worker is cut off).
        """
        expired: list[Job] = []
        unstarted: list[Job] = []
        with self._lock:
            for jid, running in list(self._running.items()):
                if now > running.lease_expires and not running.job._lease_lost.is_set():
                    running.job._lease_lost.set()
                    if running.slot is None:
                        del self._running[jid]  # a slot that takes it from the inbox now skips it
                        self._awaiting_write[jid] = running.job.lease_token
                        self.completer.put(Outcome(running.job, Kind.SNOOZED, 0.0, message=NOT_STARTED))
                        unstarted.append(running.job)
                    else:
                        expired.append(running.job)
        for job in expired:
            event(logging.WARNING, "lease ran out without a renewal; told the handler to stop", job_id=job.id)
        if unstarted:
            event(
                logging.WARNING,
                "lease ran out without a renewal before a slot was free; handing the jobs back",
                job_ids=sorted(j.id for j in unstarted),
            )

    def _on_lost(self, lost: Mapping[int, int]) -> None:
        """Flag the runs whose leases (id -> token) a heartbeat found taken over.

        Matched by token, not id alone: between the heartbeat's snapshot and its
        answer a job may have finished and been claimed again by this worker,
        and that new run's lease is valid.
        """
        taken: list[int] = []
        with self._lock:
            for jid, token in lost.items():
                running = self._running.get(jid)
                overdue = self._overdue.get(jid)
                if running is not None and running.job.lease_token == token:
                    running.job._lease_lost.set()
                    if running.slot is None:
                        del self._running[jid]  # never started: a slot that takes it from the inbox skips it
                    taken.append(jid)
                elif overdue is not None and overdue[0].job.lease_token == token:
                    del self._overdue[jid]  # the sweeper decided it; the thread's end changes nothing
                    taken.append(jid)
                elif self._awaiting_write.get(jid) == token:
                    del self._awaiting_write[jid]
                    taken.append(jid)
                elif self._closing.get(jid) == token:
                    del self._closing[jid]
                    taken.append(jid)
        # A job whose completion was written while the heartbeat ran is not lost: say nothing of it.
        if taken:
            event(logging.WARNING, "leases taken over by another worker", job_ids=sorted(taken))

    def _set_limits_exist(self, exist: bool) -> None:
        self.limits_exist = exist

    def _on_cancel(self, ids: set[int]) -> None:
        with self._lock:
            for jid in ids:
                running = self._running.get(jid) or (self._overdue[jid][0] if jid in self._overdue else None)
                if running is not None and not running.job.cancel_requested:
                    running.job._cancel_requested.set()
                    event(logging.INFO, "cancellation requested", job_id=jid, type=running.job.type)

    def _enqueue_periodic(self, conn: psycopg.Connection) -> None:
        periodic.enqueue_due(conn, self.handlers.values())

    def _report_progress(self, job: Job, progress: dict) -> bool:  # type: ignore[type-arg]
        try:
            with self.pool.connection() as conn:
                row = conn.execute(
                    sql("job_set_progress"),
                    {"id": job.id, "token": job.lease_token, "progress": json.dumps(progress)},
                ).fetchone()
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout):
            return False
        return row is not None

    def _finish(self, slot: Slot, job: Job, outcome: Outcome) -> None:
        with self._lock:
            overdue = self._overdue.get(job.id)
            if overdue is not None and overdue[0].slot is slot:
                self._finish_overdue(job, outcome, overdue[1])
                return
            running = self._running.get(job.id)
            if slot.abandoned.is_set() or running is None or running.slot is not slot:
                return  # handed back or taken over: there is nothing left to record
            del self._running[job.id]
            if outcome.kind is not Kind.COMMITTED:
                self._awaiting_write[job.id] = job.lease_token
            self._typical_run = 0.9 * self._typical_run + 0.1 * outcome.duration
            # Queued under the lock: once the job has left _running, a shutdown that sees
            # nothing in flight stops the completer, and the outcome must be in its queue by then.
            self.completer.put(outcome)
        self._wake.set()

    def _finish_overdue(self, job: Job, outcome: Outcome, decided: Outcome) -> None:
        """A handler past its timeout has returned: record the timeout, now that it cannot run on.

        Called with the lock held. What the handler returned does not count:
        it was told to stop (``lease_lost``), and a cooperative handler that
        stops early returns as if it had finished. A transactional handler
        that committed its success anyway has already recorded it.
        """
        del self._overdue[job.id]
        if outcome.kind is Kind.COMMITTED:
            event(logging.INFO, "job past its timeout committed its success", job_id=job.id, type=job.type)
            return
        self._awaiting_write[job.id] = job.lease_token
        self.completer.put(decided)
        event(logging.INFO, "job past its timeout returned; its timeout is recorded", job_id=job.id, type=job.type)

    def _check_timeouts(self) -> None:
        """Give jobs past their timeout up, but keep their leases until their threads return.

        Python cannot stop a thread. Recording the timeout at once would let
        the retry start while the first run goes on, so the outcome is decided
        now and written when the handler returns; meanwhile the lease is
        heartbeated like any running job's and a fresh slot takes the stuck
        one's place. A handler that never returns holds its job until the
        worker stops.
        """
        now = time.monotonic()
        expired: list[Running] = []
        with self._lock:
            for jid, running in list(self._running.items()):
                if running.slot is not None and running.deadline is not None and now > running.deadline:
                    expired.append(running)
                    del self._running[jid]
                    running.slot.abandoned.set()
            for running in expired:
                job = running.job
                spec = self.handlers.get(job.type)
                exc = JobTimeout(f"handler ran past its timeout of {spec.timeout if spec else '?'}s")
                message, entry = describe(exc, job, self.id)
                entry["traceback"] = None
                kind = Kind.DEAD if job.attempt >= job.max_attempts else Kind.RETRY
                delay = spec.backoff.delay(job.attempt) if spec else 0.0
                decided = Outcome(job, kind, now - running.started, delay=delay, message=message, error=entry)
                self._overdue[job.id] = (running, decided)
                job._lease_lost.set()  # tells a cooperative handler to stop
        for running in expired:
            job = running.job
            self._start_slot()  # the stuck thread keeps its slot object; the worker gets a fresh one
            event(
                logging.WARNING,
                "job timed out; its lease is kept until the handler returns",
                job_id=job.id,
                type=job.type,
                attempt=job.attempt,
            )

    # -- slots -------------------------------------------------------------

    def _start_slot(self) -> None:
        slot = Slot(len(self._slots))
        self._slots.append(slot)
        threading.Thread(target=self._slot_loop, args=(slot,), name=f"relay-slot-{slot.index}", daemon=True).start()

    def _slot_loop(self, slot: Slot) -> None:
        loop = SlotLoop()  # async handlers' event loop, this thread's alone
        try:
            while not slot.abandoned.is_set():
                job = self._inbox.get()
                if job is None:
                    return
                if not self._bind(slot, job):
                    continue  # handed back while it waited for a slot
                outcome = executor.run(job, self.handlers, self.pool, self.id, loop)
                self._finish(slot, job, outcome)
        finally:
            loop.close()

    def _bind(self, slot: Slot, job: Job) -> bool:
        """Mark ``job`` as running in ``slot``; its timeout starts now."""
        spec = self.handlers.get(job.type)
        now = time.monotonic()
        with self._lock:
            running = self._running.get(job.id)
            if running is None or running.job is not job:
                # Handed back, or an earlier claim of a job this worker has claimed again
                # since: the newer claim is bound when it leaves the inbox.
                return False
            if job.lease_lost:
                # Prefetched, and taken over by another worker before it started.
                del self._running[job.id]
                return False
            running.slot = slot
            running.started = now
            running.deadline = now + spec.timeout if spec and spec.timeout else None
            return True

    # -- the producer ------------------------------------------------------

    def claim(self, limit: int) -> list[Job]:
        """Claim up to ``limit`` jobs in one statement (THE CLAIM in queries.sql).

        While no job type has a limit the claim is one autocommit statement
        that itself refuses to claim once a limit exists. When limits exist
        (``limits_exist``, refreshed each second), the limits lock and the
        claim travel together in one pipelined transaction, still one round
        trip (behind a transaction pooler, one each: see ``RelayPool.pipeline``).
        """
        return self._claim(limit)[0]

    def _claim(self, limit: int) -> tuple[list[Job], float]:
        """:meth:`claim`, and when the claim was sent (monotonic), the start of its leases by this clock.

        Taken once a pooled connection is in hand: after an outage, or while
        handlers hold every connection, the wait for one can outlast the
        lease, and a lease counted from before it would be told it had run
        out the moment its handler started.
        """
        params = {
            "queues": list(self.config.queues),
            "limit": limit,
            "worker_id": self.id,
            "lease_seconds": self.config.lease_seconds,
            "locked": self.limits_exist,
        }
        with self.pool.connection(timeout=CLAIM_CONNECTION_WAIT_SECONDS) as conn:
            sent = time.monotonic()
            if self.limits_exist:
                with self.pool.pipeline(conn), conn.transaction():
                    conn.execute(sql("claim_limits_lock"), prepare=True)
                    cur = conn.cursor(row_factory=dict_row)
                    cur.execute(sql("job_claim"), params, prepare=True)
                rows = cur.fetchall()
            else:
                conn.autocommit = True
                try:
                    with conn.cursor(row_factory=dict_row) as cur:
                        rows = cur.execute(sql("job_claim"), params, prepare=True).fetchall()
                finally:
                    restore_transactions(conn)
        jobs = [Job.from_row(row) for row in rows]
        for job in jobs:
            job._report = self._report_progress
        return jobs, sent

    def _dispatch(self, jobs: list[Job], sent: float | None = None) -> None:
        """Hand claimed jobs to the slots; ``sent`` is when the claim was sent (monotonic)."""
        lease_expires = (time.monotonic() if sent is None else sent) + self.config.lease_seconds
        replaced = 0
        with self._lock:
            for job in jobs:
                replaced += self._drop_earlier_run(job)
                self._running[job.id] = Running(job, lease_expires=lease_expires)
        for _ in range(replaced):
            self._start_slot()  # the earlier run's thread keeps its slot object; the worker gets a fresh one
        for job in jobs:
            self.counters.claimed += 1
            event(logging.INFO, "job claimed", job_id=job.id, type=job.type, attempt=job.attempt, queue=job.queue)
            self._inbox.put(job)

    def _drop_earlier_run(self, job: Job) -> int:
        """Tell an earlier run of ``job`` still in this worker that its lease is gone; 1 if its slot needs replacing.

        Called with the lock held. This claim could only take the job because
        the earlier run's lease ran out and the sweeper returned it; a
        heartbeat would have said so, but the claim came first. Replacing the
        entry silently would leave that run untold (``lease_lost``), uncounted
        in flight and not waited for at shutdown.
        """
        earlier = self._running.get(job.id)
        # An overdue run was told to stop at its timeout; the sweeper decided it, so its thread's end changes nothing.
        self._overdue.pop(job.id, None)
        if earlier is None:
            return 0
        earlier.job._lease_lost.set()
        event(logging.WARNING, "lease taken over by a new claim of the same job", job_id=job.id, type=job.type)
        if earlier.slot is None:
            return 0
        earlier.slot.abandoned.set()
        return 1

    def run(self, install_signals: bool = True) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT), then shut down gracefully."""
        signals = ShutdownSignals(self._on_signal) if install_signals else None
        try:
            self._run()
        finally:
            if signals is not None:
                signals.close()

    def _run(self) -> None:
        # Not open(wait=True): a worker started while the database is down (a deploy
        # during a failover) would give up after that wait and exit. Registration
        # retries instead, until the database answers or the worker is told to stop.
        self.pool.open()
        try:
            self._with_retry(lambda: self._register())
        except ConfigurationError:
            self.pool.close()
            raise
        if self.stopping.is_set() and self.maintenance.registered_at is None:
            self.pool.close()  # stopped before the database ever answered: nothing claimed, nothing to hand back
            self.stopped.set()
            return
        for _ in range(self.config.concurrency):
            self._start_slot()
        self.completer.start()
        self.maintenance.start()
        threading.Thread(target=self._watch_leases, name="relay-lease-watch", daemon=True).start()
        if self.listener:
            self.listener.start()
        event(
            logging.INFO,
            "worker started",
            worker_id=self.id,
            queues=",".join(self.config.queues),
            concurrency=self.config.concurrency,
        )
        try:
            self._produce()
        finally:
            self._shutdown()

    def _register(self) -> None:
        # A short wait per try, so a stop during an outage is not held up by it.
        with self.pool.connection(timeout=REGISTER_WAIT_SECONDS) as conn:
            if not migrator.is_current(conn):
                raise ConfigurationError("the database schema is not up to date: run `relay migrate` first")
            self.maintenance.registered_at = register(conn, self.id, self.config.queues, self.config.concurrency)
            limits.publish_max_attempts(conn, self.handlers.values())
            limits.publish(conn, self.handlers.values())
            self.limits_exist = bool(conn.execute(sql("type_limits_exist")).fetchone()[0])
            periodic.publish(conn, self.handlers.values())

    def _with_retry(self, action) -> None:  # type: ignore[no-untyped-def]
        delay = 0.1
        while not self.stopping.is_set():
            try:
                action()
                return
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
                error = self._connect_error() if isinstance(exc, PoolTimeout) else str(exc)
                event(logging.WARNING, "database unreachable; retrying", error=error, retry_in=delay)
                self.stopping.wait(delay)
                delay = next_retry_delay(delay)

    def _connect_error(self) -> str:
        """Why a connection cannot be made now, in the server's or libpq's words.

        The pool only says it waited in vain; the cause (a refused connection, a
        database that does not exist, a wrong password) is what an operator needs.
        """
        try:
            psycopg.connect(self.dsn, connect_timeout=REGISTER_WAIT_SECONDS).close()
        except psycopg.Error as exc:
            return str(exc)
        return "no pooled connection became free in time"

    def prefetch(self) -> int:
        """How many jobs to hold beyond the slots: the next few, while jobs are short.

        Short jobs would otherwise leave slots idle for every claim's round
        trip, and larger claims cost less per job. Each slot holds about
        PREFETCH_WORK_SECONDS of typical work (at least one job, at most
        MAX_PREFETCH_PER_SLOT), so a prefetched job waits about that long at
        most. Long jobs get no prefetch: a job held behind a long one while
        another worker sits idle would only wait longer.
        """
        return prefetch_per_slot(self._typical_run) * self.config.concurrency

    def _produce(self) -> None:
        delay = 0.1
        while not self.stopping.is_set():
            capacity = self.config.concurrency + self.prefetch()
            free = capacity - self.in_flight()
            if free <= 0:
                self._wake.wait(self.config.poll_interval)
                self._wake.clear()
                continue
            if free < capacity and free < self.config.concurrency:
                # Let a few more slots free up so one statement claims for all of them.
                self.stopping.wait(CLAIM_COALESCE_SECONDS)
                free = capacity - self.in_flight()
            self._wake.clear()
            began = time.monotonic()
            try:
                jobs, sent = self._claim(free)
                delay = 0.1
                self.pooled_calls.succeeded()
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
                self.pooled_calls.failed("claim", exc, began=began)
                self.stopping.wait(delay)
                delay = next_retry_delay(delay)
                continue
            if jobs:
                self._dispatch(jobs, sent)
            if len(jobs) < free:
                self._wake.wait(self.config.poll_interval)

    def _exhaustion_cause(self) -> str | None:
        """What holds the pool's connections, as far as the worker knows; None while one is free."""
        if not all_in_use(self.pool):
            return None
        with self._lock:
            overdue = len(self._overdue)
        return (
            f"all {self.pool.max_size} connections are checked out; {overdue} job(s) past their timeout "
            "are still running (a transactional handler keeps its connection until it returns)"
        )

    # -- shutdown ----------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop claiming and shut down gracefully."""
        self.stopping.set()
        self._wake.set()

    def _on_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT (on the signal watcher's thread): stop; a second one hands back in-flight jobs now."""
        if self.stopping.is_set():
            event(logging.WARNING, "second signal: handing back in-flight jobs now", signal=signum)
            self.config.shutdown_timeout = 0
        event(logging.INFO, "shutdown requested", signal=signal.Signals(signum).name)
        self.stop()

    def _shutdown(self) -> None:
        """Finish in-flight jobs within the timeout, then return the rest with leases held to the end.

        A handler still running when the timeout ends keeps running until the
        process exits, so its job goes back only once nothing but the
        heartbeat thread is left to stop, with a short grace before another
        worker may start it. Until then heartbeats keep every lease alive.
        """
        deadline = time.monotonic() + self.config.shutdown_timeout
        # Nothing but heartbeats is needed from here on; these stop while in-flight jobs run on.
        if self.listener:
            self.listener.stop()
        # Within the shutdown timeout, however long a duty waits for a database that is down.
        self.maintenance.stop_duties(max(deadline - time.monotonic(), 0.5))
        while self.in_flight() and time.monotonic() < deadline and self.config.shutdown_timeout > 0:
            time.sleep(0.02)
        self._check_timeouts()  # a job past its deadline has its timeout recorded, not its attempt refunded
        with self._lock:
            unfinished = list(self._running.values())
            overdue = list(self._overdue.values())
            self._running.clear()
            self._overdue.clear()
            for running in unfinished + [run for run, _ in overdue]:
                if running.slot is not None:
                    running.slot.abandoned.set()
                running.job._lease_lost.set()
                self._closing[running.job.id] = running.job.lease_token
        for _ in self._slots:
            self._inbox.put(None)
        writes_end = time.monotonic() + SHUTDOWN_WRITES_SECONDS

        def left() -> float:
            """What is left of the writes' shared time: each wait for a connection ends with it."""
            return max(writes_end - time.monotonic(), 0.1)

        handed_back = 0
        never_started = [r for r in unfinished if r.slot is None]
        if never_started:
            handed_back += self._hand_back(never_started, left())
        self.completer.stop(left())  # writes the outcomes of the jobs that finished
        if overdue:
            self._record_overdue([decided for _, decided in overdue], left())
        try:
            with self.pool.connection(timeout=left()) as conn:
                conn.execute(sql("worker_stop"), {"id": self.id, "started_at": self.maintenance.registered_at})
        except (psycopg.Error, PoolTimeout) as exc:
            event(logging.WARNING, "could not record worker stop", error=str(exc))
        # The last write: from here to the process's exit must fit in the hand-back grace.
        still_running = [r for r in unfinished if r.slot is not None]
        if still_running:
            handed_back += self._hand_back(still_running, left())
        # Bounded too: a heartbeat connecting to a database that is down must not hold up the exit.
        self.maintenance.stop_heartbeats(1.0)
        self.pool.close(timeout=1.0)
        event(
            logging.INFO,
            "worker stopped",
            worker_id=self.id,
            succeeded=self.counters.succeeded,
            handed_back=handed_back,
            # Left claimed (the database did not answer, or another worker holds the job now):
            # the sweeper returns them when their leases expire.
            not_handed_back=len(unfinished) - handed_back,
            timed_out_still_running=len(overdue),
        )
        self.stopped.set()

    def _record_overdue(self, decided: list[Outcome], timeout: float) -> None:
        """Write the timeouts of handlers that never returned: the attempt counts.

        Handing them back would give the attempt back, and a handler that
        hangs every time would then never reach dead. Their retry waits at
        least the hand-back grace, like a handed-back job's.
        """
        for outcome in decided:
            outcome.delay = max(outcome.delay, HAND_BACK_GRACE_SECONDS)
        try:
            written = self.completer.write(decided, timeout=timeout)
        except (psycopg.Error, PoolTimeout) as exc:
            event(
                logging.ERROR,
                "timeouts not written; the sweeper will return these jobs when their leases expire",
                error=str(exc),
                job_ids=[o.job.id for o in decided],
            )
            return
        finally:
            self._release([o.job for o in decided])
        self._on_written(decided, written)

    def _hand_back(self, unfinished: list[Running], timeout: float) -> int:
        """Return unfinished jobs to the queue, fenced, with their attempt given back; how many went back.

        Until then their leases are in ``_closing``, which heartbeats renew.
        """
        rows: list[tuple[int]] = []
        jobs = [r.job for r in unfinished]
        # A job that never left the prefetch can run elsewhere at once; one whose thread still runs waits.
        delays = [0.0 if r.slot is None else HAND_BACK_GRACE_SECONDS for r in unfinished]
        try:
            with self.pool.connection(timeout=timeout) as conn:
                rows = conn.execute(
                    sql("job_hand_back_many"),
                    {"ids": [j.id for j in jobs], "tokens": [j.lease_token for j in jobs], "delays": delays},
                ).fetchall()
            event(logging.WARNING, "handed back unfinished jobs", job_ids=sorted(r[0] for r in rows))
        except (psycopg.Error, PoolTimeout) as exc:
            event(
                logging.ERROR,
                "hand-back failed; the sweeper will return these jobs when their leases expire",
                error=str(exc),
                job_ids=[j.id for j in jobs],
            )
        finally:
            self._release(jobs)
        return len(rows)

    def _release(self, jobs: list[Job]) -> None:
        """Stop renewing the leases of jobs whose shutdown write is done (or failed)."""
        with self._lock:
            for job in jobs:
                if self._closing.get(job.id) == job.lease_token:
                    del self._closing[job.id]
