"""Runs one claimed job and decides its outcome.

Non-transactional handlers run outside any database transaction; their
outcome goes to the completer. A handler that returns an awaitable (an
``async def``, a partial of one, an object with an async ``__call__``) is
awaited to its end on the slot's own event loop before its outcome counts.
Transactional handlers run inside the transaction that also records their
success, guarded by the lease token, so their database work commits exactly
when the success does.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

from ..backoff import DEFAULT_BACKOFF, as_delay, retry_delay
from ..connect_options import without_user_timeout
from ..errors import (
    HandlerNotFound,
    JobCancelled,
    LeaseLost,
    PermanentFailure,
    RelayError,
    Snooze,
    SuccessNotRecorded,
)
from ..handlers import HandlerSpec
from ..job import Job
from ..jsonb import UnreadableJson
from ..logs import event
from ..names import shown, type_name
from ..queries import sql
from ..sessions import handler_settings_end_with_transaction, in_autocommit, reset_session
from .aio import SlotLoop
from .ledger import NOT_BEGUN
from .outcome import Kind, Outcome, describe, result_json


def run(
    job: Job,
    handlers: Mapping[str, HandlerSpec],
    pool: ConnectionPool,
    worker_id: str,
    loop: SlotLoop,
    lease_seconds: float,
) -> Outcome:
    """Run ``job``'s handler (awaiting it on ``loop`` if it is async) and classify how it ended; never raises."""
    started = time.monotonic()
    worker_pid = os.getpid()
    spec = handlers.get(job.type)
    try:
        if job.cancel_requested:
            # Cancelled while it waited in this worker for a slot (claimed, so the cancel could
            # only ask): it ends cancelled without starting, as a handler checking first would.
            unstarted = JobCancelled(f"job {job.id} was cancelled before its handler started")
            outcome = _ended_by(unstarted, job, spec, worker_id, time.monotonic() - started)
            outcome.handler_started = False
            return outcome
        if isinstance(job.payload, UnreadableJson):
            # Written with SQL by another program: no attempt can read it, so none is spent retrying.
            raise PermanentFailure(f"the payload of job {job.id} cannot be read: {job.payload.reason}")
        if spec is None:
            registered = ", ".join(sorted(handlers)) or "none"
            raise HandlerNotFound(
                f"no handler for job type {job.type!r} on worker {worker_id} (registered: {registered})"
            )
        if spec.transactional:
            try:
                _run_transactional(job, spec, pool, lease_seconds)
            except _NotBegun as not_begun:
                event(logging.WARNING, "transaction not begun; job handed back", job_id=job.id, error=str(not_begun))
                took = time.monotonic() - started
                return Outcome(job, Kind.SNOOZED, took, message=NOT_BEGUN, handler_started=False)
            return Outcome(job, Kind.COMMITTED, time.monotonic() - started)
        value = spec.func(job)
        if inspect.isawaitable(value):
            value = loop.run(job, value)
            if inspect.isawaitable(value) or inspect.isgenerator(value) or inspect.isasyncgen(value):
                _discard(value)
                raise PermanentFailure(
                    f"the handler of {job.type!r} returned a {type_name(value)} from its await, so its "
                    "work never ran: await it in the handler (a missing `await`?) and return the result"
                )
        elif inspect.isgenerator(value) or inspect.isasyncgen(value):
            _discard(value)
            raise PermanentFailure(
                f"the handler of {job.type!r} returned a generator, so none of its body ran: "
                "make it return its result instead of yielding"
            )
        if job.lease_lost:
            # Told to stop (its lease ran out unrenewed or was taken over): a handler
            # that stops early returns as if it had finished, so no return is a success.
            raise LeaseLost(
                f"job {job.id} was told to stop (its lease ran out or was taken over); its run is not a success"
            )
        if os.getpid() != worker_pid:
            os._exit(0)  # a forked child whose handler returned: see below
        return Outcome(job, Kind.SUCCEEDED, time.monotonic() - started, result=result_json(value))
    except BaseException as exc:
        if os.getpid() != worker_pid:
            # A handler forked and the child got here (it raised, or called sys.exit): it must not
            # go on serving the slot beside its parent, holding the worker's connections.
            os._exit(exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1)
        return _ended_by(exc, job, spec, worker_id, time.monotonic() - started)


