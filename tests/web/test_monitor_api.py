"""Queues, workers, stats, metrics and health, with the counters checked against real work."""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from relay_core import Backoff, PermanentFailure, Relay, monitor
from relay_core import migrate as migrator
from relay_core.queries import sql
from relay_web.db import FOLD_ROWS_PER_READ

from ..helpers import read_while_truncating, running_worker, start_worker_process, stop_process, wait_for
from .helpers import assert_problem
from .states import make_dead


def _true_counts(db: psycopg.Connection) -> dict[tuple[str, str], int]:
    rows = db.execute("SELECT queue, status::text, count(*) FROM relay.jobs GROUP BY 1, 2").fetchall()
    return {(q, s): n for q, s, n in rows}


def _counter_counts(db: psycopg.Connection) -> dict[tuple[str, str], int]:
    return {(q, s): n for q, states in monitor.queue_counts(db).items() for s, n in states.items()}


def test_counters_match_a_full_count_after_real_work(client, admin, relay: Relay, db) -> None:
    @relay.handler("ok")
    def ok(job) -> None:
        pass

    @relay.handler("flaky", max_attempts=2, backoff=Backoff(base=0.01, jitter=0))
    def flaky(job) -> None:
        raise RuntimeError("always fails")

    @relay.handler("hopeless")
    def hopeless(job) -> None:
        raise PermanentFailure("no such mailbox")

    relay.enqueue_many([{"type": "ok"} for _ in range(30)] + [{"type": "flaky"} for _ in range(4)])
    relay.enqueue("hopeless", {}, queue="mail")
    relay.enqueue("ok", {}, queue="later", run_at=datetime.now(UTC) + timedelta(hours=1))
    with running_worker(relay, queues=("default", "mail")):
        wait_for(lambda: _true_counts(db).get(("default", "succeeded")) == 30, what="ok jobs done")
        wait_for(lambda: _true_counts(db).get(("default", "dead")) == 4, what="flaky jobs dead")
        wait_for(lambda: _true_counts(db).get(("mail", "dead")) == 1, what="hopeless job dead")
    assert _counter_counts(db) == _true_counts(db)

    stats = client.get("/api/admin/stats", headers=admin).get_json()
    assert stats["counts"] == {"queued": 1, "claimed": 0, "succeeded": 30, "dead": 5, "cancelled": 0}
    assert stats["total"] == 36 and stats["window_minutes"] == 60 and len(stats["per_minute"]) == 60
    assert (stats["succeeded"], stats["failed"], stats["dead"]) == (30, 9, 5)
    assert stats["failure_rate"] == pytest.approx(9 / 39)
    assert sum(m["succeeded"] for m in stats["per_minute"][-2:]) == 30

    queues = {q["name"]: q for q in client.get("/api/admin/queues", headers=admin).get_json()["queues"]}
    assert queues["default"]["counts"]["succeeded"] == 30 and queues["mail"]["counts"]["dead"] == 1
    assert queues["later"]["counts"]["queued"] == 1
    assert queues["later"]["oldest_runnable_age_seconds"] is None  # not due yet

    # Deletes (retention) and truncation keep the counters true as well.
    db.execute("DELETE FROM relay.jobs WHERE type = 'ok' AND status = 'succeeded' AND id % 2 = 0")
    assert _counter_counts(db) == _true_counts(db)
    db.execute("TRUNCATE relay.jobs")
    assert monitor.status_counts(db) == dict.fromkeys(monitor.status_counts(db), 0)


def test_truncating_the_jobs_leaves_no_count_behind(relay: Relay, dsn: str, db) -> None:
    """The truncate trigger deleted the counters under the truncating transaction's snapshot: a
    delta committed after a REPEATABLE READ snapshot (or a fold that committed while the TRUNCATE
    waited for it) survived, counting jobs that no longer existed."""
    relay.enqueue("t", {})
    with psycopg.connect(dsn) as truncating:
        truncating.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        truncating.execute("SELECT 1")  # the snapshot is taken
        relay.enqueue("t", {}, queue="mail")  # committed after it
        truncating.execute("TRUNCATE relay.jobs")
        truncating.commit()
    assert _true_counts(db) == {}
    assert _counter_counts(db) == {}


