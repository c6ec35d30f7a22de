"""``relay demo`` end to end: start it, log in with what it prints, watch the shop work, Ctrl-C it.

It runs against the test database (DATABASE_URL set), so it also proves the
demo uses that database instead of starting an embedded one. Within seconds
the dashboard's API must show jobs of several types succeeded, a webhook
delivery that was retried, a dead shipping label with a readable error, a
review request scheduled a minute out and one cancelled with its order; after
SIGINT the demo exits 0 and no job is left claimed.
"""

from __future__ import annotations

import io
import os
import pty
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiosmtpd.controller import Controller
from relay_shop import producer
from relay_shop.jobs import relay as shop
from relay_shop.models import create_schema, make_engine
from relay_shop.orders import place_order
from relay_shop.producer import CATALOGUE, CUSTOMERS
from sqlalchemy import event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from relay_core import Relay, users

from .helpers import ROOT, call, free_port, run_relay, running_worker, wait_for

pytestmark = pytest.mark.slow


class Output:
    """The demo's stdout, read line by line in a thread so waits stay bounded."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.closed = threading.Event()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)
        self.closed.set()

    def drain(self) -> None:
        """Move every line read so far into ``lines``."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.lines.append(line)

    def field(self, name: str) -> str | None:
        """The value of a ``  name:  value`` line of the banner, once printed."""
        self.drain()
        for line in self.lines:
            match = re.match(rf"^\s+{name}:\s+(\S+)", line)
            if match:
                return match.group(1)
        return None

    @property
    def text(self) -> str:
        """Everything printed so far."""
        self.drain()
        return "\n".join(self.lines)


def jobs(base: str, token: str, **filters: str) -> list[dict[str, Any]]:
    """One page (up to 200) of jobs matching ``filters``, newest first."""
    query = urllib.parse.urlencode({"limit": "200", **filters})
    status, page = call("GET", f"{base}/api/admin/jobs?{query}", token=token)
    assert status == 200, page
    return page["jobs"]


APPLICATION_ADMIN_PASSWORD = "the application's own admin password"


