"""Migrations: idempotent, concurrent-safe, recorded."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import conninfo

from relay_core import ConfigurationError, MigrationError, Relay
from relay_core import migrate as migrator
from relay_core.queries import sql

from .helpers import claim_params, publish_handlers, wait_for


def fresh_database(server_dsn: str) -> str:
    name = f"relay_migrate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return conninfo.make_conninfo(server_dsn, dbname=name)


def drop_database(dsn: str) -> None:
    name = conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(conninfo.make_conninfo(dsn, dbname="postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrate_twice_applies_once(database_url: str) -> None:
    dsn = fresh_database(database_url)
    try:
        assert migrator.migrate(dsn) == [f"{m.version:04d}_{m.name}" for m in migrator.available()]
        assert migrator.migrate(dsn) == []
        with psycopg.connect(dsn) as conn:
            assert migrator.schema_problem(conn) is None
    finally:
        drop_database(dsn)


def test_concurrent_migrate_commands_leave_one_schema(database_url: str, python: str, worker_env: dict) -> None:
    dsn = fresh_database(database_url)
    try:
        env = dict(worker_env, RELAY_DATABASE_URL=dsn)
        procs = [
            subprocess.Popen(
                [python, "-m", "relay_core", "migrate"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for _ in range(4)
        ]
        outputs = [p.communicate(timeout=60)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
        # Each migration is one migrator's, applied once: they may share the work, one migration each at a time.
        names = [name for out in outputs if "applied:" in out for name in out.split("applied:")[1].strip().split(", ")]
        assert sorted(names) == [f"{m.version:04d}_{m.name}" for m in migrator.available()], outputs
        with psycopg.connect(dsn) as conn:
            versions = [r[0] for r in conn.execute("SELECT version FROM relay.schema_migrations ORDER BY 1")]
            assert versions == [m.version for m in migrator.available()]
    finally:
        drop_database(dsn)


#: What a migration must not do, as the previous release's processes still run on the migrated schema
#: (docs/deploy.md, "Upgrading Relay"): a retyped column fails every prepared statement of theirs that
#: returns it until they restart; a dropped or renamed object fails their SQL outright. A function
#: named relay.migration_NNNN_* is a migration's own helper, made and dropped within it.
BREAKS_THE_RUNNING_RELEASE = re.compile(
    r"\bALTER\s+COLUMN\s+\w+\s+(?:SET\s+DATA\s+)?TYPE\b|\bDROP\s+COLUMN\b|\bRENAME\b"
    r"|\bDROP\s+(?:TABLE|VIEW|TYPE|DOMAIN|FUNCTION|PROCEDURE)\b(?!\s+relay\.migration_\d{4}_)",
    re.IGNORECASE,
)


def without_comments(sql: str) -> str:
    """``sql`` with its ``--`` comments removed (they may name what they avoid)."""
    return re.sub(r"--[^\n]*", "", sql)


def test_no_migration_breaks_the_release_still_running_while_it_is_applied() -> None:
    offending = {
        f"{m.version:04d}_{m.name}": found.group(0)
        for m in migrator.available()
        if (found := BREAKS_THE_RUNNING_RELEASE.search(without_comments(m.sql)))
    }
    assert offending == {}, "these migrations would break the release running while they apply"


@pytest.mark.parametrize(
    "statement",
    [
        "ALTER TABLE relay.jobs ALTER COLUMN queue TYPE relay.queue_name;",
        "ALTER TABLE relay.jobs ALTER COLUMN max_attempts SET DATA TYPE bigint;",
        "ALTER TABLE relay.jobs DROP COLUMN last_error;",
        "ALTER TABLE relay.jobs RENAME COLUMN type TO kind;",
        "DROP FUNCTION relay.published_max_attempts(text, integer);",
    ],
)
def test_the_running_release_guard_recognises_what_breaks_it(statement: str) -> None:
    assert BREAKS_THE_RUNNING_RELEASE.search(without_comments(statement))
    assert not BREAKS_THE_RUNNING_RELEASE.search(without_comments(f"-- not {statement}\nSELECT 1;"))
    assert not BREAKS_THE_RUNNING_RELEASE.search("DROP FUNCTION relay.migration_0009_tick_or_null(text);")


def migrate_to(dsn: str, version: int) -> None:
    """Apply the shipped migrations up to ``version``, as an older release of Relay left the schema."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        migrator._create_table_if_missing(conn)
        for migration in migrator.available():
            if migration.version <= version:
                conn.execute(migration.sql)
                conn.execute(
                    "INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)",
                    (migration.version, migration.name),
                )


