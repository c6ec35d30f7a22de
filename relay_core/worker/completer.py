"""Writes finished runs in batches, fenced by lease token.

Outcomes queue up while a write is in flight, so under load each statement
records many jobs (group commit); when idle, an outcome is written at once.
A write that fails on a broken connection keeps its batch and retries after a
backoff: the statements are fenced, so a retry can never record a job twice.
A job whose row another session holds locked is skipped, not waited for: its
outcome is held back and written again soon after (LOCKED_RETRY_FIRST_SECONDS,
doubling up to LOCKED_RETRY_MAX_SECONDS), while the rest of the worker's
outcomes go on being written. The worker's own heartbeat holds the rows it
renews for a moment, so a row found locked once is nothing to report; one
locked for over LOCKED_WARN_SECONDS is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg_pool import PoolTimeout

from ..logs import event
from ..outages import RETRYABLE, OutageLog, RepeatedWarning, answer_may_be_lost
from ..pools import RelayPool, outdated_plan
from ..queries import sql
from ..sessions import in_autocommit
from ..stalls import cut_at
from .one_message import run_as_one_message
from .outage import PooledCallLog, next_retry_delay
from .outcome import Kind, Outcome

#: Outcomes one completion statement records at most ...
MAX_BATCH = 1000
#: ... and the bytes of text they carry (results, error messages, tracebacks) past which a batch
#: takes no more. libpq keeps each connection's buffers at the size of the largest message it
#: sent or read, for as long as the connection lives: 1,000 failures with long tracebacks made a
#: statement of megabytes, and a worker whose jobs failed so held about 110 MB at concurrency 8.
MAX_BATCH_BYTES = 1 << 20
#: How long stop() gives the outcomes still queued, unless told otherwise.
STOP_GIVE_UP_SECONDS = 8.0
#: How long one write waits for a pooled connection before it counts as failed and is retried:
#: short, so a write retrying through an outage hears a stop within about this long.
CONNECTION_WAIT_SECONDS = 1.0
#: Of stop()'s time, what is kept for the answer of a write sent just before its give-up.
ANSWER_GRACE_SECONDS = 0.5
#: What a completion statement returns in place of a status for a job it skipped, its row being
#: locked by another session (an operator's SELECT ... FOR UPDATE, a long transaction): unwritten.
ROW_LOCKED = "locked"
#: How long the outcome of such a job first waits before it is written again, doubling while
#: the row stays locked ...
LOCKED_RETRY_FIRST_SECONDS = 0.01
#: ... up to this. Short: the lease of a job whose row is locked is not renewed (heartbeats
#: skip such rows too), and once a lock held past the lease is released, the first sweeper
#: to come takes the job; the write must come before it.
LOCKED_RETRY_MAX_SECONDS = 0.25
#: How long an outcome waits on a locked row before the worker says so.
LOCKED_WARN_SECONDS = 1.0


class Completer:
    """A thread that turns outcomes into fenced UPDATEs."""

    def __init__(
        self,
        pool: RelayPool,
        on_written: Callable[[list[Outcome], dict[int, str]], None],
        outage: OutageLog | PooledCallLog | None = None,
    ) -> None:
        self._pool = pool
        self._on_written = on_written
        self._outage = outage or OutageLog()
        self._inbox: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="relay-completer", daemon=True)
        self._stopped = threading.Event()
        # Set by stop(): when writes that keep failing are given up, and the wake from a retry's backoff.
        self._give_up_at: float | None = None
        self._stopping = threading.Event()
        self._writing: list[Outcome] = []  # the batch being written now, for stop() to name
        # Outcomes whose rows another session held locked, when they are written again (monotonic),
        # and the wait before that.
        self._held: list[Outcome] = []
        self._held_until = 0.0
        self._held_wait = LOCKED_RETRY_FIRST_SECONDS
        # Once past the give-up: how many of the outcomes then held back are still to have their last try.
        self._last_tries: int | None = None
        self._held_warning = RepeatedWarning(
            "job rows locked by another session; their outcomes are written once the lock is released"
        )

    def start(self) -> None:
        """Start writing."""
        self._thread.start()

    def put(self, outcome: Outcome) -> None:
        """Queue one outcome for writing."""
        self._inbox.put(outcome)

    def stop(self, timeout: float = STOP_GIVE_UP_SECONDS) -> None:
        """Write everything queued so far, then stop; return within ``timeout`` s, written or not.

        A batch already retrying through an outage is given up before then:
        the worker's drain window is not the place to wait for the database
        (the leases of what was not written expire, and the sweeper returns
        those jobs).
        """
        # A write in flight waits no longer than the give-up for a connection; what is left is for its answer.
        self._give_up_at = time.monotonic() + max(timeout - ANSWER_GRACE_SECONDS, timeout / 2)
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            # A write sent on a connection that stopped answering: no statement of Relay's has a
            # time limit there, so it may never come back. Its jobs, and those queued behind it,
            # stay claimed unless it lands; say which, as a write given up says.
            unwritten = list(self._writing) + list(self._held)
            behind: list[Outcome | None] = []
            while True:
                try:
                    behind.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in behind:  # still the thread's to write, should its write come back
                self._inbox.put(item)
            unwritten += [item for item in behind if item is not None]
            event(
                logging.ERROR,
                "completion still unanswered when the worker stopped; unless it lands, "
                "the sweeper will return these jobs",
                job_ids=sorted(o.job.id for o in unwritten),
            )

    def _loop(self) -> None:
        stopping = False
        while True:
            batch, asked_to_stop = self._take_batch(self._wait_seconds(stopping))
            stopping = stopping or asked_to_stop
            if batch:
                self._write_until_done(batch)
            elif stopping and not self._held:
                break  # everything queued before and after stop()'s marker is written
            elif stopping and self._last_tries == 0 and (self._time_left() or 0.0) <= 0:
                event(
                    logging.ERROR,
                    "completion not written before the worker stopped: job rows locked by another session; "
                    "the sweeper will return these jobs",
                    job_ids=sorted(o.job.id for o in self._held),
                )
                break
        self._stopped.set()

    def _wait_seconds(self, stopping: bool) -> float | None:
        """How long the next batch waits for a first outcome (None: until one comes).

        Not past the time held-back outcomes are due, nor, once stopping, at all
        (or, with outcomes still held back, past the give-up deadline).
        """
        if not self._held:
            return 0.0 if stopping else None
        wait = max(self._held_due_at() - time.monotonic(), 0.0)
        left = self._time_left()
        return wait if left is None else max(min(wait, left), 0.0)

    def _held_due_at(self) -> float:
        """When the held-back outcomes go again (monotonic): at their retry, or, once stopping, at the
        give-up if that comes first, for a last try before they are given up."""
        give_up_at = self._give_up_at
        if give_up_at is None or self._last_tries == 0:
            return self._held_until
        return min(self._held_until, give_up_at)

    def _take_batch(self, wait: float | None) -> tuple[list[Outcome], bool]:
        """The next batch: held-back outcomes now due, the first outcome queued (waited for ``wait``
        seconds, None: until one comes), then whatever else is queued, up to MAX_BATCH outcomes or
        MAX_BATCH_BYTES of text; and whether stop()'s marker was taken."""
        batch: list[Outcome] = []
        size = 0
        now = time.monotonic()
        if self._held and now >= self._held_due_at():
            taken = 0
            while taken < len(self._held) and len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES:
                batch.append(self._held[taken])
                size += self._held[taken].text_bytes()
                taken += 1
            give_up_at = self._give_up_at
            if give_up_at is not None and now >= give_up_at:
                # The last tries: of every outcome held at the give-up, batch by batch (those held
                # again go to the back, behind the ones still to be tried).
                left = len(self._held) if self._last_tries is None else self._last_tries
                self._last_tries = max(left - taken, 0)
            del self._held[:taken]  # what the limits left stays held, due at once (unless these are held again)
        stopping = False
        while len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES:
            try:
                first = not batch and not stopping and wait != 0
                item = self._inbox.get(timeout=wait) if first else self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stopping = True
            else:
                batch.append(item)
                size += item.text_bytes()
        return batch, stopping

    def _time_left(self) -> float | None:
        """Seconds to the give-up deadline once stopping (None: no deadline, keep retrying)."""
        give_up_at = self._give_up_at
        return None if give_up_at is None else give_up_at - time.monotonic()

    def _write_until_done(self, batch: list[Outcome]) -> None:
        self._writing = batch
        try:
            self._write_batch(batch)
        finally:
            self._writing = []

    def _write_batch(self, batch: list[Outcome]) -> None:
        delay = 0.1
        answer_lost = False  # a write failed once it was sent: it may have committed
        sent_again = False  # once already, after a schema change outdated its prepared statement
        while True:
            left = self._time_left()
            began = time.monotonic()
            try:
                wait = CONNECTION_WAIT_SECONDS if left is None else min(max(left, 0.1), CONNECTION_WAIT_SECONDS)
                written = self.write(batch, timeout=wait)
            except RETRYABLE as exc:
                answer_lost = answer_lost or answer_may_be_lost(exc)
                left = self._time_left()
                if left is not None and left <= 0:
                    event(
                        logging.ERROR,
                        "completion not written before the worker stopped; the sweeper will return these jobs",
                        error=str(exc),
                        job_ids=sorted(o.job.id for o in batch),
                    )
                    return
                self._outage.failed("completion write", exc, began=began)
                pause = delay if left is None else min(delay, left)
                if self._stopping.is_set():
                    time.sleep(pause)  # stop() woke the wait already: a refusal that comes at once must not spin
                else:
                    self._stopping.wait(pause)  # woken by stop(), which sets the give-up
                delay = next_retry_delay(delay)
                continue
            except Exception as exc:
                if outdated_plan(exc) and not sent_again:
                    # A retyped column outdated the prepared statement: it ran nothing, and the pool
                    # replaces every connection that prepared it (see RelayPool.connection), so the
                    # write goes once more on a fresh one, as an enqueue does (_run_on_fresh_connection).
                    sent_again = True
                    continue
                # Not an outage (a refusal by the database, or a value that cannot be
                # sent): one bad outcome must not block the others or stop this thread.
                if len(batch) > 1:
                    for outcome in batch:
                        self._write_batch([outcome])
                    return
                job = batch[0].job
                event(
                    logging.ERROR,
                    "completion refused by the database; the lease will expire and the job rerun",
                    job_id=job.id,
                    type=job.type,
                    error=str(exc),
                )
                self._tell(batch, {})
                return
            self._outage.succeeded()
            if answer_lost:
                written = self._with_own_successes(batch, written)
            self._tell(self._hold_locked(batch, written), written)
            return

    def _hold_locked(self, batch: list[Outcome], written: dict[int, str]) -> list[Outcome]:
        """Hold back the outcomes whose rows were locked, to be written again; the rest of ``batch``."""
        done, locked = split_locked(batch, written)
        if not locked:
            return done
        now = time.monotonic()
        again = any(o.locked_since is not None for o in locked)
        for outcome in locked:
            if outcome.locked_since is None:
                outcome.locked_since = now
        if not self._held or self._held_until <= now:
            # A new wait, also when the limits left some held outcomes due: were these held again
            # behind them with no wait, the held ones would go round at once, one full batch after
            # another, and the outcomes queued meanwhile would wait for the lock to end.
            longer = min(self._held_wait * 2, LOCKED_RETRY_MAX_SECONDS)
            self._held_wait = longer if again else LOCKED_RETRY_FIRST_SECONDS
            self._held_until = now + self._held_wait
        self._held += locked
        long_held = [o.job.id for o in locked if now - (o.locked_since or now) >= LOCKED_WARN_SECONDS]
        if long_held:
            self._held_warning.happened(job_ids=sorted(long_held))
        return done

    def write_through_locks(self, batch: list[Outcome], timeout: float) -> dict[int, str]:
        """``write`` within ``timeout`` s, the whole write bounded, writing again the outcomes whose
        rows were locked while time is left; those still locked at the end stay ROW_LOCKED.

        For a write that must end by a deadline (a shutdown's), with no later
        flush to carry its held outcomes to: a row held only for a moment (the
        worker's own heartbeat renewing it) is written all the same.
        """
        end = time.monotonic() + timeout
        written = self.write(batch, timeout=timeout, bounded=True)
        wait = LOCKED_RETRY_FIRST_SECONDS
        while True:
            _done, locked = split_locked(batch, written)
            if not locked or end - time.monotonic() <= wait:
                return written
            time.sleep(wait)
            wait = min(wait * 2, LOCKED_RETRY_MAX_SECONDS)
            try:
                again = self.write(locked, timeout=end - time.monotonic(), bounded=True)
            except RETRYABLE as exc:  # fenced: tried again while time is left
                event(logging.WARNING, "could not write again the outcomes of locked job rows", error=str(exc))
                continue
            except psycopg.Error as exc:  # refused: what the first write wrote stands
                event(logging.ERROR, "the outcomes of locked job rows were refused", error=str(exc))
                return written
            for outcome in locked:  # not in the answer: no longer this worker's (its locker took it)
                written.pop(outcome.job.id, None)
            written.update(again)

    def _with_own_successes(self, batch: list[Outcome], written: dict[int, str]) -> dict[int, str]:
        """``written`` with the successes an earlier try wrote before its answer was lost.

        The retry of such a write finds those jobs no longer claimed and
        writes nothing for them, which reads as a lease taken over: a job that
        succeeded would be logged and counted as lost. A success is read back
        by its lease token; other outcomes cannot be told from what a sweeper
        writes after a lease runs out, and stay as the retry found them.
        """
        unseen = [o for o in batch if o.kind is Kind.SUCCEEDED and o.job.id not in written]
        if not unseen:
            return written
        params = {"ids": [o.job.id for o in unseen], "tokens": [o.job.lease_token for o in unseen]}
        try:
            with self._pool.connection(timeout=CONNECTION_WAIT_SECONDS) as conn:
                found = dict(conn.execute(sql("job_succeeded_with_tokens"), params).fetchall())
        except (psycopg.Error, PoolTimeout) as exc:
            event(logging.WARNING, "could not read back successes whose completion answer was lost", error=str(exc))
            return written
        if found:
            event(logging.INFO, "completion answer lost; its successes were written", job_ids=sorted(found))
        return {**written, **found}

    def _tell(self, batch: list[Outcome], written: dict[int, str]) -> None:
        """Hand the result to the worker; a failure there must not stop this thread's writes."""
        try:
            self._on_written(batch, written)
        except Exception as exc:  # the thread outlives any bookkeeping bug
            event(logging.ERROR, "bookkeeping after a completion write failed", error=repr(exc), jobs=len(batch))

    def write(self, batch: list[Outcome], timeout: float | None = None, bounded: bool = False) -> dict[int, str]:
        """Record a batch in one statement per outcome kind.

        Returns the status written for each job that was still this worker's:
        not always the outcome's own (a failure of a job an admin asked to
        cancel ends it cancelled), and ROW_LOCKED, unwritten, for one whose row
        another session holds locked. ``timeout`` bounds the wait for a pooled
        connection (the pool's own timeout if None); ``bounded``, the whole
        write: a database that stops answering has its connection cut then.
        """
        written: dict[int, str] = {o.job.id: "succeeded" for o in batch if o.kind is Kind.COMMITTED}
        statements = [(name, params) for name, params in _statements(batch) if params["ids"]]
        if not statements:
            return written
        end = None if timeout is None or not bounded else time.monotonic() + timeout
        with self._pool.connection(timeout=timeout) as conn, cut_at(conn, end):
            if len(statements) == 1:
                # The usual batch (all successes) is one statement: autocommit, one round trip.
                name, params = statements[0]
                with in_autocommit(conn):
                    written.update(conn.execute(sql(name), params, prepare=True).fetchall())
                return written
            # BEGIN, the statements and COMMIT as one message: one round trip per batch, and a
            # worker frozen meanwhile leaves no transaction holding its jobs' rows locked.
            for rows in run_as_one_message(conn, statements, prepared=not self._pool.transaction_pooling):
                written.update(rows)
        return written


