"""The jobs list (filters in the URL, keyset pages) and one job's page with its actions.

Filters live in the query string, so "dead send_email jobs" is a link that
can be pasted into a chat. A job's page offers only the actions its state
allows, confirms each, and swaps the answer into place; while the job is
queued or running its status card polls itself, so a requeued job is seen
running and then succeeding without a reload.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flask import Response, abort, request

from relay_core import ChangedSince, IllegalTransition, JobDetail, JobStatus, RelayError, admin, monitor
from relay_core.validation import BIGINT_MAX, positive_number

from ..db import connection
from ..records.common import parse_moment
from . import formatting
from .blueprint import bp
from .render import answer_plain_form, is_htmx, kept_notice, page
from .session import require

#: Jobs per page of the list.
PAGE_SIZE = 50
#: Seconds between refreshes of a queued or running job's status card.
JOB_REFRESH_SECONDS = 2
#: The answer to a stop request (a cancel of a running job).
STOP_REQUESTED = "Stop requested: the worker stops the job at its next heartbeat."
#: The filters a jobs URL may carry, in the order the form shows them.
FILTERS = ("state", "queue", "type", "q")
#: Statuses in the order a person triages them.
STATES = ("dead", "queued", "claimed", "cancelled", "succeeded")
#: The event a status card raises when the job's state changed, so the rest of the page reloads its part.
CHANGED_EVENT = "relay-job-changed"


@dataclass(frozen=True)
class Attempt:
    """One failed attempt from a job's error history, whatever shape the stored entry has."""

    attempt: int | None
    at: datetime | None
    worker: str | None
    type: str | None
    message: str
    traceback: str | None

    @classmethod
    def of(cls, entry: Any) -> Attempt:
        """Read a stored history entry; odd values are shown as text, never trusted as markup."""
        if not isinstance(entry, dict):
            return cls(None, None, None, None, formatting.as_text(entry), None)
        number = entry.get("attempt")

        def text(key: str) -> str | None:
            value = entry.get(key)
            return None if value is None else formatting.as_text(value)

        return cls(
            attempt=number if isinstance(number, int) and not isinstance(number, bool) else None,
            at=parse_moment(entry.get("at")),
            worker=text("worker"),
            type=text("type"),
            message=text("message") or "",
            traceback=text("traceback"),
        )


def actions(job: JobDetail) -> list[str]:
    """The actions the state machine allows on ``job`` now."""
    if job.status in (JobStatus.DEAD, JobStatus.CANCELLED):
        return ["requeue"]
    if job.status == JobStatus.QUEUED:
        return ["cancel"]
    if job.status == JobStatus.CLAIMED and job.cancel_requested_at is None:
        return ["stop"]
    return []


def _filters() -> dict[str, str]:
    """The non-empty filters of the request: the search text trimmed, the rest exactly as given.

    A job type may end in a space (the API takes ``"mail "``), and the dead
    view links to its jobs by type: trimmed, the link listed ``mail``'s jobs.
    """
    found = {}
    for name in FILTERS:
        value = request.args.get(name, "")
        if name == "q":
            value = value.strip()
        if value:
            found[name] = value
    return found


def _job_filter(filters: dict[str, str]) -> monitor.JobFilter:
    return monitor.JobFilter(
        status=filters.get("state"), queue=filters.get("queue"), type=filters.get("type"), q=filters.get("q")
    )


def _each_given_once() -> None:
    """Refuse a filter or cursor given twice: the list showed the first and named neither (the API refuses it too)."""
    for name in (*FILTERS, "before"):
        if len(request.args.getlist(name)) > 1:
            raise RelayError(f"the {name} parameter is given more than once; give it once")


def _before() -> int | None:
    raw = request.args.get("before", "")
    if not raw:
        return None
    before = positive_number(raw)
    if before is None:
        raise RelayError("the page cursor must be a job id")
    return before


@bp.get("/jobs")
@require("viewer")
def jobs() -> Response:
    """Jobs newest first, filtered by state, queue, type and a search in type and error text."""
    filters = _filters()
    error = None
    listing = monitor.JobPage(jobs=[], next_before=None)
    try:
        _each_given_once()
        where = _job_filter(filters)
        before = _before()
    except RelayError as exc:
        error = str(exc)
    else:
        with connection() as conn:
            listing = monitor.list_jobs(conn, where, limit=PAGE_SIZE, before=before)
    return page(
        "jobs",
        status=400 if error else 200,
        filters=filters,
        listing=listing,
        error=error,
        states=STATES,
        paged=bool(request.args.get("before")),
        now=formatting.now(),
    )