def test_schedules_of_an_existing_database_keep_their_last_run(database_url: str) -> None:
    """Migration 0009 reads each schedule's last run from the cron jobs still kept; a schedule whose jobs
    retention removed is marked as unrecorded until then, not shown as never run."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 8)
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "INSERT INTO relay.schedules (type, cron, last_tick, next_tick) VALUES "
                "('nightly', '0 3 * * *', '2030-01-03 03:00+00', '2030-01-04 03:00+00'), "
                "('monthly', '0 0 1 * *', '2030-01-01 00:00+00', '2030-02-01 00:00+00')"
            )
            insert = (
                "INSERT INTO relay.jobs (status, type, payload, idempotency_key) "
                "VALUES ('queued', %s, jsonb_build_object('scheduled_for', %s::text), %s) RETURNING id"
            )
            for tick in ("2030-01-01T03:00:00+00:00", "2030-01-02T03:00:00+00:00"):
                conn.execute(insert, ("nightly", tick, f"cron:nightly:{tick}"))
            # Not a cron job of its schedule, whatever its payload says:
            conn.execute(insert, ("nightly", "2030-01-03T03:00:00+00:00", "my-own-key"))
            conn.execute(insert, ("monthly", "not a time", "cron:monthly:not a time"))
            # Shaped like a tick, but no such day: the cast failed the migration, and every later run of it.
            conn.execute(insert, ("monthly", "2024-02-30T00:00:00+00:00", "cron:monthly:2024-02-30T00:00:00+00:00"))
            (newest,) = conn.execute("SELECT max(id) FROM relay.jobs WHERE type = 'nightly'").fetchone()
            newest -= 1
        assert migrator.migrate(dsn) == [f"{m.version:04d}_{m.name}" for m in migrator.available() if m.version > 8]
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT type, last_enqueued_tick = '2030-01-02 03:00+00', last_job_id, runs_recorded_since IS NOT NULL "
                "FROM relay.schedules ORDER BY type"
            ).fetchall()
        assert rows == [("monthly", None, None, True), ("nightly", True, newest, False)]
    finally:
        drop_database(dsn)


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_the_counters_migration_counts_a_job_committed_while_it_waited_whatever_the_default_isolation(
    database_url: str, isolation: str
) -> None:
    """Migration 0003 counts the jobs there are once CREATE TRIGGER's lock has waited out the writers.
    The migrator's transactions took the database's default isolation: under REPEATABLE READ the
    snapshot came before that wait, and a job committed during it was counted by neither the trigger
    nor the count, for good."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 2)
        with psycopg.connect(dsn) as writer:
            writer.execute("INSERT INTO relay.jobs (type) VALUES ('early')")  # uncommitted: holds the table
            strict = conninfo.make_conninfo(
                dsn, options=f"-c default_transaction_isolation={isolation.replace(' ', chr(92) + ' ')}"
            )
            migrating = threading.Thread(target=migrator.migrate, args=(strict,), daemon=True)
            migrating.start()
            with psycopg.connect(dsn, autocommit=True) as watch:
                wait_for(
                    lambda: (
                        watch.execute(
                            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'relay.jobs'::regclass"
                        ).fetchone()[0]
                        > 0
                    ),
                    what="the migration to wait for the writer",
                )
            writer.commit()
        migrating.join(60)
        assert not migrating.is_alive()
        with psycopg.connect(dsn) as conn:
            counted = dict(conn.execute("SELECT state::text, sum(n)::int FROM relay.job_counts GROUP BY 1"))
            true = dict(conn.execute("SELECT status::text, count(*)::int FROM relay.jobs GROUP BY 1"))
        assert counted == true == {"queued": 1}
    finally:
        drop_database(dsn)


