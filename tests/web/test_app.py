"""The app factory: 12-factor settings, clear startup errors, and gunicorn serving it."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from psycopg import conninfo

from relay_core import ConfigurationError, Relay, users
from relay_web import create_app

from ..helpers import TcpProxy, call, wait_for
from .conftest import SECRET

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = (
    "JWT_SECRET_KEY",
    "SECRET_KEY",
    "RELAY_ENV",
    "DATABASE_URL",
    "RELAY_DATABASE_URL",
    "RELAY_PROXY_HOPS",
    "RELAY_METRICS_TOKEN",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_production_without_a_secret_refuses_to_start(clean_env, dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="JWT_SECRET_KEY"):
        create_app({"RELAY_DATABASE_URL": dsn})


def test_production_refuses_a_short_secret(clean_env, dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="at least 32"):
        create_app({"RELAY_DATABASE_URL": dsn, "SECRET_KEY": "changeme"})


def test_missing_database_is_a_startup_error(clean_env) -> None:
    with pytest.raises(ConfigurationError, match="DATABASE_URL"):
        create_app({"JWT_SECRET_KEY": SECRET})


def test_malformed_setting_is_a_startup_error(clean_env, dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="RELAY_PROXY_HOPS"):
        create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, "RELAY_PROXY_HOPS": "two"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RELAY_ACCESS_TOKEN_SECONDS", "99999999999999999999"),
        ("RELAY_ACCESS_TOKEN_SECONDS", "1000000000000"),
        ("RELAY_LOGIN_WINDOW_SECONDS", "9999999999999"),
        ("RELAY_WORKER_STALE_SECONDS", "9999999999999"),
        ("RELAY_STATEMENT_TIMEOUT_MS", "99999999999"),
    ],
)
def test_a_setting_too_large_to_work_is_a_startup_error(clean_env, dsn: str, name: str, value: str) -> None:
    """Accepted, they failed every login, every scrape or every statement later (500s, or a 503 'the
    database cannot be reached'), or the start itself with an OverflowError naming nothing."""
    with pytest.raises(ConfigurationError, match=f"^{name} must be at most"):
        create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, name: value})


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"JWT_SECRET_KEY": " " * 40}, "JWT_SECRET_KEY (or SECRET_KEY) is blank"),
        ({"JWT_SECRET_KEY": SECRET, "SECRET_KEY": "short"}, "SECRET_KEY must be at least 32"),
        ({"JWT_SECRET_KEY": SECRET, "RELAY_METRICS_TOKEN": "scrape "}, "RELAY_METRICS_TOKEN must be printable"),
        ({"JWT_SECRET_KEY": SECRET, "RELAY_METRICS_TOKEN": "tökén"}, "RELAY_METRICS_TOKEN must be printable"),
        ({"JWT_SECRET_KEY": SECRET, "RELAY_METRICS_TOKEN": "   "}, "RELAY_METRICS_TOKEN is blank"),
    ],
    ids=["blank-jwt-secret", "short-flask-secret", "token-trailing-space", "token-not-ascii", "token-blank"],
)
def test_a_secret_or_token_that_cannot_work_is_a_startup_error(clean_env, dsn: str, given: dict, said: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(said)):
        create_app({"RELAY_DATABASE_URL": dsn, **given})


def test_production_without_a_metrics_token_says_metrics_are_open(
    clean_env, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """/metrics names every queue and job type; in production, open to anyone was a silent default."""

    def open_warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "no RELAY_METRICS_TOKEN set" in r.getMessage()]

    caplog.set_level("WARNING", logger="relay.web")
    create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})
    assert len(open_warnings()) == 1
    create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, "RELAY_METRICS_TOKEN": "scrape-me"})
    clean_env.setenv("RELAY_ENV", "development")
    create_app({"RELAY_DATABASE_URL": dsn})
    assert len(open_warnings()) == 1


def test_a_blank_database_url_is_named_as_the_variable_it_is(clean_env) -> None:
    clean_env.setenv("DATABASE_URL", "   ")
    with pytest.raises(ConfigurationError, match=r"^DATABASE_URL is blank"):
        create_app({"JWT_SECRET_KEY": SECRET})


def test_the_wait_for_a_connection_is_read_as_relay_reads_it(clean_env, dsn: str) -> None:
    """One environment serves the application's Relay() and this app: 2.5 s is 2.5 s to both."""
    clean_env.setenv("RELAY_DB_WAIT_SECONDS", "2.5")
    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})
    assert app.config["RELAY_DB_WAIT_SECONDS"] == 2.5 == Relay(dsn).db_wait
    for bad in ("0", "-1", "soon", "nan"):
        clean_env.setenv("RELAY_DB_WAIT_SECONDS", bad)
        with pytest.raises(ConfigurationError, match="RELAY_DB_WAIT_SECONDS"):
            create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})