def test_truncating_the_jobs_while_a_cursor_reads_the_counters_leaves_no_count_behind(
    relay: Relay, dsn: str, db
) -> None:
    """TRUNCATE of the counters is refused while a cursor of the same session reads them (a DECLARE,
    a driver's server-side cursor), as it is when one statement truncates both tables. The trigger took
    every such refusal for the second case and kept the counters: they counted the jobs for good."""
    relay.enqueue_many([{"type": "t"} for _ in range(5)])
    with psycopg.connect(dsn) as truncating:
        truncating.execute("DECLARE reading CURSOR FOR SELECT * FROM relay.job_counts")
        truncating.execute("TRUNCATE relay.jobs")
        truncating.commit()
    assert _true_counts(db) == {}
    assert _counter_counts(db) == {}
    # Both tables in one statement: the counters are empty already, and nothing fails.
    relay.enqueue("t", {})
    db.execute("TRUNCATE relay.jobs, relay.job_counts")
    assert _counter_counts(db) == {}


def test_recount_puts_right_the_counts_of_writes_the_triggers_did_not_see(relay: Relay, dsn: str, db) -> None:
    """A session with the triggers off (or a data-only restore of both tables) left the counters wrong
    for good: nothing in Relay rebuilt them."""
    relay.enqueue_many([{"type": "t"} for _ in range(3)])
    relay.enqueue("t", {}, queue="mail")
    with psycopg.connect(dsn) as unseen:
        unseen.execute("SET session_replication_role = replica")
        unseen.execute("INSERT INTO relay.jobs (type, queue) VALUES ('t', 'mail'), ('t', 'restored')")
        unseen.execute("DELETE FROM relay.jobs WHERE id = (SELECT min(id) FROM relay.jobs)")
        unseen.commit()
    assert _counter_counts(db) != _true_counts(db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        wrong = monitor.recount(conn)
        assert wrong == [
            {"queue": "default", "state": "queued", "was": 3, "now": 2},
            {"queue": "mail", "state": "queued", "was": 1, "now": 2},
            {"queue": "restored", "state": "queued", "was": 0, "now": 1},
        ]
        assert _counter_counts(db) == _true_counts(db)
        relay.enqueue("t", {}, queue="restored")  # counted from there on
        assert monitor.recount(conn) == []


def test_recount_while_jobs_are_written_and_folded_leaves_the_counts_exact(relay: Relay, dsn: str, db) -> None:
    """No job is counted twice or missed: not one a writer commits while the recount runs, nor one
    whose deltas a fold sums meanwhile."""
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            relay.enqueue_many([{"type": "t", "queue": "busy"} for _ in range(5)])

    def fold() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                monitor.fold_counters(conn)

    threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=fold, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(20):
                monitor.recount(conn)
                time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert _counter_counts(db) == _true_counts(db)
    assert _true_counts(db)[("busy", "queued")] >= 5


def test_every_shape_of_insert_is_counted(relay: Relay, db) -> None:
    """The insert trigger's one-queue-one-state fast path and its GROUP BY path agree with a full count."""
    relay.enqueue("t", {})
    relay.enqueue("t", {}, queue="mail", idempotency_key="k")
    relay.enqueue("t", {}, queue="mail", idempotency_key="k")  # conflicts: inserts no row
    relay.enqueue_many([{"type": "t"} for _ in range(5)])
    relay.enqueue_many([{"type": "t", "queue": f"q{i % 3}"} for i in range(7)])
    db.execute(
        "INSERT INTO relay.jobs (type, queue, status, claimed_by, claimed_until) "
        "SELECT 't', 'mail', s::relay.job_status, 'w', now() "
        "FROM unnest('{queued,claimed,dead,dead,succeeded,cancelled}'::text[]) AS s"
    )
    db.execute("INSERT INTO relay.jobs (type, queue) SELECT 't', 'b' UNION ALL SELECT 't', 'a'")
    db.execute("INSERT INTO relay.jobs (type) SELECT 't' WHERE false")
    counted = _counter_counts(db)
    assert counted == _true_counts(db)
    assert counted[("mail", "dead")] == 2 and counted[("q0", "queued")] == 3 and counted[("a", "queued")] == 1


def test_folding_keeps_counters_short_and_exact(relay: Relay, db) -> None:
    for i in range(50):
        relay.enqueue("t", {"i": i}, queue=f"q{i % 3}")
    before = db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0]
    assert before >= 50
    assert monitor.fold_counters(db)
    assert db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] == 3
    assert _counter_counts(db) == _true_counts(db)