def test_an_existing_database_gets_the_table_workers_publish_max_attempts_to(database_url: str) -> None:
    """Migration 0010 adds relay.job_types and leaves existing jobs as they were; afterwards a
    worker publishes its handlers' max_attempts there and a handler-less enqueue reads them."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 9)
        with psycopg.connect(dsn) as conn:
            (old,) = conn.execute(
                "INSERT INTO relay.jobs (status, type, payload) VALUES ('queued', 'send_email', '{}') RETURNING id"
            ).fetchone()
        assert migrator.migrate(dsn)[0] == "0010_job_types"
        publish_handlers(dsn, send_email=3)
        bare = Relay(dsn)
        try:
            new = bare.enqueue("send_email")
        finally:
            bare.close()
        with psycopg.connect(dsn) as conn:
            rows = conn.execute("SELECT id, max_attempts FROM relay.jobs ORDER BY id").fetchall()
        assert rows == [(old, 20), (new, 3)]
    finally:
        drop_database(dsn)


#: The newest migrations that lock relay.jobs (its index builds, its CHECKs dropped): the lock tests start from them.
JOBS_TABLE_MIGRATIONS = (13, 14, 22, 27)


def pending_from(first: int) -> list[str]:
    """The names of the migrations from version ``first`` on."""
    return [f"{m.version:04d}_{m.name}" for m in migrator.available() if m.version >= first]


@pytest.mark.parametrize("behind", range(1, len(JOBS_TABLE_MIGRATIONS) + 1))
def test_the_newest_migrations_run_beside_a_transaction_that_reads_jobs_then_writes_them(
    database_url: str, behind: int
) -> None:
    """An application transaction that read relay.jobs before a deploy's migration began and
    writes it after must wait for the migration, or the migration for it: neither is aborted.
    A migration that took a weaker lock on the table and then a stronger one deadlocked with it,
    and so did two migrations in one transaction: 0013's index build kept its lock on the table
    while 0014 asked for a stronger one (each migration is now its own transaction)."""
    first = JOBS_TABLE_MIGRATIONS[-behind]
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, first - 1)
        with psycopg.connect(dsn, autocommit=True) as conn:
            (job_id,) = conn.execute("INSERT INTO relay.jobs (type) VALUES ('t') RETURNING id").fetchone()
        migrated: list[object] = []
        with psycopg.connect(dsn) as app:
            app.execute("SELECT status FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
            deploy = threading.Thread(target=lambda: migrated.append(migrator.migrate(dsn)))
            deploy.start()
            with psycopg.connect(dsn, autocommit=True) as watch:
                waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'relay.jobs'::regclass AND NOT granted"
                wait_for(lambda: watch.execute(waiting).fetchone()[0], what="the migration to wait for the table")
            app.execute("UPDATE relay.jobs SET priority = 1 WHERE id = %s", (job_id,))
            app.commit()
        deploy.join(30)
        assert migrated == [pending_from(first)]
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT priority FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (1,)
    finally:
        drop_database(dsn)


@contextmanager
def database_behind(database_url: str, version: int) -> Iterator[str]:
    """A fresh database an older release migrated up to just before ``version``; dropped afterwards."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, version - 1)
        yield dsn
    finally:
        drop_database(dsn)


def deploying(dsn: str, migrated: list[object], lock_wait: float) -> threading.Thread:
    """A started thread running ``relay migrate`` on ``dsn``; it appends what it applied to ``migrated``."""
    deploy = threading.Thread(target=lambda: migrated.append(migrator.migrate(dsn, lock_wait=lock_wait)))
    deploy.start()
    return deploy