@pytest.mark.parametrize("value", ["staging", "developement", "prod"])
def test_an_unknown_environment_stops_the_app_naming_the_ones_there_are(clean_env, dsn: str, value: str) -> None:
    """It ran as production without a word, so a misspelt ``development`` hid why a secret was demanded."""
    clean_env.setenv("RELAY_ENV", value)
    with pytest.raises(ConfigurationError, match=rf"^RELAY_ENV must be production, development or test, got '{value}'"):
        create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})


@pytest.mark.parametrize("value", ["production", "Production", "", "TEST"])
def test_the_environments_there_are_are_read_in_any_case_and_blank_is_production(
    clean_env, dsn: str, value: str
) -> None:
    clean_env.setenv("RELAY_ENV", value)
    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})
    assert app.config["RELAY_ENV"] == (value.lower() or "production")


def test_development_generates_a_secret(clean_env, dsn: str) -> None:
    clean_env.setenv("RELAY_ENV", "development")
    first = create_app({"RELAY_DATABASE_URL": dsn})
    second = create_app({"RELAY_DATABASE_URL": dsn})
    assert len(first.config["JWT_SECRET_KEY"]) >= 32
    assert first.config["JWT_SECRET_KEY"] != second.config["JWT_SECRET_KEY"]


def test_settings_come_from_the_environment(clean_env, dsn: str) -> None:
    clean_env.setenv("DATABASE_URL", dsn)
    clean_env.setenv("SECRET_KEY", SECRET)
    clean_env.setenv("RELAY_PROXY_HOPS", "1")
    app = create_app()
    assert app.config["RELAY_DATABASE_URL"] == dsn
    assert app.config["JWT_SECRET_KEY"] == SECRET
    assert app.config["RELAY_PROXY_HOPS"] == 1
    assert app.config["JWT_COOKIE_SECURE"] is True
    clean_env.setenv("RELAY_DATABASE_URL", f"{dsn} application_name=relay-web-test")
    assert create_app().config["RELAY_DATABASE_URL"].endswith("application_name=relay-web-test")  # RELAY_ wins


SESSION_NAMES = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"


def test_the_web_apps_sessions_are_named_unless_the_dsn_names_them(make_app, dsn: str, db) -> None:
    assert make_app().test_client().get("/readyz").status_code == 200
    assert "relay-web" in [row[0] for row in db.execute(SESSION_NAMES).fetchall()]
    name = f"ops-console-{uuid.uuid4().hex[:8]}"
    named = make_app(RELAY_DATABASE_URL=f"{dsn} application_name={name}")
    assert named.test_client().get("/readyz").status_code == 200
    assert name in [row[0] for row in db.execute(SESSION_NAMES).fetchall()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gunicorn_with_relays_settings(
    env: dict[str, str], app_uri: str = "relay_web:create_app()"
) -> subprocess.CompletedProcess:
    """Start gunicorn as the Procfile does (on a port it cannot bind), with ``env``; it should stop."""
    gunicorn = Path(sys.executable).with_name("gunicorn")
    return subprocess.run(
        [str(gunicorn), "-c", "python:relay_web.gunicorn_conf", "--no-control-socket",
         "--bind", "127.0.0.1:1", app_uri],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "value"), [("WEB_CONCURRENCY", "99999"), ("WEB_CONCURRENCY", "0"), ("PORT", "99999")])
def test_gunicorn_with_relays_settings_refuses_a_worker_count_or_port_that_cannot_work(
    dsn: str, name: str, value: str
) -> None:
    """gunicorn took WEB_CONCURRENCY=99999 and forked workers until the machine ran out of memory;
    0 listened and never answered; PORT=99999 stopped it with a traceback."""
    env = dict(os.environ, DATABASE_URL=dsn, JWT_SECRET_KEY=SECRET, WEB_CONCURRENCY="1", PORT="8000")
    env[name] = value
    done = gunicorn_with_relays_settings(env)
    assert done.returncode == 1
    assert f"Error: {name} must be a whole number from 1 to" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Booting worker" not in done.stderr


