"""``relay enqueue``: a job from the command line, and a clear refusal of bad input that writes nothing."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import subprocess
import threading
import time

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import conninfo

from relay_core import logs
from relay_core.cli import main

from .helpers import ROOT, publish_handlers, wait_for


@pytest.fixture
def enqueue(dsn: str):
    def invoke(*args: str) -> Result:
        # catch_exceptions=False: an exception escaping the command would be a traceback for the user.
        return CliRunner().invoke(main, ["enqueue", *args], env={"RELAY_DATABASE_URL": dsn}, catch_exceptions=False)

    return invoke


def job_count(db: psycopg.Connection) -> int:
    return db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0]


def test_enqueue_prints_the_new_job_id(enqueue, db: psycopg.Connection) -> None:
    result = enqueue("send_email", '{"to": "a@b.c"}', "--run-at", "2030-01-01T09:00:00+02:00")
    assert result.exit_code == 0, result.output
    job_id = int(result.output)
    row = db.execute("SELECT type, payload, run_at FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row[0] == "send_email" and row[1] == {"to": "a@b.c"}
    assert row[2].isoformat().startswith("2030-01-01T07:00:00")


def test_enqueue_takes_the_max_attempts_workers_published_unless_given_one(
    enqueue, dsn: str, db: psycopg.Connection
) -> None:
    """The CLI loads no handlers: a job of a type a worker registered gets that handler's max_attempts."""
    publish_handlers(dsn, send_email=3)
    ids = [
        int(enqueue("send_email", '{"to": "a@b.c"}').output),
        int(enqueue("send_email", "{}", "--max-attempts", "6").output),
        int(enqueue("resize_image").output),
    ]
    rows = db.execute("SELECT max_attempts FROM relay.jobs WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()
    assert [r[0] for r in rows] == [3, 6, 20]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("[1, " + "7" * 5000 + "]", "longer than"),
        ('{"n": ' + "9" * 4301 + "}", "longer than"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{not json", "not valid JSON"),
        # Python's reader takes these; JSON has no NaN or Infinity, and no document holds a float past its range.
        ("NaN", "not valid JSON: NaN is not a JSON value"),
        ('{"a": -Infinity}', "not valid JSON: -Infinity"),
        ('{"a": 1e400}', "a number too large to carry: 1e400"),
        ('{"a": 1e-400}', "a number a float would change: 1e-400"),
        ('{"a": 12345678901234567.5}', "a number a float would change: 12345678901234567.5"),
        ('{"a": 1e-99999999999999999999}', "a number a float would change: 1e-99999999999999999999"),
        ('{"to": "ann@x", "to": "bob@x"}', 'repeats a key within one object: "to"'),
        ('{"mail": {"to": "ann@x", "to": "bob@x"}}', 'repeats a key within one object: "to"'),
    ],
)
def test_a_payload_python_cannot_read_is_a_usage_error(enqueue, db, payload: str, message: str) -> None:
    result = enqueue("t", payload)
    assert result.exit_code == 2, result.output
    assert "PAYLOAD" in result.output and message in result.output
    assert "Traceback" not in result.output
    assert job_count(db) == 0


@pytest.mark.parametrize("run_at", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"])
def test_a_run_at_outside_the_utc_calendar_is_refused(enqueue, db, run_at: str) -> None:
    result = enqueue("t", "{}", "--run-at", run_at)
    assert result.exit_code == 2, result.output
    assert "refused: run_at:" in result.output and "9999" in result.output
    assert job_count(db) == 0


@pytest.mark.parametrize("spelling", ["2_2", " 22", "+22", "022", "٢٢", "22.0", "9" * 20, "0"])
def test_requeue_reads_a_job_id_only_as_relay_writes_it(relay, dsn: str, db: psycopg.Connection, spelling: str) -> None:
    """int() reads all of these as some job's id; the command refuses them and touches nothing."""
    ids = relay.enqueue_many([{"type": "t", "max_attempts": 1} for _ in range(25)])
    db.execute("UPDATE relay.jobs SET status = 'dead', finished_at = now() WHERE id = ANY(%s)", (ids,))
    result = CliRunner().invoke(main, ["requeue", spelling], env={"RELAY_DATABASE_URL": dsn}, catch_exceptions=False)
    assert result.exit_code == 2 and "is not a job id" in result.output, result.output
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'dead'").fetchone()[0] == 25


def test_a_zero_written_with_an_exponent_past_what_decimal_reads_is_enqueued(enqueue, db) -> None:
    result = enqueue("t", '{"a": 0e99999999999999999999}')
    assert result.exit_code == 0, result.output
    assert db.execute("SELECT payload FROM relay.jobs").fetchone()[0] == {"a": 0.0}


def test_requeue_waits_for_a_last_failure_in_flight_where_the_database_defaults_to_repeatable_read(
    relay, dsn: str, db: psycopg.Connection
) -> None:
    """The command's connection kept the database's isolation: the row lock it waited for ended
    in a serialization error, and the job stayed dead."""
    job_id = relay.enqueue("t", {})
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = 1, claimed_by = 'w',"
        " claimed_until = now() + interval '1 minute' WHERE id = %s",
        (job_id,),
    )
    strict = conninfo.make_conninfo(dsn, options="-c default_transaction_isolation=repeatable\\ read")
    results: list = []
    with psycopg.connect(dsn) as worker:
        worker.execute(
            "UPDATE relay.jobs SET status = 'dead', claimed_until = NULL, finished_at = now() WHERE id = %s", (job_id,)
        )
        requeue = threading.Thread(
            target=lambda: results.append(
                CliRunner().invoke(main, ["requeue", str(job_id)], env={"RELAY_DATABASE_URL": strict})
            )
        )
        requeue.start()
        wait_for(
            lambda: db.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0] == 1,
            what="the requeue to wait for the worker's row lock",
        )
        worker.commit()
        requeue.join(15)
    assert results and results[0].exit_code == 0, results and results[0].output
    assert relay.get_job(job_id).status == "queued"


