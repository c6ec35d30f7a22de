"""Put jobs in a state for a test without running a worker (setup only, never under test)."""

from __future__ import annotations

import json

import psycopg


def make_dead(db: psycopg.Connection, job_id: int, message: str = "boom", attempts: int = 1) -> None:
    """The job failed ``attempts`` times and is dead, with an error history."""
    history = [
        {"attempt": n, "at": "2030-01-01T00:00:00+00:00", "worker": "w1", "type": "ValueError", "message": message}
        for n in range(1, attempts + 1)
    ]
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', claimed_by = 'w1', claimed_until = now() + interval '1 minute', "
        "attempts = %s, started_at = now() WHERE id = %s",
        (attempts, job_id),
    )
    db.execute(
        "UPDATE relay.jobs SET status = 'dead', claimed_until = NULL, finished_at = now(), last_error = %s, "
        "errors = %s::jsonb WHERE id = %s",
        (message, json.dumps(history), job_id),
    )


def make_claimed(db: psycopg.Connection, job_id: int, worker: str = "w1") -> None:
    """A worker holds the job's lease."""
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', claimed_by = %s, claimed_until = now() + interval '1 minute', "
        "attempts = attempts + 1, lease_token = lease_token + 1, started_at = now() WHERE id = %s",
        (worker, job_id),
    )


def make_succeeded(db: psycopg.Connection, job_id: int) -> None:
    """The job ran and succeeded."""
    make_claimed(db, job_id)
    db.execute(
        "UPDATE relay.jobs SET status = 'succeeded', claimed_until = NULL, finished_at = now() WHERE id = %s",
        (job_id,),
    )
