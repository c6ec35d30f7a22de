"""Relay installed without its extras: what an application, a worker and the web app need, and no more.

The demo's packages (the shop's SQLAlchemy, its SMTP sink, the embedded
PostgreSQL's binaries) are extras: a worker's image must not carry them. The
test environment has them all, so each check runs in a subprocess where
importing them fails as it would where they are not installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psycopg

from .helpers import ROOT, free_port, run_relay

#: The top-level modules of the ``demo`` and ``shop`` extras.
EXTRAS_MODULES = ("sqlalchemy", "aiosmtpd", "pgserver")

#: Prepended to a subprocess's program: importing any of EXTRAS_MODULES fails as if not installed.
WITHOUT_EXTRAS = f"""
import importlib.abc, runpy, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRAS_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
"""


def run_without_extras(python: str, program: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", WITHOUT_EXTRAS + program, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "SHOP_", "DATABASE_URL", "PORT"))}
    env.update(extra)
    return env


def test_an_application_its_worker_and_the_web_app_run_without_the_extras(
    dsn: str, db: psycopg.Connection, python: str
) -> None:
    program = """
import threading, time
from relay_core import Relay
from relay_web import create_app

relay = Relay(sys.argv[1])
relay.migrate()
relay.handler("ping")(lambda job: None)
job_id = relay.enqueue("ping", {"n": 1})
worker = relay.worker(concurrency=1)
thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
thread.start()
with relay.connect() as conn:
    deadline = time.monotonic() + 30
    while conn.execute("SELECT status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] != "succeeded":
        assert time.monotonic() < deadline, "the job never ran"
        time.sleep(0.05)
worker.stop()
thread.join(30)
app = create_app({"RELAY_DATABASE_URL": sys.argv[1], "RELAY_ENV": "test"})
print("readyz", app.test_client().get("/readyz").status_code)
app.extensions["relay.close"]()
relay.close()
sys.argv = ["relay", "worker", "--help"]
runpy.run_module("relay_core", run_name="__main__")
"""
    done = run_without_extras(python, program, clean_env(), dsn)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "readyz 200" in done.stdout
    assert "Usage: relay worker" in done.stdout
    assert db.execute("SELECT status::text FROM relay.jobs").fetchall() == [("succeeded",)]


DEMO = """
sys.argv = ["relay", "demo", "--port", sys.argv[1]]
runpy.run_module("relay_core", run_name="__main__")
"""


def test_the_demo_without_its_packages_says_what_to_install_before_starting_anything(
    tmp_path: Path, python: str
) -> None:
    data_home = tmp_path / "data"
    done = run_without_extras(python, DEMO, clean_env(XDG_DATA_HOME=str(data_home)), str(free_port()))
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "the demo needs sqlalchemy (the shop's models), aiosmtpd (the shop's SMTP sink), "
        "pgserver (the embedded PostgreSQL), which Relay itself does not: pip install 'relay-queue[demo]'"
    ) in done.stderr
    assert not data_home.exists(), "no embedded database was made"


def test_the_demo_on_a_database_url_needs_no_embedded_postgresql(dsn: str, db: psycopg.Connection, python: str) -> None:
    done = run_without_extras(python, DEMO, clean_env(DATABASE_URL=dsn), str(free_port()))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the demo needs sqlalchemy (the shop's models), aiosmtpd (the shop's SMTP sink), which" in done.stderr
    assert "pgserver" not in done.stderr
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 0, "no demo user was made"


def test_the_embedded_postgresql_without_pgserver_says_what_to_install(tmp_path: Path, python: str) -> None:
    program = """
sys.argv = ["relay", "prove", "--jobs", "10"]
runpy.run_module("relay_core", run_name="__main__")
"""
    done = run_without_extras(python, program, clean_env(XDG_DATA_HOME=str(tmp_path)))
    assert done.returncode != 0, done.stdout + done.stderr
    assert "the embedded PostgreSQL (pgserver) is not installed: set DATABASE_URL, or pip install" in done.stderr


def test_the_embedded_postgresql_starts_without_printing_its_commands(tmp_path: Path, python: str) -> None:
    """pgserver logs every initdb and pg_ctl it runs, output and all, at INFO, which the CLI shows:
    a newcomer's first ``relay demo`` opened with some forty lines of it."""
    done = run_relay(python, clean_env(XDG_DATA_HOME=str(tmp_path)), "prove", "--jobs", "20", "--workers", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no DATABASE_URL: starting an embedded PostgreSQL" in done.stderr
    assert "jobs lost:        0" in done.stdout
    assert "pgserver" not in done.stderr, done.stderr
