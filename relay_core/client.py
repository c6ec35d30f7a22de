"""The ``Relay`` object: handler registry, enqueue, migrate and admin actions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from . import admin
from . import migrate as migrator
from .backoff import Backoff
from .connections import fetch_all, fetch_first_value
from .errors import InvalidJobError, RelayError
from .handlers import DEFAULT_MAX_ATTEMPTS, HandlerSpec, make_spec
from .pools import connection_options, make_pool
from .queries import sql
from .settings import database_url, env_bool, env_int, transaction_pooling
from .validation import DEFAULT_MAX_PAYLOAD_BYTES, NewJob, new_job
from .worker import Worker, WorkerConfig

#: Bulk payloads up to this many characters in all travel as one JSON document
#: (jsonb tops out at 256 MiB); larger bulk enqueues use the array form.
ALIKE_MAX_PAYLOAD_CHARS = 64 * 1024 * 1024
#: Tries of a keyed insert whose conflicting holder keeps vanishing before it is read.
KEY_RACE_ATTEMPTS = 3


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
    ) -> None:
        self._dsn = dsn
        self.max_payload_bytes = max_payload_bytes or env_int("RELAY_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES)
        self.default_max_attempts = default_max_attempts
        #: Whether an enqueue NOTIFYs idle workers (``RELAY_NOTIFY``, default true).
        #: PostgreSQL serialises the commits of all notifying transactions, so
        #: many concurrent producers may prefer to let workers poll instead.
        self.notify = env_bool("RELAY_NOTIFY", True) if notify is None else notify
        #: Whether connections go through a pooler in transaction mode
        #: (``RELAY_TRANSACTION_POOLING``): nothing prepared, no session settings left behind.
        self.transaction_pooling = transaction_pooling()
        self.handlers: dict[str, HandlerSpec] = {}
        self._pool: ConnectionPool | None = None
        self._pool_size = pool_size
        self._pool_lock = threading.Lock()

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
        if pool is not None:
            return pool
        with self._pool_lock:
            if self._pool is None:
                self._pool = make_pool(
                    self.dsn, name="relay-client", min_size=1, max_size=self._pool_size, autocommit=True
                )
                self._pool.open()
            return self._pool

    def close(self) -> None:
        """Close the connection pool (a new one opens if Relay is used again)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    # -- handlers ----------------------------------------------------------

    def handler(
        self,
        job_type: str,
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
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
        with a second parameter (``def h(job, conn)``) is transactional unless
        ``transactional=False``. ``concurrency=N`` caps running jobs of the type
        across all workers; ``rate_limit=(N, seconds)`` caps starts per sliding
        window. ``cron="0 0 1 * *"`` (with ``timezone``) enqueues one job per
        tick into ``queue``; ``catch_up=True`` enqueues the latest tick missed
        while no worker ran.
        """

        def register(func: Callable[..., Any]) -> Callable[..., Any]:
            if job_type in self.handlers:
                raise RelayError(f"a handler for {job_type!r} is already registered")
            self.handlers[job_type] = make_spec(
                job_type,
                func,
                max_attempts=max_attempts,
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
        # Without a local handler, the default stands in until _with_published
        # replaces it by what workers published for the type, if anything.
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
        published for the type (one more statement, on the insert's
        connection), else ``default_max_attempts``.
        """
        job = self._validated(
            job_type, {} if payload is None else payload, queue, priority, run_at, max_attempts, idempotency_key
        )
        unresolved = self._takes_published(job, max_attempts)
        if conn is not None:
            if unresolved:
                job = self._with_published(conn, [job], [True])[0]
            return self._insert(conn, job)
        pool = self.pool
        # The pool's connections are autocommit (see ``pool``), so the insert is
        # its own transaction and there is nothing to commit before returning it.
        own = pool.getconn()
        try:
            if unresolved:
                job = self._with_published(own, [job], [True])[0]
            return self._insert(own, job)
        finally:
            pool.putconn(own)

    def _takes_published(self, job: NewJob, max_attempts: int | None) -> bool:
        """Whether ``job`` gets the max_attempts workers published: none given and no local handler."""
        return max_attempts is None and job.type not in self.handlers

    def _with_published(self, conn: Any, jobs: list[NewJob], unresolved: list[bool]) -> list[NewJob]:
        """``jobs`` where each ``unresolved`` one takes the max_attempts workers published for its type.

        One statement for all the types, on the connection of the insert that
        follows (a caller's ``conn``: in its transaction); a type nothing was
        published for keeps ``default_max_attempts``.
        """
        types = sorted({job.type for job, open_ in zip(jobs, unresolved, strict=True) if open_})
        if not types:
            return jobs
        rows = fetch_all(conn, sql("job_type_max_attempts_many"), {"types": types})
        published = {row["type"]: row["max_attempts"] for row in rows}
        return [
            replace(job, max_attempts=published[job.type]) if open_ and job.type in published else job
            for job, open_ in zip(jobs, unresolved, strict=True)
        ]

    def _insert(self, conn: Any, job: NewJob) -> int:
        params = job.params()
        params["notify"] = self.notify
        if job.idempotency_key is None:
            return fetch_first_value(conn, sql("job_insert"), params)
        for _ in range(KEY_RACE_ATTEMPTS):
            job_id = fetch_first_value(conn, sql("job_insert_keyed"), params)
            if job_id is not None:
                return job_id
            lookup = {"idempotency_key": job.idempotency_key}
            existing = fetch_first_value(conn, sql("job_id_by_idempotency_key"), lookup)
            if existing is not None:
                return existing
            # The holder was deleted (pruned) between the two statements: the key is free again.
        raise RelayError(f"idempotency key {job.idempotency_key!r} conflicted but its job vanished; retry")

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
        allowed = {"type", "payload", "queue", "priority", "run_at", "max_attempts", "idempotency_key"}
        validated: list[NewJob] = []
        unresolved: list[bool] = []
        for index, item in enumerate(jobs):
            unknown = set(item) - allowed
            if unknown:
                raise InvalidJobError(f"jobs[{index}]", f"unknown fields {sorted(unknown)}")
            try:
                validated.append(
                    self._validated(
                        item.get("type"),
                        {} if item.get("payload") is None else item["payload"],
                        item.get("queue", "default"),
                        item.get("priority", 0),
                        item.get("run_at"),
                        item.get("max_attempts"),
                        item.get("idempotency_key"),
                    )
                )
            except InvalidJobError as exc:
                raise InvalidJobError(f"jobs[{index}].{exc.field}", exc.message) from None
            unresolved.append(self._takes_published(validated[-1], item.get("max_attempts")))
        if not validated:
            return []
        if conn is not None:
            return self._insert_many(conn, self._with_published(conn, validated, unresolved))
        with self.pool.connection() as own:  # autocommit: the insert is one statement, its own transaction
            return self._insert_many(own, self._with_published(own, validated, unresolved))

    def _insert_many(self, conn: Any, jobs: list[NewJob]) -> list[int]:
        first = jobs[0]
        payload_chars = sum(len(j.payload_json) for j in jobs)
        if payload_chars < ALIKE_MAX_PAYLOAD_CHARS and all(
            j.type == first.type
            and j.queue == first.queue
            and j.priority == first.priority
            and j.run_at == first.run_at
            and j.max_attempts == first.max_attempts
            and j.idempotency_key is None
            for j in jobs
        ):
            alike = {
                "type": first.type,
                "queue": first.queue,
                "priority": first.priority,
                "run_at": first.run_at,
                "max_attempts": first.max_attempts,
                "payloads": "[" + ",".join(j.payload_json for j in jobs) + "]",
                "notify": self.notify,
            }
            return list(fetch_all(conn, sql("job_insert_many_alike"), alike)[0]["ids"])
        params = {
            "types": [j.type for j in jobs],
            "payloads": [j.payload_json for j in jobs],
            "queues": [j.queue for j in jobs],
            "priorities": [j.priority for j in jobs],
            "run_ats": [j.run_at for j in jobs],
            "max_attempts": [j.max_attempts for j in jobs],
            "idempotency_keys": [j.idempotency_key for j in jobs],
            "notify": self.notify,
        }
        row = fetch_all(conn, sql("job_insert_many"), params)[0]
        inserted_ids: list[int] = list(row["ids"])
        inserted_keys = {key for key in row["keys"] if key is not None}
        conflicted = sorted(
            {j.idempotency_key for j in jobs if j.idempotency_key and j.idempotency_key not in inserted_keys}
        )
        existing: dict[str, int] = {}
        if conflicted:
            for found in fetch_all(conn, sql("job_ids_by_idempotency_keys"), {"idempotency_keys": conflicted}):
                existing[found["idempotency_key"]] = found["id"]
        for key in conflicted:
            if key not in existing:  # its holder was deleted between the two statements: insert it now
                existing[key] = self._insert(conn, next(j for j in jobs if j.idempotency_key == key))
        # Rows were inserted in input order, so fresh ids ascend with input position;
        # a key repeated within one call resolves to the job its first use created.
        fresh = iter(inserted_ids)
        by_key: dict[str, int] = dict(existing)
        result: list[int] = []
        for job in jobs:
            key = job.idempotency_key
            if key is not None and key in by_key:
                result.append(by_key[key])
                continue
            job_id = next(fresh)
            if key is not None:
                by_key[key] = job_id
            result.append(job_id)
        return result

    # -- schema and admin --------------------------------------------------

    def migrate(self) -> list[str]:
        """Apply pending migrations; return the names of those applied."""
        return migrator.migrate(self.dsn)

    def get_job(self, job_id: int) -> admin.JobDetail:
        """One job with its error history; raises JobNotFound."""
        with self.pool.connection() as conn:
            return admin.get_job(conn, job_id)

    def requeue(self, job_id: int) -> admin.JobDetail:
        """Run a dead or cancelled job again now, with fresh attempts."""
        with self.pool.connection() as conn:
            return admin.requeue(conn, job_id)

    def cancel(self, job_id: int) -> admin.JobDetail:
        """Cancel a job: a queued one never runs; a running one is asked to stop.

        A running job's worker sees the request at its next heartbeat; the job
        ends ``cancelled`` when its handler stops (see ``Job.cancel_requested``).
        """
        with self.pool.connection() as conn:
            return admin.cancel(conn, job_id)

    def pause_queue(self, queue: str) -> None:
        """Stop every worker from claiming from ``queue`` (survives restarts)."""
        with self.pool.connection() as conn:
            admin.set_queue_paused(conn, queue, True)

    def resume_queue(self, queue: str) -> None:
        """Let workers claim from ``queue`` again."""
        with self.pool.connection() as conn:
            admin.set_queue_paused(conn, queue, False)

    def paused_queues(self) -> list[str]:
        """Names of the queues paused now."""
        with self.pool.connection() as conn:
            return admin.paused_queues(conn)

    def schedules(self) -> list[dict[str, Any]]:
        """Every periodic schedule with its last tick, last run and next tick."""
        with self.pool.connection() as conn:
            return admin.schedules(conn)

    def worker(self, **settings: Any) -> Worker:
        """A worker for this app's handlers; settings override RELAY_* defaults."""
        return Worker(self.dsn, self.handlers, WorkerConfig.from_env(**settings))

    def run_worker(self, **settings: Any) -> None:
        """Run a worker in this process until SIGTERM/SIGINT."""
        self.worker(**settings).run()

    def connection_options(self) -> dict[str, Any]:
        """psycopg options for a connection of Relay's own (see ``transaction_pooling``)."""
        return connection_options()

    def connect(self) -> psycopg.Connection:
        """A new psycopg connection to Relay's database (the caller closes it)."""
        return psycopg.connect(self.dsn, **connection_options())
