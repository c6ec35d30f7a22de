"""Queues (with pause and resume), workers, and periodic schedules."""

from __future__ import annotations

from flask import Response

from relay_core import admin, monitor

from ..config import worker_stale_seconds
from ..db import connection, counters_read
from . import formatting
from .blueprint import bp
from .render import answer_plain_form, is_htmx, kept_notice, page
from .session import require

#: Seconds between refreshes of the queues and workers pages.
REFRESH_SECONDS = 10


def _queues(notice: str | None = None) -> Response:
    with counters_read() as conn:
        depths = sorted(monitor.queue_depths(conn, stale_seconds=worker_stale_seconds()), key=lambda d: d.queue)
    return page("queues", depths=depths, notice=notice, refresh_seconds=REFRESH_SECONDS)


@bp.get("/queues")
@require("viewer")
def queues() -> Response:
    """Every queue's jobs by state, its longest wait, and whether it is paused."""
    return _queues(kept_notice())


def _set_paused(queue: str, paused: bool) -> Response:
    with connection() as conn:
        admin.set_queue_paused(conn, queue, paused)
    notice = f"Paused {queue}: workers claim nothing from it until it is resumed." if paused else f"Resumed {queue}."
    if not is_htmx():
        return answer_plain_form(notice, "dashboard.queues")
    return _queues(notice)


@bp.post("/queues/<queue>/pause")
@require("admin")
def pause_queue(queue: str) -> Response:
    """Stop workers claiming from a queue (running jobs finish)."""
    return _set_paused(queue, True)


@bp.post("/queues/<queue>/resume")
@require("admin")
def resume_queue(queue: str) -> Response:
    """Let workers claim from a paused queue again."""
    return _set_paused(queue, False)


@bp.get("/workers")
@require("viewer")
def workers() -> Response:
    """The worker registry: alive workers first, then stopped and gone ones."""
    stale = worker_stale_seconds()
    with connection() as conn:
        found = monitor.list_workers(conn, stale_seconds=stale)
        counts = monitor.worker_counts(conn, stale_seconds=stale)
    return page(
        "workers", workers=found, counts=counts, stale=stale, refresh_seconds=REFRESH_SECONDS, now=formatting.now()
    )


@bp.get("/schedules")
@require("viewer")
def schedules() -> Response:
    """Periodic jobs (cron handlers) with their last and next run."""
    with connection() as conn:
        found = admin.schedules(conn)
        limits = admin.type_limits(conn)
    return page("schedules", schedules=found, limits=limits, now=formatting.now())
