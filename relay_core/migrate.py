"""Applies the numbered SQL files in ``migrations/`` under an advisory lock.

Two ``relay migrate`` runs at once are safe: the second waits on the lock,
then finds every migration recorded and applies nothing.

Each migration is its own transaction, recorded with it: all of it or none.
One transaction for every pending migration held each one's table locks to
the end, so a later migration asking for a stronger lock on a table an
earlier one had locked deadlocked with an application transaction that read
the table first and wrote it afterwards. A migration waits at most
``lock_wait`` seconds for its locks, then lets go and tries again once the
transactions that held it up have ended (``lock_waits``): while it waits,
every statement on that table (workers' claims, enqueues, the dashboard's
reads) queues behind it, and an application transaction left open would
stall them all for as long as it stays open.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

import psycopg

from .connect_options import connection_options
from .errors import ConfigurationError, MigrationError
from .lock_waits import BlockerWatch, wait_until_ended
from .logs import event

#: Advisory-lock key shared by every migrator ("relay" as digits, arbitrary but fixed).
#: Every advisory-lock key Relay takes is listed here, so that none is taken twice:
#: 7265108721 this one; 7265108722 the counter fold (monitor.FOLD_LOCK_KEY);
#: 7265108723 the claims of limited types (claim_limits_lock in operations.sql).
#: A new one takes the next number.
MIGRATION_LOCK_KEY = 7_265_108_721

_FILENAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

#: How long a migration waits for a table's lock before it lets go and tries again.
LOCK_WAIT_SECONDS = 5.0
#: How long ``migrate`` keeps trying to get a migration's locks before it gives up.
LOCK_PATIENCE_SECONDS = 600.0
#: The pause after a try that waited too long, which lets the statements queued behind it through
#: (the migration lock held, so no other migrator's try fills it); the next try then waits for the
#: transactions that held this one up to end (``lock_waits``).
LOCK_RETRY_PAUSE_SECONDS = 1.0

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS relay.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

#: Sessions whose transactions began before a migration's try (%(began)s) and hold a lock on one
#: of Relay's tables (pg_locks shows every database's: a table of another may have the same oid):
#: whom the try waited for, not the statements queued behind it.
_LOCK_HOLDERS = """
SELECT DISTINCT a.pid, a.state, left(a.query, 80) AS query
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.relation IN (SELECT c.oid FROM pg_class AS c WHERE c.relnamespace = to_regnamespace('relay'))
  AND a.pid <> pg_backend_pid() AND a.xact_start < %(began)s
ORDER BY a.pid
"""

#: Lifts, for a migration's transaction, every timeout a role, a database or PGOPTIONS may set:
#: PostgreSQL 17's transaction_timeout too, where the server has it (15 and 16 do not know the name).
_NO_TIMEOUTS = """
SELECT set_config('lock_timeout', '0', true), set_config('statement_timeout', '0', true),
       set_config('idle_in_transaction_session_timeout', '0', true),
       (SELECT set_config(name, '0', true) FROM pg_settings WHERE name = 'transaction_timeout')
"""


@dataclass(frozen=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped in the package, in order."""
    found = []
    folder = resources.files("relay_core").joinpath("migrations")
    for entry in folder.iterdir():
        match = _FILENAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a version number: {versions}")
    return found


def applied(conn: psycopg.Connection) -> dict[int, str]:
    """Migrations recorded as applied, version -> name (empty if Relay was never migrated here)."""
    exists = conn.execute("SELECT to_regclass('relay.schema_migrations') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return {}
    return dict(conn.execute("SELECT version, name FROM relay.schema_migrations").fetchall())


def applied_versions(conn: psycopg.Connection) -> set[int]:
    """Versions recorded as applied (empty if Relay was never migrated here)."""
    return set(applied(conn))


#: What a statement of Relay's fails with on a database whose schema is behind
#: this release (never migrated, or a deploy whose migrations have not run yet):
#: a missing schema, table, column, function or type.
MISSING_SCHEMA_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.UndefinedObject,
)


