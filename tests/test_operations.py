"""Running Relay for months: paused queues, type limits, cron, retention,
cooperative cancel, progress and results."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Backoff, IllegalTransition, Job, Relay, RelayError, Snooze, admin, monitor
from relay_core.connect_options import worker_application_name
from relay_core.pools import make_pool
from relay_core.queries import sql
from relay_core.worker.claim import ClaimInFlight, claim_rows, claim_under_limits_lock, claim_within_time_limit
from relay_core.worker.maintenance import sweep_once
from relay_core.worker.periodic import enqueue_due, publish
from relay_core.worker.retention import Retention, prune_once

from .helpers import (
    TcpProxy,
    claim_params,
    job_status,
    running_worker,
    start_worker_process,
    stop_process,
    suppress_errors,
    wait_for,
)


def test_paused_queue_is_skipped_and_the_pause_survives_restarts(relay: Relay, dsn: str, db) -> None:
    @relay.handler("p")
    def p(job: Job) -> None:
        return None

    relay.pause_queue("emails")
    other = Relay(dsn)  # a fresh client (as after a restart) sees the pause
    try:
        assert other.paused_queues() == ["emails"]
    finally:
        other.close()
    with running_worker(relay, queues=("emails", "default"), poll_interval=0.1):
        held = relay.enqueue("p", queue="emails")
        runs = relay.enqueue("p", queue="default")
        wait_for(lambda: job_status(db, runs) == "succeeded")
        time.sleep(1.0)
        assert job_status(db, held) == "queued"
        relay.resume_queue("emails")
        wait_for(lambda: job_status(db, held) == "succeeded", timeout=5, what="resumed queue to run")
    assert relay.paused_queues() == []


def max_overlap(db: psycopg.Connection, job_type_filter: str = "") -> int:
    rows = db.execute(
        "SELECT at, CASE phase WHEN 'start' THEN 1 ELSE -1 END FROM relay_test.executions "
        "WHERE phase IN ('start', 'end') ORDER BY at, 2"
    ).fetchall()
    current = best = 0
    for _at, delta in rows:
        current += delta
        best = max(best, current)
    return best


@pytest.mark.slow
@pytest.mark.parametrize("isolation", [None, "repeatable read"])
def test_type_concurrency_limit_holds_across_worker_processes(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, isolation: str | None, tmp_path: Path
) -> None:
    # Four processes with two slots each: eight slots, so only the claim can hold them to three,
    # and reaching three takes at least two processes.
    env = dict(worker_env)
    if isolation:  # a database whose default is stricter: Relay's connections still read committed
        env["PGOPTIONS"] = f"-c default_transaction_isolation={isolation.replace(' ', chr(92) + ' ')}"
    logs = [tmp_path / f"worker-{i}.log" for i in range(4)]
    workers = [start_worker_process(python, env, "--concurrency", "2", log=log) for log in logs]
    wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 4, what="workers up")
    relay.enqueue_many([{"type": "limited", "payload": {"sleep": 0.3}} for _ in range(30)])
    try:
        wait_for(lambda: job_counts(db).get("succeeded") == 30, timeout=60, what="all limited jobs")
    finally:
        for proc in workers:
            stop_process(proc)
    assert max_overlap(db) == 3
    assert len({row[0] for row in db.execute("SELECT pid FROM relay_test.executions")}) >= 2
    # No attempt was spent twice, and no claim or completion failed on a serialization error.
    assert db.execute("SELECT max(attempts), max(jsonb_array_length(errors)) FROM relay.jobs").fetchone() == (1, 0)
    assert not [log for log in logs if "could not serialize" in log.read_text()]


LIMITS_LOCK = (
    "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
    " AND ((classid::bigint << 32) | objid::bigint) = 7265108723"
)


def test_a_worker_frozen_right_after_its_claim_holds_no_lock_that_stops_the_others(
    relay: Relay, db: psycopg.Connection, dsn: str, python: str, worker_env: dict
) -> None:
    """The claim under the limits lock sent BEGIN, then the lock and the claim, and its COMMIT
    only once the claimed rows were back: between the two the server waited for the client while
    holding the lock every limited claim needs. A worker stopped there (SIGSTOP here; a paused
    host or a cut network path alike) stopped every other worker's claims, on every queue."""
    worker = start_worker_process(python, worker_env, "--concurrency", "2")
    try:
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.type_limits").fetchone()[0], what="limits published")
        with psycopg.connect(dsn, autocommit=True) as holding:
            holding.execute("SELECT pg_advisory_lock(7265108723)")
            relay.enqueue("noop")
            wait_for(
                lambda: [row for row in db.execute(LIMITS_LOCK).fetchall() if not row[1]],
                what="the worker's claim waiting for the limits lock",
            )
            worker.send_signal(signal.SIGSTOP)
            holding.execute("SELECT pg_advisory_unlock(7265108723)")
        try:
            wait_for(lambda: job_counts(db) == {"claimed": 1}, timeout=10, what="the claim committed")
            # Nobody holds the lock now: the frozen worker's claim ended on the server.
            assert db.execute(LIMITS_LOCK).fetchall() == []
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute("SET lock_timeout = '2s'")
                other.execute("BEGIN")
                other.execute(sql("claim_limits_lock"))
                other.execute("COMMIT")
        finally:
            worker.send_signal(signal.SIGCONT)
        wait_for(lambda: job_counts(db) == {"succeeded": 1}, what="the job ran once the worker woke")
    finally:
        stop_process(worker)


def test_a_worker_frozen_right_after_its_first_send_of_a_limited_claim_holds_no_lock(
    relay: Relay, db: psycopg.Connection, dsn: str
) -> None:
    """psycopg sends each statement of a pipeline as it is queued: a worker frozen after sending
    BEGIN and the lock, before the claim and COMMIT, held the lock every limited claim needs until
    the server dropped its connection. The whole transaction now travels in one message."""
    proxy = TcpProxy.in_front_of(dsn)
    pool = make_pool(proxy.dsn, name="t", min_size=1, max_size=1)
    pool.open(wait=True)
    # The first checkout checks the connection, and the first limited claim prepares the claim on it:
    # the claim below then sends nothing before its own message.
    claim_rows(pool, claim_params(limit=5), ClaimInFlight())
    job_id = relay.enqueue("noop")
    claim = threading.Thread(
        target=lambda: suppress_errors(claim_rows, pool, claim_params(limit=5), ClaimInFlight()), daemon=True
    )
    try:
        with psycopg.connect(dsn, autocommit=True) as holding:
            holding.execute("SELECT pg_advisory_lock(7265108723)")
            proxy.stall_after_next_write.set()  # the worker freezes once its first write is out
            claim.start()
            wait_for(
                lambda: [row for row in db.execute(LIMITS_LOCK).fetchall() if not row[1]],
                what="the frozen worker's claim waiting for the limits lock",
            )
            holding.execute("SELECT pg_advisory_unlock(7265108723)")
        wait_for(lambda: job_status(db, job_id) == "claimed", timeout=10, what="the claim committed")
        # The server ended the claim's transaction without another byte from the worker.
        wait_for(lambda: db.execute(LIMITS_LOCK).fetchall() == [], timeout=5, what="the limits lock released")
    finally:
        proxy.close()
        claim.join(timeout=10)
        pool.close()


def test_a_limited_claim_after_psycopg_emptied_its_prepared_statements_still_claims(relay: Relay, dsn: str) -> None:
    """psycopg sends DEALLOCATE ALL whenever it empties its own cache of prepared statements (here a
    transaction() block that raised, as a failing transactional handler's does): the session lost the
    claim prepared on it, and the next limited claim on the connection failed."""
    with psycopg.connect(dsn) as conn:
        claim_under_limits_lock(conn, claim_params(limit=5))  # prepares the claim on the session
        conn.execute("SELECT 1", prepare=True)  # one of psycopg's own
        with contextlib.suppress(RuntimeError), conn.transaction():
            raise RuntimeError("a handler failed")
        mine = "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'relay%%'"
        assert conn.execute(mine).fetchone() == (0,)
        conn.commit()
        job_id = relay.enqueue("noop")
        assert [row["id"] for row in claim_under_limits_lock(conn, claim_params(limit=5))] == [job_id]


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "written-out"])
def test_a_claim_that_waited_for_the_limits_lock_takes_a_job_that_fell_due_meanwhile(
    relay: Relay, db: psycopg.Connection, dsn: str, prepared: bool
) -> None:
    """The claim judged which jobs were due by when its transaction began, or its message arrived,
    both before its wait for the limits lock: a job enqueued during the wait was not due yet, and
    waited for the next claim. Its start and lease were counted from the transaction's beginning,
    before the job's run_at."""
    claimed: list[list[dict]] = []
    # Written out, with each statement's time limit: the claim behind a transaction pooler.
    claim = claim_under_limits_lock if prepared else claim_within_time_limit
    with psycopg.connect(dsn) as other_claim, psycopg.connect(dsn) as waiting:
        other_claim.execute(sql("claim_limits_lock"))
        claimer = threading.Thread(target=lambda: claimed.append(claim(waiting, claim_params(limit=5))))
        claimer.start()
        wait_for(lambda: [row for row in db.execute(LIMITS_LOCK).fetchall() if not row[1]], what="the claim waiting")
        job_id = relay.enqueue("noop")
        other_claim.commit()
        claimer.join(10)
    assert [[row["id"] for row in rows] for rows in claimed] == [[job_id]]
    # Its start and lease by the same clock: not by when the claim's transaction began, before the job.
    started = "SELECT started_at >= run_at, claimed_until >= run_at + interval '30 s' FROM relay.jobs WHERE id = %s"
    assert db.execute(started, (job_id,)).fetchone() == (True, True)


def test_the_limits_lock_is_taken_even_while_no_limit_is_seen(db: psycopg.Connection, dsn: str) -> None:
    """The lock statement took the lock only if its own snapshot saw a limit row: a limit that
    committed between it and the claim was enforced by two claims at once, neither locked."""
    assert db.execute("SELECT count(*) FROM relay.type_limits").fetchone()[0] == 0
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        first.execute(sql("claim_limits_lock"))
        second.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            second.execute(sql("claim_limits_lock"))


def job_counts(db: psycopg.Connection) -> dict[str, int]:
    return dict(db.execute("SELECT status::text, count(*) FROM relay.jobs GROUP BY 1").fetchall())


