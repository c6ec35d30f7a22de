"""Relay behind a real PgBouncer in transaction pooling (RELAY_TRANSACTION_POOLING=true).

A transaction pooler hands each transaction whichever server connection is
free, so nothing a Relay connection leaves on a session may matter to the
next transaction, Relay's or the application's: no prepared statements
(their names collide across clients), no session settings. The pooler here
keeps one server connection, so every client shares it and anything left
behind is seen by the next.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Job, PermanentFailure, Relay, users
from relay_core.errors import ConfigurationError
from relay_core.migrate import migrate
from relay_core.worker.config import WorkerConfig
from relay_web import create_app

from .helpers import AT_COMMIT_SETTINGS, free_port, running_worker, start_worker_process, stop_process, wait_for
from .web.conftest import FAST_HASH, PASSWORD, SECRET

PGBOUNCER = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
)

#: What every server session must still say after Relay used it (the database defaults here).
SESSION_STATE = (
    "SELECT current_setting('jit'), current_setting('default_transaction_isolation'), "
    "current_setting('statement_timeout'), (SELECT count(*) FROM pg_prepared_statements)"
)

STATUS_COUNTS = "SELECT status::text, count(*) FROM relay.jobs GROUP BY 1"

#: What the test database's server sessions are doing (the pooler's one among them).
SESSIONS = (
    "SELECT pid, state, now() - xact_start, now() - state_change, wait_event_type, wait_event, left(query, 300) "
    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass
class Pooler:
    """A running PgBouncer: the test database through it, and the file its log goes to."""

    dsn: str
    log: Path


@contextlib.contextmanager
def pgbouncer(dsn: str, settings: str = "") -> Iterator[Pooler]:
    """The test database through PgBouncer in transaction pooling with one server connection."""
    if PGBOUNCER is None:
        pytest.skip("PgBouncer is not installed (apt-get install pgbouncer)")
    server_host = str(conninfo.conninfo_to_dict(dsn).get("host") or "")
    if os.geteuid() == 0 and server_host.startswith("/"):
        # PgBouncer refuses root and runs as postgres below, which may not enter the
        # embedded server's data directory (mode 0700, root's), where its socket is.
        pytest.skip("PgBouncer runs as postgres and cannot reach the embedded server's socket: set DATABASE_URL")
    # Its own folder, readable by the user PgBouncer runs as (pytest's tmp_path is root's alone).
    folder = Path(tempfile.mkdtemp(prefix="relay-pgbouncer-"))
    folder.chmod(0o755)
    server = conninfo.conninfo_to_dict(dsn)
    port = free_port()
    target = " ".join(
        f"{key}={_quote(str(server[key]))}" for key in ("host", "port", "user", "password") if server.get(key)
    )
    user = str(server.get("user") or "postgres")
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n{server['dbname']} = {target} dbname={server['dbname']}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\ndefault_pool_size = 1\nmax_client_conn = 100\n" + settings
    )
    command = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        command[1:1] = ["-u", "postgres"]
    log = folder / "output.txt"
    output = open(log, "wb")  # noqa: SIM115 - closed with the pooler
    proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    pooled = conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(port), user=user, password="")

    def answers() -> bool:
        try:
            with psycopg.connect(pooled, connect_timeout=2, prepare_threshold=None):
                return True
        except psycopg.OperationalError:
            return proc.poll() is not None  # stop waiting for a pooler that exited

    try:
        wait_for(answers, timeout=15, what="PgBouncer to accept connections")
        assert proc.poll() is None, log.read_text()
        yield Pooler(pooled, log)
    finally:
        proc.terminate()
        proc.wait(10)
        output.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pooled_dsn(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test database through PgBouncer in transaction pooling with one server connection."""
    with pgbouncer(dsn) as pooler:
        monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
        yield pooler.dsn


def session_state(pooled: str) -> tuple:
    """The shared server session's settings and prepared statements, read through the pooler."""
    with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as conn:
        return conn.execute(SESSION_STATE).fetchone()


