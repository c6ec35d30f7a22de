"""The dead-letter view: dead jobs grouped by type, each type requeued in one action.

Per-type counts come from the jobs that died last (``monitor.recently_dead``,
latest death first), at most :data:`SCAN_LIMIT` of them: dead jobs are few
when things are healthy, and past the limit the page says "at least" rather
than counting a million rows on a phone's request; the types failing now are
the ones counted. The requeue itself
is ``monitor.requeue_matching``, which changes every matching job however
many there are and reports the real number: every job of the type that was
dead when the page was read, and none that died after, which it did not count.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime

import psycopg
from flask import Response, request

from relay_core import BulkActionStopped, RelayError, admin, monitor

from ..db import connection
from . import formatting
from .blueprint import bp
from .render import answer_plain_form, is_htmx, kept_notice, page
from .session import require

log = logging.getLogger("relay.web")

#: Dead jobs read to count them by type.
SCAN_LIMIT = 1000
#: Dead jobs listed below the groups (the jobs list pages through the rest).
LISTED = 20


@dataclass(frozen=True)
class DeadType:
    """A job type with dead jobs, and its newest dead job's error."""

    type: str
    count: int
    newest_error: str | None


@dataclass(frozen=True)
class DeadSummary:
    """Dead jobs by type; ``complete`` is False when there were more than could be counted."""

    groups: list[DeadType]
    total: int
    complete: bool
    newest: list[monitor.JobSummary]
    #: The database's time before the dead jobs were read: "Requeue all" leaves jobs that die after it alone.
    read_at: datetime


def summarize(conn: psycopg.Connection) -> DeadSummary:
    """Count dead jobs by type, latest death first, reading at most :data:`SCAN_LIMIT` of them."""
    read_at = monitor.database_now(conn)
    seen, more = monitor.recently_dead(conn, SCAN_LIMIT)
    counts = Counter(job.type for job in seen)
    newest = {}
    for job in seen:
        newest.setdefault(job.type, job)
    groups = [DeadType(t, n, newest[t].last_error) for t, n in counts.most_common()]
    return DeadSummary(groups=groups, total=len(seen), complete=not more, newest=seen[:LISTED], read_at=read_at)


def _render(notice: str | None = None, status: int = 200) -> Response:
    with connection() as conn:
        summary = summarize(conn)
    return page("dead", status=status, summary=summary, notice=notice, now=formatting.now())


@bp.get("/dead")
@require("viewer")
def dead() -> Response:
    """Dead jobs by type, with their newest error and a requeue-all button per type."""
    return _render(kept_notice())


def _page_time(text: str | None) -> datetime | None:
    """The time the page that posted read its dead jobs (None from a page without one)."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise RelayError("the page's time is not a time: reload the page and try again") from None
    if when.tzinfo is None:
        raise RelayError("the page's time has no UTC offset: reload the page and try again")
    return when


@bp.post("/dead/requeue")
@require("admin")
def requeue_dead() -> Response:
    """Requeue every dead job of one type; answers the refreshed dead-letter view."""
    job_type = request.form.get("type", "")
    if not job_type:
        raise RelayError("say which type of dead jobs to requeue")
    finished_by = _page_time(request.form.get("finished_by"))
    # Checked before anything reads with it (a NUL in the type was the database's refusal, a 500).
    where = monitor.JobFilter(status="dead", type=job_type, finished_by=finished_by)
    stopped: BulkActionStopped | None = None
    try:
        # Read first, on its own: once the requeue has committed, a failed read must not answer an error
        # page, and the requeue commits batch by batch, not within a transaction the read began.
        with connection() as conn:
            paused = admin.paused_queues_holding_dead(conn, job_type)
        with connection() as conn:
            changed = monitor.requeue_matching(conn, where)
    except BulkActionStopped as exc:
        log.warning("requeue of dead %s jobs stopped after %d: %s", job_type, exc.changed, exc.__cause__)
        stopped, changed = exc, exc.changed
    noun, they = ("job", "it runs") if changed == 1 else ("jobs", "they run")
    if stopped is not None:
        notice = (
            f"Requeued {formatting.number(changed)} dead {job_type} {noun}, then the database "
            "gave up; the rest are still dead. Press Requeue all again to go on."
        )
    elif changed == 0:  # another admin requeued them first
        notice = f"Nothing requeued: no dead {job_type} jobs are left."
    else:
        notice = f"Requeued {formatting.number(changed)} dead {job_type} {noun}; {they} again now."
        if paused:
            notice = notice[:-1] + f", but in a paused queue ({', '.join(paused)}) only once it is resumed."
    if not is_htmx():
        return answer_plain_form(notice, "dashboard.dead")
    return _render(notice)