def test_a_migration_waiting_for_a_lock_lets_the_statements_behind_it_through(database_url: str) -> None:
    """An enqueue left uncommitted in a slow request holds relay.jobs; the migration that needs the
    table to itself waits for it. Waiting, it queued every other statement on the table behind it
    (workers' claims, enqueues) until that request ended. It now waits a bounded time, lets go,
    and tries again: an enqueue meanwhile gets through, and the migration lands once the request ends."""
    first = JOBS_TABLE_MIGRATIONS[-1]
    with database_behind(database_url, first) as dsn:
        migrated: list[object] = []
        with psycopg.connect(dsn) as slow_request:
            slow_request.execute("INSERT INTO relay.jobs (type) VALUES ('in_a_slow_request')")
            deploy = deploying(dsn, migrated, lock_wait=0.3)
            with psycopg.connect(dsn, autocommit=True) as watch:
                waiting = "SELECT count(*) FROM pg_locks WHERE relation = 'relay.jobs'::regclass AND NOT granted"
                wait_for(lambda: watch.execute(waiting).fetchone()[0], what="the migration to wait for the table")
                # Before, this waited behind the migration until the slow request committed.
                watch.execute("SET statement_timeout = '20s'")
                watch.execute("INSERT INTO relay.jobs (type) VALUES ('meanwhile')")
            assert not migrated and deploy.is_alive()
            slow_request.commit()
        deploy.join(30)
        assert migrated == [pending_from(first)]


def test_a_migrator_that_waits_for_its_own_table_tries_again(database_url: str) -> None:
    """A lock on relay.schema_migrations (a VACUUM FULL of it, say) held past the lock wait: only the
    migration's own statements were tried again, and this failed the deploy outright."""
    last = migrator.available()[-1].version
    with database_behind(database_url, last) as dsn:
        migrated: list[object] = []
        with psycopg.connect(dsn) as maintenance:
            maintenance.execute("LOCK TABLE relay.schema_migrations IN ACCESS EXCLUSIVE MODE")
            deploy = deploying(dsn, migrated, lock_wait=0.3)
            deploy.join(1.5)
            assert deploy.is_alive() and not migrated
        deploy.join(30)
        assert migrated == [pending_from(last)]


