"""Bad settings and inputs at the command line: one clear line naming what is wrong, nothing written (exit 1, or 2
for a bad flag, as click gives for one it cannot read)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import conninfo

from relay_core import ConfigurationError, InvalidJobError, Relay
from relay_core.cli import main
from relay_web import config as web_config

from .helpers import ROOT, start_worker_process, stop_process, wait_for


def run(dsn: str, args: list[str], env: dict[str, str] | None = None, stdin: str | None = None) -> Result:
    # catch_exceptions=False: an exception escaping the command would be a traceback for the user.
    return CliRunner().invoke(
        main, args, env={"RELAY_DATABASE_URL": dsn, **(env or {})}, input=stdin, catch_exceptions=False
    )


def run_worker(
    python: str, env: dict[str, str], *args: str, app: str = "tests.apps.worker_app:relay", cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``relay worker --app APP ARGS`` as a process, to its exit (a worker that starts fails the timeout)."""
    command = [python, "-m", "relay_core", "worker", "--app", app, *args]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def job_count(db: psycopg.Connection) -> int:
    return db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0]


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["migrate"], {"RELAY_NOTIFY": "x"}, "RELAY_NOTIFY"),
        (["migrate"], {"RELAY_TRANSACTION_POOLING": "x"}, "RELAY_TRANSACTION_POOLING"),
        (["user", "list"], {"RELAY_DATABASE_URL": "  "}, "RELAY_DATABASE_URL is blank"),
        # Set to nothing (an env file's `DATABASE_URL=`): it said "no database configured: pass a DSN to Relay(...)".
        (["migrate"], {"RELAY_DATABASE_URL": None, "DATABASE_URL": ""}, "DATABASE_URL is empty"),
        # The same for `relay prove`, which took it for unset and proved an embedded PostgreSQL instead.
        (["prove", "--jobs", "10"], {"RELAY_DATABASE_URL": None, "DATABASE_URL": ""}, "DATABASE_URL is empty"),
    ],
)
def test_a_bad_setting_ends_the_command_with_one_line_naming_it(
    dsn: str, db: psycopg.Connection, args: list[str], env: dict[str, str], named: str
) -> None:
    result = run(dsn, args, env)
    assert result.exit_code == 1, result.output
    assert named in result.output and "Traceback" not in result.output
    assert job_count(db) == 0


