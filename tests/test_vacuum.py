"""Relay vacuums its own tables where autovacuum is off, and only there."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Relay
from relay_core.worker import maintenance, vacuum
from relay_core.worker.vacuum import VACUUM_THRESHOLD, vacuum_if_needed

from .helpers import running_worker, wait_for


@pytest.fixture(autouse=True)
def no_naptime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests share one database, where an earlier test's vacuum would otherwise hold the next one off."""
    monkeypatch.setattr(vacuum, "VACUUM_NAPTIME_SECONDS", 0)


@pytest.fixture
def jobs_without_autovacuum(db: psycopg.Connection) -> Iterator[None]:
    """relay.jobs with autovacuum switched off for the table (the server's setting may be either)."""
    db.execute("ALTER TABLE relay.jobs SET (autovacuum_enabled = false)")
    try:
        yield
    finally:
        db.execute("ALTER TABLE relay.jobs RESET (autovacuum_enabled)")


def _jobs_stats(db: psycopg.Connection) -> tuple[int, int]:
    """(dead row versions, vacuums so far) of relay.jobs, as the statistics system sees them now."""
    db.execute("SELECT pg_stat_clear_snapshot()")
    row = db.execute(
        "SELECT n_dead_tup, vacuum_count FROM pg_stat_user_tables WHERE relid = 'relay.jobs'::regclass"
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def _leave_dead_rows(relay: Relay, dsn: str, count: int) -> None:
    """Insert ``count`` jobs and delete them, from a session whose statistics are flushed on close."""
    relay.enqueue_many([{"type": "t", "payload": {"i": i}} for i in range(count)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM relay.jobs")


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_table_autovacuum_skips_is_vacuumed_once_dead_rows_pass_the_threshold(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
    vacuums_before = _jobs_stats(db)[1]

    with psycopg.connect(dsn) as conn:
        vacuumed = vacuum_if_needed(conn)
        assert not conn.autocommit, "the connection goes back to transactions after VACUUM"

    assert "jobs" in vacuumed
    wait_for(lambda: _jobs_stats(db) == (0, vacuums_before + 1), timeout=10, what="the vacuum counted")
    # Autovacuum off is autoanalyze off too: without an ANALYZE the planner kept the row
    # counts and value spread of the table's first days, whatever the backlog became.
    assert db.execute(
        "SELECT analyze_count > 0 AND n_mod_since_analyze = 0 FROM pg_stat_user_tables"
        " WHERE relid = 'relay.jobs'::regclass"
    ).fetchone()[0]


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_few_dead_rows_are_left_for_later(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    _leave_dead_rows(relay, dsn, 50)
    wait_for(lambda: _jobs_stats(db)[0] >= 50, timeout=10, what="dead rows counted")

    with psycopg.connect(dsn) as conn:
        assert "jobs" not in vacuum_if_needed(conn)
    assert _jobs_stats(db)[0] >= 50


@pytest.mark.parametrize("spelling", ["off", "0", "no"])
def test_autovacuum_switched_off_in_any_spelling_is_noticed(
    relay: Relay, dsn: str, db: psycopg.Connection, spelling: str
) -> None:
    if not db.execute("SELECT current_setting('autovacuum')::boolean").fetchone()[0]:
        pytest.skip("the server's autovacuum is off, so every table qualifies whatever its own setting says")
    db.execute(f"ALTER TABLE relay.jobs SET (autovacuum_enabled = {spelling})")
    try:
        _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
        wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
        with psycopg.connect(dsn) as conn:
            assert "jobs" in vacuum_if_needed(conn)
    finally:
        db.execute("ALTER TABLE relay.jobs RESET (autovacuum_enabled)")


def test_tables_autovacuum_looks_after_are_left_to_it(db: psycopg.Connection, dsn: str, relay: Relay) -> None:
    db.execute("ALTER TABLE relay.jobs SET (autovacuum_enabled = true)")
    try:
        _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
        wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
        server_autovacuum = db.execute("SELECT current_setting('autovacuum')::boolean").fetchone()[0]
        with psycopg.connect(dsn) as conn:
            vacuumed = vacuum_if_needed(conn)
        # With the server's autovacuum on, the table is its business; with it off, nothing else will vacuum.
        assert ("jobs" in vacuumed) is (not server_autovacuum)
    finally:
        db.execute("ALTER TABLE relay.jobs RESET (autovacuum_enabled)")


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_running_worker_vacuums_and_one_told_not_to_does_not(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(maintenance, "VACUUM_CHECK_INTERVAL", 0.2)
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
    vacuums_before = _jobs_stats(db)[1]

    with running_worker(relay, queues=("elsewhere",), self_vacuum=False):
        time.sleep(2.0)  # ten check intervals
        assert _jobs_stats(db)[1] == vacuums_before

    with running_worker(relay, queues=("elsewhere",)):
        wait_for(lambda: _jobs_stats(db)[1] > vacuums_before, timeout=15, what="the worker's vacuum")
    assert _jobs_stats(db)[0] == 0


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_role_that_may_not_vacuum_says_so_instead_of_claiming_it_did(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Workers running as a role that does not own Relay's tables (migrations ran as another)."""
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
    role = f"relay_vacuum_test_{os.getpid()}"
    db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        db.execute(f"GRANT USAGE ON SCHEMA relay TO {role}")
        db.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA relay TO {role}")
        vacuum._warned_not_allowed.clear()
        as_role = conninfo.make_conninfo(dsn, user=role)
        with caplog.at_level("WARNING", logger="relay"), psycopg.connect(as_role) as conn:
            assert vacuum_if_needed(conn) == []
            assert vacuum_if_needed(conn) == []
        warnings = [r for r in caplog.records if r.getMessage().startswith("cannot vacuum")]
        assert len(warnings) == 1 and "jobs" in warnings[0].tables.split(",")
        assert _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3
    finally:
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_table_is_vacuumed_at_most_once_per_naptime(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an old snapshot held its dead rows back, every worker vacuumed the table again every 15 s,
    removing nothing, and logged that it had vacuumed: autovacuum waits a naptime (60 s) between passes."""
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
    with psycopg.connect(dsn) as conn:
        assert "jobs" in vacuum_if_needed(conn)
    vacuums = _jobs_stats(db)[1]
    monkeypatch.setattr(vacuum, "VACUUM_NAPTIME_SECONDS", 60)
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 3)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 3, timeout=10, what="dead rows counted")
    with psycopg.connect(dsn) as conn:
        assert "jobs" not in vacuum_if_needed(conn)  # within the naptime of the last vacuum
        assert _jobs_stats(db)[1] == vacuums
        monkeypatch.setattr(vacuum, "VACUUM_NAPTIME_SECONDS", 0)
        assert "jobs" in vacuum_if_needed(conn)


@pytest.mark.usefixtures("jobs_without_autovacuum")
def test_a_statement_timeout_of_the_role_or_database_does_not_cut_the_vacuum_short(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Autovacuum ignores statement_timeout; the worker's vacuum ran under the one its sessions had, and a
    table grown past the timeout's worth of work was cancelled every time, left to grow for good."""
    _leave_dead_rows(relay, dsn, VACUUM_THRESHOLD * 100)
    wait_for(lambda: _jobs_stats(db)[0] >= VACUUM_THRESHOLD * 100, timeout=10, what="dead rows counted")
    with psycopg.connect(conninfo.make_conninfo(dsn, options="-c statement_timeout=25")) as conn:
        assert vacuum_if_needed(conn) == ["jobs"]
        assert conn.execute("SHOW statement_timeout").fetchone() == ("25ms",), "the session's own timeout again"
    wait_for(lambda: _jobs_stats(db)[0] == 0, timeout=10, what="the vacuum counted")
