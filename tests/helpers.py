"""Test helpers: run workers in threads or processes, and wait on conditions."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo

from relay_core import Relay, Worker, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent


def wait_for(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> object:
    """Poll ``condition`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


def read_while_truncating(dsn: str, db: psycopg.Connection, read: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``read`` (a page that reads the counters, then relay.queues, then relay.jobs) while another
    connection runs TRUNCATE relay.jobs, in the order that deadlocks a reader which keeps the counters
    locked: the read is held on relay.queues, after the counters, until the TRUNCATE holds relay.jobs
    and reaches the counters (or has ended). Returns what ``read`` returned and the TRUNCATE's error."""
    results: dict[str, Any] = {}

    def truncate() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE relay.jobs")
            results["truncate"] = None
        except psycopg.Error as exc:
            results["truncate"] = f"{type(exc).__name__}: {exc}"

    def waiting_on(table: str) -> bool:
        query = "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted AND relation = %s::regclass)"
        return bool(db.execute(query, (table,)).fetchone()[0])

    reading = threading.Thread(target=lambda: results.update(read=read()))
    truncating = threading.Thread(target=truncate)
    with psycopg.connect(dsn) as holding:
        holding.execute("LOCK TABLE relay.queues IN ACCESS EXCLUSIVE MODE")
        reading.start()
        wait_for(lambda: waiting_on("relay.queues"), what="the read waits for relay.queues")
        truncating.start()
        wait_for(lambda: waiting_on("relay.job_counts") or "truncate" in results, what="TRUNCATE at the counters")
    reading.join(30)
    truncating.join(30)
    assert not reading.is_alive() and not truncating.is_alive(), "the read or the TRUNCATE hangs"
    return results["read"], results["truncate"]


@contextmanager
def running_worker(relay: Relay, **settings: object) -> Iterator[Worker]:
    """Run a worker for ``relay`` in a thread; stop it gracefully on exit."""
    defaults: dict[str, object] = {
        "poll_interval": 0.2,
        "sweep_interval": 0.5,
        "lease_seconds": 10.0,
        "heartbeat_interval": 2.0,
        "shutdown_timeout": 5.0,
    }
    defaults.update(settings)
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig(**defaults))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "worker did not stop"


def publish_handlers(dsn: str, **max_attempts: int) -> None:
    """Run a real worker whose handlers declare these ``max_attempts`` until it has published them, then stop it.

    What a deployed worker leaves behind for ``relay enqueue``, the admin API
    and services that enqueue without registering handlers.
    """
    app = Relay(dsn)
    for job_type, attempts in max_attempts.items():
        app.handler(job_type, max_attempts=attempts)(lambda job: None)
    wanted = sorted(max_attempts.items())
    try:
        with running_worker(app), psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(
                lambda: (
                    conn.execute(
                        "SELECT type, max_attempts FROM relay.job_types WHERE type = ANY(%s) ORDER BY type",
                        (list(max_attempts),),
                    ).fetchall()
                    == wanted
                ),
                what=f"max_attempts published: {wanted}",
            )
    finally:
        app.close()


def claim_params(**given: object) -> dict[str, object]:
    """The parameters of the job_claim statement run by hand: one job of the default queue, under the limits lock."""
    return {
        "queues": ["default"],
        "limit": 1,
        "worker_id": "w",
        "lease_seconds": 30,
        "locked": True,
        "last_attempt_room": 100,
        "idle_slots": 100,
        **given,
    }


#: The parameters of the job_rescue_expired statement run by hand: up to 10 expired leases, no grace, none held.
RESCUE_PARAMS = {"limit": 10, "restart_grace": 0, "stall_seconds": 2, "held_ids": [], "held_tokens": []}


def job_status(conn: psycopg.Connection, job_id: int) -> str:
    """The status of one job."""
    row = conn.execute("SELECT status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None, f"job {job_id} does not exist"
    return row[0]


def status_counts(conn: psycopg.Connection) -> dict[str, int]:
    """How many jobs are in each status."""
    return dict(conn.execute("SELECT status::text, count(*) FROM relay.jobs GROUP BY 1").fetchall())


def start_worker_process(
    python: str, env: dict[str, str], *args: str, app: str = "tests.apps.worker_app:relay", log: Path | None = None
) -> subprocess.Popen:
    """Start ``relay worker`` as a real process (its own pid, real signals)."""
    command = [python, "-m", "relay_core", "--log-level", "info", "worker", "--app", app, *args]
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - closed by the process's exit
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def run_relay(python: str, env: dict[str, str], *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``relay ARGS`` as a process of its own to its end; its exit code and output."""
    return subprocess.run(
        [python, "-m", "relay_core", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM a process and wait for it; SIGKILL if it does not stop."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def call(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """One JSON request; returns (status, decoded body) for any status; (0, None) when nothing answers."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None
    except OSError:
        return 0, None


class TcpProxy:
    """A TCP proxy in front of the test PostgreSQL, listening on ``listen_port`` (else a free port).

    Clearing ``flowing`` stops it passing bytes while every connection stays
    open: a database that stalls rather than refuses. Setting ``hold_answers_with``
    holds back the database's answers that carry those bytes (the statements
    still arrive and run), and :meth:`cut` then breaks every connection: those
    answers are lost in transit. Setting ``stall_after_next_write`` lets one
    more read of a client's bytes through, then stalls as clearing
    ``flowing`` does: a client frozen right after one write. ``latency`` delays
    every read passed on, each way, by that many seconds: a database across a
    slow network.
    """

    def __init__(self, host: str, port: int, listen_port: int = 0) -> None:
        # A host that is a directory is a Unix socket's (the embedded PostgreSQL of a run
        # without DATABASE_URL listens on one only): clients still reach the proxy over TCP.
        self.upstream: tuple[str, int] | str = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)
        self.flowing = threading.Event()
        self.flowing.set()
        self.latency = 0.0
        self.hold_answers_with: bytes | None = None
        self.stall_after_next_write = threading.Event()
        self._released = threading.Event()
        self.sockets: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", listen_port))
        self.port = self.server.getsockname()[1]
        #: A DSN through this proxy (set by :meth:`in_front_of`).
        self.dsn = ""
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def in_front_of(cls, dsn: str) -> TcpProxy:
        """A proxy in front of the server ``dsn`` names; :attr:`dsn` is ``dsn`` through it."""
        params = conninfo.conninfo_to_dict(dsn)
        proxy = cls(str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
        proxy.dsn = conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
        return proxy

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = self._connect_upstream()
            except OSError:  # the database is down: refuse this client, keep serving the next
                client.close()
                continue
            self.sockets += [client, upstream]
            for src, dst, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(src, dst, answers), daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, tuple):
            return socket.create_connection(self.upstream)
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.connect(self.upstream)
        except OSError:
            unix.close()
            raise
        return unix

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if self.latency:
                    time.sleep(self.latency)
                self.flowing.wait()
                if answers and self.hold_answers_with is not None and self.hold_answers_with in data:
                    self._released.wait()
                    return  # the answer is lost with its connection
                dst.sendall(data)
                if not answers and self.stall_after_next_write.is_set():
                    self.stall_after_next_write.clear()
                    self.flowing.clear()
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Break every open connection (their held answers are lost); new ones pass as before."""
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.hold_answers_with = None
        self._released.set()

    def close(self) -> None:
        """Stop accepting and end every connection at both ends.

        Each socket is shut down before it is closed: a close alone does not
        wake a pipe thread blocked reading it, so the database never heard the
        client go, and a session left in a transaction (a write sent into a
        stall) kept its locks, holding up the next test's TRUNCATE. The freed
        descriptor could also be reused by another connection that the pipe
        thread would then write into.
        """
        self.flowing.set()
        self._released.set()
        # Shut down first: a close alone leaves the accept under way to take one more connection.
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def suppress_errors(function: Callable[..., object], *args: object) -> None:
    """Call ``function``, ignoring the psycopg error a cut connection ends it with (a thread's target)."""
    with contextlib.suppress(psycopg.Error):
        function(*args)


#: A deferred trigger: what the settings are as the handler's transaction commits.
AT_COMMIT_SETTINGS = """
CREATE TABLE relay_test.handler_rows (job_id bigint);
CREATE TABLE relay_test.commit_settings (search_path text, synchronous_commit text);
CREATE FUNCTION relay_test.record_commit_settings() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO relay_test.commit_settings
    VALUES (current_setting('search_path'), current_setting('synchronous_commit'));
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON relay_test.handler_rows DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION relay_test.record_commit_settings();
"""
