"""Error handlers: every failure, expected or not, leaves as a problem.

HTTP errors keep their status; Relay's own errors map to the status that
says what went wrong; a database that cannot be reached is a 503 the client
may retry; anything else is a 500 whose details go to the log, never to the
client.
"""

from __future__ import annotations

import logging

import psycopg
from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from relay_core import BulkActionStopped, IllegalTransition, InvalidJobError, JobNotFound, RelayError, monitor
from relay_core.outages import RETRYABLE

from .db import get_database
from .health import missing_schema_problem
from .problems import Problem

log = logging.getLogger("relay.web")

#: Details for the HTTP errors werkzeug raises, in words a client can act on.
HTTP_DETAILS = {
    400: "The request could not be read (is the body valid JSON?).",
    404: "There is nothing at this URL.",
    405: "This URL does not accept this method.",
    406: "This URL cannot answer in a format the request accepts.",
    413: "The request body is too large.",
    415: "Send the body as application/json.",
}


def http_problem(exc: HTTPException) -> Response:
    """An HTTP error werkzeug raised, as a problem."""
    status = exc.code or 500
    detail = HTTP_DETAILS.get(status, exc.description or "")
    headers = {}
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
        headers["Allow"] = ", ".join(sorted(exc.valid_methods))
    return Problem(status, exc.name, detail, headers=headers).response()


def _problem(exc: Problem) -> Response:
    return exc.response()


def _not_found(exc: JobNotFound) -> Response:
    return Problem(404, "Job not found", f"There is no job {exc.job_id}.", slug="job-not-found").response()


def transition_detail(exc: IllegalTransition) -> str:
    """The sentence the API and the dashboard give for an action the job's state does not allow."""
    return f"Job {exc.job_id} is {exc.current}; {exc.rule}."


#: The endpoints that take filters (status or state, queue, type), and whose rows narrower ones would cut.
FILTERED_ENDPOINTS = frozenset(
    {"api.jobs.list_jobs", "api.jobs.requeue_many", "api.jobs.cancel_many", "dashboard.jobs"}
)


def timed_out_detail(filters: str) -> str:
    """What to do about a statement the statement timeout ended, for the API and the dashboard.

    Listings and bulk actions read many rows: narrower filters help. An
    action on one job or one queue reads one row: it ran out of time waiting
    for a lock another transaction holds. Anything else (/readyz, /metrics,
    the overview) takes no filters either: a lock or a busy server held it.
    """
    if request.endpoint in FILTERED_ENDPOINTS:
        return f"The database gave up on this query; narrow the filters ({filters}) and try again."
    if request.view_args and ({"job_id", "queue"} & set(request.view_args)):
        return "The database gave up waiting: another transaction holds what this needs. Try again shortly."
    return "The database gave up on this query: a lock another transaction holds, or a busy server. Try again shortly."


def _illegal(exc: IllegalTransition) -> Response:
    return Problem(
        409,
        "Illegal transition",
        transition_detail(exc),
        slug="illegal-transition",
        job_id=exc.job_id,
        current_status=exc.current,
        allowed_from=list(exc.allowed_from),
    ).response()


def _invalid_job(exc: InvalidJobError) -> Response:
    field = exc.field.split(".")[-1]
    return Problem(
        422,
        "Invalid request",
        f"Fix these fields and try again: {field}.",
        slug="validation",
        errors=[{"field": field, "in": "body", "detail": exc.message}],
    ).response()


def _unavailable(exc: Exception) -> Response:
    get_database().unavailable(request.path, exc)
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        detail = "The database refuses writes right now (read-only: a failover under way?); try again shortly."
    else:
        detail = "The database cannot be reached right now; try again shortly."
    return Problem(
        503,
        "Service unavailable",
        detail,
        slug="unavailable",
        headers={"Retry-After": "5"},
    ).response()


def _too_slow(exc: psycopg.errors.QueryCanceled) -> Response:
    log.warning("admin query cancelled by statement_timeout: %s", exc)
    return Problem(
        503,
        "Query took too long",
        timed_out_detail("status, queue, type"),
        slug="query-timeout",
        headers={"Retry-After": "1"},
    ).response()


def _bulk_stopped(exc: BulkActionStopped) -> Response:
    """Some batches of a bulk action committed before the database failed: say how many jobs changed."""
    log.warning("bulk %s stopped after %d job(s): %s", exc.action, exc.changed, exc.__cause__)
    if isinstance(exc.__cause__, psycopg.errors.QueryCanceled):
        why = "then the database gave up on a query (the statement timeout)"
    else:
        why = "then a database error stopped it (this app's log names it)"
    return Problem(
        503,
        "Stopped part way",
        f"{exc.changed} matching job(s) were {exc.done}; {why}, and the rest are unchanged. "
        "Send the same request again to go on, or narrow the filters.",
        slug="bulk-incomplete",
        headers={"Retry-After": "1"},
        action=exc.action,
        changed=exc.changed,
    ).response()


def _missing_schema(exc: psycopg.Error) -> Response:
    """A table, column or function this release needs is missing: 503 until ``relay migrate`` runs."""
    pending = missing_schema_problem(exc)
    return pending.response() if pending else _internal(exc)


def _relay_error(exc: RelayError) -> Response:
    if isinstance(exc.__cause__, monitor.MISSING_SCHEMA_ERRORS):
        # Relay's own calls (an enqueue) say a missing schema as ConfigurationError, from the server's error.
        return _missing_schema(exc.__cause__)
    log.error("unexpected Relay error", exc_info=exc)
    return _internal(exc)


def _internal(exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    return Problem(
        500, "Internal server error", "Something went wrong on our side; it has been logged.", slug="internal"
    ).response()


def register(app: Flask) -> None:
    """Install the handlers on ``app`` (most specific class wins)."""
    app.register_error_handler(HTTPException, http_problem)
    app.register_error_handler(Problem, _problem)
    app.register_error_handler(JobNotFound, _not_found)
    app.register_error_handler(IllegalTransition, _illegal)
    app.register_error_handler(InvalidJobError, _invalid_job)
    app.register_error_handler(BulkActionStopped, _bulk_stopped)
    app.register_error_handler(RelayError, _relay_error)
    app.register_error_handler(psycopg.errors.QueryCanceled, _too_slow)
    for missing in monitor.MISSING_SCHEMA_ERRORS:
        app.register_error_handler(missing, _missing_schema)
    for unavailable in RETRYABLE:  # the database away, or refusing writes for now
        app.register_error_handler(unavailable, _unavailable)
    app.register_error_handler(Exception, _internal)