@pytest.mark.slow
def test_rate_limit_holds_back_without_failing(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    relay.enqueue_many([{"type": "rate_limited"} for _ in range(12)])
    workers = [start_worker_process(python, worker_env, "--concurrency", "4") for _ in range(2)]
    try:
        wait_for(lambda: job_counts(db).get("succeeded") == 12, timeout=60, what="all rate-limited jobs")
    finally:
        for proc in workers:
            stop_process(proc)
    starts = [row[0] for row in db.execute("SELECT at FROM relay_test.executions ORDER BY at")]
    assert len(starts) == 12
    for i, start in enumerate(starts):
        in_window = [s for s in starts[i:] if s - start < timedelta(seconds=2.0)]
        assert len(in_window) <= 5, f"{len(in_window)} starts within 2 s"
    # Held back is not failed: one attempt each, no errors.
    assert db.execute("SELECT max(attempts), max(jsonb_array_length(errors)) FROM relay.jobs").fetchone() == (1, 0)
    assert starts[-1] - starts[0] >= timedelta(seconds=4.0)


@pytest.mark.slow
def test_a_rate_limited_job_is_not_prefetched_behind_a_long_one_so_its_window_holds(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    """A start counts against its window when the job is claimed. Jobs prefetched behind a long one
    started 0.8 s after their claim, and the next window's claims started 1.2 s after them: one
    slot, a limit of five per 2 s, and all ten starts came within 2 s."""
    worker = start_worker_process(python, worker_env, "--concurrency", "1")
    try:
        # Short jobs first, so the worker holds jobs beyond its slot.
        relay.enqueue_many([{"type": "noop"} for _ in range(60)])
        wait_for(lambda: job_counts(db).get("succeeded") == 60, timeout=30, what="the short jobs")
        limited = relay.enqueue_many(
            [{"type": "record", "payload": {"sleep": 0.8}}] + [{"type": "rate_limited"} for _ in range(10)]
        )[1:]
        wait_for(lambda: job_counts(db).get("succeeded") == 71, timeout=60, what="the rate-limited jobs")
    finally:
        stop_process(worker)
    starts = [
        row[0]
        for row in db.execute(
            "SELECT at FROM relay_test.executions WHERE phase = 'start' AND job_id = ANY(%s) ORDER BY at", (limited,)
        )
    ]
    assert len(starts) == 10
    most = max(sum(1 for s in starts[i:] if s - start < timedelta(seconds=2.0)) for i, start in enumerate(starts))
    assert most <= 5, f"{most} starts within 2 s under a limit of 5"


def test_the_claim_returns_its_jobs_in_claim_order(db: psycopg.Connection) -> None:
    """Slots take claimed jobs in the order the claim returns them. The UPDATE returned them in
    whatever order its join met them: of 136 jobs claimed from 1,000, urgent ones came back behind
    others, to wait for a slot behind them (and a limited job, given only to an idle slot, too)."""
    db.execute(
        "INSERT INTO relay.jobs (status, type, payload, queue, priority, run_at, max_attempts) "
        "SELECT 'queued', 'u', '{}', 'default', (g * 7919) % 10, now() - (g * 104729 % 3600) * interval '1 s', 25 "
        "FROM generate_series(1, 1000) AS g"
    )
    db.execute("ANALYZE relay.jobs")
    rows = db.execute(sql("job_claim"), claim_params(limit=136)).fetchall()
    order = [(row[3], row[8], row[0]) for row in rows]  # priority, run_at, id
    assert len(order) == 136
    assert order == sorted(order)


def test_the_claim_gives_limited_jobs_only_to_idle_slots_and_prefetches_the_rest(
    relay: Relay, db: psycopg.Connection
) -> None:
    db.execute("INSERT INTO relay.type_limits (type, rate_limit, rate_period_seconds) VALUES ('rl', 10, 60)")
    db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('cl', 10)")
    first, rate, second, concurrency, third = relay.enqueue_many(
        [{"type": "u"}, {"type": "rl"}, {"type": "u"}, {"type": "cl"}, {"type": "u"}]
    )

    def claim(idle_slots: int) -> list[int]:
        rows = db.execute(sql("job_claim"), claim_params(limit=5, idle_slots=idle_slots)).fetchall()
        db.execute("UPDATE relay.jobs SET status = 'queued', claimed_by = NULL, claimed_until = NULL")
        return sorted(row[0] for row in rows)

    # One idle slot takes the first job; the limited ones behind it would wait for it.
    assert claim(1) == [first, second, third]
    assert claim(2) == [first, rate, second, third]
    assert claim(4) == [first, rate, second, concurrency, third]
    # No idle slot: a claim for prefetch alone takes no limited job.
    assert claim(0) == [first, second, third]


def test_a_rate_limited_start_is_stamped_when_its_claim_ran_not_when_it_began_to_wait_for_the_lock(
    relay: Relay, db: psycopg.Connection, dsn: str
) -> None:
    """A start stamped before the wait for the limits lock left the window that much early: a claim
    that waited 1 s under a limit of 1 per 2 s let the next start come 1 s after it."""
    db.execute("INSERT INTO relay.type_limits (type, rate_limit, rate_period_seconds) VALUES ('rl', 1, 2.0)")
    relay.enqueue("rl")
    params = claim_params(worker_id="w-1")
    claimed: list[list[dict]] = []

    def claim_behind_the_lock(conn: psycopg.Connection) -> None:
        claimed.append(claim_under_limits_lock(conn, params))

    with psycopg.connect(dsn) as other_claim, psycopg.connect(dsn) as waiting:
        other_claim.execute(sql("claim_limits_lock"))
        claimer = threading.Thread(target=claim_behind_the_lock, args=(waiting,))
        claimer.start()
        waiting_for_lock = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        wait_for(lambda: db.execute(waiting_for_lock).fetchone()[0], what="the claim to wait for the limits lock")
        time.sleep(1.0)  # the other claim holds the lock a while
        (released,) = other_claim.execute("SELECT clock_timestamp()").fetchone()
        other_claim.commit()
        claimer.join(10)
    assert [len(rows) for rows in claimed] == [1]
    (started,) = db.execute("SELECT started_at FROM relay.rate_starts").fetchone()
    assert started >= released


def test_cron_enqueues_exactly_one_job_per_tick_across_workers(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("every_two_seconds", cron="* * * * * */2")
    def tick(job: Job) -> None:
        return None

    with running_worker(relay), running_worker(relay), running_worker(relay):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] >= 3, timeout=15)
    ticks = db.execute("SELECT payload->>'scheduled_for', count(*) FROM relay.jobs GROUP BY 1 ORDER BY 1").fetchall()
    assert all(count == 1 for _tick, count in ticks), ticks
    times = [datetime.fromisoformat(t) for t, _ in ticks]
    assert all((b - a) == timedelta(seconds=2) for a, b in itertools.pairwise(times))
    schedule = relay.schedules()[0]
    assert schedule["type"] == "every_two_seconds" and schedule["next_tick"] > schedule["last_tick"]


def test_an_every_second_schedule_gets_each_tick_just_after_it_falls_due(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("every_second", cron="* * * * * *")
    def tick(job: Job) -> None:
        return None

    # Start mid-second by the database clock: checks that kept the start's phase, or
    # drifted from it, would enqueue each tick half a second or more after it fell due.
    phase = "SELECT mod(extract(epoch FROM clock_timestamp())::numeric, 1)::float8"
    wait_for(lambda: 0.45 <= db.execute(phase).fetchone()[0] <= 0.55, timeout=5, interval=0.01, what="mid-second")
    with running_worker(relay):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] >= 6, timeout=15)
    rows = db.execute(
        "SELECT (payload->>'scheduled_for')::timestamptz AS tick, created_at FROM relay.jobs ORDER BY tick"
    ).fetchall()
    ticks = [tick for tick, _created in rows]
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(ticks)), ticks  # none passed over
    lags = [(created - tick).total_seconds() for tick, created in rows]
    # Checks that kept the start's phase would lag about 0.5 s each tick; one check held up by a
    # loaded machine lags one tick only.
    assert statistics.median(lags) < 0.4, lags
    assert all(0 <= lag < 1.5 for lag in lags), lags


@pytest.mark.parametrize("catch_up", [False, True])
def test_ticks_missed_while_no_worker_ran_are_enqueued_once_only_when_configured(
    relay: Relay, db: psycopg.Connection, catch_up: bool
) -> None:
    @relay.handler("settlement_report", cron="0 0 1 * *", timezone="Europe/Berlin", catch_up=catch_up)
    def settle(job: Job) -> None:
        return None

    specs = list(relay.handlers.values())
    publish(db, specs)
    # No job for the tick that had already passed when the schedule first appeared.
    assert enqueue_due(db, specs) == []
    # Every worker was down across the last month-end tick:
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '62 days'")
    first = enqueue_due(db, specs)
    again = enqueue_due(db, specs)
    assert again == []
    jobs = db.execute("SELECT payload->>'scheduled_for' FROM relay.jobs").fetchall()
    if catch_up:
        assert len(first) == 1 and len(jobs) == 1
        assert datetime.fromisoformat(jobs[0][0]).day == 1
    else:
        assert first == [] and jobs == []


def hourly_rollup_two_hours_ahead(relay: Relay, db: psycopg.Connection) -> tuple[list, datetime, datetime]:
    """An hourly schedule, published; the tick two hours ahead, and a check five minutes after it."""
    relay.handler("hourly_rollup", cron="0 * * * *")(lambda job: None)
    specs = list(relay.handlers.values())
    publish(db, specs)
    now = db.execute("SELECT now()").fetchone()[0].astimezone(UTC)
    tick = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=2)
    return specs, tick, tick + timedelta(minutes=5)


def test_a_tick_that_fell_due_while_a_worker_ran_is_enqueued_however_late(relay: Relay, db: psycopg.Connection) -> None:
    """A worker's cron check held up past the tick (a long vacuum, an outage) still runs it, even if a worker
    that started meanwhile checks first; a tick that fell due while no worker ran is skipped."""

    specs, tick, late = hourly_rollup_two_hours_ahead(relay, db)
    register = (
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at) "
        "VALUES (%s, 'h', 1, %s, 8, %s, %s)"
    )
    assert enqueue_due(db, specs, clock=tick - timedelta(seconds=1)) == []  # the earlier, unseen tick

    # Nobody ran at the tick: a worker started after it (b) skips it as missed.
    db.execute(register, ("b", ["default"], tick + timedelta(minutes=4), late))
    db.execute(register, ("other-queue", ["mail"], tick - timedelta(hours=1), late))
    assert enqueue_due(db, specs, clock=late) == []
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0

    # Worker a was running at the tick (heartbeats after it) but its check came late; b checks first.
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute(register, ("a", ["default"], tick - timedelta(hours=1), late))
    assert enqueue_due(db, specs, clock=late) == [("hourly_rollup", tick.isoformat())]

    # A worker that had stopped before the tick, or was last heard from before it, does not count.
    db.execute("DELETE FROM relay.jobs")
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute("UPDATE relay.workers SET stopped_at = %s WHERE id = 'a'", (tick - timedelta(minutes=1),))
    assert enqueue_due(db, specs, clock=late) == []
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute(
        "UPDATE relay.workers SET stopped_at = NULL, last_seen_at = %s WHERE id = 'a'", (tick - timedelta(seconds=5),)
    )
    assert enqueue_due(db, specs, clock=late) == []

    # Nor does one that had stopped checking schedules before the tick, though it was still draining jobs.
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute(
        "UPDATE relay.workers SET last_seen_at = %s, schedules_stopped_at = %s WHERE id = 'a'",
        (late, tick - timedelta(seconds=5)),
    )
    assert enqueue_due(db, specs, clock=late) == []
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute("UPDATE relay.workers SET schedules_stopped_at = %s WHERE id = 'a'", (tick + timedelta(seconds=5),))
    assert enqueue_due(db, specs, clock=late) == [("hourly_rollup", tick.isoformat())]
    db.execute("DELETE FROM relay.jobs")
    db.execute("DELETE FROM relay.workers WHERE id = 'a'")

    # Unless that worker is the one checking: alive now and registered before the tick, it was
    # running then, though its heartbeats (every lease / 3) came too seldom for the registry to show it.
    # Not so for a checker that serves only another queue, or that registered after the tick.
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    since = tick - timedelta(hours=1)
    assert enqueue_due(db, specs, clock=late, running_since=since, queues=["mail"]) == []
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    assert enqueue_due(db, specs, clock=late, running_since=tick + timedelta(seconds=1), queues=["default"]) == []
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    assert enqueue_due(db, specs, clock=late, running_since=since, queues=["default"]) == [
        ("hourly_rollup", tick.isoformat())
    ]