@pytest.mark.parametrize(
    "app_uri",
    [
        "relay_web:create_app()",
        "relay_web:create_app({})",
        "relay_web.app:create_app(config_overrides={'RELAY_ENV': 'production'})",
    ],
)
def test_gunicorn_with_relays_settings_refuses_a_missing_secret_in_one_line(dsn: str, app_uri: str) -> None:
    """Found only as each worker built the app: a traceback per worker and "Worker failed to boot"."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(DATABASE_URL=dsn, WEB_CONCURRENCY="1", PORT="8000")
    done = gunicorn_with_relays_settings(env, app_uri)
    assert done.returncode == 1
    assert done.stderr.startswith("Error: no signing secret: set JWT_SECRET_KEY"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


@contextmanager
def gunicorn_serving(env: dict[str, str], options: list[str], app_uri: str) -> Iterator[int]:
    """gunicorn with two workers serving ``app_uri`` on a free port, ready at ``/readyz``; its port."""
    port = _free_port()
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen(
        [str(gunicorn), *options, "--bind", f"127.0.0.1:{port}", "--workers", "2", app_uri],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                assert time.monotonic() < deadline, "gunicorn did not answer"
                time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_gunicorn_without_bind_listens_where_relay_web_host_says(dsn: str) -> None:
    """With PORT set and no --bind, gunicorn listened on 0.0.0.0 though RELAY_WEB_HOST said 127.0.0.1."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "WEB_CONCURRENCY"}
    env.update(
        DATABASE_URL=dsn, PYTHONPATH=str(ROOT), JWT_SECRET_KEY=SECRET, PORT=str(port), RELAY_WEB_HOST="127.0.0.1"
    )
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen(
        [str(gunicorn), "-c", "python:relay_web.gunicorn_conf", "--workers", "1", "relay_web:create_app()"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "Listening at:" in line or not line:
                break
        assert f"Listening at: http://127.0.0.1:{port} " in lines[-1], lines
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("options", "app_uri", "secret_in_env"),
    [
        ([], "relay_web:create_app()", True),
        # Given to the factory only: gunicorn_conf reads them as the factory will.
        (["-c", "python:relay_web.gunicorn_conf"], f"relay_web:create_app({{'JWT_SECRET_KEY': '{SECRET}'}})", False),
        # The application's own factory hands them over: only it knows them.
        (["-c", "python:relay_web.gunicorn_conf"], "tests.apps.web_factory:create()", False),
    ],
)
def test_gunicorn_serves_the_factory(dsn: str, options: list[str], app_uri: str, secret_in_env: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "WEB_CONCURRENCY"}
    env.update(DATABASE_URL=dsn, PYTHONPATH=str(ROOT), APP_SIGNING_SECRET=SECRET)
    if secret_in_env:
        env["JWT_SECRET_KEY"] = SECRET
    with (
        gunicorn_serving(env, options, app_uri) as port,
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/openapi.json", timeout=5) as response,
    ):
        assert response.headers["Content-Type"] == "application/json"


@pytest.mark.parametrize(("hops", "believed"), [("0", False), ("1", True)])
def test_under_relays_gunicorn_settings_proxy_hops_alone_decide_whose_https_is_believed(
    dsn: str, hops: str, believed: bool
) -> None:
    """gunicorn believes X-Forwarded-Proto from 127.0.0.1 by default: with RELAY_PROXY_HOPS=0, which
    docs/api.md says ignores the header, a proxy on the same host passing a client's header through
    made plain HTTP look like HTTPS to the app (it sent HSTS)."""
    left_out = {*SETTINGS, "WEB_CONCURRENCY", "FORWARDED_ALLOW_IPS"}
    env = {k: v for k, v in os.environ.items() if k not in left_out}
    env.update(DATABASE_URL=dsn, JWT_SECRET_KEY=SECRET, RELAY_PROXY_HOPS=hops)
    with gunicorn_serving(env, ["-c", "python:relay_web.gunicorn_conf"], "relay_web:create_app()") as port:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", headers={"X-Forwarded-Proto": "https"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert ("Strict-Transport-Security" in response.headers) is believed


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://relay:Xk9%zzQpw4@db.internal:5432/relay",  # a % not followed by two hex digits
        "postgres://relay:Xk9%zzQpw4@db.internal/relay",
        "host=db.internal user=relay password=Xk9%zzQpw4 dbname",  # key=value with a key missing its '='
    ],
)
def test_an_unreadable_database_url_is_a_startup_error_that_never_shows_the_password(clean_env, url: str) -> None:
    with pytest.raises(ConfigurationError, match="DATABASE_URL") as raised:
        create_app({"RELAY_DATABASE_URL": url, "JWT_SECRET_KEY": SECRET})
    assert "zzQpw4" not in str(raised.value) and "Xk9" not in str(raised.value)