def test_relay_prove_run_in_process_puts_the_sigterm_handler_back(dsn: str) -> None:
    """It made SIGTERM raise KeyboardInterrupt for the whole process and left it so: a caller's own
    SIGTERM (a test runner's timeout) then became an interrupt, which broad handlers swallow."""
    import signal

    before = signal.getsignal(signal.SIGTERM)
    result = run(dsn, ["prove", "--jobs", "10"], {"RELAY_DATABASE_URL": None, "DATABASE_URL": ""})
    assert result.exit_code == 1 and "DATABASE_URL is empty" in result.output
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RELAY_NOTIFY": "maybe"}, "RELAY_NOTIFY"),
        ({"RELAY_DB_WAIT_SECONDS": "0"}, "RELAY_DB_WAIT_SECONDS"),
        ({"RELAY_MAX_PAYLOAD_BYTES": "abc"}, "RELAY_MAX_PAYLOAD_BYTES"),
        ({"RELAY_MAX_PAYLOAD_BYTES": "-1"}, "RELAY_MAX_PAYLOAD_BYTES"),
        ({"RELAY_MAX_PAYLOAD_BYTES": "419430400"}, "RELAY_MAX_PAYLOAD_BYTES"),
        ({"RELAY_DATABASE_URL": " "}, "RELAY_DATABASE_URL is blank"),
        ({"RELAY_DATABASE_URL": None, "DATABASE_URL": ""}, "DATABASE_URL is empty"),
        ({"RELAY_DATABASE_URL": None, "DATABASE_URL": None}, "no database configured"),
        ({"RELAY_DATABASE_URL": "postgresql://postgres@127.0.0.1/test?connect_timeout=abc"}, "connect_timeout"),
        ({"RELAY_DATABASE_URL": "postgresql://postgres@127.0.0.1/test?sslmode=bogus"}, "sslmode"),
        ({"RELAY_DATABASE_URL": "postgresql://postgres@127.0.0.1/test?port=abc"}, "port"),
    ],
)
def test_relay_enqueue_exits_2_for_a_setting_it_cannot_use(
    dsn: str, db: psycopg.Connection, env: dict[str, str], named: str
) -> None:
    """The README's contract: 2 for what a retry cannot fix, 1 only for a database that failed or refused.
    A bad setting exited 1, so a script that retried on 1 retried it for ever."""
    result = run(dsn, ["enqueue", "t", "{}"], env)
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
    assert job_count(db) == 0


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RELAY_ARGON2_TIME_COST": "-1"}, "RELAY_ARGON2_TIME_COST"),
        ({"RELAY_ARGON2_MEMORY_COST": "99999999999999"}, "RELAY_ARGON2_MEMORY_COST"),
        ({"RELAY_ARGON2_PARALLELISM": "100000000"}, "RELAY_ARGON2_PARALLELISM"),
        ({"RELAY_ARGON2_PARALLELISM": "8", "RELAY_ARGON2_MEMORY_COST": "32"}, "RELAY_ARGON2_MEMORY_COST"),
    ],
)
def test_argon2_settings_out_of_bounds_are_refused_before_any_password_is_set(
    dsn: str, db: psycopg.Connection, env: dict[str, str], named: str
) -> None:
    create = ["user", "create", "carol", "--role", "admin", "--password-stdin"]
    assert run(dsn, create, stdin="a long enough password\n").exit_code == 0
    before = db.execute("SELECT password_hash FROM relay.users WHERE username = 'carol'").fetchone()
    result = run(dsn, ["user", "set-password", "carol", "--password-stdin"], env, stdin="another password here\n")
    assert result.exit_code == 1 and named in result.output, result.output
    assert db.execute("SELECT password_hash FROM relay.users WHERE username = 'carol'").fetchone() == before
    with pytest.raises(ConfigurationError, match=named):
        web_config.load({"TESTING": True, "RELAY_DATABASE_URL": dsn, **env})


def test_a_connection_setting_libpq_cannot_use_is_a_clear_error(dsn: str) -> None:
    result = run(conninfo.make_conninfo(dsn, connect_timeout="abc"), ["user", "list"])
    assert result.exit_code == 1
    assert "cannot connect to the database" in result.output and "connect_timeout" in result.output


def test_input_relay_enqueue_refuses_exits_2_while_the_database_is_unreachable_too() -> None:
    """It connected before it checked: with the database down, a bad priority exited 1, as an outage does."""
    result = run(
        "postgresql://postgres@127.0.0.1:1/nowhere?connect_timeout=2", ["enqueue", "t", "{}", "--priority", "40000"]
    )
    assert result.exit_code == 2, result.output
    assert "refused: priority" in result.output and "connect" not in result.output


@pytest.mark.parametrize(
    "args",
    [["enqueue", "t\udcff", "{}"], ["enqueue", "t", "{}", "--idempotency-key", "k\udcff"]],
)
def test_a_lone_surrogate_in_a_type_or_key_is_refused(dsn: str, db: psycopg.Connection, args: list[str]) -> None:
    # What a shell hands Python for the byte 0xff in an argument.
    result = run(dsn, args)
    assert result.exit_code == 2 and "lone surrogate" in result.output, result.output
    assert job_count(db) == 0


def test_the_python_api_refuses_lone_surrogates_as_invalid_jobs(relay: Relay, db: psycopg.Connection) -> None:
    with pytest.raises(InvalidJobError, match="type"):
        relay.enqueue("t\ud800", {})
    with pytest.raises(InvalidJobError, match="idempotency_key"):
        relay.enqueue("t", {}, idempotency_key="k\ud800")
    assert job_count(db) == 0