def test_two_migrators_waiting_for_a_lock_still_let_the_statements_behind_them_through(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two `relay migrate` at once (Railway's two services each run it before a deploy). The one that
    let go of its try released the migration lock with it, and the other, waiting for that lock, took
    it at once and queued its own try: the pause between tries let nothing through, and every enqueue
    waited out a whole try for as long as the slow request stayed open. The pause now holds the lock.
    The warning named, as holding Relay's tables, the sessions queued behind the migration too."""
    caplog.set_level("WARNING", logger="relay")
    first = JOBS_TABLE_MIGRATIONS[-1]
    with database_behind(database_url, first) as dsn:
        migrated: list[object] = []
        quick: list[float] = []
        with psycopg.connect(dsn) as slow_request, psycopg.connect(dsn, autocommit=True) as enqueuer:
            slow_request.execute("INSERT INTO relay.jobs (type) VALUES ('in_a_slow_request')")
            # Each try outlasts the pause between two: the other migrator's try filled that pause.
            deploys = [deploying(dsn, migrated, lock_wait=1.5) for _ in "ab"]
            enqueuer.execute("SET statement_timeout = '20s'")
            until = time.monotonic() + 6
            while time.monotonic() < until:
                started = time.monotonic()
                enqueuer.execute("INSERT INTO relay.jobs (type) VALUES ('meanwhile')")
                if time.monotonic() - started < 0.1:
                    quick.append(started)
            assert not migrated and all(deploy.is_alive() for deploy in deploys)
            slow_request.commit()
            holder = slow_request.info.backend_pid
            queued_behind = enqueuer.info.backend_pid
        for deploy in deploys:
            deploy.join(30)
        assert len(migrated) == 2 and sorted(migrated[0] + migrated[1]) == pending_from(first)  # each once
    # A pause of 1 s follows each try of 1.5 s, and enqueues meanwhile go straight through; before,
    # every one but those that fell into the moment between two migrators' tries waited for a try.
    assert len(quick) >= 100, len(quick)
    named = [r.holders for r in caplog.records if r.getMessage().startswith("a migration waited for a lock")]
    # The first try names it; the one that holds the migration lock then waits for it to end, and a
    # try that ended as the slow request committed finds no one holding the table ("none now").
    assert any(f"pid {holder} " in holders for holders in named), named
    assert not any(f"pid {queued_behind} " in holders for holders in named), named


def tries_of(caplog: pytest.LogCaptureFixture) -> int:
    """How many of a migration's tries waited too long for a table (each says so once)."""
    return sum(r.getMessage().startswith("a migration waited for a lock") for r in caplog.records)


def test_a_migration_held_up_by_an_open_transaction_tries_again_once_it_ends(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request's transaction that enqueued and stays open holds up the index a migration builds. The
    migration tried again after a fixed pause while that transaction still held the table, and each try
    queued every enqueue and claim behind it: they stalled 5 s of every 6 for as long as it stayed open
    (ten minutes, a deploy's patience). It now tries again once that transaction has ended: one stall.
    Meanwhile it holds no transaction open, which would hold back every vacuum."""
    caplog.set_level("WARNING", logger="relay")
    with database_behind(database_url, 23) as dsn:
        migrated: list[object] = []
        stalls: list[float] = []
        with psycopg.connect(dsn) as slow_request, psycopg.connect(dsn, autocommit=True) as enqueuer:
            slow_request.execute("INSERT INTO relay.jobs (type) VALUES ('in_a_slow_request')")
            deploy = deploying(dsn, migrated, lock_wait=0.3)
            enqueuer.execute("SET statement_timeout = '20s'")
            until = time.monotonic() + 4  # some three tries of 0.3 s and their pauses of 1 s, before
            while time.monotonic() < until:
                started = time.monotonic()
                enqueuer.execute("INSERT INTO relay.jobs (type) VALUES ('meanwhile')")
                if time.monotonic() - started > 0.25:
                    stalls.append(started)
                time.sleep(0.01)
            assert not migrated and deploy.is_alive()
            open_elsewhere = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%%' AND pid <> %s"
            )
            assert enqueuer.execute(open_elsewhere, (slow_request.info.backend_pid,)).fetchone() == (0,)
            slow_request.commit()
        deploy.join(30)
        assert migrated == [pending_from(23)]
    assert tries_of(caplog) == 1
    assert len(stalls) <= 2, stalls  # the one try's, and room for a machine's hiccup


def test_a_migration_waits_only_for_the_transactions_that_held_it_up(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After a try that waited too long, the next one waits for the sessions that held it up, not for
    every open transaction on Relay's tables: not for one that only reads while the migration's lock
    allows reads (a pg_dump reads for hours, and a new index does not wait for it), nor for one
    writing another of Relay's tables. Migration 0027 adds a column, which needs the table to
    itself: it waits for the reader, and only for it."""
    caplog.set_level("WARNING", logger="relay")
    with database_behind(database_url, 23) as dsn:
        migrated: list[object] = []
        with (
            psycopg.connect(dsn) as dump,
            psycopg.connect(dsn) as elsewhere,
            psycopg.connect(dsn) as slow_request,
            psycopg.connect(dsn, autocommit=True) as watch,
        ):
            dump.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            dump.execute("SELECT count(*) FROM relay.jobs").fetchone()
            elsewhere.execute("INSERT INTO relay.queues (name, paused) VALUES ('elsewhere', false)")
            slow_request.execute("INSERT INTO relay.jobs (type) VALUES ('in_a_slow_request')")
            deploy = deploying(dsn, migrated, lock_wait=0.3)
            wait_for(lambda: tries_of(caplog), what="a try to wait for the slow request")
            slow_request.commit()
            newest = "SELECT max(version) FROM relay.schema_migrations"
            wait_for(lambda: watch.execute(newest).fetchone() == (26,), what="0023-0026 applied beside the reader")
            assert deploy.is_alive() and not migrated, "0027 applied while the reader held the table"
            dump.commit()
            deploy.join(15)
            assert migrated == [pending_from(23)], "applied while the other writer is open"
            assert elsewhere.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS


@contextmanager
def role_owning_its_schema(database_url: str) -> Iterator[tuple[str, str, str]]:
    """A fresh database whose schema relay a new login role owns, with CREATE on the database revoked
    from PUBLIC: (the admin DSN, the role's DSN, the role's name). Both are dropped afterwards."""
    dsn = fresh_database(database_url)
    role = f"relay_app_{uuid.uuid4().hex[:8]}"
    dbname = conninfo.conninfo_to_dict(dsn)["dbname"]
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'CREATE ROLE "{role}" LOGIN')
            admin.execute(f'REVOKE CREATE ON DATABASE "{dbname}" FROM PUBLIC')
            admin.execute(f'CREATE SCHEMA relay AUTHORIZATION "{role}"')
        yield dsn, conninfo.make_conninfo(dsn, user=role), role
    finally:
        drop_database(dsn)
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_a_role_that_may_not_create_in_the_database_migrates_its_own_schema(database_url: str) -> None:
    """A least-privilege role owning schema relay, without CREATE on the database: `relay migrate`
    with nothing pending failed with "permission denied for database" on every deploy."""
    with role_owning_its_schema(database_url) as (dsn, as_role, role):
        dbname = conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'GRANT CREATE ON DATABASE "{dbname}" TO "{role}"')
        assert len(migrator.migrate(as_role)) == len(migrator.available())
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'REVOKE CREATE ON DATABASE "{dbname}" FROM "{role}"')
        assert migrator.migrate(as_role) == []


def test_a_role_given_only_its_own_schema_makes_its_first_install(database_url: str) -> None:
    """The schema made for the role beforehand, no CREATE on the database: the first `relay migrate`
    failed with "permission denied for database", as CREATE SCHEMA IF NOT EXISTS asks for it anyway."""
    with role_owning_its_schema(database_url) as (_dsn, as_role, _role):
        assert len(migrator.migrate(as_role)) == len(migrator.available())
        assert migrator.migrate(as_role) == []


def test_a_role_without_temp_tables_migrates_and_a_failing_migration_is_named(database_url: str) -> None:
    """Migration 0009 made a temporary function, which needs TEMP on the database: a role without it
    stopped at 0009 on every deploy, told only "permission denied to create temporary tables". And the
    error of a failing migration now names it and says the ones before it are applied."""
    with role_owning_its_schema(database_url) as (dsn, as_role, _role):
        dbname = conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'REVOKE TEMP ON DATABASE "{dbname}" FROM PUBLIC')
        assert len(migrator.migrate(as_role)) == len(migrator.available())
        with psycopg.connect(as_role) as conn:
            leftovers = "SELECT count(*) FROM pg_proc WHERE proname LIKE 'migration_0009%'"
            assert conn.execute(leftovers).fetchone()[0] == 0, "the migration's function is dropped"
            conn.execute("DELETE FROM relay.schema_migrations WHERE version = 21")
            conn.execute("ALTER TABLE relay.schedules RENAME TO schedules_elsewhere")  # 0021 alters it
        with pytest.raises(migrator.MigrationError, match="migration 0021_schedule_publisher failed") as failed:
            migrator.migrate(as_role)
        assert "the migrations before it are applied" in str(failed.value)