def split_locked(batch: list[Outcome], written: dict[int, str]) -> tuple[list[Outcome], list[Outcome]]:
    """``batch`` as the outcomes ``write`` wrote (or found no longer the worker's) and those it left
    unwritten on rows another session held locked (ROW_LOCKED)."""
    if ROW_LOCKED not in written.values():
        return batch, []
    done: list[Outcome] = []
    locked: list[Outcome] = []
    for outcome in batch:
        (locked if written.get(outcome.job.id) == ROW_LOCKED else done).append(outcome)
    return done, locked


def _fenced(outcomes: list[Outcome], **columns: list[object]) -> dict[str, list[object]]:
    """Parameters of a fenced *_many statement: ids, lease tokens and per-job columns."""
    return {"ids": [o.job.id for o in outcomes], "tokens": [o.job.lease_token for o in outcomes], **columns}


def _statements(batch: list[Outcome]) -> list[tuple[str, dict[str, list[object]]]]:
    """The fenced statement (and its parameters) for each kind of outcome in ``batch``."""
    succeeded = [o for o in batch if o.kind is Kind.SUCCEEDED]
    failed = [o for o in batch if o.kind in (Kind.RETRY, Kind.DEAD)]
    snoozed = [o for o in batch if o.kind is Kind.SNOOZED]
    cancelled = [o for o in batch if o.kind is Kind.CANCELLED]
    return [
        ("job_succeed_many", _fenced(succeeded, results=[o.result for o in succeeded])),
        (
            "job_fail_many",
            _fenced(
                failed,
                next_statuses=["dead" if o.kind is Kind.DEAD else "queued" for o in failed],
                delays=[o.delay for o in failed],
                runs_on=[o.runs_on for o in failed],
                messages=[o.message for o in failed],
                errors=[o.error_json() for o in failed],
            ),
        ),
        ("job_snooze_many", _fenced(snoozed, delays=[o.delay for o in snoozed])),
        ("job_cancel_running_many", _fenced(cancelled, unstarted=[not o.handler_started for o in cancelled])),
    ]