def _ended_by(exc: BaseException, job: Job, spec: HandlerSpec | None, worker_id: str, took: float) -> Outcome:
    """The outcome of a run that raised ``exc``; never raises.

    A snooze, a cancel, a permanent failure, a failed attempt to retry after the
    handler's backoff. Classifying runs code of the handler's (its backoff, its
    exception's text): if that raises, the attempt still ends, failed, saying so.
    """
    try:
        if isinstance(exc, Snooze):
            seconds = getattr(exc, "seconds", None)
            delay = as_delay(seconds)
            if delay is not None:
                return Outcome(job, Kind.SNOOZED, took, delay=delay)
            exc = RelayError(f"{type_name(exc)} without a usable delay (seconds={shown(seconds)})")
        message, entry = describe(exc, job, worker_id)
        if isinstance(exc, JobCancelled) and job.cancel_requested:
            return Outcome(job, Kind.CANCELLED, took, message=message, error=entry)
        # Any other failure is recorded as one, also of a job asked to cancel (job_fail_many then
        # ends it cancelled, with this attempt's error in its history like every other), and a
        # JobCancelled no admin asked for (a handler's own, to give up): claimed -> cancelled is an
        # admin's stop, and ended so its message was lost. PermanentFailure gives up for good.
        if gives_up(exc) or job.attempt >= job.max_attempts:
            return Outcome(job, Kind.DEAD, took, message=message, error=entry)
        delay, problem = retry_delay(spec.backoff if spec else DEFAULT_BACKOFF, job.attempt)
        if problem:
            message = f"{message} ({problem})"
            entry["message"] = f"{entry.get('message')} ({problem})"
        return Outcome(job, Kind.RETRY, took, delay=delay, message=message, error=entry)
    except BaseException as failure:  # a KeyboardInterrupt from the handler's code here would end the slot's thread
        name = type_name(exc)
        message = f"{name} (and classifying it raised {type_name(failure)})"
        entry = {
            "attempt": job.attempt,
            "worker": worker_id,
            "type": name,
            "message": message,
            "traceback": None,
        }
        kind = Kind.DEAD if job.attempt >= job.max_attempts else Kind.RETRY
        return Outcome(job, kind, took, delay=DEFAULT_BACKOFF.delay(job.attempt), message=message, error=entry)


def gives_up(exc: BaseException) -> bool:
    """Whether ``exc`` ends its job dead at once: a PermanentFailure, or a group of nothing else.

    ``asyncio.TaskGroup`` (and ``except*``-style code) raises an exception
    group of its tasks' errors, so a handler whose tasks all raised
    PermanentFailure raised no PermanentFailure itself, and its job was
    retried up to ``max_attempts`` though every part of it had given up. A
    group holding any other error is a failed attempt like that error alone.
    """
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(PermanentFailure)
        return rest is None
    return isinstance(exc, PermanentFailure)


#: Why a transactional handler's success failed to be written under REPEATABLE READ or SERIALIZABLE.
STRICTER_ISOLATION = (
    "the success of job {job_id} could not be written in its handler's transaction, so its work was rolled back: "
    "the job's row changed after the transaction's snapshot (a heartbeat renewing the lease, a progress report "
    "or a cancel request), which only READ COMMITTED allows; keep a transactional handler at READ COMMITTED "
    "(Relay's default) unless it finishes within one heartbeat interval"
)

#: Why a transactional handler's work was rolled back after its success was written.
PAUSED_BEFORE_COMMIT = (
    "the success of job {job_id} was written in its handler's transaction, but the worker paused for over "
    "{seconds:g} s (its lease) before the COMMIT, so the server ended the transaction and its work was rolled "
    "back: a frozen process (stopped, a stalled VM) or a thread holding Python's GIL that long"
)