def test_queue_depth_and_oldest_due_job_age(client, admin, relay: Relay, db) -> None:
    now = datetime.now(UTC)
    relay.enqueue("t", {}, queue="mail", run_at=now - timedelta(minutes=10), priority=5)
    relay.enqueue("t", {}, queue="mail", run_at=now - timedelta(minutes=3), priority=-5)
    relay.enqueue("t", {}, queue="mail", run_at=now - timedelta(hours=9), priority=0)
    dead = relay.enqueue("t", {}, queue="mail", run_at=now - timedelta(days=3))
    make_dead(db, dead)
    relay.enqueue("t", {}, queue="mail", run_at=now + timedelta(hours=1), priority=-10)
    body = client.get("/api/admin/queues", headers=admin).get_json()
    (mail,) = body["queues"]
    assert mail["name"] == "mail"
    assert mail["counts"] == {"queued": 4, "claimed": 0, "succeeded": 0, "dead": 1, "cancelled": 0}
    assert 9 * 3600 - 5 <= mail["oldest_runnable_age_seconds"] <= 9 * 3600 + 60


def test_workers_alive_stopped_and_gone(client, admin, relay: Relay, db) -> None:
    with running_worker(relay, worker_id="alive-1"):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 1, what="registered")
        db.execute(
            "INSERT INTO relay.workers (id, host, pid, queues, concurrency, last_seen_at) "
            "VALUES ('gone-1', 'h', 1, '{default}', 4, now() - interval '10 minutes')"
        )
        body = client.get("/api/admin/workers", headers=admin).get_json()
        states = {w["id"]: w["state"] for w in body["workers"]}
        assert states == {"alive-1": "alive", "gone-1": "gone"}
        assert body["workers"][0]["id"] == "alive-1"
        assert body["counts"] == {"alive": 1, "stopped": 0, "gone": 1}
        assert body["stale_after_seconds"] == 60
        assert {w["id"]: w["claimed"] for w in body["workers"]} == {"alive-1": 0, "gone-1": 0}
    body = client.get("/api/admin/workers", headers=admin).get_json()
    assert {w["id"]: w["state"] for w in body["workers"]} == {"alive-1": "stopped", "gone-1": "gone"}


