"""A worker frozen between two of its statements (SIGSTOP, a paused container) holds no job, nor a schedule for long.

Its kernel still answers TCP keepalives, so the server keeps its session for
as long as it is frozen, with whatever that session's open transaction has
locked. The sweepers skip locked rows, and so do the other workers' checks of
a schedule: a lease renewed in one round trip and committed in the next kept
the frozen worker's jobs claimed, and a tick's transaction stopped the
schedule on every worker. Lease writes and a prune's deletes now commit with
their statement, and a tick's transaction may sit idle only briefly before the
server ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from relay_core import Backoff, Job, Relay
from relay_core.worker import executor, periodic
from relay_core.worker.periodic import enqueue_due, publish

from .helpers import job_status, running_worker, wait_for
from .test_operations import hourly_rollup_two_hours_ahead


def check_at_each_commit(
    monkeypatch: pytest.MonkeyPatch, checker: psycopg.Connection, locked_now: Callable[[], set[Any]]
) -> list[set[Any]]:
    """What ``locked_now`` finds locked at each COMMIT another connection sends: rows a freeze there would hold.

    A COMMIT sent in autocommit ends nothing (the statement's locks ended
    with it) and is not checked.
    """
    one_at_a_time = threading.Lock()
    held_at_commit: list[set[Any]] = []
    commit = psycopg.Connection.commit

    def checked_commit(conn: psycopg.Connection) -> None:
        if conn is not checker and conn.info.transaction_status == TransactionStatus.INTRANS:
            with one_at_a_time:
                locked = locked_now()
            if locked:
                held_at_commit.append(locked)
        commit(conn)

    monkeypatch.setattr(psycopg.Connection, "commit", checked_commit)
    return held_at_commit


def test_lease_writes_commit_with_their_statement(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every COMMIT the worker sends is checked: a job row still locked then is one a freeze there would hold.

    The worker renews the lease of a job it runs (heartbeat), writes that
    job's progress, and sweeps up the expired lease of a gone worker's job.
    """
    release = threading.Event()

    @relay.handler("long_report")
    def long_report(job: Job) -> None:
        while not release.wait(0.05):
            job.progress(percent=50)

    running = relay.enqueue("long_report")
    orphan = relay.enqueue("long_report", queue="elsewhere")  # a queue this worker does not serve
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', claimed_by = 'gone:1:x', attempts = 1, lease_token = 1,"
        " claimed_until = now() - interval '1 minute', started_at = now() - interval '2 minutes' WHERE id = %s",
        (orphan,),
    )
    watched = [running, orphan]
    checker = psycopg.connect(dsn, autocommit=True)

    def locked_jobs() -> set[Any]:
        free = checker.execute("SELECT id FROM relay.jobs WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED", (watched,))
        return set(watched) - {row[0] for row in free}

    held_at_commit = check_at_each_commit(monkeypatch, checker, locked_jobs)
    try:
        with running_worker(relay, lease_seconds=1.5, heartbeat_interval=0.3, sweep_interval=0.3):
            wait_for(
                lambda: db.execute("SELECT status FROM relay.jobs WHERE id = %s", (running,)).fetchone()[0] == "claimed"
            )
            first_lease = db.execute("SELECT claimed_until FROM relay.jobs WHERE id = %s", (running,)).fetchone()[0]

            def renewed_and_swept() -> bool:
                lease, progress = db.execute(
                    "SELECT claimed_until, progress FROM relay.jobs WHERE id = %s", (running,)
                ).fetchone()
                orphan_status = db.execute("SELECT status FROM relay.jobs WHERE id = %s", (orphan,)).fetchone()[0]
                return (
                    lease > first_lease + timedelta(seconds=0.5) and progress is not None and orphan_status == "queued"
                )

            wait_for(renewed_and_swept, 15, what="a renewal, a progress report and a sweep")
            release.set()
            # Its success written by the completer, not by the stop, whose writes are one transaction.
            wait_for(lambda: job_status(db, running) == "succeeded", 10, what="the job's success written")
    finally:
        release.set()
        checker.close()
    assert held_at_commit == []


