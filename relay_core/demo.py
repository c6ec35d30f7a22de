"""``relay demo``: the whole product on one machine, started and stopped by one command.

It runs what a deployment runs, as real processes: the web app under gunicorn,
two ``relay worker`` processes serving the example shop (``relay_shop``), and
around them a stream of orders, a local SMTP server and a flaky partner
endpoint, so every kind of job outcome shows up within a minute. Nothing is
simulated inside Relay: a reader can watch the dashboard and trust what it shows.

The database is DATABASE_URL (or RELAY_DATABASE_URL) when set, else an
embedded PostgreSQL (the ``pgserver`` wheel) whose data is kept per user and
reused; ``--fresh`` starts it over. Every child runs in its own session, so
Ctrl-C reaches only this process, which then stops them in order: the
producer first (no half-placed order), then the workers (they finish or hand
back what they hold, so no job is lost or left claimed), then the web app and
the mail and webhook sinks the workers were still talking to.

This module never imports Flask or ``relay_web``: the web app is a subprocess.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psycopg
from psycopg import conninfo

from . import monitor, users
from .client import Relay
from .connect_options import connection_options
from .embedded import INSTALL_DEMO, default_data_dir, get_server, load_pgserver
from .errors import ConfigurationError, RelayError
from .queries import sql
from .settings import database_url, database_url_set
from .signals import SHUTDOWN_SIGNALS, ShutdownSignals

#: The demo's own user (role admin): named for the demo, so that on a DATABASE_URL
#: holding an application's users, the password it sets every run is no one else's.
DEMO_USER = "demo"
WORKERS = 2
WORKER_SHUTDOWN_SECONDS = 10.0
READY_TIMEOUT = 60.0
SHOP_APP = "relay_shop.jobs:relay"


#: What the demo runs besides Relay, by module (the ``demo`` extra installs them): always,
#: and for the embedded PostgreSQL when no DATABASE_URL is set.
DEMO_MODULES = {"sqlalchemy": "the shop's models", "aiosmtpd": "the shop's SMTP sink"}
EMBEDDED_MODULES = {"pgserver": "the embedded PostgreSQL"}


def missing_packages(embedded: bool) -> list[str]:
    """The modules the demo needs that are not installed, each with what it is for.

    Checked before anything starts: found missing halfway, the demo would
    leave a migrated database and processes that fail one by one.
    """
    needed = {**DEMO_MODULES, **(EMBEDDED_MODULES if embedded else {})}
    missing = []
    for module, purpose in needed.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module} ({purpose})")
    return missing


def _connect(dsn: str) -> psycopg.Connection:
    """An autocommit connection for the demo's own statements, named and bounded like Relay's (5 s to connect)."""
    return psycopg.connect(dsn, autocommit=True, **{**connection_options(dsn), "connect_timeout": 5})


class DemoError(RelayError):
    """The demo could not start; the message says why and what to do."""


def demo_data_dir() -> Path:
    """The embedded cluster of the demo: per user, apart from ``relay prove``'s."""
    return default_data_dir().parent / "demo-pgdata"


