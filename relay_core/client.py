"""The ``Relay`` object: handler registry, enqueue, migrate and admin actions."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from . import admin, inserts
from . import migrate as migrator
from .backoff import Backoff
from .connect_options import connection_options
from .connections import run, run_async
from .errors import ConfigurationError, InvalidJobError, RelayError
from .handlers import DEFAULT_MAX_ATTEMPTS, HandlerSpec, make_spec
from .pools import RelayConnection, RelayPool, make_pool, outdated_plan
from .queries import sql
from .settings import check_dsn_type, database_url, env_bool, env_float, env_int, transaction_pooling
from .validation import (
    BATCH_JOB_OVERHEAD_CHARS,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_BATCH_CHARS,
    MAX_PAYLOAD_BYTES_LIMIT,
    NewJob,
    check_idempotency_key,
    check_job_id,
    check_max_attempts,
    check_payload,
    check_queue,
    check_seconds,
    new_job,
)
from .wakeups import Wakeups
from .worker import Worker, WorkerConfig, require_handlers
from .worker.shutdown import end_owned_process

T = TypeVar("T")

#: How long an enqueue without ``conn`` waits for a pooled connection by default (RELAY_DB_WAIT_SECONDS).
DEFAULT_DB_WAIT_SECONDS = 5.0
#: How long a statement on Relay's own pool (an enqueue without ``conn``, an admin action) waits for a
#: lock: an idempotency key held by a transaction not yet committed, a table a migration holds. Without
#: a bound, a key held by the caller's own open transaction on another connection hung the call for good
#: (a deadlock the server cannot see), and an ``enqueue_async`` cancelled meanwhile kept its thread and
#: connection waiting, until every enqueue failed for want of one. Longer than a migration's try (5 s).
LOCK_WAIT_SECONDS = 30.0
#: Added to the error (LockNotAvailable, an OperationalError) of an enqueue that waited that long: what it
#: waited for, and that it enqueued nothing.
LOCK_WAIT_NOTE = (
    f"Nothing was enqueued: a lock was held for over {LOCK_WAIT_SECONDS:g} s (an idempotency key of a "
    "transaction not yet committed, perhaps your own on another connection; a migration's or a TRUNCATE's "
    "table lock). Pass conn= to enqueue in that transaction, or retry once it has ended."
)


@contextmanager
def lock_wait_explained() -> Iterator[None]:
    """An enqueue's LockNotAvailable carries ``LOCK_WAIT_NOTE``."""
    try:
        yield
    except psycopg.errors.LockNotAvailable as exc:
        exc.add_note(LOCK_WAIT_NOTE)
        raise


#: Every Relay of this process, so that a forked child can give each a pool lock nobody holds.
RELAYS: weakref.WeakSet[Relay] = weakref.WeakSet()


def _unlock_pools_after_fork() -> None:
    """In a forked child, each Relay's pool lock anew.

    A thread of the parent that held one at the fork (closing the pool, or
    opening it) does not exist in the child, and the lock it held stayed
    held there: the child's first enqueue waited for it forever.
    """
    for relay in list(RELAYS):
        relay._pool_lock = threading.Lock()
        relay._wakeups.start_fresh()  # the wake-ups the parent owes are the parent's to send


os.register_at_fork(after_in_child=_unlock_pools_after_fork)


@atexit.register
def _send_owed_wakeups() -> None:
    """At exit, the wake-ups each Relay still owes, sent while its pool is open.

    ``pools.close_open_pools`` was registered first, so it runs after this.
    """
    for relay in list(RELAYS):
        with contextlib.suppress(Exception):  # exiting anyway; workers poll
            relay._wakeups.close()


def batch_items(jobs: Any) -> list[Any]:
    """The items of an ``enqueue_many`` batch, refused unless it is an iterable of them (a single mapping is not)."""
    if isinstance(jobs, (Mapping, str, bytes)) or not isinstance(jobs, Iterable):
        raise InvalidJobError("jobs", f"must be a list of mappings (one per job), got {type(jobs).__name__}")
    return list(jobs)