def test_a_log_field_with_a_line_break_stays_on_its_line_and_json_times_carry_milliseconds_and_offset() -> None:
    """Written as it was, a handler's error with a newline started a log line of its own: one that
    could read "job succeeded job_id=424242"."""
    record = logging.LogRecord("relay", logging.WARNING, __file__, 1, "job failed; will retry", (), None)
    record.error = "ValueError: first\n2026-12-02 05:40:11,000 INFO relay job succeeded job_id=424242"
    record.job_id = 7
    line = logs.KeyValueFormatter("%(levelname)s %(name)s %(message)s").format(record)
    assert "\n" not in line and "job_id=7" in line
    assert 'error="ValueError: first\\n2026-12-02 05:40:11,000 INFO relay job succeeded job_id=424242"' in line
    entry = json.loads(logs.JsonFormatter().format(record))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", entry["time"]), entry["time"]


def test_requeue_of_a_job_in_the_wrong_state_names_the_rule(relay, dsn: str) -> None:
    job_id = relay.enqueue("t")
    result = CliRunner().invoke(main, ["requeue", str(job_id)], env={"RELAY_DATABASE_URL": dsn})
    assert result.exit_code == 1
    assert (
        f"cannot requeue job {job_id}: it is queued, and only dead or cancelled jobs can be requeued" in result.output
    )