def test_a_transactional_success_may_sit_idle_only_briefly_before_its_commit(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The success UPDATE and the COMMIT of a transactional handler were two round trips with no idle
    limit: a worker frozen between them held the job's row for as long as it was frozen, out of the
    sweeper's reach, and an admin's cancel of the job waited as long. The limit is read at COMMIT by a
    deferred trigger, as the server applies it to that last gap."""
    db.execute(
        """
        CREATE TABLE relay_test.idle_limit_rows (job_id bigint);
        CREATE TABLE relay_test.commit_idle_limit (setting text);
        CREATE FUNCTION relay_test.record_idle_limit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO relay_test.commit_idle_limit VALUES (current_setting('idle_in_transaction_session_timeout'));
            RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON relay_test.idle_limit_rows DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION relay_test.record_idle_limit();
        """
    )

    @relay.handler("write_row")
    def write_row(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("INSERT INTO relay_test.idle_limit_rows VALUES (%s)", (job.id,))

    job_id = relay.enqueue("write_row")
    try:
        with running_worker(relay, lease_seconds=12.0):
            wait_for(lambda: job_status(db, job_id) == "succeeded")
        # A lease: a worker paused longer than that is taken for gone anyway.
        assert db.execute("SELECT setting FROM relay_test.commit_idle_limit").fetchall() == [("12s",)]
    finally:
        db.execute("DROP TABLE relay_test.idle_limit_rows, relay_test.commit_idle_limit")
        db.execute("DROP FUNCTION relay_test.record_idle_limit()")


def test_a_worker_paused_past_its_lease_before_a_transactional_commit_says_its_work_was_rolled_back(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the server ends the idle transaction, the COMMIT fails: the attempt is a failure that says
    why (the pause, and the lease it passed), not the server's bare "idle-in-transaction timeout"."""
    db.execute("CREATE TABLE relay_test.paused_rows (job_id bigint, attempt integer)")
    commit = psycopg.Transaction.__exit__
    paused: list[bool] = []

    def commit_after_a_pause(self: psycopg.Transaction, *args: Any) -> Any:
        if self.connection is not db and not paused and args[0] is None:
            paused.append(True)
            time.sleep(1.6)  # this thread only: the worker's heartbeats go on
        return commit(self, *args)

    monkeypatch.setattr(psycopg.Transaction, "__exit__", commit_after_a_pause)

    @relay.handler("write_row", max_attempts=2, backoff=Backoff(base=0.01, cap=0.01, jitter=0))
    def write_row(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("INSERT INTO relay_test.paused_rows VALUES (%s, %s)", (job.id, job.attempt))

    job_id = relay.enqueue("write_row")
    try:
        with running_worker(relay, lease_seconds=1.0, heartbeat_interval=0.3):
            wait_for(lambda: job_status(db, job_id) == "succeeded")
        job = relay.get_job(job_id)
        assert [e["type"] for e in job.errors] == ["SuccessNotRecorded"]
        assert "paused for over 1 s (its lease) before the COMMIT" in job.errors[0]["message"]
        assert "its work was rolled back" in job.errors[0]["message"]
        assert db.execute("SELECT attempt FROM relay_test.paused_rows").fetchall() == [(2,)]
    finally:
        db.execute("DROP TABLE relay_test.paused_rows")


def test_a_heartbeat_meeting_a_transactional_success_being_written_does_not_call_it_a_takeover(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transactional run commits its own success before the ledger hears it ended: a heartbeat in
    that gap found the row no longer claimed and logged "leases taken over by another worker" for a
    job nobody took over (16 of 4,000 with a 0.1 s heartbeat). The heartbeat's report is made here,
    deterministically, as the success is about to be written."""
    found_taken: list[list[int]] = []
    running: dict[str, Any] = {}
    settings_before_success = executor.handler_settings_end_with_transaction

    def heartbeat_reports_it_lost(idle_limit_seconds: float) -> str:
        worker = running["worker"]
        (job_id,) = list(worker.ledger.running)
        found_taken.append(worker.ledger.lost({job_id: worker.ledger.running[job_id].job.lease_token}))
        return settings_before_success(idle_limit_seconds)

    monkeypatch.setattr(executor, "handler_settings_end_with_transaction", heartbeat_reports_it_lost)

    @relay.handler("write_nothing")
    def write_nothing(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("SELECT 1")

    job_id = relay.enqueue("write_nothing")
    with running_worker(relay, concurrency=1) as worker:
        running["worker"] = worker
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert found_taken == [[]]


def test_a_tick_frozen_mid_transaction_frees_its_schedule(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frozen after it took the schedule's row, a worker's tick is ended by the server; the next check enqueues it."""
    specs, tick, late = hourly_rollup_two_hours_ahead(relay, db)
    publish(db, specs)
    since = tick - timedelta(hours=1)
    monkeypatch.setattr(periodic, "TICK_IDLE_LIMIT_MS", 300, raising=False)
    during_freeze: list[Any] = []
    is_missed = periodic.is_missed

    def frozen(*args: Any) -> bool:
        # The worker froze here, between its statements, the schedule's row locked by its tick.
        threading.Event().wait(1.5)
        try:
            with db.transaction():
                db.execute("SELECT type FROM relay.schedules WHERE type = 'hourly_rollup' FOR UPDATE NOWAIT")
            during_freeze.append("free")
        except psycopg.errors.LockNotAvailable:
            during_freeze.append("held")
        return is_missed(*args)

    monkeypatch.setattr(periodic, "is_missed", frozen)
    with psycopg.connect(dsn, autocommit=True) as worker_conn:
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            enqueue_due(worker_conn, specs, clock=late, running_since=since, queues=["default"])
        assert worker_conn.broken
    assert during_freeze == ["free"]
    monkeypatch.setattr(periodic, "is_missed", is_missed)
    assert enqueue_due(db, specs, clock=late, running_since=since, queues=["default"]) == [
        ("hourly_rollup", tick.isoformat())
    ]
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'hourly_rollup'").fetchone()[0] == 1


def test_pruning_commits_each_delete_with_its_statement(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker frozen between a prune's deletes held what they deleted: finished jobs, long-gone workers' rows."""
    finished = relay.enqueue("nightly_export")
    db.execute(
        "UPDATE relay.jobs SET status = 'succeeded', attempts = 1, finished_at = now() - interval '8 days'"
        " WHERE id = %s",
        (finished,),
    )
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at)"
        " VALUES ('gone-8d', 'h', 1, '{default}', 8, now() - interval '9 days', now() - interval '8 days')"
    )
    checker = psycopg.connect(dsn, autocommit=True)

    def locked_rows() -> set[Any]:
        locked = set()
        for name, query in (
            ("job", "SELECT id FROM relay.jobs WHERE id = %s FOR UPDATE NOWAIT"),
            ("worker", "SELECT id FROM relay.workers WHERE id = %s FOR UPDATE NOWAIT"),
        ):
            try:
                checker.execute(query, (finished if name == "job" else "gone-8d",)).fetchall()
            except psycopg.errors.LockNotAvailable:
                locked.add(name)
        return locked

    def pruned() -> bool:
        worker.maintenance.prune()
        return (
            db.execute(
                "SELECT (SELECT count(*) FROM relay.jobs WHERE id = %s) + (SELECT count(*) FROM relay.workers"
                " WHERE id = 'gone-8d')",
                (finished,),
            ).fetchone()[0]
            == 0
        )

    held_at_commit = check_at_each_commit(monkeypatch, checker, locked_rows)
    try:
        with running_worker(relay) as worker:
            wait_for(lambda: worker.maintenance.registered_at is not None, what="the worker to register")
            # Again if a delete skipped a row the checker's FOR UPDATE held at that moment.
            wait_for(pruned, what="the prune")
    finally:
        checker.close()
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE id = %s", (finished,)).fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM relay.workers WHERE id = 'gone-8d'").fetchone()[0] == 0
    assert held_at_commit == []