class Relay:
    """A Relay application: where jobs are enqueued and which handlers run them.

    The DSN comes from the argument, else ``RELAY_DATABASE_URL``, else
    ``DATABASE_URL``; it is resolved when first needed, so a module can build
    ``relay = Relay()`` at import time.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        max_payload_bytes: int | None = None,
        default_max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        pool_size: int = 4,
        notify: bool | None = None,
        db_wait: float | None = None,
    ) -> None:
        check_dsn_type(dsn)  # when the Relay is made, not at its first enqueue
        self._dsn = dsn
        if max_payload_bytes is None:
            max_payload_bytes = env_int("RELAY_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)
        self.max_payload_bytes = max_payload_bytes
        if (
            isinstance(max_payload_bytes, bool)
            or not isinstance(max_payload_bytes, int)
            or not 1 <= max_payload_bytes <= MAX_PAYLOAD_BYTES_LIMIT
        ):
            # Below it every enqueue would be refused as if its payload were too big; past it, see the limit.
            raise ConfigurationError(
                f"max_payload_bytes (RELAY_MAX_PAYLOAD_BYTES) must be from 1 to {MAX_PAYLOAD_BYTES_LIMIT} "
                f"(32 MiB), got {self.max_payload_bytes}"
            )
        try:
            self.default_max_attempts = check_max_attempts(default_max_attempts)
        except InvalidJobError as exc:
            # Else every enqueue that gives none would be refused, naming a field it did not give.
            raise ConfigurationError(f"default_max_attempts {exc.message}, got {default_max_attempts!r}") from None
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigurationError(f"pool_size must be a whole number of connections, at least 1, got {pool_size!r}")
        #: Whether an enqueue NOTIFYs idle workers (``RELAY_NOTIFY``, default true).
        #: PostgreSQL serialises the commits of all notifying transactions, so
        #: many concurrent producers may prefer to let workers poll instead.
        self.notify = env_bool("RELAY_NOTIFY", True) if notify is None else notify
        if not isinstance(self.notify, bool):
            # It goes into every insert as a boolean: 0 or 1 failed each enqueue there (leaving a
            # caller's transaction aborted), and "false" would be a true value.
            raise ConfigurationError(f"notify must be True or False, got {notify!r}")
        #: Whether connections go through a pooler in transaction mode
        #: (``RELAY_TRANSACTION_POOLING``): nothing prepared, no session settings left behind.
        self.transaction_pooling = transaction_pooling()
        #: How long an enqueue without ``conn`` (or an admin action) waits for a
        #: connection before raising (``RELAY_DB_WAIT_SECONDS``, default 5): a
        #: database that is down fails the caller's request in seconds, well
        #: inside the 30 s a platform's router gives a web request.
        wait = env_float("RELAY_DB_WAIT_SECONDS", DEFAULT_DB_WAIT_SECONDS) if db_wait is None else db_wait
        try:
            # The pool's wait for a connection cannot take longer than a thread's
            # wait: past it every enqueue raised OverflowError.
            self.db_wait = check_seconds("db_wait", wait, most=threading.TIMEOUT_MAX)
        except InvalidJobError as exc:
            raise ConfigurationError(f"db_wait (RELAY_DB_WAIT_SECONDS) {exc.message}, got {wait!r}") from None
        self.handlers: dict[str, HandlerSpec] = {}
        self._pool: RelayPool | None = None
        self._pool_size = pool_size
        self._pool_lock = threading.Lock()
        #: Which of this Relay's own one-job enqueues notify in their statement (see ``wakeups``).
        self._wakeups = Wakeups(self._wake_queues)
        RELAYS.add(self)

    # -- configuration -----------------------------------------------------

    @property
    def dsn(self) -> str:
        """The database this Relay talks to."""
        return database_url(self._dsn)

    @property
    def pool(self) -> ConnectionPool:
        """A small pool of autocommit connections for enqueues without ``conn`` and admin actions.

        An enqueue is one statement, so autocommit makes it its own transaction
        with no BEGIN/COMMIT round trips; admin actions that need several
        statements open ``conn.transaction()`` themselves.
        """
        pool = self._pool
        if pool is not None and not pool.inherited:
            return pool
        with self._pool_lock:
            # A process forked after the pool opened makes its own: the parent's connections are the parent's.
            if self._pool is None or self._pool.inherited:
                pool = make_pool(
                    self.dsn,
                    name="relay-client",
                    min_size=1,
                    max_size=self._pool_size,
                    timeout=self.db_wait,
                    autocommit=True,
                    lock_wait_seconds=LOCK_WAIT_SECONDS,
                )
                pool.open()
                # Stored once open: a thread reads it above without the lock, and an unopened
                # pool refused its enqueue ("the pool 'relay-client' is not open yet").
                self._pool = pool
            return self._pool

    def close(self) -> None:
        """Send the wake-ups still owed, then close the connection pool (a new one opens if Relay is used again)."""
        self._wakeups.close()
        with self._pool_lock:
            if self._pool is not None and not self._pool.inherited:
                self._pool.close()
            self._pool = None

    # -- handlers ----------------------------------------------------------

    def handler(
        self,
        job_type: str,
        *,
        max_attempts: int | None = None,
        backoff: Backoff | None = None,
        timeout: float | None = None,
        transactional: bool | None = None,
        concurrency: int | None = None,
        rate_limit: tuple[int, float] | None = None,
        cron: str | None = None,
        timezone: str = "UTC",
        catch_up: bool = False,
        queue: str = "default",
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Register the decorated function as the handler of ``job_type``.

        ``timeout`` (seconds) fails an attempt that runs longer. A handler
        with a second required parameter (``def h(job, conn)``) is
        transactional unless ``transactional=False``. ``concurrency=N`` caps running jobs of the type
        across all workers; ``rate_limit=(N, seconds)`` caps starts per sliding
        window (1 ms to 31 days). ``cron="0 0 1 * *"`` (with ``timezone``) enqueues one job per
        tick into ``queue``; ``catch_up=True`` enqueues the latest tick missed
        while no worker ran.
        """
        if callable(job_type):
            # ``@relay.handler`` with no type: the function came as the type, and the decorator
            # returned in its place replaced it without registering anything.
            name = getattr(job_type, "__name__", "the handler")
            raise InvalidJobError(
                "type", f"is missing: write @relay.handler({name!r}), naming the job type, not @relay.handler"
            )

        def register(func: Callable[..., Any]) -> Callable[..., Any]:
            if job_type in self.handlers:
                raise RelayError(f"a handler for {job_type!r} is already registered")
            self.handlers[job_type] = make_spec(
                job_type,
                func,
                # Unsaid, this Relay's default (20 unless Relay(default_max_attempts=...) says otherwise).
                max_attempts=self.default_max_attempts if max_attempts is None else max_attempts,
                backoff=backoff,
                timeout=timeout,
                transactional=transactional,
                concurrency=concurrency,
                rate_limit=rate_limit,
                cron=cron,
                timezone=timezone,
                catch_up=catch_up,
                queue=queue,
            )
            return func

        return register

    # -- enqueue -----------------------------------------------------------

    def _validated(
        self,
        job_type: Any,
        payload: Any,
        queue: Any,
        priority: Any,
        run_at: datetime | None,
        max_attempts: int | None,
        idempotency_key: str | None,
    ) -> NewJob:
        # Without a local handler, the default stands in for what workers published for
        # the type, if anything: the insert reads that (inserts.enqueue_one, inserts.with_published).
        if max_attempts is None:
            spec = self.handlers.get(job_type) if isinstance(job_type, str) else None
            max_attempts = spec.max_attempts if spec else self.default_max_attempts
        return new_job(
            job_type,
            payload,
            queue=queue,
            priority=priority,
            run_at=run_at,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            max_payload_bytes=self.max_payload_bytes,
        )

    def enqueue(
        self,
        job_type: str,
        payload: Any = None,
        *,
        conn: Any = None,
        run_at: datetime | None = None,
        priority: int = 0,
        queue: str = "default",
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
    ) -> int:
        """Add one job and return its id.

        With ``conn`` (psycopg Connection, SQLAlchemy Connection or Session)
        the insert joins the caller's transaction: rolled back, there is no
        job. Without it, the job is committed before this returns. A second
        enqueue with the same ``idempotency_key`` inserts nothing and returns
        the first job's id.

        Without ``max_attempts``, the job gets the ``max_attempts`` of this
        Relay's handler for the type; with no such handler, the one workers
        published for the type (read by the insert itself), else
        ``default_max_attempts``.
        """
        job = self._validated(
            job_type, {} if payload is None else payload, queue, priority, run_at, max_attempts, idempotency_key
        )
        unresolved = self._takes_published(job, max_attempts)
        if conn is not None:
            return run(conn, inserts.enqueue_one(job, unresolved, self.notify))
        if not self.notify or job.run_at is not None:
            return self._enqueue_on_pool(job, unresolved, self.notify)  # a run_at: the insert tells if it is due
        # A job due at once, sent while others are in flight, leaves its NOTIFY to the end of its
        # queue's window if the queue was notified within it (see ``wakeups``).
        notify = self._wakeups.notify_now(job.queue)
        try:
            return self._enqueue_on_pool(job, unresolved, notify)
        finally:
            self._wakeups.sent(job.queue, owed=not notify)

    def _enqueue_on_pool(self, job: NewJob, unresolved: bool, notify: bool) -> int:
        """Insert ``job`` on a connection of this Relay's pool: committed once this returns; its id."""
        pool = self.pool
        # The pool's connections are autocommit (see ``pool``), so the insert is
        # its own transaction and there is nothing to commit before returning it.
        own = pool.getconn()
        try:
            with lock_wait_explained():
                return run(own, inserts.enqueue_one(job, unresolved, notify))
        except psycopg.errors.FeatureNotSupported as exc:
            if not pool.replace_if_outdated(exc):
                raise
        except psycopg.errors.ReadOnlySqlTransaction:
            pool.replace_for_read_only()  # a failover left it on a server that refuses writes
            raise
        finally:
            pool.putconn(own)
        return self._run_on_fresh_connection(inserts.enqueue_one(job, unresolved, notify))

    def _wake_queues(self, queues: list[str]) -> None:
        """Send the NOTIFY owed to each of ``queues`` (see ``wakeups``); nothing once this Relay is closed.

        A closed Relay's pool is not opened again for it (an enqueue that failed
        as the Relay closed still owes one).
        """
        pool = self._pool  # read once: close() may set it to None meanwhile
        if pool is None:
            return
        if pool.inherited:
            pool = self.pool  # a forked child's own
        with pool.connection() as conn:
            conn.execute(sql("wake_queues"), {"queues": queues})

    def _run_on_fresh_connection(self, steps: inserts.Steps[T]) -> T:
        """Run ``steps`` again after the schema outdated a statement prepared on this Relay's pool.

        The server refused that statement before it ran, and any statement
        before it changed nothing (a lookup, or a keyed insert that found its
        key held) or was rolled back with it (a bulk enqueue's insert runs in
        one transaction with its lookups), so the whole enqueue runs once
        more, on a connection that prepares its statements anew (see
        ``RelayPool.replace_if_outdated``).
        """
        with lock_wait_explained(), self.pool.connection() as fresh, fresh.transaction():
            return run(fresh, steps)

    def _takes_published(self, job: NewJob, max_attempts: int | None) -> bool:
        """Whether ``job`` gets the max_attempts workers published: none given and no local handler."""
        return max_attempts is None and job.type not in self.handlers

    def enqueue_many(
        self,
        jobs: Iterable[Mapping[str, Any]],
        *,
        conn: Any = None,
    ) -> list[int]:
        """Add many jobs in one statement; return their ids in input order.

        Each item is a mapping with ``type`` and optionally ``payload``
        (None or absent is stored as ``{}``, as by :meth:`enqueue`),
        ``queue``, ``priority``, ``run_at``, ``max_attempts`` and
        ``idempotency_key``. Every item is validated first: one bad item
        means nothing is written. ``conn`` and a missing ``max_attempts``
        work as in :meth:`enqueue` (one lookup for all the types that need it).
        """
        validated, unresolved = self._validated_many(jobs)
        if not validated:
            return []
        steps = inserts.enqueue_many(validated, unresolved, self.notify)
        if conn is not None:
            return run(conn, steps)
        try:
            # One transaction: a bulk enqueue may follow its insert with lookups of keys already
            # held, and should one of them fail the insert must not stay behind the retry below.
            with lock_wait_explained(), self.pool.connection() as own, own.transaction():
                return run(own, steps)
        except psycopg.errors.FeatureNotSupported as exc:
            if not outdated_plan(exc):
                raise
        return self._run_on_fresh_connection(inserts.enqueue_many(validated, unresolved, self.notify))

    def _validated_many(self, jobs: Iterable[Mapping[str, Any]]) -> tuple[list[NewJob], list[bool]]:
        """Every item of an ``enqueue_many`` validated, and whether each takes the published max_attempts.

        The items of a bulk enqueue mostly share their type, queue, priority,
        run_at and max_attempts, so those are checked once per combination
        that passed (keyed by class and value: 1 and True, or 1 and 1.0, are
        told apart); each item's payload and idempotency key are checked
        every time. The errors are the same as checking each item whole.
        """
        allowed = {"type", "payload", "queue", "priority", "run_at", "max_attempts", "idempotency_key"}
        validated: list[NewJob] = []
        unresolved: list[bool] = []
        passed: dict[tuple[tuple[type, Any], ...], tuple[NewJob, bool]] = {}
        for index, item in enumerate(batch_items(jobs)):
            if not isinstance(item, Mapping):
                raise InvalidJobError(f"jobs[{index}]", f"must be a mapping with a type, got {type(item).__name__}")
            if not allowed.issuperset(item):
                raise InvalidJobError(f"jobs[{index}]", f"unknown fields {sorted(set(item) - allowed)}")
            get = item.get
            job_type, queue, priority = get("type"), get("queue", "default"), get("priority", 0)
            run_at, max_attempts, idempotency_key = get("run_at"), get("max_attempts"), get("idempotency_key")
            payload = get("payload")
            if payload is None:
                payload = {}
            key = (
                (job_type.__class__, job_type),
                (queue.__class__, queue),
                (priority.__class__, priority),
                # Equal datetimes may differ in what their tzinfo says (fold, another zone object).
                (run_at.__class__, run_at, getattr(run_at, "tzinfo", None), getattr(run_at, "fold", None)),
                (max_attempts.__class__, max_attempts),
            )
            try:
                seen = passed.get(key)
            except TypeError:  # an unhashable value: checked whole below, and refused there
                key, seen = None, None
            try:
                if seen is None:
                    job = self._validated(job_type, payload, queue, priority, run_at, max_attempts, idempotency_key)
                    takes = self._takes_published(job, max_attempts)
                    if key is not None:
                        passed[key] = (job, takes)
                else:
                    like, takes = seen
                    job = NewJob(
                        type=like.type,
                        payload_json=check_payload(payload, self.max_payload_bytes),
                        queue=like.queue,
                        priority=like.priority,
                        run_at=like.run_at,  # the same moment (the key holds it), already read into UTC
                        max_attempts=like.max_attempts,
                        idempotency_key=check_idempotency_key(idempotency_key),
                    )
            except InvalidJobError as exc:
                raise InvalidJobError(f"jobs[{index}].{exc.field}", exc.message) from None
            validated.append(job)
            unresolved.append(takes)
        sent = sum(
            len(job.payload_json) + len(job.type) + len(job.queue) + len(job.idempotency_key or "") for job in validated
        )
        sent += BATCH_JOB_OVERHEAD_CHARS * len(validated)
        if sent > MAX_BATCH_CHARS:
            raise InvalidJobError(
                "jobs",
                f"the batch would send {sent} characters (payloads, types, queues, keys), more than the "
                f"{MAX_BATCH_CHARS} one enqueue_many sends; enqueue them in smaller batches",
            )
        return validated, unresolved

    # -- enqueue from asyncio ----------------------------------------------

    async def enqueue_async(
        self,
        job_type: str,
        payload: Any = None,
        *,
        conn: Any = None,
        run_at: datetime | None = None,
        priority: int = 0,
        queue: str = "default",
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
    ) -> int:
        """:meth:`enqueue` for asyncio code: the same checks, statements and idempotency.

        With ``conn`` (psycopg AsyncConnection, SQLAlchemy AsyncConnection or
        AsyncSession) the insert joins the caller's transaction: rolled back,
        there is no job. Without it, :meth:`enqueue` runs on Relay's own pool
        in a thread, so the event loop is not blocked, and the job is
        committed before this returns. Cancelling the await does not stop
        that thread: the job may be committed all the same (retry with an
        ``idempotency_key``).
        """
        options = {
            "run_at": run_at,
            "priority": priority,
            "queue": queue,
            "idempotency_key": idempotency_key,
            "max_attempts": max_attempts,
        }
        if conn is None:
            return await asyncio.to_thread(functools.partial(self.enqueue, job_type, payload, **options))
        job = self._validated(job_type, {} if payload is None else payload, **options)
        steps = inserts.enqueue_one(job, self._takes_published(job, max_attempts), self.notify)
        return await run_async(conn, steps)

    async def enqueue_many_async(self, jobs: Iterable[Mapping[str, Any]], *, conn: Any = None) -> list[int]:
        """:meth:`enqueue_many` for asyncio code; ``conn`` as in :meth:`enqueue_async`."""
        if conn is None:
            return await asyncio.to_thread(self.enqueue_many, batch_items(jobs))
        validated, unresolved = self._validated_many(jobs)
        if not validated:
            return []
        return await run_async(conn, inserts.enqueue_many(validated, unresolved, self.notify))

    # -- schema and admin --------------------------------------------------

    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        return migrator.migrate(self.dsn)

    def get_job(self, job_id: int) -> admin.JobDetail:
        """One job with its error history; raises JobNotFound (InvalidJobError for what is no job id)."""
        job_id = check_job_id(job_id)  # before any wait for a connection: bad input is refused at once
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            return admin.get_job(conn, job_id)

    def requeue(self, job_id: int) -> admin.JobDetail:
        """Run a dead or cancelled job again now, with fresh attempts."""
        job_id = check_job_id(job_id)
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            return admin.requeue(conn, job_id)

    def cancel(self, job_id: int) -> admin.JobDetail:
        """Cancel a job: a queued one never runs; a running one is asked to stop.

        A running job's worker sees the request at its next heartbeat; the job
        ends ``cancelled`` when its handler stops (see ``Job.cancel_requested``).
        """
        job_id = check_job_id(job_id)
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            return admin.cancel(conn, job_id)

    def pause_queue(self, queue: str) -> None:
        """Stop every worker from claiming from ``queue`` (survives restarts)."""
        check_queue(queue)
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            admin.set_queue_paused(conn, queue, True)

    def resume_queue(self, queue: str) -> None:
        """Let workers claim from ``queue`` again."""
        check_queue(queue)
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            admin.set_queue_paused(conn, queue, False)

    def paused_queues(self) -> list[str]:
        """Names of the queues paused now."""
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            return admin.paused_queues(conn)

    def schedules(self) -> list[dict[str, Any]]:
        """Every periodic schedule with its last tick, last run and next tick."""
        with migrator.SchemaNeeded(), self.pool.connection() as conn:
            return admin.schedules(conn)

    def worker(self, **settings: Any) -> Worker:
        """A worker for this app's handlers; settings override RELAY_* defaults."""
        return Worker(self.dsn, self.handlers, WorkerConfig.from_env(**settings))

    def run_worker(self, **settings: Any) -> None:
        """Run a worker in this process until SIGTERM/SIGINT.

        The worker owns the process, as ``relay worker``'s does: if handlers
        still run when its shutdown ends (their jobs handed back, to start
        elsewhere after a short grace), the process ends at once rather than
        return and let them run on beside their next attempt. A worker that
        stopped itself for handlers stuck past their timeouts
        (``RELAY_MAX_STUCK_HANDLERS``) ends it with status 3, to be started again.
        """
        worker = self.worker(owns_process=True, **settings)
        require_handlers(worker.handlers)
        worker.run()
        end_owned_process(worker)

    def connection_options(self) -> dict[str, Any]:
        """psycopg options for the application's own connections to Relay's database.

        Behind a transaction pooler (``transaction_pooling``), what keeps them
        safe there; everywhere, a bound on waits on a dead network path
        (``connect_options.liveness_options``), but not ``tcp_user_timeout``, which
        would also break a bulk load queued behind a statement waiting on a lock.
        """
        return connection_options(self.dsn, self.transaction_pooling, user_timeout=False, application_name=None)

    def connect(self) -> psycopg.Connection:
        """A new psycopg connection to Relay's database, for Relay's own statements (the caller closes it)."""
        return RelayConnection.connect(self.dsn, **connection_options(self.dsn, self.transaction_pooling))