def test_migrate_says_when_a_newer_relay_migrated_the_database(dsn: str, db: psycopg.Connection) -> None:
    db.execute("INSERT INTO relay.schema_migrations (version, name) VALUES (9999, 'from_the_future')")
    try:
        result = run(dsn, ["migrate"])
    finally:  # the test database keeps its migrations from test to test
        db.execute("DELETE FROM relay.schema_migrations WHERE version = 9999")
    assert result.exit_code == 0, result.output  # a rollback to this version must still deploy
    assert "9999_from_the_future" in result.output and "newer Relay" in result.output
    assert "schema is up to date" not in result.output


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RELAY_NOTIFY": "x"}, "RELAY_NOTIFY"),  # read as the app module builds its Relay
        ({"RELAY_CONCURRENCY": "100000"}, "RELAY_CONCURRENCY: concurrency must be"),
        ({"RELAY_POLL_INTERVAL": "1e300"}, "RELAY_POLL_INTERVAL: poll_interval must be"),
        ({"RELAY_SHUTDOWN_TIMEOUT": "1e300"}, "RELAY_SHUTDOWN_TIMEOUT: shutdown_timeout must be"),
        ({"RELAY_MAX_STUCK_HANDLERS": "-1"}, "RELAY_MAX_STUCK_HANDLERS: max_stuck_handlers must be between 0"),
        ({"RELAY_MAX_STUCK_HANDLERS": "some"}, "RELAY_MAX_STUCK_HANDLERS must be an integer"),
        ({"RELAY_LEASE_SECONDS": "0.5"}, "RELAY_LEASE_SECONDS: lease_seconds must be at least 1"),
        # An idle worker ran empty claims back to back.
        ({"RELAY_POLL_INTERVAL": "0.000001"}, "RELAY_POLL_INTERVAL: poll_interval must be at least 0.01 s"),
        ({"RELAY_SWEEP_INTERVAL": "0.001"}, "RELAY_SWEEP_INTERVAL: sweep_interval must be at least 0.1 s"),
        # Said "queue: 'Bad' is not a valid queue name", naming no setting.
        ({"RELAY_QUEUES": "emails,Bad"}, "RELAY_QUEUES: queues must be queue names: 'Bad' is not a valid queue name"),
        ({"RELAY_QUEUES": " , "}, "RELAY_QUEUES: queues must name at least one queue"),
    ],
)
def test_a_worker_with_a_bad_setting_exits_with_one_line(
    python: str, worker_env: dict[str, str], db: psycopg.Connection, env: dict[str, str], named: str
) -> None:
    done = run_worker(python, {**worker_env, **env})
    assert done.returncode == 1, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert db.execute("SELECT count(*) FROM relay.workers").fetchone() == (0,)


def test_a_worker_whose_database_refuses_its_registration_exits_with_one_line(
    python: str, worker_env: dict[str, str], dsn: str, db: psycopg.Connection
) -> None:
    """A role that may only read Relay's tables (here, a read-only DATABASE_URL): the worker's
    registration was refused with a traceback, where `relay enqueue` says it in one line."""
    read_only = conninfo.make_conninfo(dsn, options="-c default_transaction_read_only=on")
    done = run_worker(python, {**worker_env, "RELAY_DATABASE_URL": read_only})
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the database refused: cannot execute INSERT"), done.stderr
    assert "Traceback" not in done.stderr
    assert db.execute("SELECT count(*) FROM relay.workers").fetchone() == (0,)


APP_READING_ITS_OWN_TABLE = """\
import os

import psycopg

from relay_core import Relay

with psycopg.connect(os.environ["RELAY_DATABASE_URL"]) as conn:
    conn.execute("SELECT name FROM app_feature_flags")

relay = Relay()
"""