def test_a_migrator_waits_out_another_whatever_lock_timeout_the_database_sets(database_url: str) -> None:
    """A database's (or a role's, or PGOPTIONS') lock_timeout cut short the wait for another migrator:
    on a fresh database it failed with 'schema "relay" does not exist', and on a migrated one it
    spent the patience meant for waits on tables while the other migrator worked."""
    dsn = fresh_database(database_url)
    dbname = conninfo.conninfo_to_dict(dsn)["dbname"]
    try:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE \"{dbname}\" SET lock_timeout = '200ms'")
        migrated: list[object] = []
        with psycopg.connect(dsn) as other_migrator:
            other_migrator.execute("SELECT pg_advisory_xact_lock(%s)", (migrator.MIGRATION_LOCK_KEY,))
            deploy = threading.Thread(target=lambda: migrated.append(migrator.migrate(dsn, patience=0.5)))
            deploy.start()
            deploy.join(1.5)
            assert deploy.is_alive() and not migrated
            other_migrator.commit()
        deploy.join(60)
        assert migrated == [[f"{m.version:04d}_{m.name}" for m in migrator.available()]]
    finally:
        drop_database(dsn)


def test_a_rate_window_past_31_days_written_by_hand_no_longer_stops_every_claim(database_url: str) -> None:
    """relay.type_limits accepted a rate_period_seconds of 'Infinity' or NaN, and every worker's claim,
    which evaluates each limit's window, then failed with "interval out of range" on every queue.
    Migration 0020 brings such rows down to the 31-day bound and refuses new ones."""
    from relay_core.queries import sql

    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 19)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO relay.type_limits (type, rate_limit, rate_period_seconds) VALUES "
                "('forever', 5, 'Infinity'), ('nan', 5, 'NaN'), ('huge', 5, 1e300), ('hour', 5, 3600)"
            )
            # A start of each inside its window: the claim evaluates a window only to count starts.
            conn.execute("INSERT INTO relay.rate_starts (type, started_at) SELECT type, now() FROM relay.type_limits")
            conn.execute("INSERT INTO relay.jobs (status, type, payload) VALUES ('queued', 'send_email', '{}')")
            claim = claim_params()
            with pytest.raises(psycopg.errors.DatetimeFieldOverflow):
                conn.execute(sql("job_claim"), claim)
            assert migrator.migrate(dsn)[0] == "0020_type_limits_window_bounded"
            windows = conn.execute("SELECT type, rate_period_seconds FROM relay.type_limits ORDER BY type").fetchall()
            assert windows == [("forever", 2678400), ("hour", 3600), ("huge", 2678400), ("nan", 2678400)]
            assert len(conn.execute(sql("job_claim"), claim).fetchall()) == 1
            with pytest.raises(psycopg.errors.CheckViolation, match="type_limits_rate_window_at_most_31_days"):
                conn.execute("UPDATE relay.type_limits SET rate_period_seconds = 'Infinity' WHERE type = 'hour'")
    finally:
        drop_database(dsn)


