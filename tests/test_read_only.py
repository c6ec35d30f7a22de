"""A database that refuses writes for a while (SQLSTATE 25006), as during a failover.

A failover leaves a worker's sessions on the demoted primary, or on a
standby an old DNS answer still names; a cutover sets
``default_transaction_read_only``. Each test makes its own database refuse
writes to new sessions (``ALTER DATABASE ... SET default_transaction_read_only``)
and ends the sessions open on it, so Relay's pools reconnect into the
refusal; ending it changes the setting for new sessions only, so the
sessions already open stay read-only, as they do on a server a failover left
behind. Relay must wait it out, lose nothing, and take new sessions once it
is over.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Relay, users
from relay_core.migrate import migrate
from relay_core.outages import OutageLog
from relay_web import create_app
from relay_web.db import FOLD_REFUSED, Database

from .helpers import running_worker, wait_for
from .web.conftest import FAST_HASH, PASSWORD, SECRET


class ReadOnlySwitch:
    """A scratch database whose new sessions can be made to refuse writes, and a session that always may write."""

    def __init__(self, server_dsn: str) -> None:
        self.name = f"relay_read_only_{uuid.uuid4().hex[:8]}"
        self._server_dsn = server_dsn
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.name}"')
        self.dsn = conninfo.make_conninfo(server_dsn, dbname=self.name)
        migrate(self.dsn)
        #: Opened while writes are taken, so it takes them throughout (the test's own view of the primary).
        self.writer = psycopg.connect(self.dsn, autocommit=True)

    def refuse_writes(self) -> None:
        """New sessions refuse writes; every session but the writer ends (and Relay's reconnect read-only)."""
        with psycopg.connect(self._server_dsn, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{self.name}" SET default_transaction_read_only = on')
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
                (self.name, self.writer.info.backend_pid),
            )

    def take_writes(self) -> None:
        """New sessions take writes again; those already open stay read-only, as on a server left behind."""
        with psycopg.connect(self._server_dsn, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{self.name}" RESET default_transaction_read_only')

    def job(self, job_id: int) -> dict[str, Any]:
        """The job's row, as the writer sees it."""
        with self.writer.cursor(row_factory=psycopg.rows.dict_row) as cur:
            row = cur.execute("SELECT * FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
        assert row is not None
        return row

    def close(self) -> None:
        self.writer.close()
        with psycopg.connect(self._server_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


#: What a worker logs as its writes begin to be refused (up to the "; retrying").
REFUSING = "database refuses writes (read-only: a failover or a standby?)"


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What Relay has logged so far, each line up to its first semicolon."""
    return [r.getMessage().split(";")[0] for r in caplog.records if r.name == "relay"]


@pytest.fixture
def switch(database_url: str) -> Iterator[ReadOnlySwitch]:
    with contextlib.closing(ReadOnlySwitch(database_url)) as made:
        yield made


@pytest.fixture
def dsn(switch: ReadOnlySwitch) -> str:
    """The scratch database: conftest's ``relay`` is bound to it."""
    return switch.dsn


def test_a_success_refused_as_read_only_is_written_once_writes_are_taken_again(
    switch: ReadOnlySwitch, relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler ran once and succeeded while the database refused writes: that success is what is recorded.

    It was dropped as a refusal for good, its lease left to run out, and the
    sweeper ended the job dead (one attempt) although its handler succeeded.
    Its progress report, refused too, is dropped rather than raised into it.
    """
    caplog.set_level("WARNING", logger="relay")
    release, started = threading.Event(), threading.Event()
    runs: list[int] = []
    progress_answers: list[object] = []

    @relay.handler("charge", max_attempts=1)
    def charge(job: Any) -> dict[str, bool]:
        runs.append(job.attempt)
        started.set()
        release.wait(30)
        try:
            progress_answers.append(job.progress(50, "charging"))
        except Exception as exc:  # what the test looks for: a report must not fail the handler
            progress_answers.append(exc)
        return {"charged": True}

    job_id = relay.enqueue("charge", {"amount": 5})
    with running_worker(relay, lease_seconds=6.0, heartbeat_interval=1.0, sweep_interval=0.5):
        assert started.wait(15), "the handler never started"
        switch.refuse_writes()
        release.set()
        wait_for(lambda: REFUSING in said(caplog), what="a write refused as read-only")
        # Reads get through meanwhile (a LISTEN, maintenance with nothing to change): each
        # ended the outage and the next refused write began it again, a pair of lines a second.
        switch.writer.execute("SELECT pg_sleep(1.5)")
        assert switch.job(job_id)["status"] == "claimed"
        assert said(caplog)[-1] == REFUSING and said(caplog).count(REFUSING) == 1, said(caplog)
        switch.take_writes()
        wait_for(lambda: switch.job(job_id)["status"] != "claimed", timeout=20, what="the job's end written")
    row = switch.job(job_id)
    assert (row["status"], row["attempts"], row["result"]) == ("succeeded", 1, {"charged": True}), row
    assert runs == [1]
    assert len(progress_answers) == 1 and isinstance(progress_answers[0], bool), progress_answers
    assert said(caplog)[-1] == "database reachable again", said(caplog)
    refusals = [r for r in caplog.records if "refused by the database" in r.getMessage()]
    assert not refusals, [r.getMessage() for r in refusals]


def test_a_worker_claims_again_once_writes_are_taken_not_when_its_sessions_expire(
    switch: ReadOnlySwitch, relay: Relay
) -> None:
    """Its pool's sessions, reopened while writes were refused, refused every claim for their whole lifetime."""
    handled = threading.Event()
    relay.handler("ping")(lambda job: handled.set())
    with running_worker(relay, poll_interval=0.2):
        switch.refuse_writes()
        switch.writer.execute("SELECT pg_sleep(1.5)")  # the worker reconnects, and its claims are refused
        switch.take_writes()
        switch.writer.execute(
            "INSERT INTO relay.jobs (type, payload) VALUES ('ping', '{}')"
        )  # by the writer: Relay's own pool is the one under test
        assert handled.wait(15), "the job was not claimed after writes were taken again"


def test_a_worker_started_while_writes_are_refused_waits_then_works(
    switch: ReadOnlySwitch, relay: Relay, caplog: pytest.LogCaptureFixture
) -> None:
    """Its start (registering itself is a write) failed, and the worker stopped, where an outage is waited out."""
    caplog.set_level("WARNING", logger="relay")
    handled = threading.Event()
    relay.handler("ping")(lambda job: handled.set())
    switch.refuse_writes()
    with running_worker(relay, poll_interval=0.2) as worker:
        switch.writer.execute("SELECT pg_sleep(1.0)")
        wait_for(lambda: said(caplog), timeout=10, what="the refused start said")  # a thread started late
        assert not worker.stopped_for_stuck_handlers
        registered = switch.writer.execute("SELECT count(*) FROM relay.workers").fetchone()
        assert registered == (0,)
        assert said(caplog) == [REFUSING], "said as what it is, not as a database unreachable"
        switch.take_writes()
        switch.writer.execute("INSERT INTO relay.jobs (type, payload) VALUES ('ping', '{}')")
        assert handled.wait(20), "the worker never got past its start"


def test_an_enqueue_refused_as_read_only_raises_and_the_next_one_after_writes_are_taken_works(
    switch: ReadOnlySwitch, relay: Relay
) -> None:
    """The pool kept the refused session, and every enqueue on it was refused for its lifetime."""
    switch.refuse_writes()  # before the pool's first session opens, so that one refuses writes
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        relay.enqueue("refused", {})
    switch.take_writes()

    def enqueued() -> int | None:
        try:
            return relay.enqueue("after", {})
        except psycopg.errors.ReadOnlySqlTransaction:
            return None

    # Within a second or so (the pool replaces its sessions at most once a second), not the sessions' hour.
    job_id = wait_for(enqueued, timeout=5, what="an enqueue taken")
    assert switch.job(int(job_id))["type"] == "after"  # type: ignore[arg-type]
    types = [row[0] for row in switch.writer.execute("SELECT type FROM relay.jobs ORDER BY id")]
    assert types == ["after"]


@pytest.fixture
def make_app(switch: ReadOnlySwitch) -> Iterator[Callable[[], Any]]:
    built: list[Any] = []

    def build() -> Any:
        app = create_app({"TESTING": True, "RELAY_DATABASE_URL": switch.dsn, "JWT_SECRET_KEY": SECRET, **FAST_HASH})
        built.append(app)
        return app

    yield build
    for app in built:
        app.extensions["relay.close"]()


def test_an_admin_write_refused_as_read_only_is_a_503_that_says_so(
    switch: ReadOnlySwitch, make_app: Callable[[], Any]
) -> None:
    """It was a 500, "something went wrong on our side", for what is a failover to wait out."""
    users.create_user(switch.writer, "admin", PASSWORD, "admin", hasher=users.make_hasher(1, 1024, 1))
    job_id = switch.writer.execute(
        "INSERT INTO relay.jobs (type, payload, status, attempts, finished_at, last_error)"
        " VALUES ('charge', '{}', 'dead', 1, now(), 'boom') RETURNING id"
    ).fetchone()[0]
    client = make_app().test_client()
    login = client.post("/api/auth/login", json={"username": "admin", "password": PASSWORD})
    assert login.status_code == 200, login.get_json()
    headers = {"Authorization": f"Bearer {login.get_json()['access_token']}"}
    switch.refuse_writes()
    refused = client.post(f"/api/admin/jobs/{job_id}/requeue", headers=headers)
    assert refused.status_code == 503, refused.get_json()
    assert refused.headers["Content-Type"] == "application/problem+json"
    assert "refuses writes" in refused.get_json()["detail"]
    assert switch.job(job_id)["status"] == "dead"
    switch.take_writes()

    def requeued() -> bool:
        return client.post(f"/api/admin/jobs/{job_id}/requeue", headers=headers).status_code == 200

    wait_for(requeued, timeout=5, what="the requeue taken")
    assert switch.job(job_id)["status"] == "queued"


def refused() -> psycopg.errors.ReadOnlySqlTransaction:
    return psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_that_met_a_refused_write_ends_only_with_a_write_whatever_failed_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It was ended by a read getting through whenever another failure (a connection the pool was
    replacing) came after the refusal: reachable again, then refuses writes, a pair each time."""
    caplog.set_level("WARNING", logger="relay")
    clock = Clock()
    log = OutageLog(clock=clock)
    log.failed("completion write", refused())
    clock.now += 1
    log.failed("claim", psycopg.OperationalError("server closed the connection unexpectedly"))
    clock.now += 1
    log.succeeded(wrote=False)  # a LISTEN, maintenance that read only
    assert log.under_way()
    log.failed("completion write", refused())
    log.succeeded(wrote=True)
    assert not log.under_way()
    assert said(caplog) == [REFUSING, "database reachable again"]
    log.failed("claim", psycopg.OperationalError("server closed the connection unexpectedly"))
    log.succeeded(wrote=False)  # an outage that met no refused write: a read ends it
    assert not log.under_way()


def test_an_outage_that_turns_read_only_says_so_once_not_at_every_turn(caplog: pytest.LogCaptureFixture) -> None:
    """Failures alternating between unreachable and read-only (a failover by DNS) said "refuses writes"
    at each turn, past the once-per-30-s limit."""
    caplog.set_level("WARNING", logger="relay")
    clock = Clock()
    log = OutageLog(clock=clock)
    for _ in range(5):
        log.failed("claim", psycopg.OperationalError("connection refused"))
        clock.now += 0.5
        log.failed("completion write", refused())
        clock.now += 0.5
    assert said(caplog) == ["database unreachable", REFUSING]


def test_the_web_apps_log_warns_of_refused_writes_without_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """Each page's checkout ended the outage a refused write began, and the next refusal, begun before
    that end, was taken for its tail and not said: an outage log that swung and dropped every other one."""
    caplog.set_level("WARNING", logger="relay")
    database = Database("postgresql://unused", size=1, wait_seconds=1.0, statement_timeout_ms=0, max_payload_bytes=1)
    for _ in range(3):
        database.unavailable("/api/admin/jobs/1/requeue", refused())
        database.outage.succeeded()
    assert not database.outage.under_way()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["database refuses writes (read-only: a failover or a standby?); answering 503"]


def test_the_counters_pages_read_on_while_writes_are_refused(
    switch: ReadOnlySwitch, make_app: Callable[[], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Their fold of the counter deltas is a write: it made every scrape and overview a 503 in a failover."""
    users.create_user(switch.writer, "admin", PASSWORD, "admin", hasher=users.make_hasher(1, 1024, 1))
    switch.writer.execute("INSERT INTO relay.jobs (type, payload, queue) VALUES ('charge', '{}', 'billing')")
    client = make_app().test_client()
    login = client.post("/api/auth/login", json={"username": "admin", "password": PASSWORD})
    headers = {"Authorization": f"Bearer {login.get_json()['access_token']}"}
    switch.refuse_writes()
    deltas = switch.writer.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0]
    for path in ("/metrics", "/api/admin/queues", "/api/admin/stats"):
        answer = client.get(path, headers=headers)
        assert answer.status_code == 200, (path, answer.get_data(as_text=True)[:300])
    assert 'relay_jobs{queue="billing",state="queued"} 1.0' in client.get("/metrics").get_data(as_text=True)
    queues = client.get("/api/admin/queues", headers=headers).get_json()
    assert queues, queues
    assert switch.writer.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0] == deltas
    said = [r.getMessage() for r in caplog.records if r.name == "relay"]
    assert said == [FOLD_REFUSED], said  # once, and no "answering 503" while answering 200
    switch.take_writes()