def refuse_foreign_jobs(dsn: str) -> None:
    """Refuse a database whose default queue holds jobs the shop has no handler for.

    The demo's workers serve that queue; a job of another type they claim
    fails with HandlerNotFound and spends an attempt each time, until it is
    dead. A DATABASE_URL holding an application's own jobs is no place for them.
    """
    from relay_shop.jobs import relay as shop

    try:
        with _connect(dsn) as conn:
            if conn.execute("SELECT to_regclass('relay.jobs')").fetchone()[0] is None:
                return
            foreign = [
                row[0]
                for row in conn.execute(sql("job_types_unhandled_in_default_queue"), {"handled": sorted(shop.handlers)})
            ]
    except psycopg.Error as exc:
        raise DemoError(f"could not read DATABASE_URL's jobs: {exc}") from None
    if foreign:
        raise DemoError(
            f"DATABASE_URL's default queue holds jobs the demo's workers cannot run ({', '.join(foreign)}):"
            " they would claim them and spend their attempts; point DATABASE_URL at a database of its own,"
            " or unset it for the embedded one"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


#: Connection parameters that hold secrets: the password, and the passphrase of the client's SSL key.
SECRET_PARAMETERS = ("password", "sslpassword")


def _safe_dsn(dsn: str) -> str:
    """The DSN to print: its secrets, where it has any, masked."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(as configured)"
    secret = [name for name in SECRET_PARAMETERS if params.get(name)]
    if secret:
        params.update(dict.fromkeys(secret, "****"))
        return conninfo.make_conninfo(**params)
    return dsn


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM this child if the demo itself dies without stopping it (best effort)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One process the demo started."""

    name: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        """Whether it is still running."""
        return self.proc.poll() is None


@dataclass
class Demo:
    """One run of ``relay demo``."""

    port: int = 8000
    fresh: bool = False
    orders_per_minute: float = 30.0
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    children: list[Child] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    signals: int = 0

    # -- output --------------------------------------------------------------

    def say(self, line: str = "") -> None:
        """Print one line now (the output may be a pipe), or nothing once it is gone.

        A terminal that closed (the SIGHUP that stops the demo) fails every
        write with EIO: the first line of the stop raised, and the demo ended
        with a traceback before its workers were told to stop.
        """
        self._write(line + "\n")

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except OSError:
            self._lose_output()

    def _lose_output(self) -> None:
        """Write nothing more: the terminal or pipe is gone (and so is what was waiting to be flushed to it)."""
        gone, self.out = self.out, open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (the process's to close)
        if gone is sys.stdout:
            sys.stdout = self.out  # its unflushed line would fail again as the interpreter exits

    def step(self, n: int, text: str) -> None:
        """A progress line while starting."""
        self.say(f"[{n}/6] {text}")

    # -- start ---------------------------------------------------------------

    def database(self) -> str:
        """DATABASE_URL when set, else the embedded PostgreSQL (started over with --fresh)."""
        try:
            dsn = database_url() if database_url_set() else None
        except ConfigurationError as exc:
            # An unreadable URL is a mistake to report, not a reason to run elsewhere.
            raise DemoError(str(exc)) from None
        if dsn:
            if self.fresh:
                raise DemoError("--fresh starts the embedded database over; it does nothing to DATABASE_URL's")
            self.step(1, "database: DATABASE_URL")
            return dsn
        pgserver = load_pgserver()
        data_dir = demo_data_dir()
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        reused = data_dir.exists() and any(data_dir.iterdir())
        if self.fresh and data_dir.exists():
            pgserver.get_server(str(data_dir), cleanup_mode="delete").cleanup()
            if data_dir.exists():
                raise DemoError(f"the embedded database in {data_dir} is in use by another process; stop it first")
            reused = False
        self.step(1, f"database: embedded PostgreSQL in {data_dir} ({'reused' if reused else 'new'}), starting...")
        try:
            return get_server(pgserver, data_dir, "stop").get_uri()
        except ConfigurationError as exc:
            raise DemoError(str(exc)) from None

    def prepare(self, dsn: str) -> str:
        """Migrate, create the shop's tables, set the demo user's password; return the password."""
        from relay_shop.models import create_schema, make_engine
        from sqlalchemy.exc import DBAPIError

        if database_url_set():
            refuse_foreign_jobs(dsn)
        applied = Relay(dsn).migrate()
        engine = make_engine(dsn)
        try:
            create_schema(engine)
        except DBAPIError as exc:  # a role that may not create the shop's schema, say
            lines = str(exc.orig or exc).strip().splitlines()
            raise DemoError(f"the database refused the example shop's tables: {lines[0] if lines else exc}") from None
        finally:
            engine.dispose()
        self.step(2, f"schema: {len(applied)} migration(s) applied, shop tables ready")
        password = secrets.token_urlsafe(12)
        with _connect(dsn) as conn:
            try:
                users.create_user(conn, DEMO_USER, password, "admin")
                how = "created"
            except users.UserExists:
                # The walkthrough requeues a job, which a viewer may not: the demo's own user is made
                # admin again, as the banner and the README say it is.
                users.set_password(conn, DEMO_USER, password)
                users.set_role(conn, DEMO_USER, "admin")
                how = "exists from an earlier run; new password set"
            # Last month's settlement report once, so the periodic job has a result to show.
            month = conn.execute("SELECT to_char(now() - interval '1 month', 'YYYY-MM')").fetchone()[0]
            with conn.transaction():
                Relay(dsn).enqueue(
                    "settlement_report", {"month": month}, conn=conn, idempotency_key=f"demo:settlement:{month}"
                )
        self.step(3, f"user: {DEMO_USER}, role admin ({how})")
        return password

    def spawn(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
        """Start one child in its own session, its output in ``log_dir/name.log``."""
        log = log_dir / f"{name}.log"
        with open(log, "ab") as sink:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # No threads run in this process yet, so a pre-exec hook is safe here.
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start_processes(self, dsn: str, log_dir: Path) -> None:
        """The sinks, the web app, the workers and the producer."""
        smtp_port, hook_port = _free_port(), _free_port()
        env = dict(os.environ)
        env.update(
            DATABASE_URL=dsn,
            RELAY_DATABASE_URL=dsn,
            JWT_SECRET_KEY=secrets.token_urlsafe(48),  # a new one each run: old tokens stop working
            RELAY_ENV="development",  # plain http on 127.0.0.1: cookies without the Secure flag
            RELAY_SHUTDOWN_TIMEOUT=str(WORKER_SHUTDOWN_SECONDS),
            SHOP_SMTP_HOST="127.0.0.1",
            SHOP_SMTP_PORT=str(smtp_port),
            SHOP_WEBHOOK_URL=f"http://127.0.0.1:{hook_port}/hooks/orders",
            PYTHONUNBUFFERED="1",
        )
        py = sys.executable
        self.spawn("smtp", [py, "-m", "relay_shop.smtp_sink", "--port", str(smtp_port)], env, log_dir)
        self.spawn("webhooks", [py, "-m", "relay_shop.webhook_endpoint", "--port", str(hook_port)], env, log_dir)
        self.step(4, f"sinks: SMTP on 127.0.0.1:{smtp_port}, partner webhook on 127.0.0.1:{hook_port}")
        web = [py, "-m", "gunicorn", "relay_web:create_app()", "--bind", f"127.0.0.1:{self.port}"]
        web += ["--worker-class", "gthread", "--workers", "1", "--threads", "8", "--graceful-timeout", "5"]
        # No gunicornc control socket: its default path in $HOME is shared by every gunicorn of the user.
        self.spawn("web", [*web, "--no-control-socket", "--access-logfile", "-"], env, log_dir)
        for n in range(1, WORKERS + 1):
            # Its queue named: a RELAY_QUEUES of the caller's had the workers serve another, and run nothing.
            worker = [py, "-m", "relay_core", "worker", "--app", SHOP_APP, "--queues", "default", "--concurrency", "4"]
            self.spawn(f"worker-{n}", worker, env, log_dir)
        rate = f"{self.orders_per_minute:g}"
        self.spawn("producer", [py, "-m", "relay_shop.producer", "--per-minute", rate], env, log_dir)
        self.step(5, f"processes: web (gunicorn), {WORKERS} workers, order producer ({rate}/min)")

    def wait_ready(self) -> None:
        """Wait until the web app answers /readyz; fail early if a child dies."""
        url = f"http://127.0.0.1:{self.port}/readyz"
        deadline = time.monotonic() + READY_TIMEOUT
        self.step(6, "waiting for the web app to answer...")
        while not self.stopping.is_set():
            self.check_children()
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"the web app did not answer {url} within {READY_TIMEOUT:.0f}s")
            self.stopping.wait(0.25)

    def check_children(self) -> None:
        """Raise if any child exited on its own."""
        for child in self.children:
            if not child.alive():
                tail = child.log.read_text(errors="replace").strip().splitlines()[-5:]
                detail = "\n    ".join(tail)
                raise DemoError(f"{child.name} exited with {child.proc.returncode}; its log {child.log}:\n    {detail}")

    # -- run and stop --------------------------------------------------------

    def on_signal(self, signum: int) -> None:
        """First Ctrl-C/SIGTERM/SIGHUP: stop gracefully. Second: workers hand back at once."""
        self.signals += 1
        self.stopping.set()
        if self.signals > 1:
            for child in self.children:
                if child.name.startswith("worker") and child.alive():
                    child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Start everything, print where it is, wait for Ctrl-C, stop everything; the exit code.

        A closed terminal (SIGHUP) stops it as Ctrl-C does: it ended the demo at
        once, its embedded PostgreSQL left running and held for good.
        """
        signals = ShutdownSignals(self.on_signal, (*SHUTDOWN_SIGNALS, signal.SIGHUP))
        try:
            return self._run()
        finally:
            signals.close()

    def _run(self) -> int:
        self.say("Relay demo: the example shop (examples/relay_shop) on a Relay queue")
        missing = missing_packages(embedded=not database_url_set())
        if missing:
            raise DemoError(f"the demo needs {', '.join(missing)}, which Relay itself does not: {INSTALL_DEMO}")
        if not _port_is_free(self.port):
            raise DemoError(f"port {self.port} on 127.0.0.1 is in use; pass --port (or set PORT)")
        dsn = self.database()
        try:
            password = self.prepare(dsn)
            log_dir = Path(tempfile.mkdtemp(prefix="relay-demo-"))
            if not self.stopping.is_set():
                self.start_processes(dsn, log_dir)
                self.wait_ready()
            if not self.stopping.is_set():
                self.banner(dsn, password, log_dir)
                self.watch(dsn)
            return 0
        finally:
            self.stop_all()
            if self.children:  # a demo that refused to start ran nothing to sum up
                self.summary(dsn)

    def banner(self, dsn: str, password: str, log_dir: Path) -> None:
        """Where to look and how to log in."""
        base = f"http://127.0.0.1:{self.port}"
        login = f'{{"username": "{DEMO_USER}", "password": "{password}"}}'
        self.say()
        self.say("Relay is running.")
        self.say()
        self.say(f"  URL:       {base}/")
        self.say(f"  username:  {DEMO_USER}")
        self.say(f"  password:  {password}   (shown once; the next `relay demo` sets a new one)")
        self.say()
        self.say(f"  API:       curl -s -X POST {base}/api/auth/login -H 'Content-Type: application/json' -d '{login}'")
        self.say(f"  database:  {_safe_dsn(dsn)}")
        self.say(f"  logs:      {log_dir}/")
        self.say()
        self.say("Orders arrive every few seconds. Within a minute you will see every state: mails sent,")
        self.say("webhooks retried with growing gaps, review requests scheduled a minute out, and dead")
        self.say("shipping labels (a bad postcode) to read and requeue. Press Ctrl-C to stop.")
        self.say()

    def watch(self, dsn: str, interval: float | None = None) -> None:
        """Print a status line every few seconds (``interval``) until asked to stop."""
        interval = interval or (2.0 if self.out.isatty() else 10.0)
        conn: psycopg.Connection | None = None
        try:
            while not self.stopping.wait(interval):
                self.check_children()
                try:
                    # Connected again after a database restart: the demo rides it out like its workers do.
                    if conn is None or conn.closed:
                        conn = _connect(dsn)
                    counts = monitor.status_counts(conn)
                    line = "  ".join(f"{state} {n}" for state, n in counts.items())
                except psycopg.OperationalError:
                    if conn is not None:
                        conn.close()
                    line = "database unreachable; waiting for it"
                if self.out.isatty():
                    self._write(f"\r{time.strftime('%H:%M:%S')}  {line}   ")
                else:
                    self.say(f"{time.strftime('%H:%M:%S')}  {line}")
        finally:
            if conn is not None:
                conn.close()
        if self.out.isatty():
            self.say()

    def stop_all(self) -> None:
        """Stop the children in order, each group given time to finish what it holds."""
        groups = [
            (["producer"], 10.0),
            ([c.name for c in self.children if c.name.startswith("worker")], WORKER_SHUTDOWN_SECONDS + 10.0),
            (["web"], 10.0),
            (["smtp", "webhooks"], 5.0),
        ]
        if any(c.alive() for c in self.children):
            self.say("stopping: producer, workers (finishing in-flight jobs), web, sinks...")
        for names, timeout in groups:
            group = [c for c in self.children if c.name in names and c.alive()]
            for child in group:
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for child in group:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"{child.name} did not stop in {timeout:.0f}s; killing it")
                    child.proc.kill()
                    child.proc.wait(5)

    def summary(self, dsn: str) -> None:
        """What the queue holds now that everything has stopped."""
        try:
            with _connect(dsn) as conn:
                counts = monitor.status_counts(conn)
        except psycopg.Error:
            return
        self.say(
            f"stopped: {counts.get('claimed', 0)} job(s) left claimed, {counts.get('queued', 0)} queued "
            "(those run at the next start)."
        )


def run(port: int = 8000, fresh: bool = False, orders_per_minute: float = 30.0) -> int:
    """Run the demo until Ctrl-C or SIGTERM; return the process exit code."""
    return Demo(port=port, fresh=fresh, orders_per_minute=orders_per_minute).run()