MISSING_SCHEMA_SQLSTATES = frozenset(error.sqlstate for error in MISSING_SCHEMA_ERRORS)

#: What Relay says when one of its statements fails that way (the server's words stay in the cause).
MISSING_TABLES = "Relay's tables are missing or older than this release: run `relay migrate` first"


def schema_missing(exc: BaseException) -> ConfigurationError | None:
    """What to raise instead of ``exc`` when it says Relay's schema is missing or behind this release; else None.

    For an application's calls (an enqueue, an admin action): they raised the
    server's ``relation "relay.jobs" does not exist`` as it came, where the
    CLI, the worker and the web app say to run ``relay migrate``. A
    ConfigurationError, like the worker's refusal to start on such a
    database, to be raised from ``exc``, which keeps the server's words. Told
    by the server's error code, whether psycopg raised it or SQLAlchemy
    wrapped it (``orig``), psycopg's (``sqlstate``) or psycopg2's (``pgcode``).
    """
    cause = getattr(exc, "orig", exc)
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code not in MISSING_SCHEMA_SQLSTATES:
        return None
    return ConfigurationError(MISSING_TABLES)


#: An object of Relay's schema as the server's error message names it: relation "relay.jobs",
#: function relay.published_max_attempts(...), type "relay.job_status", schema "relay".
NAMES_RELAYS_SCHEMA = re.compile(r'\brelay\.|"relay"')


class SchemaNeeded:
    """Around Relay's statements: raise ``schema_missing``'s error instead of one that says the schema is behind.

    A class rather than a generator-based context manager: an enqueue runs
    inside one, and entering this costs next to nothing.

    ``conn``: the caller's connection the statements run on, if any. In a
    psycopg pipeline (``conn.pipeline()``) the server's error for one of the
    caller's own statements queued before Relay's (a mistyped table) comes
    back at Relay's fetch: there only an error that names Relay's schema is
    Relay's to explain, and any other is raised as it came.
    """

    __slots__ = ("conn",)

    def __init__(self, conn: object = None) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        missing = schema_missing(exc) if exc is not None else None
        if missing is not None and (not self._in_pipeline() or _names_relays_schema(exc)):
            raise missing from exc
        return False

    def _in_pipeline(self) -> bool:
        pgconn = getattr(self.conn, "pgconn", None)  # a psycopg connection, sync or async
        try:
            return pgconn is not None and pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF
        except psycopg.Error:  # a connection closed since: not in a pipeline any more
            return False


def _names_relays_schema(exc: BaseException) -> bool:
    """Whether the server's message of ``exc`` names an object of Relay's schema."""
    diag = getattr(exc, "diag", None)
    return bool(NAMES_RELAYS_SCHEMA.search(getattr(diag, "message_primary", None) or ""))


#: What a database recording another build's migrations went through, and what to do about it.
FOREIGN_BUILD = "a build whose migrations this Relay does not ship migrated this database"
RESTORE = (
    "Restore the database from before that build (or, if its jobs may go, drop the relay schema) and migrate again"
)


def replaced(recorded: dict[int, str]) -> list[str]:
    """The recorded migrations whose number this Relay ships under another name, each as a sentence.

    A migration's number is its own once released. A database that records
    another name under it was migrated by a build that shipped a migration
    this Relay does not have (one withdrawn before a release, its number
    reused), so its schema is not the one this Relay's migrations build on;
    counted by number alone, the shipped one was skipped and the schema
    reported current.
    """
    shipped = {m.version: m.name for m in available()}
    return [
        f"the database records migration {version:04d}_{name} where this Relay ships {version:04d}_{shipped[version]}"
        for version, name in sorted(recorded.items())
        if version in shipped and shipped[version] != name
    ]


def pending(conn: psycopg.Connection) -> list[Migration]:
    """Migrations not yet applied on this database."""
    done = applied_versions(conn)
    return [m for m in available() if m.version not in done]