#: Why a transactional handler that ran COMMIT or ROLLBACK itself ends dead. The success, written
#: after it, committed on its own: after a ROLLBACK the job said succeeded with its work gone, and
#: after a COMMIT a job whose lease was taken over ran again with its first run's work kept. Run
#: again, the handler would end its transaction again.
ENDED_OWN_TRANSACTION = (
    "the transactional handler of {job_type!r} ended its own transaction (COMMIT or ROLLBACK in its SQL), "
    "so its work and the job's success could not commit together: what it wrote before that was committed or "
    "rolled back by it, not by Relay; return to commit and raise to roll back, or register it with "
    "transactional=False to manage transactions itself"
)

#: The failure of a transactional handler that raised psycopg.Rollback.
ROLLED_BACK = (
    "the transactional handler of {job_type!r} raised psycopg.Rollback, so its work was rolled back; "
    "this attempt counts as failed (raise an exception of your own to say why)"
)


#: Connections a transactional run tries before its handler starts. One the server
#: ended while it sat in the pool (a restart, a failover, an idle-session killer)
#: fails Relay's BEGIN; the pool tests only connections idle for over a second,
#: so each of a worker's pooled connections may be such a one.
TRANSACTION_OPEN_TRIES = 4


@dataclass
class _TransactionRun:
    """What a failed transactional run had got to: the connection it took, and whether its handler started."""

    conn: psycopg.Connection | None = None
    handler_started: bool = False

    def lost_its_connection_first(self) -> bool:
        """Whether it failed on a connection that broke before the handler started: nothing ran or was written."""
        return not self.handler_started and self.conn is not None and (self.conn.broken or self.conn.closed)


class _NotBegun(Exception):
    """A transactional run that got no working connection before its handler started: nothing ran."""


def _run_transactional(job: Job, spec: HandlerSpec, pool: ConnectionPool, lease_seconds: float) -> None:
    """``_run_in_transaction``, on another connection while the one it took broke before the handler started.

    Nothing has run then and nothing was written, so the attempt is not the
    handler's to lose: it was charged with ``AdminShutdown`` (dead at
    ``max_attempts=1``) after a restart ended the pool's idle connections.
    Only a broken connection is tried again (not a pool timeout, nor an error
    on a connection that still works), never once the lease is lost (another
    worker may have the job by then), and at most ``TRANSACTION_OPEN_TRIES``
    times in all.

    When no working connection comes at all (the pool's wait ran out during
    an outage or with the server out of connections, or every one tried was
    broken), ``_NotBegun`` hands the job back with its attempt: charged with
    ``PoolTimeout``, a job with one attempt ended dead without its handler
    ever starting. So it is when the lease was lost during the wait: the
    hand-back is fenced by the lease token, so it changes nothing if another
    worker has the job, and gives the job back if nobody took it. A failure
    once the handler has started is the attempt's.
    """
    for tries_left in range(TRANSACTION_OPEN_TRIES - 1, -1, -1):
        run = _TransactionRun()
        try:
            _run_in_transaction(job, spec, pool, lease_seconds, run)
            return
        except PoolTimeout as exc:
            if run.conn is not None:
                raise
            raise _NotBegun(str(exc)) from exc
        except psycopg.Error as exc:
            if not run.lost_its_connection_first():
                raise
            if job.lease_lost or not tries_left:
                # Handed back, fenced: a lease lost meanwhile (it ran out during the wait, or
                # another worker has the job) writes nothing if it is no longer this run's.
                raise _NotBegun(str(exc)) from exc
            event(logging.INFO, "transaction not begun: connection lost; trying another", job_id=job.id, error=str(exc))


