"""The landing page: is anything on fire, and where.

Counts come from relay_core's counters (never a count over the jobs table),
the chart from the per-minute outcomes, the newest dead jobs from the
status index; the page polls its own partial so it stays current.
"""

from __future__ import annotations

from flask import Response

from relay_core import JobStatus, monitor

from ..config import worker_stale_seconds
from ..db import counters_read
from . import chart, formatting
from .blueprint import bp
from .render import page
from .session import require

#: Seconds between the overview's refreshes.
REFRESH_SECONDS = 5
#: Dead jobs listed on the landing page, so the newest is one tap away.
LATEST_DEAD = 5


def state_totals(depths: list[monitor.QueueDepth]) -> dict[str, int]:
    """Jobs per state across every queue, every state present."""
    totals = {status.value: 0 for status in JobStatus}
    for depth in depths:
        for state, n in depth.counts.items():
            totals[state] = totals.get(state, 0) + n
    return totals


def oldest_wait(depths: list[monitor.QueueDepth]) -> float | None:
    """How long the job waiting longest, in any queue, has been due."""
    ages = [d.oldest_runnable_age_seconds for d in depths if d.oldest_runnable_age_seconds is not None]
    return max(ages) if ages else None


@bp.get("/")
@require("viewer")
def overview() -> Response:
    """Counts by state and queue, throughput over the last hour, oldest due job, workers alive, newest dead jobs."""
    stale = worker_stale_seconds()
    with counters_read() as conn:
        depths = monitor.queue_depths(conn, stale_seconds=stale)
        minutes = monitor.outcomes_per_minute(conn)
        workers = monitor.worker_counts(conn, stale_seconds=stale)
        latest_dead, _more = monitor.recently_dead(conn, LATEST_DEAD)
    stats = monitor.Stats(counts=state_totals(depths), minutes=minutes)
    return page(
        "overview",
        depths=sorted(depths, key=lambda d: d.queue),
        stats=stats,
        chart=chart.throughput(minutes),
        oldest_wait=oldest_wait(depths),
        workers=workers,
        latest_dead=latest_dead,
        refresh_seconds=REFRESH_SECONDS,
        now=formatting.now(),
    )