def test_a_worker_with_a_long_lease_counts_as_running_until_two_heartbeats_are_missed(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Worker a ran through the tick, but with a 900 s lease it heartbeats every 300 s: last heard from
    before the tick, it counted as not running, and when a worker started since checked first, the tick
    was skipped as missed. It runs now; a worker silent for over two of its intervals still does not count."""
    specs, tick, late = hourly_rollup_two_hours_ahead(relay, db)
    assert enqueue_due(db, specs, clock=tick - timedelta(seconds=1)) == []
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at, heartbeat_seconds)"
        " VALUES ('a', 'h', 1, '{default}', 8, %s, %s, 300), ('b', 'h', 2, '{default}', 8, %s, %s, 300)",
        (tick - timedelta(hours=1), tick - timedelta(seconds=590), tick + timedelta(minutes=4), late),
    )
    assert enqueue_due(db, specs, clock=late) == [("hourly_rollup", tick.isoformat())]
    db.execute("DELETE FROM relay.jobs")
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute("UPDATE relay.workers SET last_seen_at = %s WHERE id = 'a'", (tick - timedelta(seconds=610),))
    assert enqueue_due(db, specs, clock=late) == []
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


def register_report_checkers(db: psycopg.Connection, *worker_ids: str) -> None:
    """Live workers (just heard from) that serve the default queue and check the schedule of ``report``."""
    for pid, worker_id in enumerate(worker_ids, start=1):
        db.execute(
            "INSERT INTO relay.workers (id, host, pid, queues, concurrency, heartbeat_seconds, schedules)"
            " VALUES (%s, 'h', %s, '{default}', 8, 10, '{report}')",
            (worker_id, pid),
        )


def database_midnight(db: psycopg.Connection) -> datetime:
    """The start of today, UTC, by the database's clock."""
    return db.execute("SELECT now()").fetchone()[0].astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def test_workers_of_an_old_release_leave_a_changed_schedule_to_the_ones_that_published_it(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling deploy moves a report from 03:00 to 04:00. The new release's workers publish 04:00 as they
    start; the old release's, still running, went on enqueuing 03:00, so that day the report ran twice.
    An old worker restarted during the deploy publishes 03:00 again: the new ones leave it the schedule
    while it checks it, and take it back once it stops."""
    relay.handler("report", cron="0 3 * * *")(lambda job: None)
    old = list(relay.handlers.values())
    new_release = Relay(relay.dsn)
    new_release.handler("report", cron="0 4 * * *")(lambda job: None)
    new = list(new_release.handlers.values())
    register_report_checkers(db, "new-1", "old-2")
    publish(db, old, published_by="old-1")
    publish(db, new, published_by="new-1")
    today = database_midnight(db)
    three, four = today + timedelta(days=1, hours=3), today + timedelta(days=1, hours=4)
    with caplog.at_level(logging.WARNING, logger="relay"):
        for _ in range(2):
            assert enqueue_due(db, old, clock=three + timedelta(seconds=1), worker_id="old-1") == []
    outdated = [r for r in caplog.records if "published a different schedule" in r.getMessage()]
    assert len(outdated) == 1, "warned once"
    assert outdated[0].schedule == "0 3 * * * (UTC, queue default)"
    assert outdated[0].published == "0 4 * * * (UTC, queue default)"
    assert enqueue_due(db, new, clock=four + timedelta(seconds=1), worker_id="new-1") == [("report", four.isoformat())]
    assert db.execute("SELECT payload->>'scheduled_for' FROM relay.jobs").fetchall() == [(four.isoformat(),)]

    # old-2 restarts mid-deploy and publishes 03:00 again: it runs the schedule while it checks it.
    db.execute("DELETE FROM relay.jobs")
    publish(db, old, published_by="old-2")
    day_after = four + timedelta(days=1)
    assert enqueue_due(db, new, clock=day_after + timedelta(seconds=1), worker_id="new-1") == []
    db.execute("UPDATE relay.workers SET stopped_at = now() WHERE id = 'old-2'")
    with caplog.at_level(logging.WARNING, logger="relay"):
        assert enqueue_due(db, new, clock=day_after + timedelta(seconds=1), worker_id="new-1") == []
    assert "took over a periodic schedule whose publisher no longer checks it" in caplog.text
    published = "SELECT cron, published_by FROM relay.schedules WHERE type = 'report'"
    assert db.execute(published).fetchone() == ("0 4 * * *", "new-1")
    next_day = day_after + timedelta(days=1)
    assert enqueue_due(db, new, clock=next_day + timedelta(seconds=1), worker_id="new-1") == [
        ("report", next_day.isoformat())
    ]
    new_release.close()


def test_a_changed_schedule_stays_with_the_new_release_when_the_worker_that_published_it_stops(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A rolling deploy moves a report from 03:00 to 04:00; new-1 published 04:00 and then stopped (a
    restart, a scale-down) while new-2 of the same release ran on. The take-over asked only whether
    new-1 still checked the schedule: old-1 of the old release took it back and enqueued 03:00, and
    04:00's tick was lost. A live worker that checks the published schedule now holds it."""
    from relay_core.worker.maintenance import register
    from relay_core.worker.periodic import checked_schedule_definitions

    relay.handler("report", cron="0 3 * * *")(lambda job: None)
    old = list(relay.handlers.values())
    new_release = Relay(relay.dsn)
    new_release.handler("report", cron="0 4 * * *")(lambda job: None)
    new = list(new_release.handlers.values())
    for worker_id, specs in (("old-1", old), ("new-1", new), ("new-2", new)):
        register(db, worker_id, ("default",), 8, 10.0, checked_schedule_definitions(specs))
    publish(db, new, published_by="new-1")
    db.execute("UPDATE relay.workers SET stopped_at = now() WHERE id = 'new-1'")
    db.commit()
    published = "SELECT cron FROM relay.schedules WHERE type = 'report'"
    today = database_midnight(db)
    three, four = today + timedelta(days=1, hours=3), today + timedelta(days=1, hours=4)
    assert enqueue_due(db, old, clock=three + timedelta(seconds=1), worker_id="old-1") == []
    assert db.execute(published).fetchone() == ("0 4 * * *",), "the old release took the schedule back"
    assert enqueue_due(db, new, clock=four + timedelta(seconds=1), worker_id="new-2") == [("report", four.isoformat())]
    # Once no worker checks 04:00 any more, the old release's workers take the schedule over.
    db.execute("UPDATE relay.workers SET stopped_at = now() WHERE id = 'new-2'")
    db.commit()
    enqueue_due(db, old, clock=three + timedelta(days=1, seconds=1), worker_id="old-1")
    assert db.execute(published).fetchone() == ("0 3 * * *",)
    new_release.close()


def test_a_tick_that_fell_due_while_the_schedule_was_removed_is_skipped_when_it_comes_back(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A deploy removed the schedule (the handler stayed) and the next brought it back unchanged: the
    tick that fell due in between counted as seen on time, since workers served its queue, and ran at
    once, hours late. Only workers that checked the schedule saw its ticks."""

    specs, tick, late = hourly_rollup_two_hours_ahead(relay, db)
    assert enqueue_due(db, specs, clock=tick - timedelta(seconds=1)) == []
    register = (
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at, schedules) "
        "VALUES (%s, 'h', 1, '{default}', 8, %s, %s, %s)"
    )
    db.execute(register, ("without-it", tick - timedelta(hours=1), late, []))
    assert enqueue_due(db, specs, clock=late) == []
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0

    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 hour'")
    db.execute(register, ("with-it", tick - timedelta(hours=1), late, ["hourly_rollup"]))
    assert enqueue_due(db, specs, clock=late) == [("hourly_rollup", tick.isoformat())]


def test_a_worker_draining_jobs_on_the_way_out_no_longer_counts_as_checking_its_schedules(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Its checks stop as its shutdown begins, but it stayed registered, heartbeating, while it drained: a
    tick that fell due meanwhile counted as seen by it, and the next worker enqueued it late, catch_up or not."""
    release = threading.Event()
    relay.handler("nightly", cron="@daily")(lambda job: None)
    relay.handler("slow")(lambda job: release.wait(30))
    running_at = sql("worker_was_running_at")
    with running_worker(relay, shutdown_timeout=30.0) as worker:
        job_id = relay.enqueue("slow")
        wait_for(lambda: job_status(db, job_id) == "claimed", what="the slow job to start")
        before_stop = db.execute("SELECT now()").fetchone()[0]
        stopper = threading.Thread(target=worker.stop)
        stopper.start()
        try:
            checks_ended = (
                "SELECT schedules_stopped_at, stopped_at FROM relay.workers WHERE schedules_stopped_at IS NOT NULL"
            )
            stopped_checking, stopped = wait_for(lambda: db.execute(checks_ended).fetchone(), what="checks to end")
            assert stopped is None, "still draining the slow job"
            assert job_status(db, job_id) == "claimed"
            during_drain = db.execute("SELECT now()").fetchone()[0]
            assert during_drain > stopped_checking
            for at, seen in ((before_stop, True), (during_drain, False)):
                params = {"queue": "default", "type": "nightly", "at": at}
                assert db.execute(running_at, params).fetchone()[0] is seen, at
        finally:
            release.set()
            stopper.join(30)
    assert job_status(db, job_id) == "succeeded"


def test_a_worker_records_the_schedules_it_checks(relay: Relay, db: psycopg.Connection) -> None:
    relay.handler("nightly", cron="@daily")(lambda job: None)
    relay.handler("hourly", cron="@hourly")(lambda job: None)
    relay.handler("plain")(lambda job: None)
    with running_worker(relay):
        wait_for(lambda: db.execute("SELECT schedules FROM relay.workers").fetchone(), what="the registration")
        assert db.execute("SELECT schedules FROM relay.workers").fetchone()[0] == ["hourly", "nightly"]


def test_ticks_passed_between_two_late_checks_are_logged_and_only_the_latest_runs(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    @relay.handler("every_minute", cron="* * * * *")
    def minute(job: Job) -> None:
        return None

    specs = list(relay.handlers.values())
    publish(db, specs)
    now = db.execute("SELECT now()").fetchone()[0].astimezone(UTC)
    first = now.replace(second=0, microsecond=0) + timedelta(minutes=10)
    later = first + timedelta(minutes=5)
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at) "
        "VALUES ('a', 'h', 1, '{default}', 8, %s, %s)",
        (now - timedelta(hours=1), later + timedelta(minutes=1)),
    )
    assert enqueue_due(db, specs, clock=first + timedelta(seconds=5)) == [("every_minute", first.isoformat())]
    caplog.clear()
    with caplog.at_level("WARNING", logger="relay"):
        assert enqueue_due(db, specs, clock=later + timedelta(seconds=5)) == [("every_minute", later.isoformat())]
    passed = [r for r in caplog.records if r.getMessage().startswith("periodic ticks passed")]
    assert [(r.passed, r.since, r.tick) for r in passed] == [(4, first.isoformat(), later.isoformat())]
    scheduled = db.execute("SELECT payload->>'scheduled_for' FROM relay.jobs ORDER BY id").fetchall()
    assert scheduled == [(first.isoformat(),), (later.isoformat(),)]


def test_ticks_passed_over_are_counted_after_the_tick_commits_not_while_its_row_is_held(
    dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An every-second schedule three hours behind: counting its passed ticks (a thousand, the cap) ran
    inside the tick's transaction, under its idle limit. On a worker whose handlers kept the interpreter
    busy that took seconds, the server ended the session, the advance rolled back, and every later
    check did the same. The count here is made slow by hand, past a shortened idle limit."""
    from relay_core.worker import periodic

    counted = periodic.ticks_between

    def counted_on_a_busy_worker(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return counted(*args, **kwargs)

    monkeypatch.setattr(periodic, "TICK_IDLE_LIMIT_MS", 300)
    monkeypatch.setattr(periodic, "ticks_between", counted_on_a_busy_worker)
    app = Relay(dsn)
    app.handler("each_second", cron="* * * * * *")(lambda job: None)
    (spec,) = app.handlers.values()
    publish(db, [spec])
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '3 hours'")
    with psycopg.connect(dsn) as conn, caplog.at_level("WARNING", logger="relay"):
        conn.execute("SELECT 1")  # the worker's own check reads first, in a transaction
        enqueued = enqueue_due(conn, [spec])
        assert not conn.broken
    assert len(enqueued) == 1
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'each_second'").fetchone() == (1,)
    (last_tick,) = db.execute("SELECT last_tick FROM relay.schedules").fetchone()
    assert last_tick.isoformat() == datetime.fromisoformat(enqueued[0][1]).isoformat()
    passed = [r for r in caplog.records if r.getMessage().startswith("periodic ticks passed")]
    assert [r.passed for r in passed] == ["1000 or more"]


def test_each_schedule_tick_commits_on_its_own_after_the_checks_first_read(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's check reads first (periodic_check) on a connection outside autocommit, so the ticks'
    transactions were savepoints of the one that read opened: a tick stayed uncommitted until every
    schedule after it was checked, and a schedule whose session the server ended took it back, logged
    as enqueued."""
    from relay_core.worker import periodic

    app = Relay(dsn)
    for name in ("first", "second"):
        app.handler(name, cron="* * * * * *")(lambda job: None)
    specs = list(app.handlers.values())
    publish(db, specs)
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '1 second'")
    seen_after_each: list[int] = []
    enqueue_one = periodic._enqueue_latest_tick

    def then_look(conn, spec, *args):  # type: ignore[no-untyped-def]
        tick = enqueue_one(conn, spec, *args)
        seen_after_each.append(db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0])
        return tick

    monkeypatch.setattr(periodic, "_enqueue_latest_tick", then_look)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql("periodic_check")).fetchone()
        assert len(enqueue_due(conn, specs)) == 2
    assert seen_after_each == [1, 2]


def _scans_of(plan: dict, relation: str) -> list[dict]:
    """The nodes of an EXPLAIN (FORMAT JSON) plan that read ``relation``."""
    found = [plan] if plan.get("Relation Name") == relation else []
    for child in plan.get("Plans", []):
        found += _scans_of(child, relation)
    return found


def test_a_schedule_published_as_the_worker_has_it_does_not_read_the_worker_registry(db: psycopg.Connection) -> None:
    """Every check of every schedule read the whole registry (a week of workers, a killed one's schedules
    matched as JSON), needed only for a schedule published differently: 8,000 rows took a second."""
    db.execute("INSERT INTO relay.schedules (type, cron, last_tick) VALUES ('each_second', '* * * * * *', now())")
    schedule = {"type": "each_second", "timezone": "UTC", "queue": "default", "worker_id": "w"}
    ticks = {"tick": datetime(2030, 1, 1, tzinfo=UTC), "next_tick": datetime(2030, 1, 1, 0, 0, 1, tzinfo=UTC)}
    explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + sql("schedule_advance")
    loops = {}
    for cron in ("* * * * * *", "*/5 * * * * *"):  # as published, then another release's
        ((plan,),) = db.execute(explain, {**schedule, **ticks, "cron": cron}).fetchall()
        loops[cron] = sum(node["Actual Loops"] for node in _scans_of(plan[0]["Plan"], "workers"))
    assert loops == {"* * * * * *": 0, "*/5 * * * * *": 1}


def test_a_schedule_whose_last_tick_is_ahead_of_the_clock_says_why_it_enqueues_nothing(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A tick taken while the database's clock ran a day ahead, then stepped back: every tick is held off
    until the clock passes that one, and the schedule stopped without a line saying why."""
    relay.handler("every_minute_ahead", cron="* * * * *")(lambda job: None)
    specs = list(relay.handlers.values())
    publish(db, specs)
    db.execute("UPDATE relay.schedules SET last_tick = date_trunc('minute', now()) + interval '1 day'")
    with caplog.at_level("WARNING", logger="relay"):
        assert enqueue_due(db, specs) == []
        assert enqueue_due(db, specs) == []
    ahead = [r for r in caplog.records if "later than the database's clock" in r.getMessage()]
    assert [r.type for r in ahead] == ["every_minute_ahead"], "said once, naming the schedule"
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone() == (0,)


def test_a_schedule_another_transaction_holds_is_skipped_then_moves_on_from_its_latest_tick(
    dsn: str, db: psycopg.Connection
) -> None:
    """Worker A advances an every-second schedule to T1 and has not committed. Worker B's advance to T2
    skips the row rather than wait (every other maintenance duty of B's, the sweeper among them, would
    wait behind it). B's next check, after A's commit, names T1: B reports no tick passed (A enqueued T1)."""
    t0, t1, t2 = (datetime(2030, 1, 1, 0, 0, s, tzinfo=UTC) for s in (0, 1, 2))
    db.execute("INSERT INTO relay.schedules (type, cron, last_tick) VALUES ('each_second', '* * * * * *', %s)", (t0,))
    advance = sql("schedule_advance")
    schedule = {"type": "each_second", "cron": "* * * * * *", "timezone": "UTC", "queue": "default", "worker_id": None}
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        b.execute("SET lock_timeout = '5s'")
        assert a.execute(advance, {**schedule, "tick": t1, "next_tick": t2}).fetchone()[:3] == (True, t0, True)
        assert b.execute(advance, {**schedule, "tick": t2, "next_tick": t2}).fetchone()[:3] == (False, None, True)
        b.rollback()
        a.commit()
        assert b.execute(advance, {**schedule, "tick": t2, "next_tick": t2}).fetchone()[:3] == (True, t1, True)
        b.commit()
    assert db.execute("SELECT last_tick FROM relay.schedules").fetchone() == (t2,)


def test_a_worker_named_publisher_of_a_schedule_not_its_own_takes_it_over(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A Relay older than migration 0021, restarted mid-deploy, wrote its schedule back and left
    published_by naming the new release's worker, which then left the ticks to itself: once the old
    workers stopped, the schedule never fired again until that worker restarted."""
    relay.handler("report", cron="0 4 * * *")(lambda job: None)
    new = list(relay.handlers.values())
    register_report_checkers(db, "new-1")
    publish(db, new, published_by="new-1")
    db.execute("UPDATE relay.schedules SET cron = '0 3 * * *'")  # the old release's upsert, published_by kept
    today = database_midnight(db)
    four = today + timedelta(days=1, hours=4)
    with caplog.at_level(logging.WARNING, logger="relay"):
        assert enqueue_due(db, new, clock=four + timedelta(seconds=1), worker_id="new-1") == []
    assert "took over a periodic schedule whose publisher no longer checks it" in caplog.text
    assert db.execute("SELECT cron, published_by FROM relay.schedules").fetchone() == ("0 4 * * *", "new-1")
    next_day = four + timedelta(days=1)
    assert enqueue_due(db, new, clock=next_day + timedelta(seconds=1), worker_id="new-1") == [
        ("report", next_day.isoformat())
    ]


def test_a_worker_whose_schedule_is_not_the_published_one_leaves_the_row_unlocked(
    dsn: str, db: psycopg.Connection
) -> None:
    """In a rolling deploy that changed an every-second schedule, the old release's workers read the row
    FOR UPDATE at the same moment of each second as the new ones, which skipped it: about a third of the
    new schedule's ticks were lost for as long as the deploy overlapped."""
    t0, t1, t2 = (datetime(2030, 1, 1, 0, 0, s, tzinfo=UTC) for s in (0, 1, 2))
    db.execute("INSERT INTO relay.schedules (type, cron, last_tick) VALUES ('each_second', '* * * * * *', %s)", (t0,))
    advance = sql("schedule_advance")
    new = {"type": "each_second", "cron": "* * * * * *", "timezone": "UTC", "queue": "default", "worker_id": None}
    old = {**new, "cron": "*/2 * * * * *"}
    with psycopg.connect(dsn) as old_worker, psycopg.connect(dsn) as new_worker:
        won, _previous, current, *_ = old_worker.execute(advance, {**old, "tick": t1, "next_tick": t2}).fetchone()
        assert (won, current) == (False, False)  # its transaction is still open
        assert new_worker.execute(advance, {**new, "tick": t1, "next_tick": t2}).fetchone()[:3] == (True, t0, True)
        new_worker.commit()
        old_worker.rollback()
    assert db.execute("SELECT last_tick FROM relay.schedules").fetchone() == (t1,)


def test_a_take_over_skips_a_schedule_another_transaction_holds(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Its publisher gone, a schedule is taken over by the next worker to check it: that worker waited
    for a row an operator's open transaction held, and its maintenance (the sweeper too) waited with it."""
    relay.handler("report", cron="* * * * *")(lambda job: None)
    specs = list(relay.handlers.values())
    db.execute(
        "INSERT INTO relay.schedules (type, cron, timezone, queue, last_tick, published_by)"
        " VALUES ('report', '*/5 * * * *', 'UTC', 'default', now() - interval '1 hour', 'gone-worker')"
    )
    with psycopg.connect(dsn) as operator, psycopg.connect(dsn, autocommit=True) as worker_conn:
        operator.execute("SELECT * FROM relay.schedules FOR UPDATE")
        worker_conn.execute("SET lock_timeout = '3s'")  # the wait, were it to wait, ends as an error
        with caplog.at_level(logging.ERROR, logger="relay"):
            assert enqueue_due(worker_conn, specs, worker_id="w1") == []
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        operator.rollback()
        assert db.execute("SELECT cron FROM relay.schedules").fetchone() == ("*/5 * * * *",)
        assert enqueue_due(worker_conn, specs, worker_id="w1") == []  # taken over, starting from now
    assert db.execute("SELECT cron, published_by FROM relay.schedules").fetchone() == ("* * * * *", "w1")


def test_a_schedule_deleted_while_a_worker_has_it_is_published_again(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Deleted by hand, it stopped on every live worker without a word, until one restarted."""
    relay.handler("every_minute", cron="* * * * *")(lambda job: None)
    specs = list(relay.handlers.values())
    publish(db, specs)
    now = db.execute("SELECT now()").fetchone()[0].astimezone(UTC)
    tick = now.replace(second=0, microsecond=0) + timedelta(minutes=10)
    db.execute("DELETE FROM relay.schedules")
    with caplog.at_level("WARNING", logger="relay"):
        assert enqueue_due(db, specs, clock=tick + timedelta(seconds=5)) == []
    said = [r for r in caplog.records if r.getMessage().startswith("published again a periodic schedule")]
    assert [r.type for r in said] == ["every_minute"]
    schedule = db.execute("SELECT cron, last_tick, next_tick FROM relay.schedules").fetchall()
    assert schedule == [("* * * * *", tick, tick + timedelta(minutes=1))]  # from the check's moment on
    following = tick + timedelta(minutes=1)
    assert enqueue_due(db, specs, clock=following + timedelta(seconds=5)) == [("every_minute", following.isoformat())]


REFUSE_JOBS_OF_B_BROKEN = """
CREATE FUNCTION relay_test.refuse_b_broken() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the application refuses % jobs', NEW.type; END $$;
CREATE TRIGGER refuse_b_broken BEFORE INSERT ON relay.jobs
    FOR EACH ROW WHEN (NEW.type = 'b_broken') EXECUTE FUNCTION relay_test.refuse_b_broken();
"""
ALLOW_JOBS_OF_B_BROKEN = (
    "DROP TRIGGER IF EXISTS refuse_b_broken ON relay.jobs; DROP FUNCTION IF EXISTS relay_test.refuse_b_broken()"
)


@contextmanager
def jobs_of_b_broken_refused(db: psycopg.Connection) -> Iterator[None]:
    """A trigger (standing in for any lasting per-schedule error) makes every insert of a b_broken job fail."""
    db.execute(REFUSE_JOBS_OF_B_BROKEN)
    try:
        yield
    finally:
        db.execute(ALLOW_JOBS_OF_B_BROKEN)


def test_a_schedule_that_keeps_failing_does_not_stop_the_schedules_after_it(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("a_first", "b_broken", "c_after"):
        relay.handler(name, cron="* * * * *")(lambda job: None)
    specs = list(relay.handlers.values())
    publish(db, specs)
    now = db.execute("SELECT now()").fetchone()[0].astimezone(UTC)
    tick = now.replace(second=0, microsecond=0) + timedelta(minutes=10)
    with jobs_of_b_broken_refused(db), caplog.at_level("ERROR", logger="relay"):
        enqueued = enqueue_due(db, specs, clock=tick + timedelta(seconds=5))
    assert enqueued == [("a_first", tick.isoformat()), ("c_after", tick.isoformat())]
    failed = [r for r in caplog.records if r.getMessage() == "periodic schedule failed"]
    assert [r.type for r in failed] == ["b_broken"] and "refuses b_broken jobs" in failed[0].error
    # Its tick was not used up: the next check, with the trigger gone, enqueues it.
    assert enqueue_due(db, specs, clock=tick + timedelta(seconds=6)) == [("b_broken", tick.isoformat())]


def test_a_failing_schedule_does_not_keep_a_worker_from_learning_a_limit_appeared(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Until a worker learns that a limit exists, its claims (which skip the limits lock) find nothing."""
    relay.handler("b_broken", cron="* * * * * *")(lambda job: None)
    relay.handler("plain")(lambda job: None)
    with jobs_of_b_broken_refused(db), running_worker(relay, poll_interval=0.1) as worker:
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.schedules").fetchone()[0] == 1)
        assert not worker.limits_exist
        # Another application's worker (or a deploy) declares the first limit.
        db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('elsewhere', 1)")
        job_id = relay.enqueue("plain")
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=10)


def test_a_schedules_last_run_is_the_last_tick_that_enqueued_a_job(relay: Relay, db: psycopg.Connection) -> None:
    """last_tick also moves when a schedule is registered and when a missed tick is skipped; the last run
    (last_enqueued_tick, last_job_id) moves only with the job a tick enqueued, in the same transaction."""

    @relay.handler("nightly_report", cron="0 3 * * *")
    def report(job: Job) -> None:
        return None

    specs = list(relay.handlers.values())
    publish(db, specs)
    (schedule,) = admin.schedules(db)
    assert schedule["last_tick"] is not None  # the tick before registration: nothing ran
    assert (schedule["last_enqueued_tick"], schedule["last_job_id"], schedule["last_job_status"]) == (None, None, None)
    assert schedule["runs_recorded_since"] is None  # registered after runs were recorded: "never" is exact

    # Yesterday's tick, checked on time, enqueues a job.
    tick = schedule["last_tick"] - timedelta(days=1)
    db.execute("UPDATE relay.schedules SET last_tick = %s", (tick - timedelta(days=1),))
    assert enqueue_due(db, specs, clock=tick + timedelta(seconds=10)) == [("nightly_report", tick.isoformat())]
    (job_id,) = db.execute("SELECT id FROM relay.jobs").fetchone()
    (schedule,) = admin.schedules(db)
    assert (schedule["last_enqueued_tick"], schedule["last_job_id"], schedule["last_job_status"]) == (
        tick,
        job_id,
        "queued",
    )

    # Today's tick fell due while no worker ran: skipped. last_tick moves on, the last run does not.
    today = tick + timedelta(days=1)
    assert enqueue_due(db, specs, clock=today + timedelta(hours=1)) == []
    (schedule,) = admin.schedules(db)
    assert schedule["last_tick"] == today
    assert (schedule["last_enqueued_tick"], schedule["last_job_id"]) == (tick, job_id)

    # The job finishes, then retention prunes it: the run stays known, its job no longer exists.
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = lease_token + 1, claimed_by = 'w', "
        "claimed_until = now() + interval '1 minute', started_at = now()"
    )
    db.execute("UPDATE relay.jobs SET status = 'succeeded', finished_at = now(), claimed_until = NULL")
    assert admin.schedules(db)[0]["last_job_status"] == "succeeded"
    db.execute("DELETE FROM relay.jobs")
    (schedule,) = admin.schedules(db)
    assert (schedule["last_enqueued_tick"], schedule["last_job_id"], schedule["last_job_status"]) == (
        tick,
        job_id,
        None,
    )


def test_a_worker_id_used_again_is_a_new_start(relay: Relay, db: psycopg.Connection) -> None:
    """Its row takes the new process's details, so the time it was down is not mistaken for running time."""
    with running_worker(relay, worker_id="steady", queues=("default",)):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 1, what="registered")
    (first_start,) = db.execute("SELECT started_at FROM relay.workers").fetchone()
    with running_worker(relay, worker_id="steady", queues=("default", "mail")):
        wait_for(
            lambda: db.execute("SELECT stopped_at IS NULL FROM relay.workers").fetchone()[0], what="registered again"
        )
        started_at, queues = db.execute("SELECT started_at, queues FROM relay.workers").fetchone()
    assert started_at > first_start and queues == ["default", "mail"]


def test_the_old_process_of_a_worker_id_used_again_leaves_the_new_ones_row_alone(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A restart whose new process registers before the old one has stopped (a preboot, a slow
    shutdown): the old process's stop and heartbeats must not mark the running one stopped, or a
    cron tick checked late while it ran would be skipped as if no worker had been running."""
    relay.handler("nightly", cron="@daily")(lambda job: None)
    registered = "SELECT queues FROM relay.workers WHERE id = 'steady'"
    with running_worker(relay, worker_id="steady", heartbeat_interval=0.3) as old:
        wait_for(lambda: db.execute(registered).fetchone(), what="the old process registered")
        with running_worker(relay, worker_id="steady", heartbeat_interval=0.3, queues=("default", "mail")):
            wait_for(lambda: db.execute(registered).fetchone()[0] == ["default", "mail"], what="the new one")
            old.stop()
            assert old.stopped.wait(15)
            (at,) = db.execute("SELECT now()").fetchone()
            wait_for(
                lambda: db.execute("SELECT last_seen_at > %s FROM relay.workers", (at,)).fetchone()[0],
                what="a heartbeat of the new process",
            )
            assert [w.state for w in monitor.list_workers(db)] == ["alive"]
            params = {"queue": "default", "type": "nightly", "at": at}
            running = db.execute(sql("worker_was_running_at"), params).fetchone()[0]
            assert running, "the registry says no worker served 'default' while the new process ran"


def test_invalid_cron_or_timezone_is_refused(relay: Relay) -> None:
    from relay_core import InvalidJobError

    with pytest.raises(InvalidJobError, match="cron"):
        relay.handler("bad", cron="every tuesday")(lambda job: None)
    with pytest.raises(InvalidJobError, match="timezone"):
        relay.handler("bad2", cron="@daily", timezone="Mars/Olympus")(lambda job: None)
    # Names ZoneInfo reads that mean another zone on another worker's machine, or are no zone names.
    with pytest.raises(InvalidJobError, match="whatever zone this machine is set to"):
        relay.handler("bad_local", cron="@daily", timezone="localtime")(lambda job: None)
    for name in ("posixrules", "right/UTC", "posix/Europe/Berlin"):
        with pytest.raises(InvalidJobError, match=r"is not an? (known )?IANA time zone name"):
            relay.handler("bad_file", cron="@daily", timezone=name)(lambda job: None)
    # A region's directory, and a name longer than a file's: ZoneInfo raised an OSError of its own there.
    for name in ("America", "Etc", "Europe/" + "x" * 300):
        with pytest.raises(InvalidJobError, match=r"^timezone: .* IANA time zone name"):
            relay.handler("bad_dir", cron="@daily", timezone=name)(lambda job: None)
    relay.handler("good_zone", cron="@daily", timezone="US/Eastern")(lambda job: None)
    with pytest.raises(InvalidJobError, match="never fires"):
        relay.handler("bad3", cron="0 0 30 2 *")(lambda job: None)  # February 30th
    with pytest.raises(InvalidJobError, match="never fires"):
        # Every ten minutes of 2 a.m. on the second Sunday of March: the hour New York skips.
        relay.handler("bad4", cron="*/10 2 * 3 0#2", timezone="America/New_York")(lambda job: None)
    assert "bad" not in relay.handlers and "bad3" not in relay.handlers
    relay.handler("leap_day", cron="0 0 29 2 *")(lambda job: None)  # rare, but it fires


def test_schedule_options_without_a_schedule_or_flags_that_are_not_flags_are_refused(relay: Relay) -> None:
    """catch_up="no" counted as true (missed ticks were enqueued); a zone or queue without cron went unchecked."""
    from relay_core import InvalidJobError

    with pytest.raises(InvalidJobError, match="catch_up"):
        relay.handler("nightly", cron="0 3 * * *", catch_up="no")(lambda job: None)
    with pytest.raises(InvalidJobError, match="give cron too"):
        relay.handler("zoned", timezone="Not/AZone")(lambda job: None)
    with pytest.raises(InvalidJobError, match="give cron too"):
        relay.handler("caught_up", catch_up=True)(lambda job: None)
    with pytest.raises(InvalidJobError, match="give cron too"):
        # Taken and ignored before: its jobs went wherever enqueue sent them.
        relay.handler("queued", queue="emails")(lambda job: None)
    with pytest.raises(InvalidJobError, match="transactional"):
        relay.handler("tx", transactional="yes")(lambda job: None)
    with pytest.raises(InvalidJobError, match=r"^timeout: is too large"):
        relay.handler("forever", timeout=10**400)(lambda job: None)
    assert not {"nightly", "zoned", "caught_up", "queued", "tx", "forever"} & set(relay.handlers)


@pytest.mark.parametrize(
    ("cron", "reason"),
    [
        ("R * * * *", "random"),  # croniter draws a new minute each time it reads this
        ("0 R(0-23) * * *", "random"),
        ("*/5 * * * * R", "random"),
        ("0 0 1 1 * 0 2027", "7 fields"),  # croniter's year field: stops matching after 2027
        ("0 0 1 1 * 0 2026,2027", "7 fields"),
    ],
)
def test_croniter_extensions_that_are_not_cron_are_refused(relay: Relay, cron: str, reason: str) -> None:
    from relay_core import InvalidJobError

    with pytest.raises(InvalidJobError, match=reason):
        relay.handler("not_cron", cron=cron)(lambda job: None)
    assert "not_cron" not in relay.handlers


@pytest.mark.parametrize("cron", ["0 0 * MAR,APR *", "0 9 * * THU", "0 0 L * *", "0 0 * * 5#3", "* * * * * */5"])
def test_month_and_day_names_and_cron_extras_are_accepted(relay: Relay, cron: str) -> None:
    relay.handler("named", cron=cron)(lambda job: None)
    assert relay.handlers["named"].cron == cron


def test_retention_prunes_old_finished_jobs_and_keeps_history(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("r")
    def r(job: Job) -> None:
        return None

    ids = relay.enqueue_many([{"type": "r"} for _ in range(30)])
    with running_worker(relay, retention=None):
        wait_for(lambda: job_counts(db).get("succeeded") == 30)
    dead = relay.enqueue("r")
    db.execute("UPDATE relay.jobs SET status = 'dead', finished_at = now() - interval '10 days' WHERE id = %s", (dead,))
    db.execute("UPDATE relay.jobs SET finished_at = now() - interval '8 days' WHERE id = ANY(%s)", (ids[:20],))
    history_before = db.execute("SELECT coalesce(sum(succeeded), 0) FROM relay.job_outcomes").fetchone()[0]
    deleted = prune_once(db, Retention(succeeded=7 * 86400, dead=30 * 86400))
    assert deleted == {"succeeded": 20, "cancelled": 0, "dead": 0}
    remaining = {row[0] for row in db.execute("SELECT id FROM relay.jobs")}
    assert remaining == set(ids[20:]) | {dead}
    history_after = db.execute("SELECT coalesce(sum(succeeded), 0) FROM relay.job_outcomes").fetchone()[0]
    assert history_after == history_before == 30
    assert prune_once(db, Retention(succeeded=7 * 86400, dead=9 * 86400))["dead"] == 1


def test_a_retention_pass_reads_the_expired_jobs_and_not_the_history_it_keeps(db: psycopg.Connection) -> None:
    # 20,000 succeeded jobs kept, then 3 that expired long ago: among the newest
    # ids, where a search in id order finds them last.
    db.execute(
        "INSERT INTO relay.jobs (type, status, attempts, lease_token, started_at, finished_at)"
        " SELECT 'kept', 'succeeded', 1, 1, now(), now() - interval '1 second' * g"
        " FROM generate_series(1, 20000) AS g"
    )
    db.execute(
        "INSERT INTO relay.jobs (type, status, attempts, lease_token, started_at, finished_at)"
        " SELECT 'expired', 'succeeded', 1, 1, now(), now() - interval '8 days' - interval '1 hour' * g"
        " FROM generate_series(1, 3) AS g"
    )
    (finished_last,) = db.execute(
        "SELECT id FROM relay.jobs WHERE type = 'expired' ORDER BY finished_at DESC LIMIT 1"
    ).fetchone()
    db.execute("ANALYZE relay.jobs")
    params = {"status": "succeeded", "older_than_seconds": 7 * 86400, "limit": 2}
    with db.transaction(force_rollback=True):
        (plan,) = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql("job_prune_finished"), params).fetchone()
        left = db.execute("SELECT type, count(*) FROM relay.jobs GROUP BY type ORDER BY type").fetchall()
        expired_left = db.execute("SELECT id FROM relay.jobs WHERE type = 'expired'").fetchall()
    root = plan[0]["Plan"]
    touched = root["Shared Hit Blocks"] + root["Shared Read Blocks"]
    # Testing the kept jobs' finished_at reads every block that holds them (over 400).
    assert touched < 100, f"the prune touched {touched} blocks to delete 2 jobs of 20,003"
    assert left == [("expired", 1), ("kept", 20000)]
    assert expired_left == [(finished_last,)], "the two that finished first were deleted"
    assert prune_once(db, Retention(succeeded=7 * 86400)) == {"succeeded": 3, "cancelled": 0, "dead": 0}
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'expired'").fetchone()[0] == 0


@pytest.mark.parametrize("status", ["succeeded", "dead", "cancelled"])
def test_a_finished_state_is_listed_from_its_index_whatever_newer_jobs_the_table_holds(
    db: psycopg.Connection, status: str
) -> None:
    # Three jobs of the state, then 20,000 newer ones of the others: the newest
    # first through the primary key would read all of them before the three.
    finished = "INSERT INTO relay.jobs (type, status, attempts, lease_token, started_at, finished_at)"
    db.execute(finished + " SELECT 'listed', %s, 1, 1, now(), now() FROM generate_series(1, 3)", (status,))
    others = [s for s in ("succeeded", "dead", "cancelled") if s != status]
    db.execute(
        finished + " SELECT 'newer', (%s::relay.job_status[])[1 + g %% 2], 1, 1, now(), now()"
        " FROM generate_series(1, 10000) AS g",
        (others,),
    )
    db.execute("INSERT INTO relay.jobs (type) SELECT 'newer' FROM generate_series(1, 10000)")
    db.execute("ANALYZE relay.jobs")
    params = monitor.JobFilter(status=status).params() | {"limit": 51, "before": None, "error_chars": 200}
    (plan,) = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql("job_list"), params).fetchone()
    listed = db.execute(sql("job_list"), params).fetchall()
    root = plan[0]["Plan"]
    touched = root["Shared Hit Blocks"] + root["Shared Read Blocks"]
    assert touched < 50, f"listing 3 {status} jobs touched {touched} blocks"
    assert [row[1] for row in listed] == ["listed"] * 3


def test_the_registry_forgets_workers_last_heard_from_over_a_week_ago(relay: Relay, db: psycopg.Connection) -> None:
    """Never one relay.worker_state still calls alive: a worker that heartbeats every five days is
    alive ten days after its last beat, and forgetting it after seven made it vanish from the
    workers page and from its queues' live workers while it ran."""
    add = (
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, started_at, last_seen_at, stopped_at,"
        " heartbeat_seconds) VALUES (%s, 'h', 1, '{default}', 8, now() - %s::interval, now() - %s::interval,"
        " now() - %s::interval, %s)"
    )
    five_days = 5 * 86400
    for worker_id, started, seen, stopped, heartbeat in [
        ("stopped-8d", "9 days", "8 days", "8 days", None),
        ("gone-8d", "9 days", "8 days", None, None),
        ("stopped-6d", "9 days", "6 days", "6 days", None),
        ("gone-6d", "9 days", "6 days", None, None),
        ("alive-since-9d", "9 days", "1 second", None, None),
        ("beats-every-5d-seen-8d", "20 days", "8 days", None, five_days),
        ("beats-every-5d-gone-11d", "20 days", "11 days", None, five_days),
        ("beats-every-5d-stopped-8d", "20 days", "8 days", "8 days", five_days),
    ]:
        db.execute(add, (worker_id, started, seen, stopped, heartbeat))
    with running_worker(relay, retention=None) as worker:
        wait_for(lambda: worker.maintenance.registered_at is not None, what="the worker to register")
        worker.maintenance.prune()  # also where retention is off
        kept = {row[0] for row in db.execute("SELECT id FROM relay.workers")}
    assert kept == {"stopped-6d", "gone-6d", "alive-since-9d", "beats-every-5d-seen-8d", worker.id}


def test_running_job_is_cancelled_cooperatively(relay: Relay, db: psycopg.Connection) -> None:
    saw_request = threading.Event()

    @relay.handler("export")
    def export(job: Job) -> None:
        for _ in range(400):
            if job.cancel_requested:
                saw_request.set()
            job.raise_if_cancelled()
            time.sleep(0.05)

    job_id = relay.enqueue("export")
    with running_worker(relay, heartbeat_interval=0.3):
        wait_for(lambda: job_status(db, job_id) == "claimed")
        detail = relay.cancel(job_id)
        assert detail.status == "claimed" and detail.cancel_requested_at is not None
        wait_for(lambda: job_status(db, job_id) == "cancelled", timeout=10)
    assert saw_request.is_set()
    (totals,) = monitor.outcome_totals(db)
    assert (totals.succeeded, totals.failed, totals.dead) == (0, 0, 0), "stopping on request is not a failure"
    with pytest.raises(IllegalTransition, match=r"it is cancelled, and only queued or claimed jobs can be cancelled$"):
        relay.cancel(job_id)
    assert relay.requeue(job_id).status == "queued"


def test_a_job_cancelled_while_it_waits_in_the_worker_for_a_slot_never_starts(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A prefetched job is claimed before a slot is free, so a cancel can only ask it to stop.
    The worker learned of the request at its next heartbeat, and started the handler anyway:
    one that does its work without checking (sends the e-mail) ended the job succeeded.
    Its claim counted an attempt that never ran: it is given back, as a hand-back gives it."""
    release = threading.Event()
    started: list[str] = []
    relay.handler("short")(lambda job: None)

    @relay.handler("blocker")
    def blocker(job: Job) -> None:
        release.wait(20)

    @relay.handler("victim")
    def victim(job: Job) -> None:
        started.append("victim")

    with running_worker(relay, concurrency=1, heartbeat_interval=0.2) as worker:
        relay.enqueue_many([{"type": "short"} for _ in range(100)])
        wait_for(lambda: job_counts(db).get("succeeded") == 100, what="short jobs: the worker prefetches")
        assert worker.prefetch() > 0
        blocking, waiting = relay.enqueue_many([{"type": "blocker", "priority": -1}, {"type": "victim"}])
        held = worker.ledger.running
        wait_for(lambda: waiting in held and held[waiting].slot is None, what="the victim claimed, waiting")
        assert relay.cancel(waiting).cancel_requested_at is not None
        wait_for(lambda: held[waiting].job.cancel_requested, what="the heartbeat to bring the request")
        release.set()
        wait_for(lambda: job_status(db, waiting) != "claimed", what="the victim's end")
    assert (job_status(db, waiting), started) == ("cancelled", [])
    assert db.execute("SELECT attempts FROM relay.jobs WHERE id = %s", (waiting,)).fetchone()[0] == 0
    assert job_status(db, blocking) == "succeeded"


@pytest.mark.parametrize("ending", ["raises", "snoozes", "is handed back"])
def test_cancel_requested_while_running_is_not_carried_to_another_attempt(
    relay: Relay, db: psycopg.Connection, ending: str
) -> None:
    """The attempt ends before any heartbeat told the worker of the request: the job still ends cancelled."""
    asked = threading.Event()
    runs: list[int] = []

    @relay.handler("report", max_attempts=3, backoff=Backoff(base=0.05, factor=1, jitter=0))
    def report(job: Job) -> None:
        runs.append(job.attempt)
        asked.wait(10)
        if ending == "raises":
            raise ConnectionError("upstream closed the connection")
        if ending == "snoozes":
            raise Snooze(0.05)
        time.sleep(10)  # still running when the worker's shutdown timeout ends

    job_id = relay.enqueue("report")
    # Heartbeats far apart: the worker has not heard of the request when the attempt ends.
    with running_worker(
        relay, heartbeat_interval=8.0, lease_seconds=30.0, shutdown_timeout=0.2, poll_interval=0.05
    ) as worker:
        wait_for(lambda: job_status(db, job_id) == "claimed")
        relay.cancel(job_id)
        asked.set()
        if ending != "is handed back":
            wait_for(lambda: job_status(db, job_id) != "claimed", what="the attempt to end")
            time.sleep(0.5)  # room for a wrongly requeued job to be claimed again
    job = relay.get_job(job_id)
    assert job.status == "cancelled" and job.finished_at is not None
    assert runs == [1]
    if ending != "is handed back":
        assert worker.counters.cancelled == 1, "the worker logged and counted what was written"
    if ending == "raises":
        assert [e["type"] for e in job.errors] == ["ConnectionError"]
    (totals,) = monitor.outcome_totals(db)
    expected_failed = 1 if ending == "raises" else 0  # a snooze or a hand-back is not a failed attempt
    assert (totals.succeeded, totals.failed, totals.dead) == (0, expected_failed, 0)


def test_sweeper_ends_an_expired_job_cancelled_when_a_cancel_was_pending(relay: Relay, db: psycopg.Connection) -> None:
    """A worker died holding a job an admin had asked to stop: the sweep cancels it and counts the lost attempt."""
    job_id = relay.enqueue("report", queue="sweep")
    db.execute(
        sql("job_claim"),
        claim_params(queues=["sweep"], limit=1, worker_id="gone", lease_seconds=0, locked=False),
    )
    assert relay.cancel(job_id).cancel_requested_at is not None
    assert sweep_once(db) == {"queued": 0, "dead": 0, "cancelled": 1}
    job = relay.get_job(job_id)
    assert job.status == "cancelled" and [e["type"] for e in job.errors] == ["LeaseExpired"]
    (totals,) = monitor.outcome_totals(db)
    assert (totals.succeeded, totals.failed, totals.dead) == (0, 1, 0)


def test_the_sweeper_logs_each_job_it_rescues(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep logged only how many jobs it rescued: a job that died on an expired lease had no line naming it."""
    requeued, dead = relay.enqueue("report", queue="sweep"), relay.enqueue("report", queue="sweep", max_attempts=1)
    db.execute(sql("job_claim"), claim_params(queues=["sweep"], limit=2, worker_id="gone", lease_seconds=0))
    caplog.set_level("WARNING", logger="relay")
    assert sweep_once(db) == {"queued": 1, "dead": 1, "cancelled": 0}
    lines = {
        (r.job_id, r.type, r.attempt, r.worker_id, r.ended)
        for r in caplog.records
        if r.getMessage() == "job lease expired"
    }
    assert lines == {(requeued, "report", 1, "gone", "queued"), (dead, "report", 1, "gone", "dead")}


def test_the_claim_stops_before_a_job_on_its_last_attempt_that_it_has_no_room_for(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A worker killed outright spends the attempt of every job it holds: few may be on their last.

    The claim takes jobs in order and stops before the one that would pass
    the worker's room for such jobs: never one after it, so no job is passed
    over, whatever its priority; the next claim starts from it.
    """
    spare = relay.enqueue("twice", queue="last", max_attempts=2)
    once = relay.enqueue_many([{"type": "once", "queue": "last", "max_attempts": 1} for _ in range(4)])
    later = relay.enqueue("twice", queue="last", max_attempts=2)
    urgent = relay.enqueue("twice", queue="last", max_attempts=2, priority=-1)
    params = {"queues": ["last"], "limit": 10, "worker_id": "w", "lease_seconds": 30, "locked": False, "idle_slots": 10}

    def claim(room: int) -> list[int]:
        return sorted(row[0] for row in db.execute(sql("job_claim"), {**params, "last_attempt_room": room}))

    assert claim(2) == sorted([urgent, spare, *once[:2]])
    # A queue named twice is still served once: its jobs are neither taken nor counted twice.
    db.execute("UPDATE relay.jobs SET status = 'queued', attempts = 0 WHERE queue = 'last'")
    both = db.execute(sql("job_claim"), {**params, "queues": ["last", "last"], "last_attempt_room": 2}).fetchall()
    assert sorted(row[0] for row in both) == sorted([urgent, spare, *once[:2]])
    # No room: the next job in order is on its last attempt, so nothing behind it is taken either.
    assert claim(0) == []
    assert claim(1) == [once[2]]
    assert claim(5) == [once[3], later]
    assert {relay.get_job(i).attempts for i in [spare, *once, later, urgent]} == {1}


def test_progress_is_visible_while_running_and_the_result_is_kept(relay: Relay, db: psycopg.Connection) -> None:
    halfway = threading.Event()
    release = threading.Event()

    @relay.handler("import_rows")
    def import_rows(job: Job) -> dict:
        assert job.progress(50, "halfway")
        halfway.set()
        release.wait(10)
        return {"rows": 3}

    @relay.handler("odd_result")
    def odd_result(job: Job) -> object:
        return {1, 2}

    @relay.handler("colliding_keys")
    def colliding_keys(job: Job) -> object:
        return {"by_hour": {9: "a", "9": "b"}}  # JSON would keep {"9": "b"} only

    @relay.handler("status_counts")
    def status_counts(job: Job) -> object:
        return {"by_status": {200: 5, 404: 1}}  # no two keys alike: kept, as strings

    job_id = relay.enqueue("import_rows")
    odd, colliding, counts = (
        relay.enqueue("odd_result"),
        relay.enqueue("colliding_keys"),
        relay.enqueue("status_counts"),
    )
    with running_worker(relay):
        wait_for(halfway.is_set)
        assert relay.get_job(job_id).progress == {"percent": 50.0, "message": "halfway"}
        release.set()
        wait_for(lambda: {job_status(db, j) for j in (job_id, odd, colliding, counts)} == {"succeeded"})
    assert relay.get_job(job_id).result == {"rows": 3}
    assert relay.get_job(odd).result == {"unstored_result": "not JSON-serializable: set"}
    assert relay.get_job(colliding).result == {
        "unstored_result": "has keys that JSON cannot tell apart: 9 and '9' are both '9' in JSON"
    }
    assert relay.get_job(counts).result == {"by_status": {"200": 5, "404": 1}}


def test_a_result_json_cannot_hold_says_why_and_an_error_type_name_is_bounded(relay: Relay, db) -> None:
    """A result holding a NaN was stored as "not JSON-serializable: dict", the type of the whole value;
    and an exception class's name was kept whole (3 MB in each attempt's entry) where the message and
    traceback are cut to 2,000 and 8,000 characters."""
    huge = type("E" * 5000, (Exception,), {})

    @relay.handler("nan_result")
    def nan_result(job: Job) -> object:
        return {"ratio": [1.0, float("nan")]}

    @relay.handler("odd_class", max_attempts=1)
    def odd_class(job: Job) -> None:
        raise huge("boom")

    nan, odd = relay.enqueue("nan_result"), relay.enqueue("odd_class")
    with running_worker(relay):
        wait_for(lambda: (job_status(db, nan), job_status(db, odd)) == ("succeeded", "dead"))
    # Python's own words, which later versions end with the value (": nan").
    said = relay.get_job(nan).result["unstored_result"]
    assert said.startswith("not storable as JSON: Out of range float values are not JSON compliant"), said
    [entry] = relay.get_job(odd).errors
    assert entry["type"] == "E" * 200 and relay.get_job(odd).last_error == "E" * 200 + ": boom"


def test_a_result_json_cannot_hold_names_the_value_it_met_not_the_whole_results_type() -> None:
    """A datetime inside a dict was reported as "not JSON-serializable: dict"."""
    from relay_core.worker.outcome import result_json

    assert json.loads(result_json({"at": datetime(2030, 1, 1, tzinfo=UTC)}) or "") == {
        "unstored_result": "not JSON-serializable: datetime"
    }
    assert json.loads(result_json({1, 2}) or "") == {"unstored_result": "not JSON-serializable: set"}


def test_a_result_with_a_backslash_before_u0000_is_kept_one_with_a_nul_is_not(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The NUL check read ``\\u0000`` anywhere in the result's JSON as a NUL character, so the text
    ``C:\\u0000dir`` (which jsonb stores) was replaced by a note that it held one."""
    relay.handler("path")(lambda job: {"path": "C:\\u0000dir"})
    relay.handler("nul")(lambda job: {"path": "C:\\\x00"})
    kept, dropped = relay.enqueue("path"), relay.enqueue("nul")
    with running_worker(relay):
        wait_for(lambda: {job_status(db, kept), job_status(db, dropped)} == {"succeeded"})
    assert relay.get_job(kept).result == {"path": "C:\\u0000dir"}
    assert relay.get_job(dropped).result == {"unstored_result": "contains NUL characters"}


def test_requeue_of_a_queued_job_is_refused_naming_its_state(relay: Relay) -> None:
    job_id = relay.enqueue("x", run_at=datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(IllegalTransition, match="it is queued"):
        relay.requeue(job_id)


def test_workers_fold_the_admin_counters_so_they_stay_small(relay: Relay, db: psycopg.Connection) -> None:
    for _ in range(40):
        relay.enqueue("fold_me", queue="folding")
    assert db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] >= 40
    with running_worker(relay, queues=("other",)) as worker:
        assert worker.maintenance.fold()
    rows = db.execute("SELECT queue, state::text, n FROM relay.job_counts WHERE n <> 0").fetchall()
    assert rows == [("folding", "queued", 40)]
    assert db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] == 1


def test_a_worker_folds_a_pile_of_counter_deltas_whatever_the_statement_timeout(
    dsn: str, db: psycopg.Connection
) -> None:
    """Deltas piled up while no worker ran (producers enqueueing overnight, workers scaled to zero): the
    worker folded them all in one statement, under its sessions' statement_timeout, which cancelled it
    every 30 s while new deltas kept coming, so the pile only grew. It now folds in chunks, untimed."""
    db.execute(
        "INSERT INTO relay.job_counts (queue, state, n) "
        "SELECT 'mail', 'queued', CASE WHEN g % 2 = 0 THEN 1 ELSE -1 END FROM generate_series(1, 300001) AS g"
    )
    timed = Relay(conninfo.make_conninfo(dsn, options="-c statement_timeout=100"))
    try:
        with running_worker(timed, queues=("other",)) as worker:
            for _ in range(5):  # each fold goes on for FOLD_CHUNK_SECONDS, then leaves the rest to the next
                assert worker.maintenance.fold()
                if db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] == 1:
                    break
    finally:
        timed.close()
    assert db.execute("SELECT queue, state::text, n FROM relay.job_counts").fetchall() == [("mail", "queued", -1)]


def test_a_workers_fold_lets_go_of_a_counter_table_another_transaction_holds(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """The worker's fold runs with no statement timeout: a lock on a counter table held in a transaction
    left open (a TRUNCATE, an ALTER) would hold up its thread of duties, the sweeper's among them, for as
    long as it stayed open. It waits a bounded time for the lock, then leaves the fold to the next one."""
    relay.enqueue("fold_me")
    with running_worker(relay, queues=("other",)) as worker, psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE relay.job_counts IN ACCESS EXCLUSIVE MODE")
        outcome: list[bool] = []
        fold = threading.Thread(target=lambda: outcome.append(worker.maintenance.fold()), daemon=True)
        fold.start()
        fold.join(10)
        assert outcome == [False], "the fold waited on for the lock"
        holder.rollback()
        assert worker.maintenance.fold()


def test_the_unlocked_claim_takes_nothing_once_any_type_has_a_limit(relay: Relay, db: psycopg.Connection) -> None:
    from relay_core.queries import sql

    relay.enqueue_many([{"type": "free"} for _ in range(3)])
    assert len(db.execute(sql("job_claim"), claim_params(locked=False)).fetchall()) == 1
    db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('other', 1)")
    assert db.execute(sql("job_claim"), claim_params(locked=False)).fetchall() == []
    assert len(db.execute(sql("job_claim"), claim_params()).fetchall()) == 1


def test_a_retention_pass_that_hits_its_cap_asks_for_another_soon() -> None:
    from relay_core.worker.retention import PASS_CAP, hit_cap

    assert hit_cap({"succeeded": PASS_CAP, "cancelled": 0, "dead": 0})
    assert not hit_cap({"succeeded": PASS_CAP - 1, "cancelled": 3, "dead": 0})


def test_limits_the_claim_cannot_hold_are_refused_at_registration(relay: Relay, db: psycopg.Connection) -> None:
    """Every worker's claim reads every limit: one it cannot evaluate would stop the whole fleet."""
    from relay_core import InvalidJobError
    from relay_core.queries import sql
    from relay_core.worker import limits

    int4_max, month = 2**31 - 1, 31 * 86400
    for bad in [
        {"rate_limit": (1, 1e16)},  # its window reaches past the start of time
        {"rate_limit": (100, 10**400)},  # too large for a float: it raised a bare OverflowError
        {"rate_limit": (100, float("inf"))},
        {"rate_limit": (1, month + 1)},
        {"rate_limit": (1, 1e-9)},  # shorter than the database clock counts: it never limited
        {"rate_limit": (1, 0.0009)},
        {"rate_limit": (int4_max + 1, 60)},
        {"rate_limit": (True, 60)},
        {"concurrency": int4_max + 1},
    ]:
        with pytest.raises(InvalidJobError, match=r"^(rate_limit|concurrency): "):
            relay.handler("too_big", **bad)(lambda job: None)
    assert "too_big" not in relay.handlers
    # The largest limits allowed work in the claim, start after start.
    relay.handler("widest", concurrency=int4_max, rate_limit=(int4_max, month))(lambda job: None)
    relay.handler("narrowest", rate_limit=(1, 0.001))(lambda job: None)
    limits.publish(db, relay.handlers.values())
    relay.enqueue_many([{"type": "widest"} for _ in range(2)])
    params = claim_params()
    assert len(db.execute(sql("job_claim"), params).fetchall()) == 1
    assert len(db.execute(sql("job_claim"), params).fetchall()) == 1


@pytest.mark.parametrize("value", ["inf", "nan", "1e20", "-1"])
def test_a_retention_no_prune_pass_could_use_is_refused_at_start(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Such a value failed every pass, so nothing of any state was pruned again, and no error reached the operator."""
    from relay_core import ConfigurationError, WorkerConfig

    monkeypatch.setenv("RELAY_RETENTION_SUCCEEDED", value)
    with pytest.raises(ConfigurationError, match="RELAY_RETENTION_SUCCEEDED"):
        WorkerConfig.from_env()
    # The longest retention allowed prunes what is past it and keeps the rest.
    century = 36500 * 86400.0
    old, recent = relay.enqueue("r"), relay.enqueue("r")
    finish = "UPDATE relay.jobs SET status = 'dead', finished_at = now() - %s::interval WHERE id = %s"
    db.execute(finish, ("36501 days", old))
    db.execute(finish, ("1 day", recent))
    assert prune_once(db, Retention(succeeded=century, cancelled=century, dead=century))["dead"] == 1
    assert [row[0] for row in db.execute("SELECT id FROM relay.jobs")] == [recent]


@pytest.mark.parametrize(
    "value",
    [True, "7", 10**400, float("nan"), -1, Decimal(86400)],
    ids=["bool", "str", "int-past-float", "nan", "negative", "decimal"],
)
def test_a_retention_given_in_code_that_is_no_number_of_seconds_is_refused_by_name(value: object) -> None:
    """``Retention(dead=True)`` was taken as 1 second, so dead jobs went a second after they died;
    a string and an int too large for a float raised TypeError and OverflowError naming nothing."""
    from relay_core import ConfigurationError

    with pytest.raises(ConfigurationError, match="retention dead must be a number of seconds from 0"):
        Retention(dead=value)  # type: ignore[arg-type]


def test_a_retention_given_as_any_real_number_prunes(relay: Relay, db: psycopg.Connection) -> None:
    """A Fraction passed the check and then failed every prune pass: PostgreSQL takes no Fraction."""
    retention = Retention(succeeded=Fraction(86400), cancelled=60, dead=7 * 86400)
    assert (retention.succeeded, retention.cancelled) == (86400.0, 60.0)
    old = relay.enqueue("r")
    db.execute(
        "UPDATE relay.jobs SET status = 'succeeded', finished_at = now() - interval '2 days' WHERE id = %s", (old,)
    )
    assert prune_once(db, retention)["succeeded"] == 1


@pytest.mark.parametrize(
    ("cron", "timezone", "night", "expected"),
    [
        # The clocks go back: a fixed time that happens twice runs once ...
        ("30 2 * * *", "Europe/Berlin", datetime(2024, 10, 26, 22, tzinfo=UTC), ["2024-10-27T02:30:00+02:00"]),
        ("0 1 * * *", "America/New_York", datetime(2024, 11, 3, 3, tzinfo=UTC), ["2024-11-03T01:00:00-04:00"]),
        # ... a wildcard schedule runs in both passes of the repeated hour, as elapsed time demands ...
        (
            "*/30 1-2 * * *",
            "Europe/Berlin",
            datetime(2024, 10, 26, 22, 45, tzinfo=UTC),
            [
                f"2024-10-27T0{h}:{m}:00{z}"
                for h, z in ((1, "+02:00"), (2, "+02:00"), (2, "+01:00"))
                for m in ("00", "30")
            ],
        ),
        # ... and the clocks jump forward: a fixed time that never happens runs at the jump.
        ("30 2 * * *", "Europe/Berlin", datetime(2024, 3, 30, 22, tzinfo=UTC), ["2024-03-31T03:00:00+02:00"]),
    ],
)
def test_cron_across_a_daylight_saving_change_runs_each_tick_once(
    relay: Relay, db: psycopg.Connection, cron: str, timezone: str, night: datetime, expected: list[str]
) -> None:
    @relay.handler("nightly", cron=cron, timezone=timezone)
    def nightly(job: Job) -> None:
        return None

    specs = list(relay.handlers.values())
    publish(db, specs)
    db.execute("UPDATE relay.schedules SET last_tick = %s", (night,))
    # Workers check every second; every 20 s through the night is enough to see each tick on time.
    for step in range(6 * 180):
        enqueue_due(db, specs, clock=night + timedelta(seconds=20 * step))
    ticks = db.execute("SELECT payload->>'scheduled_for' FROM relay.jobs ORDER BY id").fetchall()
    assert [tick for (tick,) in ticks] == expected


def test_a_time_zone_that_is_not_a_name_is_refused_clearly(relay: Relay) -> None:
    from zoneinfo import ZoneInfo

    from relay_core import InvalidJobError

    for timezone in (ZoneInfo("Europe/Berlin"), None, 1):
        with pytest.raises(InvalidJobError, match=r"^timezone: .* IANA time zone name"):
            relay.handler("tz", cron="@daily", timezone=timezone)(lambda job: None)  # type: ignore[arg-type]
    assert "tz" not in relay.handlers


def test_rate_limit_starts_are_forgotten_even_where_retention_is_off(relay: Relay, db: psycopg.Connection) -> None:
    """One row per start of a rate-limited type: with pruning of finished jobs off, they piled up forever."""

    @relay.handler("metered", rate_limit=(100, 60))
    def metered(job: Job) -> None:
        return None

    db.execute("INSERT INTO relay.rate_starts (type, started_at) SELECT 'metered', now() - interval '2 minutes'")
    db.execute("INSERT INTO relay.rate_starts (type) VALUES ('metered')")
    with running_worker(relay, retention=None) as worker:
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.type_limits").fetchone()[0], what="limits published")
        worker.maintenance.prune()
    assert db.execute("SELECT count(*) FROM relay.rate_starts").fetchone()[0] == 1


def test_each_types_rate_limit_starts_are_kept_for_its_own_window(relay: Relay, db: psycopg.Connection) -> None:
    """Trimmed to the longest window of any type: a type limited per second kept a month of starts."""
    relay.handler("per_second", rate_limit=(100, 1))(lambda job: None)
    relay.handler("per_month", rate_limit=(1000, 31 * 24 * 3600))(lambda job: None)
    db.execute(
        "INSERT INTO relay.rate_starts (type, started_at)"
        " SELECT t, now() - interval '1 hour' FROM unnest(ARRAY['per_second', 'per_month', 'unlimited_now']) AS t"
    )
    db.execute("INSERT INTO relay.rate_starts (type) VALUES ('per_second')")
    with running_worker(relay, retention=None) as worker:
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.type_limits").fetchone()[0] == 2, what="limits")
        worker.maintenance.prune()
    kept = db.execute("SELECT type, started_at > now() - interval '1 minute' FROM relay.rate_starts ORDER BY 1, 2")
    assert kept.fetchall() == [("per_month", False), ("per_second", True)]


SESSION_NAMES = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"


def session_names(db: psycopg.Connection) -> list[str]:
    """The application_name of every session on the test database."""
    return [row[0] for row in db.execute(SESSION_NAMES).fetchall()]


def test_each_relay_connection_names_its_process_in_pg_stat_activity(
    relay: Relay, dsn: str, db, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    relay.handler("noop")(lambda job: None)
    with running_worker(relay, heartbeat_interval=0.2) as worker:
        job_id = relay.enqueue("noop")
        wait_for(lambda: job_status(db, job_id) == "succeeded", what="the job to run")
        # The pool's two standing connections, the heartbeat's and the listener's.
        wait_for(lambda: session_names(db).count(worker_application_name(worker.id)) >= 4, what="the worker's sessions")
    with relay.pool.connection() as conn:  # the client's, which enqueued
        assert conn.execute("SHOW application_name").fetchone() == ("relay",)
    with psycopg.connect(dsn, **relay.connection_options()) as own:  # the application's own: not called Relay's
        assert own.execute("SHOW application_name").fetchone() == ("",)


def test_a_worker_id_too_long_for_a_session_name_keeps_its_host_and_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RELAY_TRANSACTION_POOLING", raising=False)
    long_id = "ip-10-0-1-23.eu-west-1.compute.internal:123456:a1b2c3"
    name = worker_application_name(long_id)
    assert len(name) == 63
    assert name.startswith("relay-worker ip-10-0-1-23.eu-west")
    assert name.endswith(":123456:a1b2c3")
    assert worker_application_name("vm:42:abcdef") == "relay-worker vm:42:abcdef"
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
    assert worker_application_name(long_id) == "relay-worker"


def test_an_application_name_the_dsn_gives_wins_over_relays(dsn: str, db) -> None:
    name = f"billing-{uuid.uuid4().hex[:8]}"
    named = Relay(f"{dsn} application_name={name}")
    try:
        named.handler("noop")(lambda job: None)
        with running_worker(named, heartbeat_interval=0.2) as worker:
            job_id = named.enqueue("noop")
            wait_for(lambda: job_status(db, job_id) == "succeeded", what="the job to run")
            # The client's connection, the pool's two, the heartbeat's and the listener's.
            wait_for(lambda: session_names(db).count(name) >= 5, what="the client's and the worker's sessions")
            assert worker_application_name(worker.id) not in session_names(db)
    finally:
        named.close()


def test_get_job_reads_a_job_a_program_wrote_with_sql(relay: Relay, db: psycopg.Connection) -> None:
    """Times no datetime holds are read as the nearest that does; a history that is not an array, as one entry."""
    (job_id,) = db.execute(
        "INSERT INTO relay.jobs (type, status, run_at, created_at, finished_at, errors)"
        " VALUES ('odd', 'cancelled', '-infinity', '0044-03-15 00:00:00+00 BC', 'infinity', '\"oops\"') RETURNING id"
    ).fetchone()
    job = relay.get_job(job_id)
    assert (job.run_at, job.created_at) == (datetime(1, 1, 2, tzinfo=UTC), datetime(1, 1, 2, tzinfo=UTC))
    assert job.finished_at == datetime(9999, 12, 30, tzinfo=UTC)
    assert job.errors == ["oops"]


def test_a_requeue_filter_with_a_cut_off_time_but_no_utc_offset_is_refused(relay: Relay, db) -> None:
    """A naive time cannot be compared with the database's: refused before anything changes."""
    job_id = relay.enqueue("t")
    db.execute("UPDATE relay.jobs SET status = 'dead', finished_at = now() WHERE id = %s", (job_id,))
    with pytest.raises(RelayError, match="UTC offset"):
        monitor.JobFilter(status="dead", finished_by=datetime(2030, 1, 1))
    aware = monitor.JobFilter(status="dead", finished_by=datetime(2000, 1, 1, tzinfo=UTC))
    with psycopg.connect(relay.dsn) as conn:
        assert monitor.requeue_matching(conn, aware) == 0  # it ended after the cut-off
    assert relay.get_job(job_id).status == "dead"


@pytest.mark.parametrize("outcome", ["timeout written", "handed back"])
def test_a_job_left_running_by_a_shutdown_holds_its_place_under_its_type_limit_until_its_grace_ends(
    relay: Relay, db: psycopg.Connection, dsn: str, outcome: str
) -> None:
    """A shutdown writes an overdue handler's timeout (the job to be retried) or hands an unfinished
    one back while its thread runs on for ``runs_on`` seconds more. The claim counted only claimed
    jobs, so the type's one place under ``concurrency=1`` went to the next job at once."""
    db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('noop', 1)")
    db.commit()
    first, second = relay.enqueue("noop"), relay.enqueue("noop")
    with psycopg.connect(dsn) as conn:
        (claimed,) = claim_under_limits_lock(conn, claim_params())
        assert claimed["id"] == first
        ids, tokens = [first], [claimed["lease_token"]]
        if outcome == "timeout written":
            conn.execute(
                sql("job_fail_many"),
                {
                    "ids": ids,
                    "tokens": tokens,
                    "next_statuses": ["queued"],
                    "delays": [30.0],
                    "runs_on": [30.0],
                    "messages": ["timed out"],
                    "errors": ["{}"],
                },
            )
        else:
            conn.execute(sql("job_hand_back_many"), {"ids": ids, "tokens": tokens, "delays": [30.0]})
        conn.commit()
        assert job_status(db, first) == "queued"
        assert claim_under_limits_lock(conn, claim_params()) == [], "the next job took the place of one still running"
        # The admin surface counts it as running too, as the claim does.
        assert [(row["type"], row["running"]) for row in admin.type_limits(db)] == [("noop", 1)]
        # Once the grace is over (the thread stopped with its process at the latest), the place is free.
        db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (first,))
        db.commit()
        assert [row["id"] for row in claim_under_limits_lock(conn, claim_params())] == [second]


def test_limits_whose_publisher_is_gone_are_published_again_by_a_live_worker(
    relay: Relay, db: psycopg.Connection
) -> None:
    """In a deploy that raised a limit from 3 to 5, a worker of the old release restarted after the
    new ones wrote 3 back, and 3 stayed after it stopped: limits were published only at a start.
    A live worker's check now leaves a live publisher's limits alone and takes over the others."""
    from relay_core.worker import limits
    from relay_core.worker.maintenance import register

    def limit() -> tuple:
        return db.execute("SELECT max_running, published_by FROM relay.type_limits WHERE type = 'pay'").fetchone()

    def specs(**declared: object) -> list:
        release = Relay(relay.dsn)
        release.handler("pay", **declared)(lambda job: None)
        return list(release.handlers.values())

    new_release, old_release = specs(concurrency=5), specs(concurrency=3)
    for worker_id in ("old-restarted", "new"):
        register(db, worker_id, ("default",), 8, 5.0)
    limits.publish(db, new_release, published_by="new")
    limits.publish(db, old_release, published_by="old-restarted")
    assert limits.republish_unheld(db, new_release, "new") == [], "a live publisher's limits were overwritten"
    assert limit() == (3, "old-restarted")
    db.execute("UPDATE relay.workers SET stopped_at = now() WHERE id = 'old-restarted'")
    db.commit()
    assert limits.republish_unheld(db, new_release, "new") == ["pay"]
    assert limit() == (5, "new")
    assert limits.republish_unheld(db, new_release, "new") == [], "the check wrote again what it holds"
    # A release before migration 0024 restarted mid-deploy writes its limit over the row and leaves the
    # publisher named: the named worker, whose handler declares another, writes its own back.
    db.execute("UPDATE relay.type_limits SET max_running = 3 WHERE type = 'pay'")
    db.commit()
    assert limits.republish_unheld(db, new_release, "new") == ["pay"]
    assert limit() == (5, "new")
    # The new release removed the limit: once the last publisher of one is gone, the row goes.
    db.execute("UPDATE relay.workers SET stopped_at = now() WHERE id = 'new'")
    db.commit()
    assert limits.republish_unheld(db, specs(), "newest") == ["pay"]
    assert limit() is None
    assert limits.republish_unheld(db, specs(), "newest") == [], "no row and no limit: nothing to write"


@pytest.mark.parametrize(
    ("row_before", "new_limit", "row_after"),
    [("gone publisher", 5, [(5, "new")]), ("none", 5, [(5, "new")]), ("gone publisher", None, [])],
)
def test_a_limits_check_writes_only_over_the_row_it_read(
    relay: Relay,
    db: psycopg.Connection,
    dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    row_before: str,
    new_limit: int | None,
    row_after: list,
) -> None:
    """An old release's worker read a row nobody live held, then a new release's worker started and
    published its limit (or removed it), then the old one's check wrote its own over it: the new worker
    left the row to that live publisher, and the old limit held for as long as the old worker ran."""
    from relay_core.worker import limits
    from relay_core.worker.maintenance import register

    def release(concurrency: int | None) -> list:
        app = Relay(relay.dsn)
        app.handler("pay", concurrency=concurrency)(lambda job: None)
        return list(app.handlers.values())

    for worker_id in ("old", "new"):
        register(db, worker_id, ("default",), 8, 5.0)
    if row_before == "gone publisher":
        db.execute("INSERT INTO relay.type_limits (type, max_running, published_by) VALUES ('pay', 4, 'gone')")
    db.commit()
    publish_one = limits._publish_one

    def new_worker_starts_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(limits, "_publish_one", publish_one)  # once, as the old worker's check writes
        with psycopg.connect(dsn) as starting:
            limits.publish(starting, release(new_limit), published_by="new")
        return publish_one(*args, **kwargs)

    monkeypatch.setattr(limits, "_publish_one", new_worker_starts_first)
    assert limits.republish_unheld(db, release(3), "old") == []
    db.commit()
    assert db.execute("SELECT max_running, published_by FROM relay.type_limits").fetchall() == row_after


def test_a_limits_check_that_meets_a_held_row_lets_go_and_keeps_what_the_same_check_did_before(
    relay: Relay, db: psycopg.Connection, dsn: str
) -> None:
    """The check runs on the connection of the second's other duties, after the schedule ticks it
    enqueued: a failure in it rolled them back too, and it waited without bound for a limits row an
    operator's transaction held, with the ticks' schedule rows locked meanwhile."""
    from relay_core.worker import limits

    release = Relay(relay.dsn)
    release.handler("pay", concurrency=5)(lambda job: None)
    db.execute("INSERT INTO relay.type_limits (type, max_running, published_by) VALUES ('pay', 3, 'gone')")
    db.commit()
    with psycopg.connect(dsn) as operator, psycopg.connect(dsn) as conn:
        operator.execute("SELECT * FROM relay.type_limits WHERE type = 'pay' FOR UPDATE")
        tick = relay.enqueue("noop", conn=conn)  # not committed yet, as a tick the same check enqueued
        began = time.monotonic()
        assert limits.republish_unheld(conn, release.handlers.values(), "w1") == []
        assert time.monotonic() - began < 5
        operator.rollback()
    assert job_status(db, tick) == "queued", "the tick was rolled back with the check"
    assert db.execute("SELECT max_running FROM relay.type_limits WHERE type = 'pay'").fetchone() == (3,)


def test_admin_calls_refuse_bad_input_at_once_even_with_no_database() -> None:
    """They checked it only once a connection came: with the database down, what is no job id
    waited out the whole connection wait and raised PoolTimeout, not InvalidJobError."""
    from relay_core import InvalidJobError

    nowhere = Relay("postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=1", db_wait=5.0)
    try:
        calls = [
            lambda: nowhere.get_job("abc"),  # type: ignore[arg-type]
            lambda: nowhere.requeue(0),
            lambda: nowhere.cancel(-3),
            lambda: nowhere.pause_queue("BAD QUEUE"),
            lambda: nowhere.resume_queue(""),
        ]
        for call in calls:
            began = time.monotonic()
            with pytest.raises(InvalidJobError):
                call()
            assert time.monotonic() - began < 1.0, "it waited for a connection first"
    finally:
        nowhere.close()


def test_the_queues_live_workers_are_counted_in_one_read_of_the_worker_registry(db: psycopg.Connection) -> None:
    """Each queue scanned the whole registry (a week of workers) for its own count: with 2,000 queues and
    1,500 workers a scrape of /metrics took over a second, and it grows toward the statement timeout."""
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency)"
        " SELECT 'w' || i, 'h', i, ARRAY['q' || (i % 3), 'q' || (i % 3), 'shared'], 1 FROM generate_series(1, 30) AS i"
    )
    queues = [f"q{i}" for i in range(40)] + ["shared"]
    explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + sql("queue_service")
    ((plan,),) = db.execute(explain, {"queues": queues, "stale_seconds": 60}).fetchall()
    assert sum(node["Actual Loops"] for node in _scans_of(plan[0]["Plan"], "workers")) == 1
    rows = db.execute(sql("queue_service"), {"queues": queues, "stale_seconds": 60}).fetchall()
    served = {row[0]: row[2] for row in rows}
    assert served == {**{f"q{i}": 0 for i in range(40)}, "q0": 10, "q1": 10, "q2": 10, "shared": 30}
