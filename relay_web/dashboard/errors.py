"""Errors on dashboard routes become readable pages (or partials), not JSON.

The API's handlers answer problem+json; a person on a phone needs a sentence
and a way back. The same rule holds: no stack trace, no SQL, no class name
reaches the page. Handlers registered on the blueprint win over the app's
for requests routed to it.
"""

from __future__ import annotations

import logging

import psycopg
from flask import Response, request, url_for
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound

from relay_core import IllegalTransition, JobNotFound, RelayError, monitor
from relay_core.outages import RETRYABLE

from ..db import get_database
from ..errors import FILTERED_ENDPOINTS, http_problem, timed_out_detail, transition_detail
from ..health import missing_schema_problem
from ..problems import Problem
from .blueprint import bp, page_headers
from .render import is_htmx, page
from .session import return_path

log = logging.getLogger("relay.web")

#: Seconds between the retries of a page or fragment that could not reach the database.
RETRY_SECONDS = 5
#: Sent by a polling fragment whose answer replaces it (hx-swap="outerHTML": a job's status card, and
#: the error in its place): the error must poll on by itself. A part polled by a wrapper that stays
#: (the overview, queues, workers) is polled again by that wrapper: polling in the error too made two
#: requests where one was due, each holding a thread and a connection through a statement timeout.
REPLACES_POLLER_HEADER = "Relay-Poll-Replaced"


def error_page(
    status: int, title: str, detail: str, headers: dict[str, str] | None = None, *, retry: bool = False
) -> Response:
    """An error page with ``status``; an htmx request gets its partial.

    With ``retry``, a GET tries again by itself: a page reloads, and a fragment
    that replaced its poller (a job's status card: REPLACES_POLLER_HEADER)
    polls its own URL until it is answered. A POST is never repeated.
    """
    polls_again = not is_htmx() or request.headers.get(REPLACES_POLLER_HEADER) == "true"
    retry_url = request.full_path.rstrip("?") if retry and request.method == "GET" and polls_again else None
    response = page(
        "error",
        # A refused CSRF token: the page that sent it is stale, and reloading it gives a good one.
        reload_url=(return_path() or url_for("dashboard.overview")) if status == 403 else None,
        status=status,
        title=title,
        detail=detail,
        status_code=status,
        retry_url=retry_url,
        retry_seconds=RETRY_SECONDS,
        fragment=is_htmx(),
        action_answer=is_htmx() and request.method == "POST",
    )
    for name, value in (headers or {}).items():
        if name != "WWW-Authenticate":
            response.headers[name] = value
    return response


@bp.errorhandler(Problem)
def _problem(exc: Problem) -> Response:
    return error_page(exc.status, exc.title, exc.detail, exc.headers)


@bp.errorhandler(JobNotFound)
def _not_found(exc: JobNotFound) -> Response:
    return error_page(404, "Job not found", f"There is no job {exc.job_id}; it may have been pruned.")


@bp.errorhandler(IllegalTransition)
def _illegal(exc: IllegalTransition) -> Response:
    return error_page(409, "Not possible now", transition_detail(exc))


@bp.errorhandler(RelayError)
def _relay(exc: RelayError) -> Response:
    # relay_core's messages name the bad filter or value, never internals.
    return error_page(400, "Bad request", str(exc))


#: What a page says about an address that exists but only takes a form's button press.
BUTTON_ONLY = (
    "This address acts when a button on a dashboard page is pressed; opening it does nothing. "
    "Go back and use the button."
)


@bp.errorhandler(HTTPException)
def _http(exc: HTTPException) -> Response:
    status = exc.code or 500
    if status == 404:
        return error_page(status, exc.name, "No such page.")
    if isinstance(exc, MethodNotAllowed) and request.method == "GET":
        allowed = {name: value for name, value in exc.get_headers() if name == "Allow"}
        return error_page(status, exc.name, BUTTON_ONLY, allowed)
    return error_page(status, exc.name, "Nothing here accepts this request.")


#: Where machines call: an unknown URL under these stays problem+json whoever asks.
MACHINE_PATHS = ("/api/", "/metrics", "/healthz", "/readyz", "/static/")


@bp.app_errorhandler(NotFound)
@bp.app_errorhandler(MethodNotAllowed)
def _no_such_page(exc: NotFound | MethodNotAllowed) -> Response:
    """A mistyped or stale dashboard link opened in a browser gets a page with a way back, not JSON.

    So does an address typed by hand that only takes a button press (``/logout``,
    a job's ``/requeue``): routing refuses it before any view, so the
    dashboard's own handlers never see it. Only a request that prefers HTML (a
    browser's Accept header) outside the machines' paths; curl, scripts and
    every API URL still get problem+json.
    """
    preferred = request.accept_mimetypes.best_match(["application/problem+json", "application/json", "text/html"])
    # A dashboard view's own 404 (a job id out of range) is a page whoever asks.
    if request.blueprint == bp.name or (preferred == "text/html" and not request.path.startswith(MACHINE_PATHS)):
        # Outside the dashboard's routes its after_request never runs: the page gets its headers here.
        return page_headers(_http(exc))
    return http_problem(exc)


@bp.errorhandler(psycopg.errors.QueryCanceled)
def _too_slow(exc: psycopg.errors.QueryCanceled) -> Response:
    """A statement the statement timeout ended: a page or fragment tries again as in an outage, but a
    filtered listing, which would be as slow the next time, asks for narrower filters instead.

    Polled status cards are replaced by the answer: without a retry of its own, the card of
    a job an engineer just requeued stopped updating at the first lock that outlasted the timeout.
    """
    log.warning("dashboard query cancelled by statement_timeout: %s", exc)
    detail = timed_out_detail("state, queue, type")
    if request.endpoint in FILTERED_ENDPOINTS:
        return error_page(503, "Query took too long", detail, {"Retry-After": "1"})
    if request.method == "GET":
        detail = f"{detail.removesuffix(' Try again shortly.')} This page tries again every {RETRY_SECONDS} seconds."
    return error_page(503, "Query took too long", detail, {"Retry-After": str(RETRY_SECONDS)}, retry=True)


#: What a dashboard request meets when the database cannot be reached (PoolTimeout: no connection came in
#: time), or refuses writes for now (read-only, as during a failover).
UNREACHABLE = RETRYABLE


def _unavailable(exc: Exception) -> Response:
    get_database().unavailable(request.path, exc)
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        title, state = "Database refuses writes", "The database refuses writes right now (read-only: a failover?)"
    else:
        title, state = "Database unreachable", "The database cannot be reached right now"
    if request.method == "GET":
        detail = f"{state}; this page tries again every {RETRY_SECONDS} seconds."
    else:
        detail = f"{state}; reload the page in a moment and try again."
    return error_page(503, title, detail, {"Retry-After": str(RETRY_SECONDS)}, retry=True)


for _unreachable in UNREACHABLE:
    bp.register_error_handler(_unreachable, _unavailable)


def _missing_schema(exc: psycopg.Error) -> Response:
    """A table this release needs is missing: say what to do (``missing_schema_problem``); retry as an outage does."""
    pending = missing_schema_problem(exc)
    if pending is None:
        return _internal(exc)
    return error_page(pending.status, pending.title, pending.detail, pending.headers, retry=True)


for _missing in monitor.MISSING_SCHEMA_ERRORS:
    bp.register_error_handler(_missing, _missing_schema)


@bp.errorhandler(Exception)
def _internal(exc: Exception) -> Response:
    log.error("unhandled dashboard error", exc_info=exc)
    return error_page(500, "Something went wrong", "It has been logged. Reload the page to try again.")