def migrate(dsn: str, lock_wait: float = LOCK_WAIT_SECONDS, patience: float = LOCK_PATIENCE_SECONDS) -> list[str]:
    """Bring the schema up to date; return the names of the migrations applied.

    One transaction per migration, each holding the transaction-level
    advisory lock (so concurrent migrators serialise instead of racing, and
    a transaction pooler is no obstacle): a failure leaves the schema as the
    last migration that succeeded left it. See the module's docstring for
    ``lock_wait``; ``patience`` bounds the tries of one migration.
    """
    done: list[str] = []
    try:
        with psycopg.connect(dsn, autocommit=True, **connection_options(dsn)) as conn:
            # READ COMMITTED whatever the database's default: a migration that writes what it reads
            # (0003 counts the jobs once CREATE TRIGGER's lock waited out their writers) must read
            # after that wait, not from a snapshot taken before it.
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            while (name := _apply_next(conn, dsn, lock_wait, patience)) is not None:
                done.append(name)
    except psycopg.Error as exc:
        raise MigrationError(f"migration failed: {exc}") from exc
    return done


def _apply_next(conn: psycopg.Connection, dsn: str, lock_wait: float, patience: float) -> str | None:
    """Apply the first pending migration in a transaction of its own; its name, or None when none is pending.

    A try that waits ``lock_wait`` for a table lets go of it (the migration
    runs under a savepoint, rolled back alone) and pauses, still holding the
    migration lock: another migrator waiting for that lock (two services
    that each run ``relay migrate`` before a deploy) took it the moment a
    failed try's transaction ended and queued its own try for the table,
    and the pause let nothing through. Then, its transaction ended, it waits
    for the transactions that held the try up (a ``BlockerWatch`` noted
    them) to end before it tries again. ``patience`` counts the tries and
    the waits between them: the wait for another migrator (whose index
    build may take long) is not bounded.
    """
    waited = 0.0
    while True:
        began = tried_at = watch = None
        try:
            with conn.transaction():
                # No timeout of a role's, a database's or PGOPTIONS' may cut short the wait for another
                # migrator, nor an index build, nor end the session in the pause between two tries.
                conn.execute(_NO_TIMEOUTS)
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
                # The server process of this transaction, as the server knows it: behind a transaction
                # pooler, the one the connection announced at its start is the pooler's, or another's.
                began, server_pid = conn.execute("SELECT clock_timestamp(), pg_backend_pid()").fetchone()
                watch = BlockerWatch(dsn, server_pid)
                tried_at = time.monotonic()
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (f"{int(lock_wait * 1000)}ms",))
                try:
                    with watch:
                        return _apply_first_pending(conn)
                except _TableWaitedFor:  # and let go of: the pause holds the migration lock
                    waited = _wait_for_the_queue(conn, began, waited + time.monotonic() - tried_at, patience)
        except psycopg.errors.LockNotAvailable:
            # Waited too long outside the migration itself (a VACUUM FULL of schema_migrations): the
            # transaction, and the migration lock with it, is gone; pause all the same.
            if tried_at is None:
                raise  # not past the migration lock: lock_timeout was 0 there
            waited = _wait_for_the_queue(conn, began, waited + time.monotonic() - tried_at, patience)
        # Outside the transaction: one left open through a long wait would hold back every vacuum.
        waited_from = time.monotonic()
        blockers = watch.blockers if watch is not None else []
        wait_until_ended(conn, blockers, until=waited_from + max(patience - waited, 0.0))
        waited += time.monotonic() - waited_from


class _TableWaitedFor(Exception):
    """A migration's try waited ``lock_wait`` for a table and was rolled back to before it."""