def test_each_queue_counts_the_live_workers_that_serve_it(client, admin, relay: Relay, db) -> None:
    """A queue with jobs waiting and no live worker is one nothing drains: a mistyped name, say."""
    later = datetime.now(UTC) + timedelta(hours=1)
    for queue in ("mail", "media", "emial"):
        relay.enqueue("send_email", {}, queue=queue, run_at=later)
    with running_worker(relay, worker_id="mail-1", queues=("mail", "default")):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 1, what="registered")
        db.execute(
            "INSERT INTO relay.workers (id, host, pid, queues, concurrency, last_seen_at, stopped_at) VALUES "
            "('gone-1', 'h', 1, '{media}', 4, now() - interval '10 minutes', NULL), "
            "('stopped-1', 'h', 2, '{media,emial}', 4, now(), now())"
        )
        queues = {q["name"]: q for q in client.get("/api/admin/queues", headers=admin).get_json()["queues"]}
        assert {name: q["live_workers"] for name, q in queues.items()} == {"mail": 1, "media": 0, "emial": 0}
        text = client.get("/metrics").get_data(as_text=True)
        assert 'relay_queue_live_workers{queue="mail"} 1.0' in text
        assert 'relay_queue_live_workers{queue="emial"} 0.0' in text
        assert 'relay_queue_paused{queue="mail"} 0.0' in text
        relay.pause_queue("emial")
        text = client.get("/metrics").get_data(as_text=True)
        assert 'relay_queue_paused{queue="emial"} 1.0' in text
        assert 'relay_queue_paused{queue="mail"} 0.0' in text
        relay.resume_queue("emial")
        assert {d.queue for d in monitor.queue_depths(db) if d.unserved} == {"media", "emial"}
        # A worker silent for less than the stale limit still counts.
        assert {d.queue: d.live_workers for d in monitor.queue_depths(db, stale_seconds=3600)}["media"] == 1
    assert {d.queue: d.live_workers for d in monitor.queue_depths(db)} == {"mail": 0, "media": 0, "emial": 0}


def test_a_sigkilled_workers_job_shows_as_a_lapsed_lease_until_a_sweeper_puts_it_back(
    client, admin, relay: Relay, db, python: str, worker_env: dict, tmp_path
) -> None:
    """A job held by a killed worker counts as claimed, and nothing runs it: the lapsed-lease gauge says so."""

    def lapsed() -> tuple[int, str]:
        queues = client.get("/api/admin/queues", headers=admin).get_json()["queues"]
        (mail,) = [q for q in queues if q["name"] == "mail"]
        return mail["lapsed_leases"], client.get("/metrics").get_data(as_text=True)

    job_id = relay.enqueue("record", {"sleep": 120}, queue="mail")
    doomed = start_worker_process(python, worker_env, "--queues", "mail", "--lease", "2", log=tmp_path / "worker.log")
    try:
        wait_for(
            lambda: db.execute("SELECT 1 FROM relay_test.executions WHERE job_id = %s", (job_id,)).fetchone(),
            what="the job to start",
        )
        time.sleep(3)  # past one lease: the worker's heartbeats keep it from lapsing
        count, text = lapsed()
        assert count == 0
        assert 'relay_queue_lapsed_leases{queue="mail"} 0.0' in text
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(10) == -signal.SIGKILL
    finally:
        stop_process(doomed)
    wait_for(lambda: lapsed()[0] == 1, timeout=15, what="the lease to lapse")
    assert 'relay_queue_lapsed_leases{queue="mail"} 1.0' in lapsed()[1]
    assert monitor.status_counts(db)["claimed"] == 1
    # A live worker's sweeper puts it back, whatever queues that worker serves.
    with running_worker(relay, queues=("elsewhere",)):
        wait_for(lambda: lapsed()[0] == 0, what="a sweeper to put the job back")
    assert 'relay_queue_lapsed_leases{queue="mail"} 0.0' in lapsed()[1]
    assert db.execute("SELECT status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "queued",
        1,
    )


