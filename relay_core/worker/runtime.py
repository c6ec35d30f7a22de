"""The worker process: claim, run, complete, heartbeat, shut down gracefully.

Threads: the producer (the caller's thread) claims as many jobs as there are
free slots in one statement; ``concurrency`` slot threads run handlers; the
completer writes outcomes in batches; the heartbeat thread renews leases; the
lease watch (``lease_watch``) enforces timeouts and stops runs whose leases
ran out by the local clock; the maintenance thread sweeps, prunes and runs
cron; the listener turns NOTIFY into wake-ups. How a worker starts is
``startup``'s; how its last writes are bounded, ``shutdown``'s.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Mapping

import psycopg
from psycopg_pool import PoolTimeout

from ..connect_options import worker_application_name
from ..errors import ConfigurationError
from ..handlers import HandlerSpec
from ..job import Job
from ..logs import event
from ..outages import RETRYABLE, OutageLog, RepeatedWarning, answer_may_be_lost
from ..pools import all_in_use, make_pool
from ..queries import sql
from ..sessions import in_autocommit
from ..signals import ShutdownSignals
from ..stalls import SHORTEST_CUT_SECONDS, seconds_until
from . import executor, limits, periodic
from .aio import SlotLoop
from .claim import (
    HAND_BACK_UNHELD_LIMIT_SECONDS,
    PAYLOAD_BYTES,
    POOLED_CLAIM_ENDS_WITHIN_SECONDS,
    PREFETCH_BELOW_SECONDS,
    PREFETCH_PAYLOAD_BYTES,
    ClaimInFlight,
    claim_rows,
    hand_back_unheld,
    prefetch_per_slot,
)
from .completer import Completer
from .config import WorkerConfig
from .lease_watch import LeaseWatch
from .ledger import Ledger, Slot
from .listener import Listener
from .maintenance import Maintenance
from .outage import POOL_EXHAUSTED, PooledCallLog, next_retry_delay
from .outcome import Outcome
from .retention import prune_once
from .shutdown import SHUTDOWN_WRITES_SECONDS, WriteTime, hand_back, record_overdue, write_within
from .startup import register_worker, retry_until_stopped
from .tally import Counters
from .vacuum import vacuum_if_needed

#: How long the producer lets freed slots gather before claiming for them.
CLAIM_COALESCE_SECONDS = 0.002
#: At shutdown, the pause between tries to return the jobs of a claim whose answer was lost.
RETURN_UNHELD_RETRY_SECONDS = 0.1
#: How long a handler told to stop (its timeout passed, or its job was taken over) may run on
#: before it counts as stuck (see ``Worker.check_stuck``): a cancelled async handler, or a sync
#: one that checks ``job.lease_lost``, returns well within it.
STUCK_AFTER_SECONDS = 5.0
#: A registration that took longer than this waited for a database that was not answering.
STARTED_DURING_AN_OUTAGE_SECONDS = 1.0
#: At the end of a shutdown, how long the heartbeat and listener threads get to stop (together),
#: and each of the pool's threads (its three workers and its scheduler, joined one after another).
THREADS_STOP_SECONDS = 0.25
POOL_THREAD_STOP_SECONDS = 0.1
#: From the end of the in-flight wait, which cancels the async handlers still running, how long
#: their cleanup (a ``finally``, an ``except CancelledError``) may take before the worker stops
#: and its process exits: it runs beside the last writes, and only what is left of it once they
#: are done holds up the stop. Within the hand-back's grace: the job starts elsewhere only after it.
ASYNC_CLEANUP_SECONDS = 0.4
#: A worker stops at most this long after its shutdown timeout ends (counted from the stop),
#: however the database behaves: the shared time of the last writes, the least each step
#: (four before the in-flight wait, four after it) gets once that ran out, and the threads'
#: stop. The platform's drain window must hold this beyond the timeout, and a moment more for
#: the process's own exit: the docs promise 4 s.
SHUTDOWN_OVERRUN_SECONDS = (
    SHUTDOWN_WRITES_SECONDS
    + 8 * SHORTEST_CUT_SECONDS
    # What is left of the async handlers' cleanup once writes that had used up their time ran
    # their two least (the completer's and the hand-back's) beside it.
    + max(ASYNC_CLEANUP_SECONDS - 2 * SHORTEST_CUT_SECONDS, 0.0)
    + THREADS_STOP_SECONDS
    + 4 * POOL_THREAD_STOP_SECONDS
)
#: Jobs on their last attempt a worker holds per slot beyond those its slots run (see ``last_attempt_room``).
LAST_ATTEMPTS_AHEAD_PER_SLOT = 2


def require_handlers(handlers: Mapping[str, HandlerSpec]) -> None:
    """Refuse to run a worker process for an app that registered no handler.

    Every job it claimed would fail (HandlerNotFound), spending attempts
    until dead: the usual cause is a module of handlers never imported.
    Checked where a worker owns its process (``relay worker``,
    ``Relay.run_worker``); a ``Worker`` embedded elsewhere may run only the
    registry and maintenance.
    """
    if not handlers:
        raise ConfigurationError(
            "this worker has no handlers: register them with @relay.handler(...) on the Relay it runs "
            "(with `relay worker --app MODULE:ATTR`, in MODULE or a module it imports)"
        )


class Worker:
    """Runs the handlers of one Relay app until told to stop."""

    def __init__(self, dsn: str, handlers: Mapping[str, HandlerSpec], config: WorkerConfig | None = None) -> None:
        self.dsn = dsn
        self.handlers = dict(handlers)
        self.config = config or WorkerConfig()
        self.id = self.config.worker_id
        #: The app's registry, read again as the worker starts (see ``_run``).
        self._registry = handlers
        self.counters = Counters()
        self.stopping = threading.Event()
        self._stop_asked_at: float | None = None  # time.monotonic() of the first stop(): the drain window's start
        self._hurried_at: float | None = None  # time.monotonic() of a second signal: nothing more is waited for
        self.stopped = threading.Event()
        self._wake = threading.Event()
        #: When a claim failed on a broken connection (monotonic), None once its jobs were looked for:
        #: it may have committed, its jobs claimed under this worker's id unseen (see ``_return_unheld``).
        self._unanswered_claim_at: float | None = None
        #: A claim the database refused (a permission revoked, a table not made yet): said as an
        #: error at most once per REPEAT_SECONDS, with how often since; each try (about once a
        #: second) logged one, 3,600 an hour.
        self._claim_refused = RepeatedWarning("claim refused by the database; retrying", level=logging.ERROR)
        #: Handlers still running when shutdown ended (their jobs handed back or timed out):
        #: they stop only when the process exits, which must come within the hand-back grace.
        self.handlers_left_running = 0
        #: How many handlers ran on past their timeouts when that made the worker stop; 0 if it
        #: did not. ``relay worker`` then exits with STUCK_EXIT_STATUS, for its supervisor to restart it.
        self.stopped_for_stuck_handlers = 0
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        #: The slots whose threads still run (a stuck one's too), under ``_slots_lock``.
        self._slots: list[Slot] = []
        self._slots_lock = threading.Lock()
        #: Set once the shutdown has sent every slot its end (a None in the inbox): no slot starts after.
        self._slots_ended = False
        self._slot_numbers = itertools.count()
        #: Whether a signal asked for the stop: a second one hurries it (see ``_on_signal``).
        self._signalled = False
        #: Each slot thread's event loop for async handlers (see ``_await_async_cleanup``).
        self._slot_loops: list[SlotLoop] = []
        # Whether any job type has a limit: decides how the claim runs (see claim()).
        self.limits_exist = True
        self._next_limits_check = time.monotonic() + limits.REPUBLISH_CHECK_SECONDS  # the start published them
        #: Whether any handler has a schedule to check: decided as the worker starts (see ``_run``).
        self._checks_schedules = False
        # Moving average of handler run time; starts "long" so nothing is prefetched until jobs prove short.
        self._typical_run = PREFETCH_BELOW_SECONDS * 2
        # Bytes of payload text a claimed job typically carries: what the prefetch holds in memory.
        self._typical_payload = 0.0
        application_name = worker_application_name(self.id)
        self.pool = make_pool(
            dsn,
            name=f"relay-worker-{self.id}",
            min_size=2,
            max_size=self.config.concurrency + 4,
            timeout=10.0,
            application_name=application_name,
        )
        #: The claim running now, which a stop cancels (see ClaimInFlight).
        self._claim_in_flight = ClaimInFlight(cancellable=not self.pool.transaction_pooling)
        # One account of a database outage for all of this worker's threads; the calls
        # that wait for a pooled connection also tell a pool whose every connection
        # is checked out apart from it.
        self.outage = OutageLog()
        self.pooled_calls = PooledCallLog(self.outage, OutageLog(wording=POOL_EXHAUSTED), self._exhaustion_cause)
        self.completer = Completer(self.pool, self._on_written, self.pooled_calls)
        self.ledger = Ledger(self.completer)
        self.lease_watch = LeaseWatch(
            self.ledger,
            self.handlers,
            self.id,
            self._start_slot,
            self.stopped,
            self.check_stuck,
        )
        self.maintenance = Maintenance(
            self.pool,
            dsn=dsn,
            worker_id=self.id,
            lease_seconds=self.config.lease_seconds,
            heartbeat_interval=self.config.heartbeat_interval,
            sweep_interval=self.config.sweep_interval,
            held_leases=self.ledger.held_leases,
            on_lost=self._on_lost,
            on_cancel=self._on_cancel,
            on_renewed=self._on_renewed,
            on_limits=self._set_limits_exist,
            in_flight=self.ledger.in_flight,
            periodic=self._periodic_duties,
            prune=(lambda conn: prune_once(conn, self.config.retention)) if self.config.retention else None,
            vacuum=vacuum_if_needed if self.config.self_vacuum else None,
            outage=self.outage,
            pooled_calls=self.pooled_calls,
        )
        self.listener = (
            Listener(dsn, self.config.queues, self._wake.set, application_name=application_name)
            if self.config.listen
            else None
        )

    # -- bookkeeping -------------------------------------------------------

    def in_flight(self) -> int:
        """Jobs claimed and not yet finished: waiting for a slot or running in one."""
        return self.ledger.in_flight()

    def _on_written(self, batch: list[Outcome], written: dict[int, str]) -> None:
        self.ledger.written(batch)
        for outcome in batch:
            self.counters.tell(outcome, written.get(outcome.job.id))

    def _on_renewed(self, renewed: Mapping[int, int], sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) extended these leases (id -> token)."""
        self.ledger.renewed(renewed, sent + self.config.lease_seconds)

    def _on_lost(self, lost: Mapping[int, int]) -> None:
        """Flag the runs whose leases (id -> token) a heartbeat found taken over."""
        taken = self.ledger.lost(lost)
        if taken:
            event(logging.WARNING, "leases taken over by another worker", job_ids=sorted(taken))

    def _set_limits_exist(self, exist: bool) -> None:
        self.limits_exist = exist

    def _on_cancel(self, ids: set[int]) -> None:
        for job in self.ledger.cancel(ids):
            event(logging.INFO, "cancellation requested", job_id=job.id, type=job.type)

    def _periodic_duties(self, conn: psycopg.Connection) -> None:
        """Each second: enqueue due schedule ticks; every few seconds, take over limits nobody holds."""
        if self._checks_schedules:
            periodic.enqueue_due(
                conn,
                self.handlers.values(),
                running_since=self.maintenance.registered_at,
                queues=self.config.queues,
                worker_id=self.id,
            )
        now = time.monotonic()
        if now >= self._next_limits_check:
            self._next_limits_check = now + limits.REPUBLISH_CHECK_SECONDS
            limits.republish_unheld(conn, self.handlers.values(), self.id)

    def _report_progress(self, job: Job, progress: dict) -> bool:  # type: ignore[type-arg]
        """Write a report; it renews the job's lease as a heartbeat does (see job_set_progress).

        In autocommit, as the heartbeat (``Maintenance.heartbeat``): the report
        locks the job's row, and a worker frozen before a separate COMMIT kept
        it from the sweepers.

        A connection the server ended while it sat in the pool fails the report
        at once; it is sent once more, on another. A report the database cannot
        take says nothing of whose the job is: the answer is then the lease as
        this worker counts it (``job.lease_lost``), not False, which a handler
        reads as "stop, the job is no longer yours".

        A handler told to stop (``job.lease_lost``: past its timeout, or its
        lease ran out or was taken over) gets False and writes nothing: its
        attempt is decided, and a handler that reads the answer as "go on"
        ran on past its timeout, its reports renewing a lease it held only
        until it returned.
        """
        if job.lease_lost:
            return False
        params = {
            "id": job.id,
            "token": job.lease_token,
            "progress": json.dumps(progress),
            "lease_seconds": self.config.lease_seconds,
        }
        row = None
        for tries_left in (1, 0):
            try:
                with self.pool.connection() as conn, in_autocommit(conn):
                    sent = time.monotonic()
                    row = conn.execute(sql("job_set_progress"), params).fetchone()
                break
            except PoolTimeout:  # an OperationalError too: no connection came, none to try again
                return not job.lease_lost
            except RETRYABLE:
                if not tries_left:
                    return not job.lease_lost
        if row is None:
            return False
        self._on_renewed({job.id: job.lease_token}, sent)
        if row[1]:
            self._on_cancel({job.id})
        return True

    def _finish(self, slot: Slot, job: Job, outcome: Outcome) -> None:
        if self.ledger.finished(slot, job, outcome):
            self._typical_run = 0.9 * self._typical_run + 0.1 * outcome.duration
            self._wake.set()

    # -- slots -------------------------------------------------------------

    def _start_slot(self) -> None:
        slot = Slot(next(self._slot_numbers))
        with self._slots_lock:
            if self._slots_ended:
                return  # the shutdown has sent each slot its end: one started now would wait for good
            self._slots.append(slot)
        threading.Thread(target=self._slot_loop, args=(slot,), name=f"relay-slot-{slot.index}", daemon=True).start()

    def _slot_loop(self, slot: Slot) -> None:
        loop = SlotLoop()  # async handlers' event loop, this thread's alone
        with self._slots_lock:
            self._slot_loops.append(loop)
        try:
            while not slot.abandoned.is_set():
                job = self._inbox.get()
                if job is None:
                    return
                if not self._bind(slot, job):
                    continue  # handed back while it waited for a slot
                outcome = executor.run(job, self.handlers, self.pool, self.id, loop, self.config.lease_seconds)
                self._finish(slot, job, outcome)
        finally:
            try:
                loop.close()
            finally:
                # Gone with its thread: kept, every timeout of a long-lived worker left a slot and a loop
                # behind. Removed whatever closing the loop raised, or it would count as stuck for good.
                with self._slots_lock:
                    self._slots.remove(slot)
                    self._slot_loops.remove(loop)

    def stuck_handlers(self, now: float) -> int:
        """Handlers told to stop (past their timeouts, or their jobs taken over) over STUCK_AFTER_SECONDS
        before ``now`` (monotonic) whose threads still run them."""
        with self._slots_lock:
            return sum(
                1
                for slot in self._slots
                if slot.abandoned_at is not None and now - slot.abandoned_at > STUCK_AFTER_SECONDS
            )

    def check_stuck(self, now: float) -> None:
        """Stop once more handlers are stuck than ``max_stuck_handlers``, for the process to end with them.

        Python cannot stop a thread: each stuck handler keeps its thread, and
        its job's lease, for the life of the process, while a fresh slot takes
        its place. A handler that hangs on every job (a network call without a
        timeout of its own) grew the worker a thread a job and held every job
        it took. The stop records their timeouts, and the process that owns
        the worker exits (STUCK_EXIT_STATUS) for its supervisor to start it
        afresh. A handler that returns soon after it was told to stop (a
        cancelled async one, a sync one that checks ``job.lease_lost``) is not
        stuck.
        """
        limit = self.config.max_stuck_handlers
        if limit is None or self.stopping.is_set() or self.stopped_for_stuck_handlers:
            return
        stuck = self.stuck_handlers(now)
        if stuck <= limit:
            return
        self.stopped_for_stuck_handlers = stuck
        event(
            logging.ERROR,
            "too many handlers are stuck past their timeouts; stopping the worker, so that its process "
            "ends with their threads and their jobs are retried",
            stuck=stuck,
            max_stuck_handlers=limit,
        )
        # On a thread of its own: stop() cancels a claim in flight, a round trip, and the lease
        # watch calling this waits on nothing but the ledger's lock (see lease_watch).
        threading.Thread(target=self.stop, name="relay-stuck-stop", daemon=True).start()

    def _await_async_cleanup(self, end: float) -> None:
        """Wait until ``end`` (monotonic) for the async handlers the shutdown cancelled to end.

        Cancelled at their ``await`` as the in-flight wait ended, they run their
        cleanup; the process's exit right after the hand-back cut it off at its
        first await. A sync handler cannot be stopped and is not waited for; a
        second signal ends the wait.
        """
        while self._async_handler_running() and time.monotonic() < end and self._hurried_at is None:
            time.sleep(0.01)

    def _async_handler_running(self) -> bool:
        with self._slots_lock:
            return any(loop.running.is_set() for loop in self._slot_loops)

    def _bind(self, slot: Slot, job: Job) -> bool:
        """Mark ``job`` as running in ``slot``; its timeout starts now."""
        spec = self.handlers.get(job.type)
        return self.ledger.bind(slot, job, time.monotonic(), spec.timeout if spec else None)

    # -- the producer ------------------------------------------------------

    def claim(self, limit: int) -> list[Job]:
        """Claim up to ``limit`` jobs in one statement (THE CLAIM in queries.sql; see ``claim_rows``).

        ``limits_exist``, refreshed each second, decides whether the claim
        takes the limits lock first.
        """
        return self._claim(limit)[0]

    def _claim(self, limit: int) -> tuple[list[Job], float]:
        """:meth:`claim`, and when the claim was sent (monotonic): see ``claim_rows``."""
        params = {
            "queues": list(self.config.queues),
            "limit": limit,
            "worker_id": self.id,
            "lease_seconds": self.config.lease_seconds,
            "locked": self.limits_exist,
            "last_attempt_room": self.last_attempt_room(),
            "idle_slots": self.idle_slots(),
        }
        rows, sent = claim_rows(self.pool, params, self._claim_in_flight)
        if rows:
            claimed = sum(row.get(PAYLOAD_BYTES, 0) for row in rows) / len(rows)
            # Up at once with larger payloads, down by halves: the prefetch never holds a run of them unawares.
            self._typical_payload = max(claimed, (self._typical_payload + claimed) / 2)
        jobs = [Job.from_row(row) for row in rows]
        for job in jobs:
            job._report = self._report_progress
        return jobs, sent

    def last_attempt_room(self) -> int:
        """How many more jobs on their last attempt the claim may take (see THE CLAIM).

        Their attempts are charged at the claim, so if this process is killed
        outright, each one that has not started ends dead without having run.
        The idle slots take theirs at once; beyond them a worker holds at most
        LAST_ATTEMPTS_AHEAD_PER_SLOT per slot, against up to
        MAX_PREFETCH_PER_SLOT of jobs with attempts to spare.
        """
        ahead = self.config.concurrency * LAST_ATTEMPTS_AHEAD_PER_SLOT
        return max(self.idle_slots() + ahead - self.ledger.waiting_on_last_attempt(), 0)

    def idle_slots(self) -> int:
        """Slots with no job to run, not even one waiting: a job claimed for one starts at once.

        The claim gives only these the jobs of limited types (see THE CLAIM).
        """
        return max(self.config.concurrency - self.in_flight(), 0)

    def _dispatch(self, jobs: list[Job], sent: float | None = None) -> None:
        """Hand claimed jobs to the slots; ``sent`` is when the claim was sent (monotonic)."""
        lease_expires = (time.monotonic() if sent is None else sent) + self.config.lease_seconds
        replaced = self.ledger.claimed(jobs, lease_expires)
        for _ in range(replaced):
            self._start_slot()  # the earlier run's thread keeps its slot object; the worker gets a fresh one
        for job in jobs:
            self.counters.claimed += 1
            event(logging.INFO, "job claimed", job_id=job.id, type=job.type, attempt=job.attempt, queue=job.queue)
            self._inbox.put(job)

    def run(self, install_signals: bool = True) -> None:
        """Run until :meth:`stop` (or SIGTERM/SIGINT), then shut down gracefully.

        Handlers still running when the shutdown ends had their jobs handed
        back, to start elsewhere 2 s after the shutdown's last write: ``handlers_left_running``
        says how many. ``relay worker`` and :meth:`Relay.run_worker`, which own
        their process, then end it at once (:func:`exit_now`); a caller that
        goes on after ``run`` returns should do the same when that is not zero.

        Given ``max_stuck_handlers``, it also returns once more handlers than
        that are stuck past their timeouts (``stopped_for_stuck_handlers``
        says how many): ``relay worker`` and ``Relay.run_worker`` then exit
        with status 3, for their supervisor to start them again.
        """
        signals = ShutdownSignals(self._on_signal) if install_signals else None
        try:
            self._run()
        finally:
            if signals is not None:
                signals.close()

    def _run(self) -> None:
        # The handlers registered by now, not only by the worker's making: an app that builds its worker
        # first and imports its handler modules after had every job of their types fail as "no handler".
        self.handlers.update(self._registry)
        self._checks_schedules = any(spec.cron for spec in self.handlers.values())
        # Not open(wait=True): a worker started while the database is down (a deploy
        # during a failover) would give up after that wait and exit. Registration
        # retries instead, until the database answers or the worker is told to stop.
        self.pool.open()
        began = time.monotonic()
        try:
            retried = retry_until_stopped(self._register, self.stopping, self.dsn)
        except ConfigurationError:
            self.pool.close()
            raise
        if retried or time.monotonic() - began > STARTED_DURING_AN_OUTAGE_SECONDS:
            # Started while the database was down or recovering (its registration failed, or waited for
            # the pool to connect): how long it had been down is unknown, so this worker's sweeper gives
            # live workers the restart grace to renew their leases, as after a long outage of its own.
            self.outage.ended_long_one()
        if self.stopping.is_set() and self.maintenance.registered_at is None:
            self.pool.close()  # stopped before the database ever answered: nothing claimed, nothing to hand back
            self.stopped.set()
            # Its last line, as every stop has one: a log that ended at "database unreachable" read as a hang.
            event(
                logging.INFO,
                "worker stopped before it started: the database never answered, or never took writes",
                worker_id=self.id,
            )
            return
        for _ in range(self.config.concurrency):
            self._start_slot()
        self.completer.start()
        self.maintenance.start()
        threading.Thread(target=self.lease_watch.run, name="relay-lease-watch", daemon=True).start()
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
        self.limits_exist = register_worker(self.pool, self.maintenance, self.id, self.config, self.handlers.values())

    def prefetch(self) -> int:
        """How many jobs to hold beyond the slots: the next few, while jobs are short (``prefetch_per_slot``).

        At most PREFETCH_PAYLOAD_BYTES of typical payloads: held jobs keep
        theirs in memory. None for a slot busy with a job that has run longer
        than short jobs take: the typical run time learns of a long job only when it ends,
        and until then the jobs held for that slot would wait behind it
        (and the ones ``LeaseWatch.hand_back_held`` gave back would be claimed again).
        """
        per_slot = prefetch_per_slot(self._typical_run)
        if not per_slot:
            return 0
        long_runs = self.ledger.long_runs(time.monotonic(), PREFETCH_BELOW_SECONDS)
        by_run_time = per_slot * max(self.config.concurrency - long_runs, 0)
        return min(by_run_time, int(PREFETCH_PAYLOAD_BYTES // max(self._typical_payload, 1.0)))

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
                if self._unanswered_claim_at is not None:
                    self._return_unheld()
                    self._unanswered_claim_at = None
                jobs, sent = self._claim(free)
                delay = 0.1
                self.pooled_calls.succeeded()
            except RETRYABLE as exc:
                if isinstance(exc, psycopg.errors.QueryCanceled) and self.stopping.is_set():
                    break  # the stop cancelled a claim the database held up: it claimed nothing
                # No connection, a refusal or a cancel claimed nothing; any other break may have lost
                # a committed claim's answer.
                if answer_may_be_lost(exc):
                    self._unanswered_claim_at = time.monotonic()
                self.pooled_calls.failed("claim", exc, began=began)
                self.stopping.wait(delay)
                delay = next_retry_delay(delay)
                continue
            except psycopg.Error as exc:
                # Refused, not cut off (a permission revoked, a table a migration has not made yet):
                # the statement claimed nothing. Say so and try again, rather than
                # stop the worker with every job it holds.
                self._claim_refused.happened(error=str(exc))
                self.stopping.wait(delay)
                delay = next_retry_delay(delay)
                continue
            if jobs:
                self._dispatch(jobs, sent)
            if len(jobs) < free:
                self._wake.wait(self.config.poll_interval)

    def _return_unheld(self, seconds: float = HAND_BACK_UNHELD_LIMIT_SECONDS) -> None:
        """Return the jobs a claim took whose answer was lost, when no other process can hold them.

        A worker id given in the settings may be another process's too (one
        starting while the other drains), and the jobs it holds must not be
        returned; those wait for the sweeper, their attempt spent.
        """
        if not self.config.owns_worker_id:
            return
        self._wait_out_unanswered_claim()
        returned = hand_back_unheld(self.pool, self.id, self.ledger.held_leases(), seconds)
        if returned:
            event(logging.WARNING, "returned jobs a claim took whose answer was lost", job_ids=sorted(returned))

    def _record_schedules_stopped(self, seconds: float) -> None:
        """Tell the registry this worker checks its schedules no more, though it drains for a while yet.

        Without it a tick that fell due during the drain counted as seen by
        this worker, and the next one to start enqueued it late, catch_up or
        not. If the write fails, that is what happens.
        """
        try:
            with write_within(self.pool, seconds) as conn:
                conn.execute(
                    sql("worker_schedules_stop"), {"id": self.id, "started_at": self.maintenance.registered_at}
                )
        except (psycopg.Error, PoolTimeout) as exc:
            event(logging.WARNING, "could not record that schedule checks stopped", error=str(exc))

    def _wait_out_unanswered_claim(self) -> None:
        """Behind a transaction pooler, wait until the claim whose answer was lost has surely ended on the server.

        No cancel was sent there, and a cut connection does not end a statement
        on the server: the claim may still run (waiting for a lock) and commit
        after the return of its jobs found none. Its own time limit ends it
        first (see ``claim.POOLED_CLAIM_STATEMENT_SECONDS``).
        """
        if self.pool.transaction_pooling and self._unanswered_claim_at is not None:
            time.sleep(seconds_until(self._unanswered_claim_at + POOLED_CLAIM_ENDS_WITHIN_SECONDS))

    def _return_unheld_while_stopping(self, seconds: float) -> None:
        """``_return_unheld``, tried again for up to ``seconds``: the connection the claim's answer
        was lost on is seldom the only pooled one that broke, and the pool hands out one returned
        within the last second unchecked. Its time counts from when that claim has surely ended."""
        self._wait_out_unanswered_claim()
        end = time.monotonic() + seconds
        while True:
            try:
                self._return_unheld(seconds_until(end))
                return
            except (psycopg.Error, PoolTimeout) as exc:
                if time.monotonic() + RETURN_UNHELD_RETRY_SECONDS >= end:
                    event(
                        logging.WARNING,
                        "could not return jobs a claim took whose answer was lost; "
                        "the sweeper returns them when their leases expire",
                        error=str(exc),
                    )
                    return
                time.sleep(RETURN_UNHELD_RETRY_SECONDS)

    def _exhaustion_cause(self) -> str | None:
        """What holds the pool's connections, as far as the worker knows; None while one is free."""
        if not all_in_use(self.pool):
            return None
        overdue = self.ledger.overdue_count()
        return (
            f"all {self.pool.max_size} connections are checked out; {overdue} job(s) past their timeout "
            "are still running (a transactional handler keeps its connection until it returns)"
        )

    # -- shutdown ----------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop claiming and shut down gracefully.

        A claim the database holds up (a lock on the jobs table, a connection
        that stopped forwarding) is cancelled, so the shutdown and its drain
        window begin now rather than when the database lets the claim finish.
        """
        if self._stop_asked_at is None:
            self._stop_asked_at = time.monotonic()
        self.stopping.set()
        self._wake.set()
        self._claim_in_flight.cancel()

    def _on_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT (on the signal watcher's thread): stop; a second one hands back in-flight jobs now."""
        # Second to a signal, not to a stop of the worker's own (check_stuck), which a platform's
        # SIGTERM then joins: that one still gives in-flight jobs their shutdown timeout.
        if self._signalled:
            event(logging.WARNING, "second signal: handing back in-flight jobs now", signal=signum)
            self._hurried_at = time.monotonic()
        self._signalled = True
        event(logging.INFO, "shutdown requested", signal=signal.Signals(signum).name)
        self.stop()

    def _shutdown(self) -> None:
        """Finish in-flight jobs within the timeout, then return the rest with leases held to the end.

        A handler still running when the timeout ends keeps running until the
        process exits, so its job goes back among the last writes, with a
        grace before another worker may start it that outlasts everything
        after them (an async handler's cleanup, the registry's stop, the
        threads' stop). Until then heartbeats keep every lease alive.

        However long the database takes, the worker stops within the timeout
        and ``SHUTDOWN_OVERRUN_SECONDS``: the platform's SIGKILL
        comes then, and a write still waiting would be lost with the process
        anyway (the sweeper returns what was not written).
        """
        # From the stop, not from here: a claim the database held up took some of the window.
        # A second signal before this point leaves running jobs no time at all.
        timeout = 0.0 if self._hurried_at is not None else self.config.shutdown_timeout
        deadline = (self._stop_asked_at or time.monotonic()) + timeout

        def final() -> float:
            """When the last write ends: the writes' time after the deadline, or after a second signal."""
            hurried_at = self._hurried_at
            return (deadline if hurried_at is None else min(deadline, hurried_at)) + SHUTDOWN_WRITES_SECONDS

        def before_deadline() -> float:
            """The time of a step ahead of the in-flight wait: within the deadline, if it can be."""
            return min(max(deadline - time.monotonic(), 1.0), SHUTDOWN_WRITES_SECONDS, seconds_until(final()))

        # Nothing but heartbeats is needed from here on; these stop while in-flight jobs run on.
        # Not waited for until the end: one whose database stopped answering would hold up
        # the shutdown for nothing.
        if self.listener:
            self.listener.stop(timeout=0)
        # Before waiting for a duty in progress (a long prune, a vacuum): no check comes after it.
        if self._checks_schedules:
            self._record_schedules_stopped(before_deadline())
        # Jobs waiting for a slot go back first: another worker can run them now, while this
        # one waits for its running jobs, and a SIGKILL at the end of that wait would spend
        # their attempts.
        unstarted = self.ledger.close_unstarted()
        handed_back_first = 0
        if unstarted:
            handed_back_first = hand_back(self.pool, self.ledger, unstarted, before_deadline())
        # Within the shutdown timeout, however long a duty waits for a database that is down,
        # and no longer once a second signal asks for the hand-back now.
        self.maintenance.stop_duties(0)
        duties_end = min(max(deadline, time.monotonic() + 0.5), final())
        while self.maintenance.duties_running() and time.monotonic() < duties_end and self._hurried_at is None:
            time.sleep(0.02)
        if self._unanswered_claim_at is not None:
            # A stop between a lost claim answer and the next claim: nothing else would return
            # those jobs before their leases ran out, and the sweeper would spend their attempt.
            self._return_unheld_while_stopping(before_deadline())
        while self.in_flight() and time.monotonic() < deadline and self._hurried_at is None:
            time.sleep(0.02)
        self.lease_watch.check_timeouts()  # a job past its deadline has its timeout recorded, not its attempt refunded
        unfinished, overdue = self.ledger.close()  # tells their handlers to stop: async ones are cancelled
        cleanup_end = time.monotonic() + ASYNC_CLEANUP_SECONDS
        with self._slots_lock:
            self._slots_ended = True
            slots = len(self._slots)
        for _ in range(slots):
            self._inbox.put(None)
        # The writes share what is left of their time; whatever came before took some of it
        # only when the database held it up, and then these cannot be written either.
        writes = WriteTime(
            min(time.monotonic() + SHUTDOWN_WRITES_SECONDS, final()), 2 + bool(overdue) + bool(unfinished)
        )

        handed_back = handed_back_first
        self.completer.stop(writes.next())  # writes the outcomes of the jobs that finished
        if overdue:
            overdue_decided = [d for _, d in overdue]
            record_overdue(self.completer, self.ledger, overdue_decided, writes.next(), writes.left(), self._on_written)
        # Every unfinished job had started (the unstarted ones went back first, and nothing was
        # claimed since). Handed back before the registry's stop, which only tells "stopped" from,
        # 60 s on, "gone": that write, held by a lock on its table, took the hand-back's time, and the
        # jobs stayed claimed with their attempts spent. A job whose handler still runs may start
        # elsewhere only once the writes after its hand-back are done and the process is gone.
        self.handlers_left_running = len(unfinished) + len(overdue)
        if unfinished:
            handed_back += hand_back(self.pool, self.ledger, unfinished, writes.next(), writes.left())
            self._await_async_cleanup(cleanup_end)
        try:
            with write_within(self.pool, writes.next()) as conn:
                conn.execute(sql("worker_stop"), {"id": self.id, "started_at": self.maintenance.registered_at})
        except (psycopg.Error, PoolTimeout) as exc:
            event(logging.WARNING, "could not record worker stop", error=str(exc))
        # Bounded too: a heartbeat connecting to a database that is down must not hold up the
        # exit. The listener, told to stop at the start, has ended by now unless its database stalled.
        threads_end = time.monotonic() + THREADS_STOP_SECONDS
        self.maintenance.stop_heartbeats(THREADS_STOP_SECONDS)
        if self.listener:
            self.listener.stop(timeout=max(threads_end - time.monotonic(), 0.0))
        # The pool's threads are joined one by one: those reconnecting to a database that stopped
        # answering would each take the whole wait.
        self.pool.close(timeout=POOL_THREAD_STOP_SECONDS)
        event(
            logging.INFO,
            "worker stopped",
            worker_id=self.id,
            succeeded=self.counters.succeeded,
            handed_back=handed_back,
            # Left claimed (the database did not answer, or another worker holds the job now):
            # the sweeper returns them when their leases expire.
            not_handed_back=len(unstarted) + len(unfinished) - handed_back,
            timed_out_still_running=len(overdue),
        )
        self.stopped.set()
