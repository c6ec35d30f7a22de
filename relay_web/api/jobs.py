"""``/api/admin/jobs``: list, read, enqueue, requeue and cancel jobs, one or many.

Every read and write goes through relay_core (``admin`` for one job,
``monitor`` for many, ``Relay.enqueue`` to add one); no job SQL lives here.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from flask import Blueprint, url_for
from werkzeug.routing import BaseConverter

from relay_core import JobDetail, admin, monitor

from ..db import connection, get_database
from ..endpoint import Reply, endpoint
from ..problems import Problem
from ..records.jobs import (
    BulkResultRecord,
    CancelFilter,
    EnqueueBody,
    IdempotencyHeaders,
    JobListQuery,
    JobPageRecord,
    JobPath,
    JobRecord,
    JobSummaryRecord,
    RequeueFilter,
    RequeueQuery,
)

bp = Blueprint("jobs", __name__, url_prefix="/admin")


class JobIdSegment(BaseConverter):
    """A job id in a URL: any segment but the bulk actions' names.

    So ``/jobs/requeue`` is never also read as "job 'requeue'" (which would
    advertise GET in its Allow header). The value itself is checked by
    :class:`JobPath`, so ``/jobs/abc`` answers 422 naming the field, not 404.
    """

    regex = r"(?!(?:requeue|cancel)$)[^/]+"


bp.record_once(lambda state: state.app.url_map.converters.setdefault("job_id", JobIdSegment))


def _jsonb_number(value: float) -> float | int:
    # jsonb keeps a number's decimal digits, not its Python type: 1.5e+25 is
    # stored as 15000000000000000000000000 and read back as an int, and
    # numeric has no negative zero.
    digits = Decimal(repr(value))
    exponent = digits.as_tuple().exponent
    if isinstance(exponent, int) and exponent >= 0:
        return int(digits)
    return value if value != 0 else 0.0


def _as_stored(payload: Any) -> str:
    """A payload as jsonb keeps it, written canonically, so equal JSON documents compare equal.

    Comparing the Python values instead would call ``true`` and ``1``, or
    ``1.0`` and ``1``, the same payload, though a handler receives each differently.
    """

    def stored(value: Any) -> Any:
        if isinstance(value, float):
            return _jsonb_number(value)
        if isinstance(value, list):
            return [stored(item) for item in value]
        if isinstance(value, dict):
            return {key: stored(item) for key, item in value.items()}
        return value

    return json.dumps(stored(payload), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@bp.get("/jobs")
@endpoint(tag="jobs", role="viewer", query=JobListQuery, responses={200: JobPageRecord})
def list_jobs(query: JobListQuery, claims: dict[str, Any]) -> JobPageRecord:
    """List jobs, newest first, filtered by status, queue, type or a search in type and error text.

    Keyset-paginated: follow ``next_cursor`` until it is null. A page stays
    stable while new jobs arrive.
    """
    where = monitor.JobFilter(status=query.status, queue=query.queue, type=query.type, q=query.q)
    before = int(query.cursor) if query.cursor else None
    with connection() as conn:
        page = monitor.list_jobs(conn, where, limit=query.limit, before=before)
    return JobPageRecord(
        jobs=[JobSummaryRecord.of(job) for job in page.jobs],
        limit=query.limit,
        next_cursor=str(page.next_before) if page.next_before else None,
    )


@bp.get("/jobs/<job_id:job_id>")
@endpoint(tag="jobs", role="viewer", path=JobPath, responses={200: JobRecord}, problems=(404,))
def get_job(path: JobPath, claims: dict[str, Any]) -> JobRecord:
    """One job with its payload, attempts, lease, worker, timings and full error history."""
    with connection() as conn:
        return JobRecord.of(admin.get_job(conn, path.job_id))


@bp.post("/jobs/<job_id:job_id>/requeue")
@endpoint(tag="jobs", role="admin", path=JobPath, query=RequeueQuery, responses={200: JobRecord}, problems=(404, 409))
def requeue_job(path: JobPath, query: RequeueQuery, claims: dict[str, Any]) -> JobRecord:
    """Run a dead or cancelled job again now, with fresh attempts; its error history is kept.

    Any other state answers 409 with the job's current state, and so does a
    job claimed since the ``seen_lease_token`` given.
    """
    with connection() as conn:
        return JobRecord.of(admin.requeue(conn, path.job_id, seen_lease_token=query.seen_lease_token))


@bp.post("/jobs/<job_id:job_id>/cancel")
@endpoint(tag="jobs", role="admin", path=JobPath, responses={200: JobRecord}, problems=(404, 409))
def cancel_job(path: JobPath, claims: dict[str, Any]) -> JobRecord:
    """Cancel a job: a queued one never runs; a running one is asked to stop.

    A claimed job stays claimed, with ``cancel_requested_at`` set, until its
    worker sees the request at a heartbeat and the handler stops. A finished
    job answers 409 with its current state.
    """
    with connection() as conn:
        return JobRecord.of(admin.cancel(conn, path.job_id))


@bp.post("/jobs")
@endpoint(
    tag="jobs",
    role="admin",
    headers=IdempotencyHeaders,
    body=EnqueueBody,
    responses={201: JobRecord, 200: JobRecord},
    problems=(409,),
    response_headers={201: {"Location": "The URL of the new job."}, 200: {"Location": "The URL of the job."}},
)
def enqueue(headers: IdempotencyHeaders, body: EnqueueBody, claims: dict[str, Any]) -> Reply:
    """Enqueue a job. 201 when it is new; with an Idempotency-Key already used, 200 and the first job.

    Reusing a key for a different job (another type, queue, priority or
    payload, a max_attempts it gives that the first job does not have, or a
    run_at it gives while the first job has never been claimed) answers 409
    and changes nothing.
    """
    key = headers.idempotency_key
    with connection() as conn:
        job_id = get_database().relay.enqueue(
            body.type,
            body.payload,
            conn=conn,
            run_at=body.run_at,
            priority=body.priority,
            queue=body.queue,
            idempotency_key=key,
            max_attempts=body.max_attempts,
        )
        created = monitor.created_in_this_transaction(conn, job_id)
        job = admin.get_job(conn, job_id)
    if not created and _asks_for_another_job(job, body):
        raise Problem(
            409,
            "Idempotency key reused",
            f"Idempotency-Key {key!r} already enqueued job {job.id} with other values; use a new key.",
            slug="idempotency-key-reused",
            job_id=job.id,
        )
    location = url_for(".get_job", job_id=job.id)
    return Reply(JobRecord.of(job), 201 if created else 200, {"Location": location})


def _asks_for_another_job(job: JobDetail, body: EnqueueBody) -> bool:
    """Whether a request repeating an Idempotency-Key describes another job than the key's.

    ``max_attempts`` and ``run_at`` count when the request gives them: one
    asking for a job in 2031 was answered with the key's job that runs now.
    ``run_at`` only while the job was never claimed (its lease token, which
    no requeue resets, is still 0), queued or cancelled before it ran: a
    retry moves it on, and a client repeating its request after that asks
    for the same job. A job an admin cancelled before it ever ran and then
    requeued cannot be told apart, and a repeat giving the original
    ``run_at`` is answered 409 with the job's id.
    """
    if (job.type, job.queue, job.priority, _as_stored(job.payload)) != (
        body.type,
        body.queue,
        body.priority,
        _as_stored(body.payload),
    ):
        return True
    if body.max_attempts is not None and body.max_attempts != job.max_attempts:
        return True
    never_claimed = job.lease_token == 0
    return body.run_at is not None and never_claimed and body.run_at != job.run_at


@bp.post("/jobs/requeue")
@endpoint(tag="jobs", role="admin", body=RequeueFilter, responses={200: BulkResultRecord})
def requeue_many(body: RequeueFilter, claims: dict[str, Any]) -> BulkResultRecord:
    """Requeue every dead or cancelled job matching the filters (e.g. every dead send_email job).

    An empty object means every dead and cancelled job. Jobs that die while
    the request runs are left alone. Answers how many jobs changed.
    """
    where = monitor.JobFilter(status=body.status, queue=body.queue, type=body.type, q=body.q)
    with connection() as conn:
        changed = monitor.requeue_matching(conn, where)
    return BulkResultRecord(action="requeue", changed=changed)


@bp.post("/jobs/cancel")
@endpoint(tag="jobs", role="admin", body=CancelFilter, responses={200: BulkResultRecord})
def cancel_many(body: CancelFilter, claims: dict[str, Any]) -> BulkResultRecord:
    """Cancel every queued job matching the filters (e.g. everything queued in one queue).

    An empty object means every queued job, in every queue. Jobs enqueued
    while the request runs are left alone (one enqueued in a transaction
    still open as it begins may be included: see docs/api.md). Answers how
    many jobs changed.
    """
    where = monitor.JobFilter(queue=body.queue, type=body.type, q=body.q)
    with connection() as conn:
        changed = monitor.cancel_matching(conn, where)
    return BulkResultRecord(action="cancel", changed=changed)