#: The one-job enqueue of the releases before migration 0027, which counted nothing itself.
JOB_INSERT_BEFORE_0027 = """
INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts)
VALUES ('queued', %(type)s, %(payload)s::jsonb, %(queue)s, %(priority)s,
        coalesce(%(run_at)s::timestamptz, now()),
        CASE WHEN %(published)s
             THEN relay.published_max_attempts(%(type)s, %(max_attempts)s)
             ELSE %(max_attempts)s END)
RETURNING id, CASE WHEN %(notify)s AND run_at <= now() THEN pg_notify('relay_jobs', queue) END AS notified
"""


def old_release_enqueue(queue: str) -> dict[str, object]:
    """The parameters of JOB_INSERT_BEFORE_0027 for one job of type t into ``queue``."""
    return {
        "type": "t",
        "payload": "{}",
        "queue": queue,
        "priority": 0,
        "run_at": None,
        "max_attempts": 3,
        "published": False,
        "notify": False,
    }


def test_statements_prepared_before_the_checks_moved_into_the_triggers_keep_working(database_url: str) -> None:
    """Migration 0022 drops relay.jobs' CHECKs and checks their rules in the counting triggers. The
    running release's prepared enqueue and claim go on working on the same connection through it,
    and a row written by hand that breaks a rule is refused before and after, by the same name."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 21)
        enqueue = old_release_enqueue("default")
        bad_queue = "INSERT INTO relay.jobs (type, queue) VALUES ('t', 'Bad Queue')"
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
            for _ in range(2):
                conn.execute(JOB_INSERT_BEFORE_0027, enqueue)
                assert len(conn.execute(sql("job_claim"), claim_params()).fetchall()) == 1
                with pytest.raises(psycopg.errors.CheckViolation, match="jobs_queue_format") as refused:
                    conn.execute(bad_queue)
                assert refused.value.diag.constraint_name == "jobs_queue_format"
                if not conn.execute("SELECT 1 FROM relay.schema_migrations WHERE version = 22").fetchone():
                    assert migrator.migrate(dsn)[0] == "0022_job_checks_in_counting_triggers"
            checks = conn.execute(
                "SELECT count(*) FROM pg_constraint WHERE conrelid = 'relay.jobs'::regclass AND contype = 'c'"
            ).fetchone()
            assert checks == (0,)
            counts = conn.execute("SELECT state::text, sum(n) FROM relay.job_counts GROUP BY 1 HAVING sum(n) <> 0")
            assert counts.fetchall() == [("claimed", 2)]
    finally:
        drop_database(dsn)


def test_the_release_before_0027_goes_on_enqueueing_and_its_jobs_are_counted_once(database_url: str) -> None:
    """0027 moves the count of Relay's inserts into the statements themselves. The release still
    running, whose prepared enqueue names no counted_by_transaction, goes on working through it on the
    same connection; its jobs are counted (by the row trigger) once, as are the new release's
    (by their own statement), and a bad row by hand is still refused by name."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 26)
        enqueue = old_release_enqueue("q")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as old_release:
            for _ in range(2):
                old_release.execute(JOB_INSERT_BEFORE_0027, enqueue)
                if not old_release.execute("SELECT 1 FROM relay.schema_migrations WHERE version = 27").fetchone():
                    assert migrator.migrate(dsn) == ["0027_inserts_count_themselves"]
            with pytest.raises(psycopg.errors.CheckViolation, match="jobs_queue_format") as refused:
                old_release.execute("INSERT INTO relay.jobs (type, queue) VALUES ('t', 'Bad Queue')")
            assert refused.value.diag.constraint_name == "jobs_queue_format"
        relay = Relay(dsn)
        try:
            relay.enqueue("t", queue="q")
            relay.enqueue("t", queue="q", idempotency_key="k")
            relay.enqueue_many([{"type": "t", "queue": "q"}, {"type": "t", "queue": "r", "idempotency_key": "k2"}])
        finally:
            relay.close()
        with psycopg.connect(dsn) as conn:
            counted = conn.execute("SELECT queue, sum(n)::int FROM relay.job_counts GROUP BY 1 ORDER BY 1").fetchall()
            held = conn.execute("SELECT queue, count(*)::int FROM relay.jobs GROUP BY 1 ORDER BY 1").fetchall()
        assert counted == held == [("q", 5), ("r", 1)]
    finally:
        drop_database(dsn)