def test_an_error_of_the_apps_own_sql_keeps_its_traceback(
    python: str, worker_env: dict[str, str], tmp_path: Path
) -> None:
    """Only what the server refuses as the worker runs is one line: an app whose own table is missing
    at import was told to run relay migrate, and the table's name was lost."""
    (tmp_path / "flags_app.py").write_text(APP_READING_ITS_OWN_TABLE)
    done = run_worker(python, worker_env, app="flags_app:relay", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f'File "{tmp_path / "flags_app.py"}", line 8' in done.stderr
    assert 'relation "app_feature_flags" does not exist' in done.stderr and "migrate" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("", "names no queue: a worker needs at least one"),
        (" , ", "names no queue: a worker needs at least one"),
        ("emails,Bad Queue", "'Bad Queue' is not a valid queue name"),
    ],
)
def test_a_worker_given_a_bad_queues_flag_is_refused_as_a_usage_error(
    python: str, worker_env: dict[str, str], db: psycopg.Connection, flag: str, said: str
) -> None:
    """`--queues ''` was read as "not given": the worker served RELAY_QUEUES, or the default queue.
    A flag that names no queue, or a bad one, is the caller's input: exit 2, as for a value click
    cannot read (it exited 1, as a database that failed does), and no worker registers."""
    done = run_worker(python, {**worker_env, "RELAY_QUEUES": "emails"}, "--queues", flag)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: Invalid value for '--queues': ") and said in last, done.stderr
    assert db.execute("SELECT count(*) FROM relay.workers").fetchone() == (0,)


@pytest.mark.parametrize(
    ("setting", "named"),
    [("sslmode=bogus", "sslmode"), ("connect_timeout=abc", "connect_timeout"), ("port=99999", "port")],
)
def test_a_worker_whose_database_url_has_a_setting_libpq_cannot_use_exits_with_one_line(
    python: str, worker_env: dict[str, str], dsn: str, setting: str, named: str
) -> None:
    """Such a URL can never connect: the worker retried it forever as if the database were down
    (and, with connect_timeout=abc, said no pooled connection became free)."""
    key, value = setting.split("=")
    env = {**worker_env, "RELAY_DATABASE_URL": conninfo.make_conninfo(dsn, **{key: value})}
    done = run_worker(python, env)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the database URL has a setting libpq cannot use") and named in last, done.stderr
    assert "Traceback" not in done.stderr


def test_the_heartbeat_interval_set_in_the_environment_is_kept_beside_lease(
    python: str, worker_env: dict[str, str], db: psycopg.Connection
) -> None:
    """--lease made the heartbeat a third of the lease whatever RELAY_HEARTBEAT_INTERVAL said,
    so a setting that breaks the lease's rule started a worker rather than being refused."""
    env = {**worker_env, "RELAY_HEARTBEAT_INTERVAL": "100"}
    done = run_worker(python, env, "--lease", "10")
    assert done.returncode == 1, done.stderr
    assert "RELAY_HEARTBEAT_INTERVAL: heartbeat_interval must be at most half of lease_seconds" in done.stderr
    assert db.execute("SELECT count(*) FROM relay.workers").fetchone() == (0,)


APP_WITH_A_BAD_CRON = """\
from relay_core import Relay

relay = Relay()


@relay.handler("report", cron="61 * * * *")
def report(job):
    pass
"""

APP_MISSING_A_DEPENDENCY = """\
from relay_core import Relay
import a_dependency_not_installed

relay = Relay()
"""


def test_a_handler_relay_refuses_ends_the_worker_with_one_line_naming_where_it_was_declared(
    python: str, worker_env: dict[str, str], tmp_path: Path
) -> None:
    """Before, a 48-line traceback through Relay's own frames."""
    (tmp_path / "cron_app.py").write_text(APP_WITH_A_BAD_CRON)
    done = run_worker(python, worker_env, app="cron_app:relay", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: cron_app:relay: cron: '61 * * * *' is not a valid cron expression (at {tmp_path / 'cron_app.py'}:6)"
    ]