def test_a_worker_that_heartbeats_slowly_is_alive_between_its_beats(client, admin, relay: Relay, db) -> None:
    """A 300 s lease heartbeats every 100 s: silent for 90 s, such a worker is alive, and so is its queue served."""
    relay.enqueue("send_email", {}, queue="mail")
    with running_worker(relay, worker_id="slow-beat", queues=("media",), lease_seconds=300.0, heartbeat_interval=None):
        wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 1, what="registered")
        assert db.execute("SELECT heartbeat_seconds FROM relay.workers").fetchone()[0] == 100.0
    # Registry rows as such workers leave them between two beats: (id, heartbeat interval, silent for).
    db.execute("DELETE FROM relay.workers")
    db.execute(
        "INSERT INTO relay.workers (id, host, pid, queues, concurrency, heartbeat_seconds, last_seen_at) "
        "SELECT id, 'h', 1, '{mail}', 4, beat, now() - make_interval(secs => silent) "
        "FROM (VALUES ('slow', 100.0, 90), ('slow-missed-two', 100.0, 210), ('fast-gone', 10.0, 90), "
        "             ('fast-within-stale', 10.0, 30), ('older-relay', NULL, 50), ('older-relay-gone', NULL, 90)) "
        "AS r(id, beat, silent)"
    )
    body = client.get("/api/admin/workers", headers=admin).get_json()
    # Gone after the longer of RELAY_WORKER_STALE_SECONDS (60 here) and two heartbeat intervals.
    assert {w["id"]: w["state"] for w in body["workers"]} == {
        "slow": "alive",
        "slow-missed-two": "gone",
        "fast-gone": "gone",
        "fast-within-stale": "alive",
        "older-relay": "alive",
        "older-relay-gone": "gone",
    }
    assert body["counts"] == {"alive": 3, "stopped": 0, "gone": 3}
    (mail,) = client.get("/api/admin/queues", headers=admin).get_json()["queues"]
    assert mail["live_workers"] == 3


def test_metrics_series(client, relay: Relay, db) -> None:
    relay.enqueue("send_email", {}, queue="mail")
    dead = relay.enqueue("send_email", {}, queue="mail")
    make_dead(db, dead)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.content_type.startswith("text/plain; version=0.0.4")
    text = response.get_data(as_text=True)
    for line in (
        'relay_jobs{queue="mail",state="queued"} 1.0',
        'relay_jobs{queue="mail",state="dead"} 1.0',
        'relay_jobs_failed_total{queue="mail",type="send_email"} 1.0',
        'relay_jobs_dead_total{queue="mail",type="send_email"} 1.0',
        "relay_jobs_failure_ratio 1.0",
        'relay_workers{state="alive"} 0.0',
        "relay_workers_alive 0.0",
    ):
        assert line in text, text
    assert 'relay_queue_oldest_job_age_seconds{queue="mail"}' in text