@pytest.mark.parametrize(
    "command",
    [("enqueue", "t", "{}"), ("requeue", "1"), ("user", "list"), ("user", "delete", "nobody")],
    ids=lambda c: " ".join(c[:2]),
)
@pytest.mark.parametrize(
    ("database", "message"),
    [
        ("postgresql://postgres@127.0.0.1:1/nowhere", "cannot connect to the database"),
        ("not-a-dsn", "cannot be read"),
        ("unmigrated", "run `relay migrate` first"),
    ],
)
def test_a_database_that_is_unreachable_malformed_or_unmigrated_is_a_clear_error(
    request, command: tuple[str, ...], database: str, message: str
) -> None:
    """No traceback, no wait for a pool: one line saying what is wrong, and exit status 1 (2 for
    ``relay enqueue`` given a URL that cannot be read: a setting no retry fixes)."""
    if database == "unmigrated":
        database = request.getfixturevalue("unmigrated_dsn")
    started = time.monotonic()
    result = CliRunner().invoke(main, list(command), env={"RELAY_DATABASE_URL": database}, catch_exceptions=False)
    unusable_setting = command[0] == "enqueue" and database == "not-a-dsn"
    assert result.exit_code == (2 if unusable_setting else 1), result.output
    assert message in result.output and "Traceback" not in result.output
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "command",
    [("enqueue", "t", "{}"), ("requeue", "1"), ("user", "delete", "nobody"), ("user", "set-role", "nobody", "viewer")],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_statement_the_database_refuses_is_one_line_not_a_traceback(
    dsn: str, db: psycopg.Connection, command: tuple[str, ...]
) -> None:
    """A DATABASE_URL that points at a read-only replica, say."""
    read_only = conninfo.make_conninfo(dsn, options="-c default_transaction_read_only=on")
    result = CliRunner().invoke(main, list(command), env={"RELAY_DATABASE_URL": read_only}, catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "the database refused: cannot execute" in result.output, result.output
    assert "read-only transaction" in result.output and "Traceback" not in result.output
    assert job_count(db) == 0


@pytest.mark.parametrize("spelling", ["jsno", "logfmt"])
def test_an_unknown_log_format_is_refused_before_anything_runs(dsn: str, spelling: str) -> None:
    """A log pipeline that expects JSON must not be fed text because of a typo in RELAY_LOG_FORMAT."""
    result = CliRunner().invoke(main, ["migrate"], env={"RELAY_DATABASE_URL": dsn, "RELAY_LOG_FORMAT": spelling})
    # 2, as for --log-format's own typo: a script that retries on 1 (a database away) retried this for good.
    assert result.exit_code == 2, result.output
    assert f"RELAY_LOG_FORMAT must be text or json, got {spelling!r}" in result.output
    assert "schema" not in result.output, "the command ran anyway"


@pytest.mark.parametrize("given", [{"RELAY_LOG_FORMAT": "JSON"}, {"flag": "JSON"}])
def test_log_format_is_read_in_any_case(dsn: str, given: dict[str, str]) -> None:
    """The variable was read in any case and the flag in lower case only: JSON there was a usage error."""
    flag = ["--log-format", given["flag"]] if "flag" in given else []
    env = {"RELAY_DATABASE_URL": dsn, **{k: v for k, v in given.items() if k != "flag"}}
    result = CliRunner().invoke(main, [*flag, "migrate"], env=env)
    assert result.exit_code == 0, result.output
    assert isinstance(logging.getLogger("relay").handlers[0].formatter, logs.JsonFormatter)


@pytest.mark.parametrize(
    ("service_file", "said"),
    [(None, 'definition of service "relay_no_such_service" not found'), ("/nonexistent", "/nonexistent")],
)
def test_a_connection_service_no_file_defines_is_a_setting_relay_enqueue_refuses(
    dsn: str, db: psycopg.Connection, service_file: str | None, said: str
) -> None:
    """libpq calls it a bad connection, as it does a bad sslmode (exit 2); it exited 1, an outage to retry.
    So is a PGSERVICEFILE that is not there."""
    missing = conninfo.make_conninfo(dsn, service="relay_no_such_service")
    env = {"RELAY_DATABASE_URL": missing, **({"PGSERVICEFILE": service_file} if service_file else {})}
    result = CliRunner().invoke(main, ["enqueue", "t", "{}"], env=env, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert said in result.output and "not found" in result.output
    assert job_count(db) == 0


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("postgresql://relay:Xk9%zzQpw4@127.0.0.1:1/relay", "percent-encod"),
        # libpq ends the password at its first "@": "zzQpw4@127.0.0.1" became the host, logged on every try.
        ("postgresql://relay:Xk9@zzQpw4@127.0.0.1:1/relay", "%40"),
    ],
    ids=["percent", "at sign"],
)
def test_a_worker_with_an_unreadable_database_url_stops_at_once_without_logging_the_password(
    python: str, worker_env: dict, url: str, hint: str
) -> None:
    """libpq quotes the token it cannot read, and a worker's pool logged that on every connection attempt."""
    env = dict(worker_env, DATABASE_URL=url)
    env.pop("RELAY_DATABASE_URL")
    command = [python, "-m", "relay_core", "worker", "--app", "tests.apps.worker_app:relay"]
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        raise AssertionError(f"the worker kept running: {output[-600:]}") from None
    assert done.returncode == 1, done.stderr
    assert "DATABASE_URL" in done.stderr and hint in done.stderr, done.stderr
    assert "zzQpw4" not in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize(
    "payload",
    ['{"n": 1' + "0" * 5000 + "}", "[" * 3000 + "]" * 3000],
    ids=["an integer of 5,001 digits", "nested 3,000 deep"],
)
def test_requeue_takes_a_dead_job_whose_payload_python_json_cannot_read(
    dsn: str, db: psycopg.Connection, payload: str
) -> None:
    """The job a worker turns dead because its payload cannot be read as JSON is the one an operator
    requeues; the command read the job back with Python's own JSON reader, printed a traceback
    (ValueError, RecursionError) and rolled the requeue back."""
    job_id = db.execute(
        "INSERT INTO relay.jobs (type, payload, status, finished_at) "
        "VALUES ('t', %s::jsonb, 'dead', now()) RETURNING id",
        (payload,),
    ).fetchone()[0]
    result = CliRunner().invoke(main, ["requeue", str(job_id)], env={"RELAY_DATABASE_URL": dsn})
    assert result.exit_code == 0, result.output
    assert db.execute("SELECT status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == "queued"


def test_a_database_behind_this_release_is_told_to_migrate_not_shown_the_missing_function(
    dsn: str, db: psycopg.Connection
) -> None:
    """A function a later migration adds was missing: "the database refused: function
    relay.published_max_attempts(unknown, smallint) does not exist"."""
    db.execute("ALTER FUNCTION relay.published_max_attempts(text, integer) RENAME TO published_max_attempts_gone")
    try:
        result = CliRunner().invoke(main, ["enqueue", "t", "{}"], env={"RELAY_DATABASE_URL": dsn})
    finally:
        db.execute("ALTER FUNCTION relay.published_max_attempts_gone(text, integer) RENAME TO published_max_attempts")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: Relay's tables are missing or older than this release: run `relay migrate` first"
    ]
    assert job_count(db) == 0