def test_a_worker_behind_a_transaction_pooler_runs_every_job_and_leaves_no_session_state(pooled_dsn: str) -> None:
    before = session_state(pooled_dsn)
    relay = Relay(pooled_dsn)
    ran: list[int] = []
    relay.handler("count")(lambda job: ran.append(job.payload["n"]))
    with relay.pool.connection() as conn:
        assert relay.enqueue("count", {"n": -1}, conn=conn) > 0
    ids = [relay.enqueue("count", {"n": n}) for n in range(150)]
    with running_worker(relay, concurrency=4, listen=False):
        wait_for(lambda: len(ran) == 151, timeout=60, what="every job to run")
    relay.close()
    with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn:
        statuses = conn.execute(
            "SELECT status::text, count(*) FROM relay.jobs WHERE id = ANY(%s) GROUP BY 1", (ids,)
        ).fetchall()
    assert statuses == [("succeeded", 150)]
    assert sorted(ran) == list(range(-1, 150))
    assert session_state(pooled_dsn) == before


def test_a_transactional_handlers_set_does_not_reach_the_next_client_of_the_pooler(
    pooled_dsn: str, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's plain SET committed with its success; the session's reset came after the COMMIT, by
    when the pooler had lent the server connection on: an application's enqueues failed read-only. Its
    settings still hold until its COMMIT, SET LOCAL or not (a deferred trigger sees them)."""
    from relay_core.worker import executor

    seen_between: list[tuple] = []
    reset_session = executor.reset_session

    def next_client_first(conn: psycopg.Connection) -> None:
        # Another client's transaction, given the server connection as the handler's COMMIT released it.
        with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as other:
            tenant = other.execute("SELECT current_setting('myapp.tenant', true)").fetchone()[0]
        seen_between.append((*session_state(pooled_dsn), tenant or None))
        reset_session(conn)

    monkeypatch.setattr(executor, "reset_session", next_client_first)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(AT_COMMIT_SETTINGS)
    try:
        before = session_state(pooled_dsn)
        relay = Relay(pooled_dsn)

        @relay.handler("sets_its_session")
        def sets_its_session(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("SET statement_timeout = '4321ms'")
            conn.execute("SET myapp.tenant = 'acme'")  # a custom setting, as row-level security uses
            conn.execute("SET LOCAL synchronous_commit = off")
            conn.execute("SET LOCAL search_path = relay_test, public")
            conn.execute("INSERT INTO handler_rows VALUES (%s)", (job.id,))  # found by its search_path

        job_id = relay.enqueue("sets_its_session")
        with running_worker(relay, concurrency=1, listen=False):
            wait_for(lambda: seen_between, timeout=30, what="the job to succeed")
        relay.close()
        assert seen_between == [(*before, None)]
        with psycopg.connect(dsn, autocommit=True) as db:
            assert db.execute("SELECT status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
                "succeeded",
            )
            at_commit = db.execute("SELECT search_path, synchronous_commit FROM relay_test.commit_settings")
            assert at_commit.fetchall() == [("relay_test, public", "off")]
    finally:
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute("DROP TABLE relay_test.handler_rows, relay_test.commit_settings")
            db.execute("DROP FUNCTION relay_test.record_commit_settings()")


def test_a_worker_behind_a_transaction_pooler_sends_no_flush_the_pooler_could_read_too_late(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg ends a pipeline with a Sync, then a Flush while results are on their way: a Flush the
    pooler reads after the Sync's ReadyForQuery freed the server ties that server to the client for
    good, and every other client waits until query_wait_timeout (see worker.one_message)."""
    with pgbouncer(dsn, "verbose = 2\n") as pooler:  # verbose 2 logs every packet
        monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
        relay = Relay(pooler.dsn)
        # A limit makes each claim a transaction (limits lock, then claim); failures beside
        # successes make completion batches of several statements in one transaction.
        relay.handler("limited", concurrency=3)(lambda job: None)

        @relay.handler("refused", max_attempts=1)
        def refuse(job: Job) -> None:
            raise PermanentFailure("refused")

        relay.enqueue_many([{"type": "limited"}] * 40 + [{"type": "refused"}] * 20)
        with running_worker(relay, concurrency=4, listen=False), psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(
                lambda: dict(conn.execute(STATUS_COUNTS).fetchall()) == {"succeeded": 40, "dead": 20},
                timeout=60,
                what="every job to finish",
            )
        relay.close()
        packets = [line for line in pooler.log.read_text().splitlines() if " C-0x" in line and " read pkt=" in line]
    assert any("read pkt='S'" in line for line in packets), "the log shows no client's Sync: no packets were logged"
    assert [line for line in packets if "read pkt='H'" in line] == []


def test_relay_worker_process_cli_and_migrate_work_behind_a_transaction_pooler(
    pooled_dsn: str, dsn: str, tmp_path: Path
) -> None:
    env = {**os.environ, "DATABASE_URL": pooled_dsn, "RELAY_DATABASE_URL": pooled_dsn}
    relay_cmd = [sys.executable, "-m", "relay_core"]
    migrated = subprocess.run([*relay_cmd, "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert migrated.returncode == 0, migrated.stderr
    for n in range(2):
        enqueued = subprocess.run(
            [*relay_cmd, "enqueue", "record", f'{{"n": {n}}}'], env=env, capture_output=True, text=True, timeout=60
        )
        assert enqueued.returncode == 0, enqueued.stderr
    Relay(pooled_dsn).enqueue_many(
        [{"type": "record", "payload": {"n": n}} for n in range(2, 60)]
        + [{"type": "record_tx", "payload": {"n": n}} for n in range(5)]
    )
    log = tmp_path / "worker.log"
    proc = start_worker_process(sys.executable, env, "--concurrency", "3", log=log)
    try:
        # Watched past the pooler, so a worker that holds the one server connection shows as what it is.
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                wait_for(
                    lambda: (
                        conn.execute("SELECT count(*) FROM relay.jobs WHERE status = 'succeeded'").fetchone()[0] == 65
                    ),
                    timeout=60,
                    what="the worker process to run every job",
                )
            except AssertionError as exc:
                states = conn.execute("SELECT type, status, count(*) FROM relay.jobs GROUP BY 1, 2").fetchall()
                sessions = conn.execute(SESSIONS).fetchall()
                raise AssertionError(
                    f"{exc}; jobs: {states}; server sessions: {sessions}; worker log:\n{log.read_text()}"
                ) from None
    finally:
        assert stop_process(proc) == 0, log.read_text()
    assert "prepared statement" not in log.read_text()
    with psycopg.connect(pooled_dsn, autocommit=True, prepare_threshold=None) as conn:
        phases = dict(conn.execute("SELECT phase, count(*) FROM relay_test.executions GROUP BY 1").fetchall())
    assert phases["end"] >= 60 and phases["tx"] == 5
    assert session_state(pooled_dsn)[3] == 0


def test_the_web_app_behind_a_transaction_pooler_serves_and_leaves_no_session_state(pooled_dsn: str, dsn: str) -> None:
    before = session_state(pooled_dsn)
    app = create_app({"TESTING": True, "RELAY_DATABASE_URL": pooled_dsn, "JWT_SECRET_KEY": SECRET, **FAST_HASH})
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            users.create_user(conn, "oncall", PASSWORD, "admin", hasher=users.make_hasher(1, 1024, 1))
        client = app.test_client()
        login = client.post("/api/auth/login", json={"username": "oncall", "password": PASSWORD})
        assert login.status_code == 200, login.get_json()
        headers = {"Authorization": f"Bearer {login.get_json()['access_token']}"}
        created = client.post("/api/admin/jobs", json={"type": "report", "payload": {}}, headers=headers)
        assert created.status_code == 201, created.get_json()
        job_id = created.get_json()["id"]
        # Enough repeats of each statement for psycopg to prepare it, were preparing on.
        for _ in range(8):
            assert client.get("/api/admin/jobs?status=queued", headers=headers).status_code == 200
            assert client.get(f"/api/admin/jobs/{job_id}", headers=headers).status_code == 200
            assert client.get("/readyz").status_code == 200
        assert client.post(f"/api/admin/jobs/{job_id}/cancel", headers=headers).status_code == 200
    finally:
        app.extensions["relay.close"]()
    assert session_state(pooled_dsn) == before


def test_transaction_pooling_turns_listening_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
    assert WorkerConfig.from_env().listen is False
    monkeypatch.setenv("RELAY_LISTEN", "true")
    assert WorkerConfig.from_env().listen is True
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "false")
    monkeypatch.delenv("RELAY_LISTEN")
    assert WorkerConfig.from_env().listen is True


def test_a_worker_configured_in_code_behind_a_transaction_pooler_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the environment's reading knew: ``Worker(dsn, handlers)`` listened through the pooler, heard
    nothing, and left its LISTEN on a server connection other clients use next."""
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
    assert WorkerConfig().listen is False
    assert WorkerConfig(listen=True).listen is True
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "false")
    assert WorkerConfig().listen is True


def test_a_malformed_transaction_pooling_setting_fails_when_relay_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "transaction")
    with pytest.raises(ConfigurationError, match="RELAY_TRANSACTION_POOLING must be true or false"):
        Relay("postgresql://127.0.0.1:1/nowhere")


def test_a_claim_held_up_by_a_lock_when_the_worker_stops_claims_nothing_after_it_is_gone(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a pooler no cancel is sent at a stop, and cutting the claim's connection does not end
    its statement on the server: waiting for a lock, it claimed once the lock was let go, after the
    worker had returned what it thought the claim took and exited. Its jobs stayed claimed by a
    worker that was gone until their leases ran out, an attempt spent on each (the last one: dead)."""
    jobs = "INSERT INTO relay.jobs (type, payload, max_attempts) SELECT 'ping', '{}', 1 FROM generate_series(1, 3)"
    waiting_claims = (  # the claim's text, in a message of its own or after its time limit
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%WITH clock AS %'"
    )
    with pgbouncer(dsn, "default_pool_size = 4\n") as pooler:
        monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
        relay = Relay(pooler.dsn)
        relay.handler("ping", max_attempts=1)(lambda job: None)
        with psycopg.connect(dsn) as locker:
            with running_worker(relay, listen=False, poll_interval=0.2, shutdown_timeout=0.5):
                wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0], what="its start")
                locker.execute(jobs)  # committed as the lock is let go: no claim sees them before
                locker.execute("LOCK TABLE relay.jobs IN ACCESS EXCLUSIVE MODE")
                wait_for(lambda: db.execute(waiting_claims).fetchone()[0], what="a claim waiting for the lock")
            # The worker has stopped (its claim's connection cut); the lock is let go after.
            db.execute("SELECT pg_sleep(0.5)")
        db.execute("SELECT pg_sleep(1.0)")  # time for a claim still on the server to take them
        relay.close()
    rows = db.execute("SELECT status::text, attempts, claimed_by FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [("queued", 0, None)] * 3


def test_a_claim_its_time_limit_ended_is_not_taken_for_one_whose_answer_was_lost(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement the server cancelled committed nothing. Taken for an answer lost, each claim a lock
    held past its time limit sent a return of "unheld" jobs after it, which the same lock held up and
    whose connection was then cut: a statement left on the server, to return whatever this worker
    had claimed by the time the lock was let go."""
    caplog.set_level("INFO", logger="relay")
    with pgbouncer(dsn, "default_pool_size = 4\n") as pooler:
        monkeypatch.setenv("RELAY_TRANSACTION_POOLING", "true")
        relay = Relay(pooler.dsn)
        ran: list[int] = []
        relay.handler("ping")(lambda job: ran.append(job.id))
        with running_worker(relay, listen=False, poll_interval=0.2) as worker:
            wait_for(lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0], what="its start")
            with psycopg.connect(dsn) as locker:
                locker.execute("LOCK TABLE relay.jobs IN ACCESS EXCLUSIVE MODE")
                wait_for(
                    lambda: any("statement cancelled by the server" in r.getMessage() for r in caplog.records),
                    what="a claim ended by its time limit",
                )
                assert worker._unanswered_claim_at is None
            job_id = relay.enqueue("ping")
            wait_for(lambda: ran == [job_id], what="the job to run once the lock is let go")
        relay.close()
    assert not [r for r in caplog.records if "whose answer was lost" in r.getMessage()]


def test_a_migration_behind_a_transaction_pooler_waits_for_the_transaction_that_held_it_up(
    database_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a pooler (here one RELAY_TRANSACTION_POOLING does not name) the process id a connection
    announces is the pooler's: the migrator asks the server which process runs its transaction, so its
    watch finds the transaction that held its try up, and its wait polls with nothing prepared."""
    from .test_migrate import database_behind, pending_from, tries_of

    monkeypatch.delenv("RELAY_TRANSACTION_POOLING", raising=False)
    caplog.set_level("WARNING", logger="relay")
    # Each transaction on another server connection, as under load: a statement prepared on one is missing there.
    settings = "default_pool_size = 4\nserver_round_robin = 1\n"
    with database_behind(database_url, 23) as dsn, pgbouncer(dsn, settings) as pooler:
        migrated: list[object] = []
        with psycopg.connect(dsn) as slow_request:
            slow_request.execute("INSERT INTO relay.jobs (type) VALUES ('in_a_slow_request')")
            deploy = threading.Thread(target=lambda: migrated.append(migrate(pooler.dsn, lock_wait=1.0)))
            deploy.start()
            time.sleep(5)  # some three tries of 1 s and their pauses of 1 s, had it not found whom to wait for
            assert not migrated and deploy.is_alive()
            slow_request.commit()
        deploy.join(30)
        assert migrated == [pending_from(23)]
    assert tries_of(caplog) == 1