def test_gunicorn_workers_of_a_development_app_share_its_random_secret(dsn: str, db) -> None:
    """Each worker made its own random signing secret, so a token one worker signed was refused by the other.

    Sync workers serve one connection at a time: a connection that sends
    nothing keeps a worker busy, which steers the login to one worker and the
    request with its token to the other.
    """
    password = "correct horse battery staple"
    users.create_user(db, "dev", password, "admin")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "WEB_CONCURRENCY"}
    env.update(DATABASE_URL=dsn, RELAY_ENV="development")
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen(
        [str(gunicorn), "-c", "python:relay_web.gunicorn_conf", "--no-control-socket",
         "--bind", f"127.0.0.1:{port}", "--workers", "2", "relay_web:create_app()"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: call("GET", f"{base}/readyz")[0] == 200, timeout=30, interval=0.2, what="gunicorn")
        with socket.create_connection(("127.0.0.1", port)):  # holds the first worker
            time.sleep(0.5)  # one worker takes this connection and waits for its request
            status, tokens = call("POST", f"{base}/api/auth/login", {"username": "dev", "password": password})
            assert status == 200, tokens
            holds_second = socket.create_connection(("127.0.0.1", port))  # the worker that signed the token
        try:
            time.sleep(0.5)
            status, body = call("GET", f"{base}/api/admin/queues", token=tokens["access_token"])
        finally:
            holds_second.close()
        assert status == 200, body
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def an_app_behind_a_proxy(dsn: str, **settings: str) -> Iterator[tuple[Any, TcpProxy, Callable[[], None]]]:
    """A test client of an app that reaches its database through a proxy. Closing the proxy refuses every
    connection; the callable opens another on the same port: the database is back."""
    proxy = TcpProxy.in_front_of(dsn)
    app = create_app({"RELAY_DATABASE_URL": proxy.dsn, "JWT_SECRET_KEY": SECRET, **settings})
    reopened: list[TcpProxy] = []

    def back() -> None:
        upstream = conninfo.conninfo_to_dict(dsn)
        host, port = str(upstream.get("host") or "127.0.0.1"), int(upstream.get("port") or 5432)
        reopened.append(TcpProxy(host, port, listen_port=proxy.port))

    try:
        yield app.test_client(), proxy, back
    finally:
        app.extensions["relay.db"].close()
        for opened in (*reopened, proxy):
            opened.close()


def test_an_outage_is_logged_once_for_every_request_that_meets_it_and_once_as_it_ends(
    clean_env, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each request that met the outage (a probe, a scrape, a dashboard refresh) logged a warning of its own."""
    caplog.set_level("INFO", logger="relay")
    with an_app_behind_a_proxy(dsn, RELAY_DB_WAIT_SECONDS="0.3") as (client, proxy, back):
        assert client.get("/readyz").status_code == 200
        proxy.close()  # refused from here on
        assert [client.get(path).status_code for path in ("/readyz", "/metrics", "/readyz")] == [503] * 3
        back()
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=15, what="the database back")
    said = [r for r in caplog.records if r.name == "relay"]
    assert [r.getMessage() for r in said] == ["database unavailable; answering 503", "database available again"]
    assert said[0].during == "/readyz" and "after" in said[0].error and said[1].failed_calls >= 3


def test_gunicorn_with_relays_settings_writes_relays_log_lines_as_json_when_asked(dsn: str) -> None:
    """RELAY_LOG_FORMAT was a worker's setting only: the web process wrote Relay's lines through Python's
    fallback, the message alone, with libpq's error over three lines."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "WEB_CONCURRENCY"}
    refused = conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(_free_port()))
    env.update(DATABASE_URL=refused, JWT_SECRET_KEY=SECRET, RELAY_LOG_FORMAT="json", RELAY_DB_WAIT_SECONDS="0.3")
    gunicorn = Path(sys.executable).with_name("gunicorn")
    proc = subprocess.Popen(
        [str(gunicorn), "-c", "python:relay_web.gunicorn_conf", "--no-control-socket",
         "--bind", f"127.0.0.1:{port}", "--workers", "1", "relay_web:create_app()"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: call("GET", f"{base}/healthz")[0] == 200, timeout=30, interval=0.2, what="gunicorn")
        assert [call("GET", f"{base}/readyz")[0] for _ in range(3)] == [503] * 3
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=20)
    relays = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    unavailable = [entry for entry in relays if entry["message"] == "database unavailable; answering 503"]
    assert len(unavailable) == 1, stderr
    assert unavailable[0]["logger"] == "relay" and unavailable[0]["during"] == "/readyz"
    assert "database unavailable" not in "\n".join(line for line in stderr.splitlines() if not line.startswith("{"))


def test_while_an_outage_is_under_way_a_request_waits_briefly_for_a_connection(clean_env, dsn: str) -> None:
    """Each request waited RELAY_DB_WAIT_SECONDS (5 s) for a connection, outage or not: with the Procfile's
    four threads, probes and refreshes held them all and /healthz, which needs no database, waited 3-4 s."""
    with an_app_behind_a_proxy(dsn, RELAY_DB_WAIT_SECONDS="3") as (client, proxy, back):
        assert client.get("/readyz").status_code == 200
        proxy.close()  # refused from here on

        def timed(path: str) -> tuple[int, float]:
            started = time.monotonic()
            status = client.get(path).status_code
            return status, time.monotonic() - started

        first_status, first_wait = timed("/readyz")
        assert first_status == 503 and first_wait >= 2.5  # the outage's first request: the whole wait
        later = [timed(path) for path in ("/readyz", "/metrics", "/readyz")]
        assert [status for status, _ in later] == [503] * 3
        assert max(wait for _, wait in later) < 1.5, later
        back()
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=15, what="the database back")


