"""``relay enqueue``: a job from the command line, and a clear refusal of bad input that writes nothing."""

from __future__ import annotations

import psycopg
import pytest
from click.testing import CliRunner, Result

from relay_core.cli import main


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


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("[1, " + "7" * 5000 + "]", "longer than"),
        ('{"n": ' + "9" * 4301 + "}", "longer than"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{not json", "not valid JSON"),
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
    assert result.exit_code == 1, result.output
    assert "refused: run_at:" in result.output and "9999" in result.output
    assert job_count(db) == 0