def test_relay_version_names_the_release_and_the_newest_migration_it_ships() -> None:
    """What an operator compares with a database's relay.schema_migrations before a rollback."""
    result = CliRunner().invoke(main, ["--version"], env={"RELAY_DATABASE_URL": None, "DATABASE_URL": None})
    newest = sorted((ROOT / "relay_core" / "migrations").glob("*.sql"))[-1].stem
    assert result.exit_code == 0, result.output
    assert result.output == f"relay {importlib.metadata.version('relay-queue')} (migrations up to {newest})\n"


def test_recount_says_which_counts_were_wrong_and_puts_them_right(dsn: str, db: psycopg.Connection) -> None:
    def recount() -> Result:
        return CliRunner().invoke(main, ["recount"], env={"RELAY_DATABASE_URL": dsn}, catch_exceptions=False)

    assert (recount().exit_code, recount().output) == (0, "the counts matched the jobs table\n")
    db.execute("SET session_replication_role = replica")  # writes the counting triggers do not see
    db.execute("INSERT INTO relay.jobs (type, queue) VALUES ('t', 'restored'), ('t', 'restored')")
    db.execute("RESET session_replication_role")
    first = recount()
    assert (first.exit_code, first.output) == (0, "restored queued: counted 0, now 2\n")
    assert recount().output == "the counts matched the jobs table\n"