def _job_or_404(job_id: int) -> JobDetail:
    if not 1 <= job_id <= BIGINT_MAX:
        abort(404)
    with connection() as conn:
        return admin.get_job(conn, job_id)


def seen(job: JobDetail) -> str:
    """What a polling status card last showed: the state and the attempts.

    A retry between two polls (claimed, failed, queued again) leaves the state
    as it was but spends an attempt and adds an error, so the attempts count too.
    """
    return f"{job.status}-{job.attempts}"


#: The parts of a job's page htmx asks for by name (``?part=``).
JOB_PARTS = ("status", "history")


def _job_context(job: JobDetail, notice: str | None = None) -> dict[str, Any]:
    return {
        "job": job,
        "seen": seen(job),
        "actions": actions(job),
        "attempts": [Attempt.of(entry) for entry in reversed(job.errors or [])],
        "notice": notice,
        # The answer to a stop request says what the card's own "Stop requested ... ago" line would.
        "stop_answered": notice == STOP_REQUESTED,
        "polling": job.status in (JobStatus.QUEUED, JobStatus.CLAIMED),
        "refresh_seconds": JOB_REFRESH_SECONDS,
        "now": formatting.now(),
    }


@bp.get("/jobs/<job_number:job_id>")
@require("viewer")
def job(job_id: int) -> Response:
    """One job: state and actions, progress, timings, lease, payload and every attempt's error."""
    found = _job_or_404(job_id)
    part = None
    if is_htmx():
        # The part htmx polls unless it names the other; any other name would be a template that does not exist.
        part = request.args.get("part") if request.args.get("part") in JOB_PARTS else "status"
    response = page("job", partial=f"job_{part}" if part else "job", **_job_context(found, kept_notice()))
    shown = request.args.get("seen")
    if part == "status" and shown and shown != seen(found):
        response.headers["HX-Trigger"] = CHANGED_EVENT
    return response


def _shown_lease_token() -> int | None:
    """The ``seen`` lease token a Requeue button posts; None from a form without one."""
    shown = request.form.get("seen")
    if not shown:
        return None
    if not (shown.isascii() and shown.isdigit() and len(shown) <= 10):  # compared in Python, never sent
        raise RelayError(f"seen must be the job's lease token, a whole number, not {shown[:40]!r}")
    return int(shown)


def _act(job_id: int, action: str) -> Response:
    if not 1 <= job_id <= BIGINT_MAX:
        abort(404)
    status = 200
    with connection() as conn:
        try:
            if action == "requeue":  # the lease token the button was shown with: the job must not have run since
                changed = admin.requeue(conn, job_id, seen_lease_token=_shown_lease_token())
            else:  # the state the button was shown for: a stale "Cancel" must not stop a job that started since
                changed = admin.cancel(conn, job_id, seen=request.form.get("seen") or None)
        except IllegalTransition as exc:
            changed, status = admin.get_job(conn, job_id), 409
            notice = f"Nothing done: the job is {exc.current} now."
            if isinstance(exc, ChangedSince):
                notice = f"Nothing done: the job has run again since this page showed it, and is {exc.current} now."
        else:
            notice = {
                "requeue": "Requeued: it runs again now, with fresh attempts.",
                "cancel": "Cancelled: it will not run.",
            }[action]
            if action == "requeue" and changed.queue in admin.paused_queues(conn):
                # "Now" sent on-call to watch a job that waits for a queue someone paused.
                notice = (
                    f"Requeued, with fresh attempts; its queue {changed.queue} is paused, "
                    "so it runs once the queue is resumed."
                )
            if action == "cancel" and changed.status == JobStatus.CLAIMED:
                notice = STOP_REQUESTED
    if not is_htmx():
        return answer_plain_form(notice, "dashboard.job", job_id=job_id)
    response = page("job", partial="job_status", status=status, **_job_context(changed, notice))
    response.headers["HX-Trigger"] = CHANGED_EVENT
    return response


@bp.post("/jobs/<job_number:job_id>/requeue")
@require("admin")
def requeue(job_id: int) -> Response:
    """Run a dead or cancelled job again now; answers the job's new status card."""
    return _act(job_id, "requeue")


@bp.post("/jobs/<job_number:job_id>/cancel")
@require("admin")
def cancel(job_id: int) -> Response:
    """Cancel a queued job, or ask a running one to stop; answers the job's new status card."""
    return _act(job_id, "cancel")