def test_a_migration_recorded_under_another_name_is_refused_and_the_schema_not_current(database_url: str) -> None:
    """Counted by number alone, a database migrated by a build whose 0019 was later withdrawn (and its
    number reused) skipped the shipped 0019 and was called current, its one-job enqueue broken."""
    dsn = fresh_database(database_url)
    try:
        migrate_to(dsn, 18)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO relay.schema_migrations (version, name) VALUES (19, 'job_checks_as_domains')")
            before = conn.execute("SELECT version, name FROM relay.schema_migrations ORDER BY version").fetchall()
            with pytest.raises(MigrationError) as refused:
                migrator.migrate(dsn)
            said = str(refused.value)
            assert "the database records migration 0019_job_checks_as_domains" in said
            assert "this Relay ships 0019_worker_state_bounded" in said
            assert (
                conn.execute("SELECT version, name FROM relay.schema_migrations ORDER BY version").fetchall() == before
            )
            assert migrator.schema_problem(conn) is not None
            # Every migration is recorded now, 0019 still under the other name: still not current.
            for m in migrator.available():
                if m.version > 19:
                    conn.execute(
                        "INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)", (m.version, m.name)
                    )
            assert migrator.pending(conn) == []
            assert migrator.schema_problem(conn) is not None
            # A worker says what relay migrate would: it told the operator to run it, and relay migrate refused.
            problem = migrator.schema_problem(conn)
            assert problem is not None and problem.startswith(
                "the database records migration 0019_job_checks_as_domains"
            )
            assert "Restore the database from before that build" in problem and "run `relay migrate`" not in problem
        relay = Relay(dsn)
        relay.handler("send_email")(lambda job: None)
        try:
            with pytest.raises(ConfigurationError) as refused_start:
                relay.worker(concurrency=1).run(install_signals=False)
        finally:
            relay.close()
        assert str(refused_start.value) == problem
    finally:
        drop_database(dsn)
