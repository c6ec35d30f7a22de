"""Records of login, queues, workers, stats and health."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from relay_core.monitor import QueueDepth, WorkerInfo

from .common import BodyRecord, QueryRecord, QueueName, Record, StatusName, text

Username = text(1, 150)
Password = text(1, 1024)

# -- auth ------------------------------------------------------------------------


class LoginBody(BodyRecord):
    """``POST /api/auth/login``."""

    username: Username
    password: Password


class TokenRecord(Record):
    """A fresh access token (and, at login, a refresh token)."""

    access_token: str
    token_type: Literal["Bearer"] = "Bearer"
    expires_in: int = Field(description="Seconds until the access token expires.")
    refresh_token: str | None = Field(default=None, description="Trade it at /api/auth/refresh; login only.")
    refresh_expires_in: int | None = None
    username: str
    role: Literal["admin", "viewer"]


# -- queues, workers, stats --------------------------------------------------------


class StatusCountsRecord(Record):
    """Jobs in each state."""

    queued: int
    claimed: int
    succeeded: int
    dead: int
    cancelled: int


class QueueRecord(Record):
    """One queue's depth by state and how long its oldest due job has waited."""

    name: str
    counts: StatusCountsRecord
    oldest_runnable_at: datetime | None
    oldest_runnable_age_seconds: float | None = Field(description="null when nothing is due.")
    paused: bool = Field(description="Workers claim nothing from a paused queue until it is resumed.")
    live_workers: int = Field(
        description="Live workers that serve this queue. With jobs queued and none, nothing will run them: "
        "a queue name mistyped at enqueue, or a queue no worker was started for."
    )
    lapsed_leases: int = Field(
        description="Claimed jobs whose lease ran out: their worker stopped heartbeating (killed, hung, cut off), "
        "and no live worker's sweeper has put them back yet. They count as claimed, but nothing runs them."
    )

    @classmethod
    def of(cls, depth: QueueDepth) -> QueueRecord:
        """The record of a queue's depth."""
        return cls(
            name=depth.queue,
            counts=StatusCountsRecord(**depth.counts),
            oldest_runnable_at=depth.oldest_runnable_at,
            oldest_runnable_age_seconds=depth.oldest_runnable_age_seconds,
            paused=depth.paused,
            live_workers=depth.live_workers,
            lapsed_leases=depth.lapsed_leases,
        )


class QueuePath(QueryRecord):
    """A queue name in the URL."""

    queue: QueueName


class QueueStateRecord(Record):
    """Whether a queue is paused, after a pause or resume."""

    name: str
    paused: bool


class ScheduleRecord(Record):
    """A periodic handler's schedule."""

    type: str
    cron: str
    timezone: str
    queue: str
    last_tick: datetime | None = Field(
        description="The newest tick a worker claimed. Not a run: it is also the tick before the schedule was "
        "registered, or a tick skipped as missed (no worker ran when it fell due). See last_enqueued_tick."
    )
    next_tick: datetime | None
    last_enqueued_tick: datetime | None = Field(
        description="The last run: the newest tick that enqueued a job. null: no tick has (since "
        "runs_recorded_since, when that is set)."
    )
    last_job_id: int | None = Field(description="The job that tick enqueued; its row may since have been pruned.")
    last_job_status: StatusName | None = Field(
        description="That job's status now; null when there is none or retention has deleted it."
    )
    runs_recorded_since: datetime | None = Field(
        description="Set only on a schedule that predates Relay's record of runs and had no job left to read its "
        "last run from: whether it ran before this moment is unknown. null: every run is recorded."
    )
    checked: bool = Field(
        description="Whether a running worker checks the schedule now. false: nothing enqueues its ticks (its "
        "handler is gone from every running worker, or no worker runs), and next_tick is when it would have run."
    )


class SchedulesRecord(Record):
    """Every periodic schedule, next run first."""

    schedules: list[ScheduleRecord]


class LimitRecord(Record):
    """A job type's limits across all workers, as its handler declares them."""

    type: str
    max_running: int | None = Field(description="At most this many of the type run at once; null: no cap.")
    rate_limit: int | None = Field(description="At most this many starts per rate_period_seconds; null: no rate.")
    rate_period_seconds: float | None
    running: int = Field(description="Jobs of the type running now.")


class LimitsRecord(Record):
    """Every declared per-type limit."""

    limits: list[LimitRecord]


class QueuesRecord(Record):
    """Every queue that holds jobs."""

    queues: list[QueueRecord]


WorkerState = Literal["alive", "stopped", "gone"]


class WorkerRecord(Record):
    """One worker process: alive (heartbeating), stopped (shut down cleanly) or gone (went quiet)."""

    id: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    in_flight: int = Field(
        description="Jobs it held at its last heartbeat: running, or claimed ahead and waiting for a slot."
    )
    claimed: int = Field(description="Jobs claimed by it now; a gone worker's until their leases run out.")
    state: WorkerState
    started_at: datetime
    last_seen_at: datetime
    stopped_at: datetime | None
    seconds_since_seen: float

    @classmethod
    def of(cls, worker: WorkerInfo) -> WorkerRecord:
        """The record of a registered worker."""
        return cls(**vars(worker))


class WorkerCountsRecord(Record):
    """How many registered workers are in each state."""

    alive: int
    stopped: int
    gone: int


class WorkersRecord(Record):
    """The worker registry."""

    workers: list[WorkerRecord]
    counts: WorkerCountsRecord
    stale_after_seconds: float = Field(
        description="A worker silent this long counts as gone (or for two of its heartbeat intervals, if longer)."
    )


class MinuteRecord(Record):
    """Attempts that finished in one minute."""

    minute: datetime
    succeeded: int
    failed: int = Field(description="Attempts that raised or lost their lease (retried or dead).")
    dead: int


class StatsRecord(Record):
    """Counts by status now, and throughput over the last hour."""

    counts: StatusCountsRecord
    total: int
    window_minutes: int
    per_minute: list[MinuteRecord]
    succeeded: int
    failed: int
    dead: int
    failure_rate: float | None = Field(description="failed / (succeeded + failed) over the window; null if idle.")


# -- health ------------------------------------------------------------------------


class HealthRecord(Record):
    """The process answers."""

    status: Literal["ok"] = "ok"


class ReadyRecord(Record):
    """The database answers and its schema is current."""

    status: Literal["ready"] = "ready"
    database: Literal["ok"] = "ok"
    migrations: Literal["current"] = "current"
