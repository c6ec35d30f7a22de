"""``/api/admin/queues``, ``/workers`` and ``/stats``: how the system is doing; pausing queues.

Counts come from the counters migration 0003 keeps (folded first, so the
counter tables stay a few rows long); nothing here counts ``relay.jobs``.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from relay_core import admin, monitor

from ..config import worker_stale_seconds
from ..db import connection, counters_read
from ..endpoint import endpoint
from ..records.ops import (
    LimitRecord,
    LimitsRecord,
    MinuteRecord,
    QueuePath,
    QueueRecord,
    QueuesRecord,
    QueueStateRecord,
    ScheduleRecord,
    SchedulesRecord,
    StatsRecord,
    StatusCountsRecord,
    WorkerCountsRecord,
    WorkerRecord,
    WorkersRecord,
)

bp = Blueprint("monitor", __name__, url_prefix="/admin")


@bp.get("/queues")
@endpoint(tag="monitor", role="viewer", responses={200: QueuesRecord})
def queues(claims: dict[str, Any]) -> QueuesRecord:
    """Every queue's depth by state and the age of its oldest job that is due to run."""
    with counters_read() as conn:
        depths = monitor.queue_depths(conn, stale_seconds=worker_stale_seconds())
    return QueuesRecord(queues=[QueueRecord.of(depth) for depth in depths])


def _set_paused(queue: str, paused: bool) -> QueueStateRecord:
    with connection() as conn:
        admin.set_queue_paused(conn, queue, paused)
    return QueueStateRecord(name=queue, paused=paused)


@bp.post("/queues/<queue>/pause")
@endpoint(tag="monitor", role="admin", path=QueuePath, responses={200: QueueStateRecord})
def pause_queue(path: QueuePath, claims: dict[str, Any]) -> QueueStateRecord:
    """Pause a queue: workers claim nothing from it (running jobs finish) until it is resumed."""
    return _set_paused(path.queue, True)


@bp.post("/queues/<queue>/resume")
@endpoint(tag="monitor", role="admin", path=QueuePath, responses={200: QueueStateRecord})
def resume_queue(path: QueuePath, claims: dict[str, Any]) -> QueueStateRecord:
    """Resume a paused queue."""
    return _set_paused(path.queue, False)


@bp.get("/schedules")
@endpoint(tag="monitor", role="viewer", responses={200: SchedulesRecord})
def schedules(claims: dict[str, Any]) -> SchedulesRecord:
    """Periodic schedules: the next tick, and the last run (the last tick that enqueued a job) with its job."""
    with connection() as conn:
        found = admin.schedules(conn)
    return SchedulesRecord(schedules=[ScheduleRecord(**row) for row in found])


@bp.get("/limits")
@endpoint(tag="monitor", role="viewer", responses={200: LimitsRecord})
def limits(claims: dict[str, Any]) -> LimitsRecord:
    """Per-type concurrency and rate limits, with how many of each type run now."""
    with connection() as conn:
        found = admin.type_limits(conn)
    return LimitsRecord(limits=[LimitRecord(**row) for row in found])


@bp.get("/workers")
@endpoint(tag="monitor", role="viewer", responses={200: WorkersRecord})
def workers(claims: dict[str, Any]) -> WorkersRecord:
    """The worker registry: alive workers first, then stopped and gone ones, most recently seen first.

    At most 200 workers are listed (the registry keeps a week of deploys); ``counts`` counts them all.
    """
    stale = worker_stale_seconds()
    with connection() as conn:
        found = monitor.list_workers(conn, stale_seconds=stale)
        counts = monitor.worker_counts(conn, stale_seconds=stale)
    return WorkersRecord(
        workers=[WorkerRecord.of(worker) for worker in found],
        counts=WorkerCountsRecord(alive=counts.alive, stopped=counts.stopped, gone=counts.gone),
        stale_after_seconds=stale,
    )


@bp.get("/stats")
@endpoint(tag="monitor", role="viewer", responses={200: StatsRecord})
def stats(claims: dict[str, Any]) -> StatsRecord:
    """Jobs by status, and attempts succeeded, failed and dead per minute over the last hour."""
    with counters_read() as conn:
        found = monitor.stats(conn)
    return StatsRecord(
        counts=StatusCountsRecord(**found.counts),
        total=sum(found.counts.values()),
        window_minutes=len(found.minutes),
        per_minute=[
            MinuteRecord(minute=m.minute, succeeded=m.succeeded, failed=m.failed, dead=m.dead) for m in found.minutes
        ],
        succeeded=found.succeeded,
        failed=found.failed,
        dead=found.dead,
        failure_rate=found.failure_rate,
    )