def test_metrics_token(make_app) -> None:
    client = make_app(RELAY_METRICS_TOKEN="scrape-me").test_client()
    assert_problem(client.get("/metrics"), 401, "metrics-token")
    assert_problem(client.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    assert client.get("/metrics", headers={"Authorization": "Bearer scrape-me"}).status_code == 200
    assert_problem(client.get("/metrics?x=1"), 401, "metrics-token")  # a query string does not get past the token


def test_health_and_readiness(client, db) -> None:
    assert client.get("/healthz").get_json() == {"status": "ok"}
    assert client.get("/readyz").get_json() == {"status": "ready", "database": "ok", "migrations": "current"}
    version, name = db.execute(
        "DELETE FROM relay.schema_migrations WHERE version = (SELECT max(version) FROM relay.schema_migrations) "
        "RETURNING version, name"
    ).fetchone()
    try:
        response = client.get("/readyz")
        body = assert_problem(response, 503, "migrations-pending")
        assert "relay migrate" in body["detail"]
        # A scrape says the same, where it answered 500 once a table it reads was missing.
        assert_problem(client.get("/metrics"), 503, "migrations-pending")
    finally:
        db.execute("INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)", (version, name))


def test_an_enqueue_meeting_a_schema_behind_this_release_answers_migrations_pending(client, db, admin) -> None:
    """Relay's enqueue says a missing schema as ConfigurationError (from the server's error); the API
    must still answer 503 migrations-pending for it, not a 500."""
    version, name = db.execute(
        "DELETE FROM relay.schema_migrations WHERE version = (SELECT max(version) FROM relay.schema_migrations) "
        "RETURNING version, name"
    ).fetchone()
    db.execute("ALTER FUNCTION relay.published_max_attempts(text, integer) RENAME TO published_max_attempts_away")
    try:
        created = client.post("/api/admin/jobs", headers=admin, json={"type": "send_email"})
        assert "relay migrate" in assert_problem(created, 503, "migrations-pending")["detail"]
    finally:
        db.execute("ALTER FUNCTION relay.published_max_attempts_away(text, integer) RENAME TO published_max_attempts")
        db.execute("INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)", (version, name))


def test_a_database_another_build_migrated_is_named_as_such_wherever_the_schema_is_checked(client, db) -> None:
    """/readyz named it, but /metrics said to run `relay migrate`, which refuses such a database."""
    (version,) = db.execute(
        "UPDATE relay.schema_migrations SET name = 'withdrawn_before_release'"
        " WHERE version = (SELECT max(version) FROM relay.schema_migrations) RETURNING version"
    ).fetchone()
    shipped = next(m.name for m in migrator.available() if m.version == version)
    try:
        for path in ("/readyz", "/metrics"):
            detail = assert_problem(client.get(path), 503, "migrations-pending")["detail"]
            assert detail.startswith(f"The database records migration {version:04d}_withdrawn_before_release"), path
            assert f"this Relay ships {version:04d}_{shipped}" in detail and "Restore the database" in detail, path
    finally:
        db.execute("UPDATE relay.schema_migrations SET name = %s WHERE version = %s", (shipped, version))


def test_a_database_never_migrated_answers_migrations_pending_not_internal_error(
    make_app, admin, unmigrated_dsn: str
) -> None:
    """Logging in, listing jobs and the dashboard's login form answered 500 "internal" (a missing table)."""
    client = make_app(RELAY_DATABASE_URL=unmigrated_dsn).test_client()
    assert_problem(client.get("/readyz"), 503, "migrations-pending")
    login = client.post("/api/auth/login", json={"username": "ops", "password": "correct horse battery"})
    assert "relay migrate" in assert_problem(login, 503, "migrations-pending")["detail"]
    assert login.headers["Retry-After"] == "10"
    assert_problem(client.get("/api/admin/jobs?status=dead", headers=admin), 503, "migrations-pending")
    created = client.post("/api/admin/jobs", headers=admin, json={"type": "send_email"})
    assert "relay migrate" in assert_problem(created, 503, "migrations-pending")["detail"]
    page = client.post("/login", data={"username": "ops", "password": "correct horse battery"})
    assert page.status_code == 503
    assert page.mimetype == "text/html"
    assert "relay migrate" in page.get_data(as_text=True)


def test_probes_and_scrapes_ignore_a_cache_busting_query_string(client) -> None:
    assert client.get("/healthz?_=1733030000").get_json() == {"status": "ok"}
    assert client.get("/readyz?probe=render&probe=again").get_json()["status"] == "ready"
    assert client.get("/metrics?cachebust=1").status_code == 200


def test_database_outage_is_503_and_liveness_stays_up(make_app, admin) -> None:
    app = make_app(RELAY_DATABASE_URL="postgresql://postgres@127.0.0.1:1/nowhere", RELAY_DB_WAIT_SECONDS=1)
    client = app.test_client()
    assert client.get("/healthz").status_code == 200
    response = client.get("/readyz")
    assert_problem(response, 503, "unavailable")
    assert response.headers["Retry-After"] == "5"
    assert_problem(client.get("/api/admin/queues", headers=admin), 503, "unavailable")


def test_pause_and_resume_a_queue(client, admin, viewer, relay: Relay, db) -> None:
    relay.enqueue("t", {}, queue="mail")
    assert client.post("/api/admin/queues/mail/pause", headers=admin).get_json() == {"name": "mail", "paused": True}
    assert client.post("/api/admin/queues/empty/pause", headers=admin).status_code == 200
    queues = {q["name"]: q for q in client.get("/api/admin/queues", headers=viewer).get_json()["queues"]}
    assert queues["mail"]["paused"] is True and queues["mail"]["counts"]["queued"] == 1
    assert queues["empty"]["paused"] is True and sum(queues["empty"]["counts"].values()) == 0
    assert client.post("/api/admin/queues/mail/resume", headers=admin).get_json() == {"name": "mail", "paused": False}
    assert_problem(client.post("/api/admin/queues/mail/pause", headers=viewer), 403, "forbidden")
    assert_problem(client.post("/api/admin/queues/Bad%20Queue/pause", headers=admin), 422, "validation")


def test_a_runaway_listing_is_cut_off_with_503(make_app, auth, relay: Relay) -> None:
    relay.enqueue_many([{"type": f"type-{i}"} for i in range(30_000)])
    client = make_app(RELAY_STATEMENT_TIMEOUT_MS=1).test_client()
    response = client.get("/api/admin/jobs?q=no-such-text", headers=auth.headers("viewer"))
    body = assert_problem(response, 503, "query-timeout")
    assert "narrow" in body["detail"]


def test_api_answers_are_not_cached_or_sniffed(client, admin) -> None:
    response = client.get("/api/admin/queues", headers=admin)
    assert response.headers["Cache-Control"] == "no-store"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    login = client.post("/api/auth/login", json={"username": "x", "password": "y"})
    assert login.headers["Cache-Control"] == "no-store"


def test_schedules_and_limits_are_listed(client, viewer, relay: Relay, db) -> None:
    from relay_core.worker import limits, periodic
    from relay_core.worker.maintenance import register

    @relay.handler("settlement_report", cron="0 0 1 * *", timezone="Europe/Berlin")
    def settle(job) -> None:
        pass

    @relay.handler("send_email", concurrency=3, rate_limit=(100, 60))
    def send(job) -> None:
        pass

    periodic.publish(db, relay.handlers.values())
    limits.publish(db, relay.handlers.values())
    schedules = client.get("/api/admin/schedules", headers=viewer).get_json()["schedules"]
    assert [(s["type"], s["cron"], s["timezone"]) for s in schedules] == [
        ("settlement_report", "0 0 1 * *", "Europe/Berlin")
    ]
    assert schedules[0]["next_tick"] > schedules[0]["last_tick"]
    # The tick before registration is not a run: nothing has been enqueued yet.
    assert [schedules[0][key] for key in ("last_enqueued_tick", "last_job_id", "last_job_status")] == [None] * 3
    assert schedules[0]["runs_recorded_since"] is None
    assert schedules[0]["checked"] is False, "no worker runs: nothing enqueues its ticks"
    register(db, "w1", ("default",), 8, 10.0, periodic.checked_schedule_definitions(relay.handlers.values()))
    (schedule,) = client.get("/api/admin/schedules", headers=viewer).get_json()["schedules"]
    assert schedule["checked"] is True
    # The month-end tick, checked on time, enqueues a job.
    (tick,) = db.execute("SELECT last_tick FROM relay.schedules").fetchone()
    db.execute("UPDATE relay.schedules SET last_tick = last_tick - interval '62 days'")
    assert periodic.enqueue_due(db, relay.handlers.values(), clock=tick + timedelta(seconds=5)) != []
    (job_id,) = db.execute("SELECT id FROM relay.jobs").fetchone()
    (schedule,) = client.get("/api/admin/schedules", headers=viewer).get_json()["schedules"]
    assert datetime.fromisoformat(schedule["last_enqueued_tick"]) == tick
    assert (schedule["last_job_id"], schedule["last_job_status"]) == (job_id, "queued")
    found = client.get("/api/admin/limits", headers=viewer).get_json()["limits"]
    assert found == [
        {"type": "send_email", "max_running": 3, "rate_limit": 100, "rate_period_seconds": 60.0, "running": 0}
    ]
    assert_problem(client.get("/api/admin/limits"), 401)


def test_answers_over_https_tell_the_browser_to_stay_on_https(client, make_app, admin) -> None:
    """Over HTTPS every answer carries HSTS, as the platform's proxy reports HTTPS; over plain HTTP none does."""
    for path in ("/healthz", "/login", "/api/admin/queues"):
        secure = client.get(path, headers=admin, base_url="https://relay.example")
        assert secure.headers["Strict-Transport-Security"] == "max-age=31536000", path
        assert "Strict-Transport-Security" not in client.get(path, headers=admin).headers, path
    proxied = make_app(RELAY_PROXY_HOPS=1).test_client()
    behind = proxied.get("/healthz", headers={"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"})
    assert behind.headers["Strict-Transport-Security"] == "max-age=31536000"
    assert "Strict-Transport-Security" not in proxied.get("/healthz", headers={"X-Forwarded-Proto": "http"}).headers


@pytest.mark.parametrize("path", ["/metrics", "/api/admin/queues"])
def test_truncating_the_jobs_while_a_scrape_reads_the_counters_deadlocks_nothing(
    path: str, client, admin, relay: Relay, dsn: str, db
) -> None:
    """A reader that held the counters (a fold, a count) while it went on to read relay.jobs deadlocked
    with TRUNCATE relay.jobs, which holds relay.jobs and then empties the counters: one of the two was
    cancelled, the scrape answering 503 'database cannot be reached'."""
    relay.enqueue("t", {}, queue="mail")
    answer, truncate_error = read_while_truncating(dsn, db, lambda: client.get(path, headers=admin))
    assert truncate_error is None
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert _counter_counts(db) == _true_counts(db) == {}


def test_a_pile_of_counter_deltas_no_worker_folded_does_not_time_the_scrape_out(
    make_app, admin, relay: Relay, db
) -> None:
    """A scrape folded every delta in one statement: a million left while no worker ran took longer
    than the web's statement timeout, and /metrics and the queues page answered 503 until a worker
    came back. A scrape folds a share; what it reads still sums every delta left."""
    relay.enqueue("t", {}, queue="mail")
    db.execute(
        "INSERT INTO relay.job_counts (queue, state, n) "
        "SELECT 'mail', 'queued', CASE WHEN g % 2 = 0 THEN 1 ELSE -1 END FROM generate_series(1, 1000000) AS g"
    )
    client = make_app(RELAY_STATEMENT_TIMEOUT_MS=1500).test_client()
    scrape = client.get("/metrics")
    assert scrape.status_code == 200, scrape.get_data(as_text=True)
    assert 'relay_jobs{queue="mail",state="queued"} 1.0' in scrape.get_data(as_text=True)
    queues = client.get("/api/admin/queues", headers=admin)
    assert queues.status_code == 200 and queues.get_json()["queues"][0]["counts"]["queued"] == 1
    # Each read folded a share (FOLD_ROWS_PER_READ) and no more, whatever the machine's speed.
    left = db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0]
    assert 1_000_001 - 2 * FOLD_ROWS_PER_READ <= left < 1_000_001 - 2 * FOLD_ROWS_PER_READ + 10
    assert monitor.fold_counters(db)
    assert db.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] == 1
    assert _counter_counts(db) == _true_counts(db)


def test_folding_on_a_repeatable_read_connection_folds_at_read_committed(relay: Relay, dsn: str, db) -> None:
    """A fold on a REPEATABLE READ connection kept the snapshot its first statement took: when a fold
    another process committed meanwhile had deleted rows it went on to delete, it failed with a
    serialization error instead of leaving those rows to the fold that took them."""
    for i in range(4):
        relay.enqueue("t", {"i": i})
    outcome: dict[str, object] = {}

    def fold() -> None:
        try:
            outcome["folded"] = monitor.fold_counters(repeatable)
        except psycopg.Error as exc:
            outcome["error"] = exc

    with psycopg.connect(dsn) as repeatable, psycopg.connect(dsn) as other:
        repeatable.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        other.execute(sql("job_counts_fold"), {"rows": None})  # another fold, not yet committed
        folding = threading.Thread(target=fold)
        folding.start()
        wait_for(
            lambda: db.execute(
                "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted)"
            ).fetchone()[0],
            what="the fold waits for the other fold's rows",
        )
        other.commit()
        folding.join(30)
    assert outcome == {"folded": True}
    assert _counter_counts(db) == _true_counts(db)