def demo_env(dsn: str) -> dict[str, str]:
    """The environment a newcomer's shell would give ``relay demo``, DATABASE_URL set to the test database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "SHOP_", "PORT"))}
    env.update(DATABASE_URL=dsn, PYTHONUNBUFFERED="1")
    return env


def start_demo(python: str, dsn: str, *options: str) -> tuple[subprocess.Popen, Output]:
    """``relay demo`` on the test database in a session of its own (Ctrl-C reaches it alone), and its output."""
    proc = subprocess.Popen(
        [python, "-m", "relay_core", "demo", *options],
        env=demo_env(dsn),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, Output(proc.stdout)


def test_relay_demo_shows_every_outcome_and_stops_without_losing_a_job(
    dsn: str, db: psycopg.Connection, python: str
) -> None:
    port = free_port()
    # The database's own admin: the demo logs in as a user of its own and leaves this one's password alone.
    Relay(dsn).migrate()
    users.create_user(db, "admin", APPLICATION_ADMIN_PASSWORD, "admin")
    proc, out = start_demo(python, dsn, "--port", str(port), "--orders-per-minute", "120")
    try:
        password = wait_for(lambda: out.field("password"), timeout=60, what="the demo's banner")
        assert out.field("username") == "demo"
        base = out.field("URL").rstrip("/")
        assert base == f"http://127.0.0.1:{port}", out.text
        assert "[1/6] database: DATABASE_URL" in out.text

        status, login = call("POST", f"{base}/api/auth/login", {"username": "demo", "password": password})
        assert status == 200, login
        admin = {"username": "admin", "password": APPLICATION_ADMIN_PASSWORD}
        assert call("POST", f"{base}/api/auth/login", admin)[0] == 200
        token = login["access_token"]

        wanted = {"send_confirmation_email", "print_shipping_label", "deliver_webhook", "settlement_report"}

        def shop_is_busy() -> bool:
            succeeded = {job["type"] for job in jobs(base, token, status="succeeded")}
            retried = [job for job in jobs(base, token, type="deliver_webhook") if job["attempts"] >= 2]
            dead = jobs(base, token, status="dead")
            cancelled = jobs(base, token, status="cancelled")
            return wanted <= succeeded and bool(retried) and bool(dead) and bool(cancelled)

        wait_for(shop_is_busy, timeout=45, interval=1.0, what="succeeded, retried, dead and cancelled jobs")

        dead = jobs(base, token, status="dead")
        assert {job["type"] for job in dead} == {"print_shipping_label"}
        assert "postcode" in dead[0]["last_error"] and "requeue" in dead[0]["last_error"]
        now = datetime.now(UTC)
        scheduled = [
            job
            for job in jobs(base, token, status="queued", type="request_review")
            if datetime.fromisoformat(job["run_at"]) > now
        ]
        assert scheduled, "a review request scheduled a minute out"
        assert {job["type"] for job in jobs(base, token, status="cancelled")} == {"request_review"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(45)
        except subprocess.TimeoutExpired:
            proc.kill()  # its children die with it (they get SIGTERM when their parent goes)
            code = proc.wait(10)
    out.closed.wait(10)
    text = out.text
    assert code == 0, text
    assert "stopped: 0 job(s) left claimed" in text, text
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0] == 0
    workers = db.execute("SELECT count(*), count(stopped_at) FROM relay.workers").fetchone()
    assert workers[0] == 2 and workers[1] == 2, "both workers registered and stopped gracefully"
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "the web app is still listening"


def test_relay_demo_refuses_a_database_whose_default_queue_holds_jobs_it_cannot_run(
    dsn: str, db: psycopg.Connection, relay: Relay, python: str
) -> None:
    """Its workers would claim the application's jobs and spend their attempts on HandlerNotFound."""
    relay.migrate()
    job_id = relay.enqueue("import_ledger", {"file": "2026-11.csv"})
    elsewhere = relay.enqueue("import_ledger", {"file": "2026-10.csv"}, queue="ledgers")
    done = run_relay(python, demo_env(dsn), "demo", "--port", str(free_port()))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "default queue holds jobs the demo's workers cannot run (import_ledger)" in done.stderr
    assert "stopped:" not in done.stdout  # it said the jobs it refused would "run at the next start"
    rows = db.execute("SELECT id, status::text, attempts FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [(job_id, "queued", 0), (elsewhere, "queued", 0)]
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 0
    # On a queue of its own the application's job is out of the demo's way: it gets as far as the banner.
    db.execute("UPDATE relay.jobs SET queue = 'ledgers'")
    proc, out = start_demo(python, dsn, "--port", str(free_port()))
    try:
        wait_for(lambda: out.field("password"), timeout=60, what="the demo's banner")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(45) == 0, out.text
    assert db.execute("SELECT status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "queued",
        0,
    )


# -- the example shop's own promises ------------------------------------------------


class SmtpSink:
    """An in-process aiosmtpd server on 127.0.0.1 that keeps what it receives."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.port = free_port()
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        """Keep the envelope; accept it."""
        self.messages.append(envelope)
        return "250 OK"


def test_place_order_commits_the_order_and_its_jobs_together_or_not_at_all(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOP_WEBHOOK_URL", "http://127.0.0.1:9/hooks/orders")
    engine = make_engine(dsn)
    try:
        create_schema(engine)
        before = db.execute("SELECT count(*) FROM shop.orders").fetchone()[0]
        with Session(engine) as session:
            order_id = place_order(session, CUSTOMERS[0], [(CATALOGUE[0], 2)]).order_id
        types = db.execute("SELECT type FROM relay.jobs ORDER BY id").fetchall()
        assert [t[0] for t in types] == [
            "send_confirmation_email",
            "print_shipping_label",
            "request_review",
            "deliver_webhook",
        ]
        assert db.execute("SELECT total_cents FROM shop.orders WHERE id = %s", (order_id,)).fetchone()[0] == 2800

        def refuse() -> None:
            raise RuntimeError("the database went away at commit")

        with Session(engine) as session:
            monkeypatch.setattr(session, "commit", refuse)
            with pytest.raises(RuntimeError):
                place_order(session, CUSTOMERS[1], [(CATALOGUE[1], 1)])
        assert db.execute("SELECT count(*) FROM shop.orders").fetchone()[0] == before + 1
        assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 4, "no job without its order"
    finally:
        engine.dispose()


def test_a_confirmation_email_goes_out_once_when_its_job_runs_twice(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = SmtpSink()
    sink.controller.start()
    monkeypatch.setenv("RELAY_DATABASE_URL", dsn)
    monkeypatch.setenv("SHOP_SMTP_PORT", str(sink.port))
    monkeypatch.delenv("SHOP_WEBHOOK_URL", raising=False)
    engine = make_engine(dsn)
    try:
        create_schema(engine)
        with Session(engine) as session:
            order_id = place_order(session, CUSTOMERS[2], [(CATALOGUE[2], 1)]).order_id
        # The same email job again, as a lease takeover or a requeue would run it.
        shop.enqueue("send_confirmation_email", {"order_id": order_id})
        emails = "SELECT count(*) FROM relay.jobs WHERE type = 'send_confirmation_email' AND status = 'succeeded'"
        with running_worker(shop, queues=("default",)):
            wait_for(lambda: db.execute(emails).fetchone()[0] == 2, timeout=20, what="both email jobs to succeed")
        results = [r[0] for r in db.execute("SELECT result FROM relay.jobs WHERE type = 'send_confirmation_email'")]
        assert sorted("skipped" in r for r in results) == [False, True], results
        assert len(sink.messages) == 1
        assert sink.messages[0].rcpt_tos == [CUSTOMERS[2].email]
        sent = db.execute("SELECT count(*) FROM shop.sent_emails WHERE order_id = %s", (order_id,)).fetchone()[0]
        assert sent == 1
    finally:
        sink.controller.stop()
        engine.dispose()
        shop.close()


def test_the_producer_looks_for_an_order_whose_commit_went_unanswered_before_placing_it_again(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database restart can land after the server committed an order and before the answer
    reached the producer, or after the answer and before the producer was done with the order's
    session (it read the committed order again to print it); the producer took every error for a
    rollback and placed the order twice."""
    monkeypatch.setenv("RELAY_DATABASE_URL", dsn)
    monkeypatch.delenv("SHOP_WEBHOOK_URL", raising=False)
    answers_lost: list[int] = []
    closes_failed: list[int] = []
    real_close = Session.close

    committed_since: list[Session] = []

    def lose_the_first_answer(session: Session) -> None:
        if not answers_lost:  # committed on the server; the client hears only a broken connection
            answers_lost.append(1)
            raise OperationalError("COMMIT", None, psycopg.OperationalError("server closed the connection"))
        committed_since.append(session)

    def fail_two_closes(session: Session) -> None:
        real_close(session)
        # The lost answer's session (its error must not hide that the order may exist), then the
        # first session whose commit was answered (its order is placed, whatever comes after).
        if (answers_lost and not closes_failed) or (committed_since and len(closes_failed) == 1):
            closes_failed.append(1)
            raise OperationalError("ROLLBACK", None, psycopg.OperationalError("server closed the connection"))

    monkeypatch.setattr(Session, "close", fail_two_closes)

    engine = make_engine(dsn)
    try:
        create_schema(engine)
    finally:
        engine.dispose()
    before = db.execute("SELECT count(*) FROM shop.orders").fetchone()[0]
    event.listen(Session, "after_commit", lose_the_first_answer)
    try:
        assert producer.run(per_minute=60_000, limit=3) == 3
    finally:
        event.remove(Session, "after_commit", lose_the_first_answer)
    out = capsys.readouterr().out
    assert (answers_lost, closes_failed) == ([1], [1, 1])
    assert "the database went away while order" in out, out
    assert "did commit before the database went away" in out, out
    assert db.execute("SELECT count(*) FROM shop.orders").fetchone()[0] == before + 3
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'send_confirmation_email'").fetchone()[0] == 3


def test_the_demo_masks_every_secret_of_the_database_url_it_prints() -> None:
    """The banner printed an SSL key's passphrase (sslpassword) in clear; only the password was masked."""
    from relay_core.demo import _safe_dsn

    shown = _safe_dsn("postgresql://app:hunter2@127.0.0.1/shop?sslmode=disable&sslpassword=KEYPASSPHRASE")
    assert "hunter2" not in shown and "KEYPASSPHRASE" not in shown
    assert "password=****" in shown and "sslpassword=****" in shown and "dbname=shop" in shown


def test_the_demo_user_is_made_admin_again_when_it_exists(dsn: str, db: psycopg.Connection) -> None:
    """A demo user made a viewer since an earlier run kept that role, while the banner said admin and
    the walkthrough's requeue was refused with 403."""
    import io

    from relay_core import users
    from relay_core.demo import DEMO_USER, Demo

    out = io.StringIO()
    Demo(out=out).prepare(dsn)
    users.set_role(db, DEMO_USER, "viewer")
    Demo(out=out).prepare(dsn)
    assert [user.role for user in users.list_users(db) if user.username == DEMO_USER] == ["admin"]
    banner = f"[3/6] user: {DEMO_USER}, role admin (exists from an earlier run; new password set)"
    assert out.getvalue().splitlines()[-1] == banner


def test_the_demos_workers_serve_the_shops_queue_whatever_relay_queues_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A RELAY_QUEUES in the caller's environment reached the demo's workers, which served that queue
    and ran none of the shop's jobs, while the demo promised every state within a minute."""
    from relay_core import demo

    started: dict[str, list[str]] = {}
    monkeypatch.setenv("RELAY_QUEUES", "emails")
    monkeypatch.setattr(demo.Demo, "spawn", lambda self, name, argv, env, log_dir: started.setdefault(name, argv))
    demo.Demo(out=io.StringIO()).start_processes("postgresql://postgres@127.0.0.1/unused", tmp_path)
    workers = [argv for name, argv in started.items() if name.startswith("worker")]
    assert workers and all(argv[argv.index("--queues") + 1] == "default" for argv in workers), workers


def test_a_demo_on_a_data_directory_it_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    """Its data made by another PostgreSQL major version (the bundled server follows the Python), a first
    start interrupted: pgserver's CalledProcessError came out as some 80 lines of traceback."""
    data = tmp_path / "relay" / "demo-pgdata"
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("9\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "RELAY_DATABASE_URL")}
    env["XDG_DATA_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "relay_core", "demo"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    (said,) = done.stderr.strip().splitlines()  # one line: no traceback, no dump of pgserver's
    assert said.startswith(f"Error: the embedded PostgreSQL in {data} did not start (pg_ctl failed: "), said
    assert f"; its log: {data / 'log'}" in said
    assert "Its data was made by PostgreSQL 9" in said and "relay demo --fresh" in said


def _both_workers_registered(db: psycopg.Connection) -> None:
    """Wait until the demo's two workers have registered (the banner comes as they start, not after)."""
    wait_for(
        lambda: db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 2, 30, what="both workers started"
    )


def _hung_up(proc: subprocess.Popen) -> int:
    """SIGHUP to the demo alone, as a closing terminal sends; its exit code (killed if it runs on 45 s)."""
    try:
        proc.send_signal(signal.SIGHUP)
        return proc.wait(45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_demo_whose_terminal_closed_stops_as_on_ctrl_c(dsn: str, db: psycopg.Connection, python: str) -> None:
    """Closing the terminal sends SIGHUP, which ended the demo at once: no cleanup ran, its embedded
    PostgreSQL went on running, and the next Ctrl-C left it running too (a stale holder in its list)."""
    port = free_port()
    proc, out = start_demo(python, dsn, "--port", str(port))
    try:
        wait_for(lambda: out.field("password"), timeout=60, what="the demo's banner")
        _both_workers_registered(db)
    finally:
        code = _hung_up(proc)
    out.closed.wait(10)
    assert code == 0, out.text
    assert "stopped: 0 job(s) left claimed" in out.text, out.text
    assert db.execute("SELECT count(*), count(stopped_at) FROM relay.workers").fetchone() == (2, 2)


def test_a_demo_whose_terminal_is_gone_still_stops_its_workers(dsn: str, db: psycopg.Connection, python: str) -> None:
    """Once the terminal has closed, every write to it fails (EIO): the stop's first line raised, and the demo
    ended with a traceback before its workers were told to stop."""
    port = free_port()
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [python, "-m", "relay_core", "demo", "--port", str(port)],
        env=demo_env(dsn),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    shown = b""
    try:
        while b"password" not in shown:
            ready, _, _ = select.select([controller], [], [], 60)
            assert ready, shown.decode(errors="replace")
            shown += os.read(controller, 4096)
        _both_workers_registered(db)
    finally:
        os.close(controller)  # the terminal window closes
        code = _hung_up(proc)
    assert code == 0
    assert db.execute("SELECT count(*), count(stopped_at) FROM relay.workers").fetchone() == (2, 2)
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0] == 0
