"""The Procfile cannot rot: honcho runs each of its processes against the test database.

``release`` migrates and exits 0; ``web`` answers ``/readyz``; a job enqueued
through the API by a user made with ``relay_core.users`` is run by ``worker``.
Everything runs as it would on a platform (the same command lines, settings
from the environment), except that the web app binds 127.0.0.1 here.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay_core import users

from .helpers import ROOT, call, free_port, wait_for

pytestmark = pytest.mark.slow

PROCFILE = ROOT / "Procfile"


def platform_env(dsn: str, port: int, tmp_path: Path) -> dict[str, str]:
    """What a platform would set: the database, a port, a signing secret; plus this venv on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "SHOP_"))}
    env.update(
        DATABASE_URL=dsn,
        PORT=str(port),
        JWT_SECRET_KEY=secrets.token_urlsafe(48),
        RELAY_WEB_HOST="127.0.0.1",
        WEB_CONCURRENCY="1",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONUNBUFFERED="1",
        # No gunicornc socket in $HOME: it would clash with other gunicorns on this machine.
        GUNICORN_CMD_ARGS="--no-control-socket",
    )
    return env


def honcho(python: str, tmp_path: Path, *processes: str, port: int) -> list[str]:
    """The honcho command line for some of the Procfile's processes (no .env file is read)."""
    no_env = tmp_path / "empty.env"
    no_env.touch()
    return [python, "-m", "honcho", "start", "-f", str(PROCFILE), "-d", str(ROOT), "-e", str(no_env),
            "-p", str(port), *processes]  # fmt: skip


def stop_honcho(proc: subprocess.Popen, log: Path) -> int:
    """SIGTERM honcho's process group (it stops its children); SIGKILL everything if it hangs."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        # honcho starts each process in its own group: kill those too, by the pids it printed.
        for pid in re.findall(r"started \(pid=(\d+)\)", log.read_text(errors="replace")):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


def test_procfile_release_web_and_worker_run_a_job_enqueued_through_the_api(
    dsn: str, db: psycopg.Connection, python: str, tmp_path: Path
) -> None:
    port = free_port()
    env = platform_env(dsn, port, tmp_path)

    release = subprocess.run(
        honcho(python, tmp_path, "release", port=port), env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert release.returncode == 0, release.stdout + release.stderr
    assert "schema is up to date" in release.stdout or "applied:" in release.stdout, release.stdout

    password = secrets.token_urlsafe(16)
    users.create_user(db, "ops", password, "admin")

    log = tmp_path / "honcho.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            honcho(python, tmp_path, "web", "worker", port=port),
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: call("GET", f"{base}/readyz")[0] == 200, timeout=60, interval=0.25, what="web /readyz")

        status, token = call("POST", f"{base}/api/auth/login", {"username": "ops", "password": password})
        assert status == 200, token
        status, job = call(
            "POST",
            f"{base}/api/admin/jobs",
            {"type": "settlement_report", "payload": {"month": "2026-10"}},
            token["access_token"],
        )
        assert status == 201, job

        def finished() -> dict[str, Any] | None:
            code, body = call("GET", f"{base}/api/admin/jobs/{job['id']}", token=token["access_token"])
            assert code == 200, body
            return body if body["status"] in ("succeeded", "dead") else None

        done = wait_for(finished, timeout=30, interval=0.25, what="the worker to run the job")
        assert done["status"] == "succeeded", done["errors"]
        assert done["result"]["month"] == "2026-10"
    finally:
        code = stop_honcho(proc, log)
    output = log.read_text(errors="replace")
    assert "web.1 started" in output and "worker.1 started" in output, output
    assert "relay worker stopped" in output, output  # the worker's own line after a graceful stop
    assert code in (0, 143), output  # honcho reports the SIGTERM it was sent as 143
    claimed = db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0]
    assert claimed == 0


def test_the_procfiles_web_process_listens_on_an_ipv6_relay_web_host(dsn: str, python: str, tmp_path: Path) -> None:
    """The Procfile's ``--bind ${RELAY_WEB_HOST:-0.0.0.0}:$PORT`` made ``::1:8000`` of an IPv6 host,
    which gunicorn read as another host and no port: "Error: '' is not a valid port number"."""
    port = free_port()
    env = {**platform_env(dsn, port, tmp_path), "RELAY_WEB_HOST": "::1"}
    log = tmp_path / "honcho.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            honcho(python, tmp_path, "web", port=port),
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: call("GET", f"http://[::1]:{port}/healthz")[0] == 200, timeout=60, interval=0.25)
    finally:
        stop_honcho(proc, log)