def _run_in_transaction(
    job: Job, spec: HandlerSpec, pool: ConnectionPool, lease_seconds: float, run: _TransactionRun
) -> None:
    """Handler and fenced success in one transaction; LeaseLost rolls both back.

    ``run`` records the connection taken and when the handler is called.

    A handler that ended the transaction itself (SQL COMMIT or ROLLBACK,
    which psycopg passes on) fails for good: see ``ENDED_OWN_TRANSACTION``.
    The connection is in autocommit meanwhile, which inside
    ``conn.transaction()`` changes nothing; but outside one psycopg would
    begin a new transaction before the handler's next statement, and the
    success would commit in that one, apart from the work. In autocommit the
    connection is still outside a transaction when the handler returns or
    raises, which is how the end is told.

    A handler that returns once ``job.lease_lost`` is true stopped because it
    was told to (its lease was taken over, or it ran past its timeout), so its
    work is rolled back rather than committed as a success.

    The success is an UPDATE of the job's row, which the worker's heartbeat
    renews every ``lease / 3``: under a stricter isolation level the handler
    set for its transaction, a renewal after its snapshot makes that UPDATE a
    serialization failure, reported as such (SuccessNotRecorded).

    Once the success is written, the transaction may sit idle for a lease at
    most (see ``handler_settings_end_with_transaction``); a worker paused
    longer before its COMMIT finds its work rolled back (SuccessNotRecorded).
    """
    success_written = False
    with pool.connection() as conn, _handlers_own(pool, conn), in_autocommit(conn):
        run.conn = conn
        try:
            with conn.transaction():
                run.handler_started = True
                try:
                    value = spec.func(job, conn)
                except BaseException as exc:
                    if _ended_its_transaction(conn):  # a retry would commit its work again
                        raise PermanentFailure(ENDED_OWN_TRANSACTION.format(job_type=job.type)) from exc
                    if isinstance(exc, psycopg.Rollback):
                        # psycopg.Rollback ends the transaction block it leaves quietly, and this
                        # block is Relay's: nothing was written, and the job sat claimed until its
                        # lease ran out, then failed as "stopped heartbeating".
                        raise RuntimeError(ROLLED_BACK.format(job_type=job.type)) from exc
                    raise
                if inspect.isawaitable(value):
                    _discard(value)
                    raise PermanentFailure(
                        f"the transactional handler of {job.type!r} returned an awaitable, so its work never ran; "
                        "its connection is a sync one in the completion transaction: make it a plain def, "
                        "or register it with transactional=False"
                    )
                if _ended_its_transaction(conn):
                    raise PermanentFailure(ENDED_OWN_TRANSACTION.format(job_type=job.type))
                if job.lease_lost:
                    raise LeaseLost(f"job {job.id} was told to stop; its work was rolled back")
                result = result_json(value)  # before the idle limit: a large result takes a while
                job._success_writing = True
                conn.execute(handler_settings_end_with_transaction(lease_seconds))  # type: ignore[arg-type]
                try:
                    done = conn.execute(
                        sql("job_succeed_in_transaction"), {"id": job.id, "token": job.lease_token, "result": result}
                    ).fetchall()
                except psycopg.errors.SerializationFailure as exc:
                    raise SuccessNotRecorded(STRICTER_ISOLATION.format(job_id=job.id)) from exc
                if not done:
                    raise LeaseLost(f"job {job.id} is no longer this worker's; its work was rolled back")
                success_written = True
        except psycopg.errors.IdleInTransactionSessionTimeout as exc:
            if not success_written:
                raise
            raise SuccessNotRecorded(PAUSED_BEFORE_COMMIT.format(job_id=job.id, seconds=lease_seconds)) from exc
        finally:
            # The handler's session settings (a plain SET commits with the success, or with a
            # COMMIT of its own) must not reach the statements Relay runs next on this connection.
            with contextlib.suppress(psycopg.Error):
                reset_session(conn)


def _ended_its_transaction(conn: psycopg.Connection) -> bool:
    """Whether the transaction Relay began for a handler is over, ended by the handler's own SQL."""
    return conn.info.transaction_status == TransactionStatus.IDLE


def _discard(awaitable: object) -> None:
    """Close a coroutine nobody will await, so Python does not warn that it never ran."""
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()


def _handlers_own(pool: ConnectionPool, conn: psycopg.Connection) -> contextlib.AbstractContextManager[None]:
    """``conn`` without the tcp_user_timeout Relay gave its pool, while a handler's work runs on it."""
    if "tcp_user_timeout" in (pool.kwargs or {}):
        return without_user_timeout(conn)
    return contextlib.nullcontext()