def test_a_pool_whose_every_connection_is_in_use_is_no_outage(
    clean_env, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request that found every connection held (more at once than RELAY_WEB_POOL_SIZE) was logged as the
    database being away, and cut the next requests' wait for a connection to an outage's."""
    caplog.set_level("INFO", logger="relay")
    settings = {"RELAY_WEB_POOL_SIZE": "1", "RELAY_DB_WAIT_SECONDS": "0.3"}
    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, **settings})
    client = app.test_client()
    database = app.extensions["relay.db"]
    try:
        assert client.get("/readyz").status_code == 200
        for _ in range(2):  # under load, failed and successful checkouts take turns
            with app.app_context(), database.connection():  # the pool's one connection, held
                assert [client.get("/readyz").status_code for _ in range(2)] == [503, 503]
            assert not database.outage.under_way()
            assert client.get("/readyz").status_code == 200
    finally:
        database.close()
    said = [r for r in caplog.records if r.name == "relay"]
    assert len(said) == 1, [r.getMessage() for r in said]  # once per 30 s, not at each turn
    assert said[0].getMessage().startswith("no free database connection") and "RELAY_WEB_POOL_SIZE" in said[0].msg
    assert said[0].times == 1 and said[0].during == "/readyz"


def test_a_database_that_stalls_is_an_outage_not_a_full_pool(
    clean_env, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Against a database that keeps its sockets open and answers nothing, the pool's last attempt to
    connect still read as a success, and the requests that met it were logged as a full pool."""
    caplog.set_level("INFO", logger="relay")
    settings = {"RELAY_WEB_POOL_SIZE": "1", "RELAY_DB_WAIT_SECONDS": "0.3", "RELAY_STATEMENT_TIMEOUT_MS": "300"}
    with an_app_behind_a_proxy(dsn, **settings) as (client, proxy, _):
        assert client.get("/readyz").status_code == 200
        proxy.flowing.clear()  # every socket stays open; nothing passes
        statuses: list[int] = []
        requests = [threading.Thread(target=lambda: statuses.append(client.get("/readyz").status_code))]
        requests.append(threading.Thread(target=lambda: statuses.append(client.get("/metrics").status_code)))
        for request in requests:  # one checks the pool's connection and waits for its answer, one waits for it
            request.start()
        for request in requests:
            request.join(30)
        assert statuses == [503, 503]
    said = [r.getMessage() for r in caplog.records if r.name == "relay"]
    assert said and all(not message.startswith("no free database connection") for message in said), said
    assert said[0] == "database unavailable; answering 503", said


def test_the_apps_sessions_do_not_jit_compile(clean_env, dsn: str) -> None:
    """As on the workers' sessions: a scrape of a few thousand queues costs enough on paper to be
    compiled, and spent 350 of its 400 ms compiling (measured with 2,002 queues)."""
    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})
    database = app.extensions["relay.db"]
    try:
        with app.app_context(), database.connection() as conn:
            assert conn.execute("SHOW jit").fetchone()[0] == "off"
            assert conn.execute("SHOW statement_timeout").fetchone()[0] == "5s"
    finally:
        database.close()