def test_a_module_that_fails_to_import_its_own_dependency_is_not_called_a_bad_app_option(
    python: str, worker_env: dict[str, str], tmp_path: Path
) -> None:
    """Before: "Invalid value for --app: cannot import 'dep_app'", with the file and line dropped."""
    (tmp_path / "dep_app.py").write_text(APP_MISSING_A_DEPENDENCY)
    done = run_worker(python, worker_env, app="dep_app:relay", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "--app" not in done.stderr
    assert f'File "{tmp_path / "dep_app.py"}", line 2' in done.stderr
    assert done.stderr.strip().endswith("No module named 'a_dependency_not_installed'")
    missing = run_worker(python, worker_env, app="no_such_app:relay", cwd=tmp_path)
    assert missing.returncode == 2 and "Invalid value for --app: cannot import 'no_such_app'" in missing.stderr


@pytest.mark.parametrize("app", [".jobs:relay", "..:relay", ".:relay"])
def test_a_relative_module_name_for_app_is_a_usage_error_not_a_traceback(
    python: str, worker_env: dict[str, str], tmp_path: Path, app: str
) -> None:
    """importlib raised TypeError ("the 'package' argument is required ..."), which left as a traceback."""
    done = run_worker(python, worker_env, app=app, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "Invalid value for --app" in done.stderr and "relative" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["worker", "--app", "tests.apps.worker_app:relay", "--lease", "nan"],
        ["worker", "--app", "tests.apps.worker_app:relay", "--lease", "inf"],
        ["worker", "--app", "tests.apps.worker_app:relay", "--shutdown-timeout", "nan"],
        ["worker", "--app", "tests.apps.worker_app:relay", "--shutdown-timeout", "inf"],
        ["prove", "--timeout", "nan"],
        ["demo", "--orders-per-minute", "nan"],
    ],
)
def test_a_seconds_or_rate_option_given_nan_or_infinity_is_a_usage_error_that_changes_nothing(
    python: str, worker_env: dict[str, str], dsn: str, command: list[str]
) -> None:
    """Every comparison with NaN is false, so click's FloatRange let it through: `relay prove --timeout nan`
    enqueued 5,000 jobs and started workers, and `relay demo --orders-per-minute nan` flooded the queue."""
    proof_schema = "SELECT count(*) FROM pg_namespace WHERE nspname = 'relay_proof'"
    with psycopg.connect(dsn) as conn:
        proof_schemas = conn.execute(proof_schema).fetchone()[0]  # an earlier test's `relay prove` leaves it
    done = subprocess.run(
        [python, "-m", "relay_core", *command], env=worker_env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert f"Invalid value for '{command[-2]}'" in done.stderr, done.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0
        assert conn.execute(proof_schema).fetchone()[0] == proof_schemas


def test_a_worker_whose_unix_socket_server_is_down_waits_for_it(
    python: str, worker_env: dict[str, str], dsn: str, tmp_path: Path
) -> None:
    """libpq calls a Unix-socket connection to a server that is not there "bad" at once, as it does a
    setting it cannot use: the worker took a restarting server for a bad URL and exited."""
    env = {**worker_env, "RELAY_DATABASE_URL": conninfo.make_conninfo(dsn, host=str(tmp_path), port="5432")}
    log = tmp_path / "worker.log"
    worker = start_worker_process(python, env, log=log)
    try:
        wait_for(lambda: "database unreachable; retrying" in log.read_text(), timeout=30, what="a retry")
        time.sleep(3)  # past the first PoolTimeout, where the cause is read
        assert worker.poll() is None, log.read_text()
    finally:
        code = stop_process(worker)
    assert code == 0, log.read_text()
    assert "Error:" not in log.read_text()
    # Its last line says it stopped: a log that ended at "database unreachable" read as a hang.
    last_line = log.read_text().strip().splitlines()[-1]
    assert "worker stopped before it started: the database never answered" in last_line, log.read_text()


def test_a_worker_whose_app_registered_no_handler_ends_with_one_line(
    python: str, worker_env: dict[str, str], tmp_path: Path, db: psycopg.Connection
) -> None:
    """An app whose handlers live in a module it never imports: the worker started and spent the
    attempts of every job it claimed (HandlerNotFound) until they were dead."""
    (tmp_path / "empty_app.py").write_text("from relay_core import Relay\n\nrelay = Relay()\n")
    db.execute("INSERT INTO relay.jobs (type, max_attempts) VALUES ('send_email', 1)")
    done = run_worker(python, worker_env, app="empty_app:relay", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: this worker has no handlers: register them with @relay.handler(...) on the Relay it runs "
        "(with `relay worker --app MODULE:ATTR`, in MODULE or a module it imports)"
    ]
    assert db.execute("SELECT status::text, attempts FROM relay.jobs").fetchall() == [("queued", 0)]


@pytest.mark.parametrize("scheme", ["postgresql+psycopg", "postgresql+psycopg2", "postgres"])
def test_a_sqlalchemy_or_heroku_spelling_of_the_database_url_is_read_as_postgresql(
    dsn: str, db: psycopg.Connection, scheme: str
) -> None:
    """An application shares one DATABASE_URL with Relay: SQLAlchemy's names a driver, which
    libpq read as key=value settings ('missing "=" after "..."')."""
    parts = conninfo.conninfo_to_dict(dsn)
    user, database = quote(parts["user"], safe=""), quote(parts["dbname"], safe="")
    url = f"{scheme}://{user}@{parts['host']}:{parts['port']}/{database}"
    result = run(url, ["enqueue", "t", "{}"])
    assert result.exit_code == 0, result.output
    assert job_count(db) == 1


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("mysql://app@db.internal/app", "is a mysql:// URL: Relay needs PostgreSQL, postgresql://"),
        ("sqlite:///app.db", "is a sqlite:// URL: Relay needs PostgreSQL, postgresql://"),
        ("garbage", 'cannot be read: missing "=" after "..." in connection info string (expected postgresql://'),
    ],
)
def test_a_database_url_that_is_not_postgresql_says_what_one_looks_like(
    db: psycopg.Connection, url: str, said: str
) -> None:
    result = run(url, ["enqueue", "t", "{}"])
    assert result.exit_code == 2, result.output  # a setting a retry cannot fix (see the test above)
    assert result.output.startswith(f"Error: the database URL (DATABASE_URL or RELAY_DATABASE_URL) {said}")
    assert job_count(db) == 0


