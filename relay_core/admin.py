"""Reads and admin actions on single jobs, guarded by the state machine; paused queues, schedules and limits.

Requeue and cancel lock the job's row, decide from the state they read
(refusing with the state the job was really in: missing, or in the wrong
state), then write, all in one transaction: a worker's write in flight has
either committed before the lock or waits for the action.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from .errors import ChangedSince, IllegalTransition, JobNotFound, RelayError
from .queries import sql
from .timestamps import read_any_timestamp
from .validation import check_queue


@dataclass(frozen=True)
class JobDetail:
    """Everything Relay knows about one job."""

    id: int
    type: str
    queue: str
    priority: int
    payload: Any
    status: str
    attempts: int
    max_attempts: int
    run_at: datetime
    lease_token: int
    claimed_by: str | None
    claimed_until: datetime | None
    idempotency_key: str | None
    last_error: str | None
    errors: list[dict[str, Any]]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None = None
    progress: Any = None
    result: Any = None


def get_job(conn: psycopg.Connection, job_id: int) -> JobDetail:
    """Load one job; raise :class:`JobNotFound` if there is none.

    A job a program wrote with SQL may hold times no datetime holds (read as
    the nearest one that does, see ``relay_core.timestamps``) and an error
    history that is not an array (read as an array of that one value).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        read_any_timestamp(cur)
        row = cur.execute(sql("job_get"), {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFound(job_id)
    errors = row["errors"]
    row["errors"] = errors if isinstance(errors, list) else [] if errors is None else [errors]
    return JobDetail(**row)


def _locked_status(conn: psycopg.Connection, job_id: int) -> tuple[str, bool, int]:
    """The job's status, whether a stop was asked of it and its lease token, its row locked until the transaction ends.

    An admin action decides from this: a worker's write that was in flight has
    committed (and is what it reads) or waits for the action, so the refusal of
    an action names the state the job really was in when the action ran.
    """
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(sql("job_lock_for_action"), {"id": job_id}).fetchone()
    if row is None:
        raise JobNotFound(job_id)
    return row[0], row[1], row[2]


def _act(
    conn: psycopg.Connection,
    job_id: int,
    statement: str,
    action: str,
    allowed_from: tuple[str, ...],
    seen_lease_token: int | None = None,
) -> JobDetail:
    with conn.transaction():
        status, _, lease_token = _locked_status(conn, job_id)
        if status not in allowed_from:
            raise IllegalTransition(job_id, status, action, allowed_from)
        if seen_lease_token is not None and lease_token != seen_lease_token:
            raise ChangedSince(job_id, status, action, allowed_from)
        conn.execute(sql(statement), {"id": job_id}).fetchall()
        return get_job(conn, job_id)


def requeue(conn: psycopg.Connection, job_id: int, *, seen_lease_token: int | None = None) -> JobDetail:
    """dead or cancelled -> queued, runnable now, attempts reset, history kept.

    ``seen_lease_token``, the job's lease token as the person asking was
    shown it, makes a job claimed since (requeued by someone else meanwhile,
    run, and ended again) a :class:`ChangedSince`: every claim changes the
    token, and a second press of Requeue must not run the job once more.
    """
    return _act(conn, job_id, "job_requeue", "requeue", ("dead", "cancelled"), seen_lease_token)


def cancel(conn: psycopg.Connection, job_id: int, *, seen: str | None = None) -> JobDetail:
    """queued -> cancelled; for a claimed job, ask its handler to stop.

    The running job stays ``claimed`` until its worker sees the request at a
    heartbeat and the handler stops; then it becomes ``cancelled``. Asking
    again while the request is pending (a second press, a retried request)
    changes nothing and answers like the first: the stop is on its way.

    ``seen``, the state the person asking was shown (``queued``: "it will not
    run"; ``claimed``: "ask it to stop"), makes a job that has moved on since
    an IllegalTransition: a cancel confirmed for a job that had not started
    must not interrupt it once it has.
    """
    if seen not in (None, "queued", "claimed"):
        raise RelayError(f"seen must be queued or claimed, not {seen!r}")
    with conn.transaction():
        status, cancel_requested, _ = _locked_status(conn, job_id)
        if seen is not None and status != seen:
            raise IllegalTransition(job_id, status, "cancel", (seen,))
        if status == "queued":
            conn.execute(sql("job_cancel"), {"id": job_id}).fetchall()
        elif status == "claimed" and not cancel_requested:
            conn.execute(sql("job_request_cancel"), {"id": job_id}).fetchall()
        elif status != "claimed":
            raise IllegalTransition(job_id, status, "cancel", ("queued", "claimed"))
        return get_job(conn, job_id)


def set_queue_paused(conn: psycopg.Connection, queue: str, paused: bool) -> None:
    """Pause or resume a queue; workers honour it at their next claim."""
    check_queue(queue)
    conn.execute(sql("queue_set_paused"), {"name": queue, "paused": paused})
    conn.commit()


def paused_queues_holding_dead(conn: psycopg.Connection, job_type: str) -> list[str]:
    """The paused queues that hold dead jobs of ``job_type``."""
    return [row[0] for row in conn.execute(sql("queue_paused_holding_dead"), {"type": job_type}).fetchall()]


def paused_queues(conn: psycopg.Connection) -> list[str]:
    """The queues paused now."""
    return [row[0] for row in conn.execute(sql("queue_paused_list")).fetchall()]


def schedules(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Periodic schedules with their next tick and their last run.

    The last run is ``last_enqueued_tick`` with its job (``last_job_id``, and
    ``last_job_status`` while the job row exists); ``last_tick`` is only the
    newest tick claimed, which may have been skipped as missed or be the tick
    before the schedule was registered. ``runs_recorded_since`` is set on a
    schedule older than Relay's record of runs with no job left to read one from.
    """
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql("schedule_list")).fetchall()


def type_limits(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Per-type concurrency and rate limits, with the jobs of each type running now."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql("type_limit_list")).fetchall()