def _apply_first_pending(conn: psycopg.Connection) -> str | None:
    """Apply the first pending migration in the transaction under way: its name, None when none is
    pending; _TableWaitedFor when it waited too long for a table (rolled back to its savepoint)."""
    _create_table_if_missing(conn)
    conflicts = replaced(applied(conn))
    if conflicts:
        raise MigrationError(f"{'; '.join(conflicts)}: {FOREIGN_BUILD}, so nothing was applied. {RESTORE}")
    todo = pending(conn)
    if not todo:
        return None
    migration = todo[0]
    try:
        with conn.transaction():  # a savepoint: a try that waited too long lets go of the table alone
            conn.execute(migration.sql)
    except psycopg.errors.LockNotAvailable:
        raise _TableWaitedFor from None
    except psycopg.Error as exc:
        # Which one, and that those before it stay: the operator fixes the cause and runs it again.
        raise MigrationError(
            f"migration {migration.version:04d}_{migration.name} failed, and was rolled back "
            f"(the migrations before it are applied): {exc}"
        ) from exc
    conn.execute(
        "INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)", (migration.version, migration.name)
    )
    return f"{migration.version:04d}_{migration.name}"


def _wait_for_the_queue(conn: psycopg.Connection, began: datetime, waited: float, patience: float) -> float:
    """After a try that waited too long for a table: give up past ``patience`` (``waited``: the
    tries and pauses so far), naming who held Relay's tables, else say so and pause while the
    statements queued behind the try go through; what has been waited with the pause.

    Named are the sessions whose transactions began before the try (``began``)
    and hold a lock on one of Relay's tables: those queued behind it, a
    worker's claim or an enqueue, hold some too but came later.
    """
    holders = [f"pid {pid} ({state}: {query})" for pid, state, query in conn.execute(_LOCK_HOLDERS, {"began": began})]
    if waited >= patience:
        raise MigrationError(
            f"a migration could not get its locks in {patience:.0f} s; sessions holding locks on "
            f"Relay's tables: {', '.join(holders) or 'none now'}"
        )
    event(
        logging.WARNING,
        "a migration waited for a lock on Relay's tables; letting the statements queued behind it through,"
        " and trying again once the transactions it waited for have ended",
        holders="; ".join(holders) or "none now",
    )
    time.sleep(LOCK_RETRY_PAUSE_SECONDS)
    return waited + LOCK_RETRY_PAUSE_SECONDS


def _create_table_if_missing(conn: psycopg.Connection) -> None:
    """The schema and its migrations table, only when missing: a CREATE ... IF NOT EXISTS needs the
    privilege to create even when there is nothing to create, and a role allowed only its own schema
    would fail every deploy."""
    schema, table = conn.execute(
        "SELECT to_regnamespace('relay') IS NOT NULL, to_regclass('relay.schema_migrations') IS NOT NULL"
    ).fetchone()
    if not schema:
        # Not IF NOT EXISTS, for the same reason: a schema made for the role beforehand is enough.
        conn.execute("CREATE SCHEMA relay")
    if not table:
        conn.execute(_CREATE_TABLE)


def unknown_applied(dsn: str) -> list[str]:
    """Migrations recorded on the database that this Relay does not ship (a newer Relay applied them)."""
    shipped = {m.version for m in available()}
    try:
        with psycopg.connect(dsn, **connection_options(dsn)) as conn:
            recorded = applied(conn)
    except psycopg.Error as exc:
        raise MigrationError(f"cannot read the applied migrations: {exc}") from exc
    return [f"{version:04d}_{name}" for version, name in sorted(recorded.items()) if version not in shipped]


def schema_problem(conn: psycopg.Connection) -> str | None:
    """Why this Relay cannot run on the database's schema, as what to do about it; None when every
    shipped migration is applied under its own name (the readiness check; see ``replaced``).

    Behind (``relay migrate`` brings it up), or migrated by another build
    (which ``relay migrate`` refuses: telling the operator to run it sent
    them to a command that would say no).
    """
    recorded = applied(conn)
    conflicts = replaced(recorded)
    if conflicts:
        return f"{'; '.join(conflicts)}: {FOREIGN_BUILD}. {RESTORE}"
    if any(recorded.get(m.version) != m.name for m in available()):
        return "the database schema is not up to date: run `relay migrate` first"
    return None
