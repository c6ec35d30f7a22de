"""A worker's start: check the schema, register, publish what its handlers declare; retry while the database is away.

A worker started during a failover, or before its database is up, waits for
it rather than exit, and says why its tries fail in the server's or libpq's
own words: at the first, then every REPEAT_SECONDS while the wait lasts (and
whenever the reason changes), not at each of its tries a second. A database
that answers and refuses (a wrong password, a database that does not exist,
too many clients) is told apart from one that cannot be reached. A setting
libpq cannot use is no outage to wait out: it ends the start with
ConfigurationError, as a schema this release cannot run on does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout

from .. import migrate as migrator
from ..connect_options import unusable_setting
from ..errors import ConfigurationError
from ..handlers import HandlerSpec
from ..logs import event
from ..outages import READ_ONLY, REPEAT_SECONDS, RETRYABLE, UNREACHABLE, Wording
from ..pools import RelayPool
from ..queries import sql
from . import limits, periodic
from .config import WorkerConfig
from .maintenance import Maintenance, register
from .outage import next_retry_delay

#: How long one try at registering waits for a connection before it logs and tries again.
REGISTER_WAIT_SECONDS = 2.0
#: What libpq's message holds when the server answered and refused the connection (its severity, in English).
SERVER_REFUSAL_MARK = "FATAL:"
#: ... and what such a refusal says when the server is starting, stopping or recovering: the
#: restart or failover a worker waits out, not a setting to fix (SQLSTATE 57P03, in English).
SERVER_NOT_READY_MARK = "the database system is"


def register_worker(
    pool: RelayPool, maintenance: Maintenance, worker_id: str, config: WorkerConfig, handlers: Iterable[HandlerSpec]
) -> bool:
    """Register the worker, then publish its handlers' limits, max_attempts and schedules; whether any type has a limit.

    The registration is recorded on ``maintenance`` as soon as it commits
    (each step commits its own): a stop during a retry of a later step must
    still find the worker registered, and record its stop. Whether any job
    type has a limit decides how the claim runs. A short wait for a
    connection per try, so a stop during an outage is not held up by it.
    """
    specs = list(handlers)
    with pool.connection(timeout=REGISTER_WAIT_SECONDS) as conn:
        problem = migrator.schema_problem(conn)
        if problem is not None:
            raise ConfigurationError(problem)
        maintenance.registered_at = register(
            conn,
            worker_id,
            config.queues,
            config.concurrency,
            config.heartbeat_interval,
            periodic.checked_schedule_definitions(specs),
        )
        limits.publish_max_attempts(conn, specs)
        limits.publish(conn, specs, published_by=worker_id)
        limits_exist = bool(conn.execute(sql("type_limits_exist")).fetchone()[0])
        periodic.publish(conn, specs, published_by=worker_id)
    return limits_exist


def retry_until_stopped(action: Callable[[], None], stopping: threading.Event, dsn: str) -> bool:
    """Run ``action`` until it gets through to the database or ``stopping`` is set, waits doubling to 1 s.

    Answers whether it had to wait: the database did not answer at first.
    """
    delay = 0.1
    waited = False
    said_at: dict[str, float] = {}  # by what was said: each reason on its own clock
    began, tries = time.monotonic(), 0
    while not stopping.is_set():
        try:
            action()
            return waited
        except RETRYABLE as exc:
            if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction) and read_only_by_own_settings(dsn):
                raise  # no failover to wait out: the worker's own settings forbid its writes
            waited = True
            tries += 1
            # The pool's timeout says only that it waited: a connection of its own says why.
            error = (connect_error(dsn) if isinstance(exc, PoolTimeout) else None) or str(exc)
            refusing_writes = isinstance(exc, psycopg.errors.ReadOnlySqlTransaction)
            wording = REFUSING_WRITES if refusing_writes else WORDINGS[retry_message(error)]
            now = time.monotonic()
            last = said_at.get(wording.begins)
            if last is None:
                event(logging.WARNING, wording.begins, error=error, retry_in=delay)
                said_at[wording.begins] = now
            elif now - last >= REPEAT_SECONDS:
                # A worker started against a database that never comes said so a line a try:
                # about 1,200 an hour. Each reason keeps its own clock, so tries that alternate
                # between two (refused, then unreachable) do not say each anew.
                event(logging.WARNING, wording.lasts, error=error, for_s=round(now - began, 1), tries=tries)
                said_at[wording.begins] = now
            stopping.wait(delay)
            delay = next_retry_delay(delay)
    return waited


#: A database that answered and refused the worker (a wrong password, a database that does not exist).
REFUSED = Wording(
    "database refused the connection; retrying",
    "database still refuses the connection; retrying",
    "database answered",
)
#: A database that answered and refuses writes (read-only: a failover, a standby): the start writes the registry.
REFUSING_WRITES = Wording(READ_ONLY, "database still refuses writes (read-only); retrying", "database takes writes")
#: What the start says as a wait begins and while it goes on, by what it said first.
WORDINGS = {wording.begins: wording for wording in (UNREACHABLE, REFUSED)}


def retry_message(error: str) -> str:
    """What the worker says while it waits: refused by a database that answered, or unreachable.

    Told by the severity libpq puts before the server's message; a server
    starting up, shutting down or in recovery refuses with that severity too,
    and is an outage. Where the server's messages are in another language,
    every failure reads as unreachable, and ``error`` still gives the
    server's words.
    """
    if SERVER_REFUSAL_MARK in error and SERVER_NOT_READY_MARK not in error:
        return REFUSED.begins
    return UNREACHABLE.begins


def probe_wait(dsn: str) -> dict[str, int]:
    """The connect_timeout of a connection the start makes to look at the database: REGISTER_WAIT_SECONDS,
    unless the DSN (or PGCONNECT_TIMEOUT) gives its own, which overriding would hide were it a bad one."""
    given = "connect_timeout" in conninfo_to_dict(dsn) or os.environ.get("PGCONNECT_TIMEOUT")
    return {} if given else {"connect_timeout": REGISTER_WAIT_SECONDS}


def read_only_by_own_settings(dsn: str) -> bool:
    """Whether the worker's sessions refuse writes because of its own settings, not the server's state now.

    ``default_transaction_read_only`` set by the connection's options (the
    DSN, PGOPTIONS), its role, or its role in this database is how a
    deployment gives a worker a role that may only read: that is fixed by
    changing the deployment, and the worker stops with the server's words.
    A server in recovery (a standby, which a failover may leave an old
    address naming), or one read-only by its own or the database's
    configuration (a cutover), takes writes again by itself: that is waited
    out. If it cannot be told, it is waited out too.
    """
    try:
        with psycopg.connect(dsn, **probe_wait(dsn)) as conn:
            row = conn.execute(sql("session_read_only_source")).fetchone()
    except psycopg.Error:
        return False
    return row is not None and not row[0] and row[1] and row[2] in {"client", "user", "database user"}


def connect_error(dsn: str) -> str | None:
    """Why a connection cannot be made now, in the server's or libpq's words; None when one can.

    The pool only says it waited in vain; the cause (a refused connection, a
    database that does not exist, a wrong password) is what an operator needs.
    A setting libpq cannot use (``sslmode=bogus``, ``connect_timeout=abc``)
    is no outage to wait out: it raises ConfigurationError.
    """
    try:
        psycopg.connect(dsn, **probe_wait(dsn)).close()
    except psycopg.Error as exc:
        if unusable_setting(exc):
            raise ConfigurationError(f"the database URL has a setting libpq cannot use: {exc}") from None
        return str(exc)
    return None  # the database answers: the pool's own timeout says what held it up