def test_a_command_with_no_database_configured_names_the_variable_not_the_python_api() -> None:
    result = CliRunner().invoke(
        main, ["migrate"], env={"RELAY_DATABASE_URL": None, "DATABASE_URL": None}, catch_exceptions=False
    )
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        "Error: no database configured: set DATABASE_URL (or RELAY_DATABASE_URL) "
        "to postgresql://user:password@host:5432/dbname"
    )


@pytest.mark.parametrize("args", [["t", "{}", "--queue", "BAD"], ["", "{}"], ["t", "{}", "--max-attempts", "0"]])
def test_refused_enqueue_input_exits_2_with_no_database_configured_as_with_one(args: list[str]) -> None:
    """The database's setting was read first, so refused input exited 1 (no database configured)
    while with a database configured the same input exits 2."""
    result = CliRunner().invoke(
        main, ["enqueue", *args], env={"RELAY_DATABASE_URL": None, "DATABASE_URL": None}, catch_exceptions=False
    )
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: refused: "), result.output


def test_a_payload_read_from_standard_input_may_be_longer_than_an_argument_may(
    dsn: str, db: psycopg.Connection
) -> None:
    """Linux refuses a command-line argument over 128 KiB, under the default payload limit of 256 KiB."""
    big = {"text": "a" * 200_000}
    result = run(dsn, ["enqueue", "big", "-"], stdin=json.dumps(big))
    assert result.exit_code == 0, result.output
    job_id = int(result.stdout.strip())
    assert db.execute("SELECT payload FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == big


@pytest.mark.parametrize(
    ("stdin", "said"),
    [("", "standard input (-) held no JSON"), ("{'a': 1}", "not valid JSON"), ('{"a": NaN}', "NaN")],
)
def test_a_payload_from_standard_input_is_checked_as_an_argument_is(
    dsn: str, db: psycopg.Connection, stdin: str, said: str
) -> None:
    result = run(dsn, ["enqueue", "t", "-"], stdin=stdin)
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert job_count(db) == 0


def test_a_payload_over_the_limit_names_the_setting_that_sets_it(dsn: str, db: psycopg.Connection) -> None:
    result = run(dsn, ["enqueue", "t", json.dumps({"a": "b" * 100})], env={"RELAY_MAX_PAYLOAD_BYTES": "50"})
    assert result.exit_code == 2, result.output
    assert "over the limit of 50 (RELAY_MAX_PAYLOAD_BYTES)" in result.output
    assert job_count(db) == 0


def test_worker_help_names_the_variable_behind_each_flag() -> None:
    result = CliRunner().invoke(main, ["worker", "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for variable in ("RELAY_QUEUES", "RELAY_CONCURRENCY", "RELAY_LEASE_SECONDS", "RELAY_SHUTDOWN_TIMEOUT"):
        assert f"default: {variable}, else" in text, variable
    assert "RELAY_LISTEN=false" in text and "RELAY_HEARTBEAT_INTERVAL" in text


def test_under_json_logs_a_module_that_fails_to_import_ends_with_a_json_record(
    python: str, worker_env: dict[str, str], tmp_path: Path
) -> None:
    """Its traceback, and every command's last "Error:" line, were plain text among JSON lines."""
    (tmp_path / "broken_app.py").write_text('raise RuntimeError("boom at import")\n')
    command = [python, "-m", "relay_core", "--log-format", "json", "worker", "--app", "broken_app:relay"]
    done = subprocess.run(command, env=worker_env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    records = [json.loads(line) for line in done.stderr.strip().splitlines()]  # every line is JSON
    assert records[-1]["level"] == "critical" and records[-1]["message"] == "RuntimeError: boom at import"
    assert f'File "{tmp_path / "broken_app.py"}", line 1' in records[-1]["exception"]


def test_under_json_logs_a_command_ends_with_a_json_error_record(dsn: str) -> None:
    result = run(dsn, ["--log-format", "json", "requeue", "999999"])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in result.stderr.strip().splitlines()]
    assert records[-1]["level"] == "error" and records[-1]["message"] == "job 999999 does not exist"
    typo = run(dsn, ["--log-format", "json", "enqueue", "t", "{bad"])
    assert typo.exit_code == 2 and "Usage:" in typo.stderr  # typed at a terminal: click's own words


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ('"postgresql://relay:Sup3rS3cret@db.internal:5432/app"', "is wrapped in quotes: remove them"),
        ("'postgresql://relay:Sup3rS3cret@db.internal:5432/app'", "is wrapped in quotes: remove them"),
        ('postgresql://relay:Se"Sup3rS3cret pass@db.internal/app', "cannot be read"),
        ("host=db.internal password=Sup3rS3cret port=5432x", "has a port that is not a number"),
        ("postgresql://relay:Sup3rS3cret@db.internal:5x432/app", "has a port that is not a number"),
        ("postgresql://relay:Sup3r/S3cret@db.internal/app", "has a '/' in its user or password: write it as %2F"),
        ("postgresql://relay:Sup3rS3cret@db.internal:5x/app?application_name=a/b@c", "has a port that is not a number"),
        ("postgresql://relay:Sup3rS3cret@db.internal/app\n", "has spaces or a line break at its start or end"),
    ],
)
def test_a_database_url_that_cannot_be_read_is_refused_without_showing_its_password(
    db: psycopg.Connection, url: str, said: str
) -> None:
    """Quoted (an env file's or a dashboard's quotes kept), libpq's message paired the wrong quotation
    marks and showed the password; a port that is no number, or a '/' in the password (read as a port),
    was an outage retried for good, its message naming the user as the host."""
    result = run(url, ["enqueue", "t", "{}"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"Error: the database URL (DATABASE_URL or RELAY_DATABASE_URL) {said}")
    assert "S3cret" not in result.output
    assert job_count(db) == 0


def test_key_value_settings_with_spaces_and_line_breaks_libpq_reads_are_taken(dsn: str, db: psycopg.Connection) -> None:
    """libpq reads whitespace between settings, and around a quoted port: refusing them refused working DSNs."""
    parts = conninfo.conninfo_to_dict(dsn)
    spaced = " ".join(f"{key}={value}" for key, value in parts.items() if key != "port")
    result = run(f"{spaced} port=' {parts.get('port', 5432)}'\n", ["enqueue", "t", "{}"])
    assert result.exit_code == 0, result.output
    assert job_count(db) == 1
