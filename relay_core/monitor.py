"""What the admin surface reads and does to many jobs at once.

Listings page by keyset, bulk actions walk the table in short batches, and
every count comes from the counters migration 0003 keeps, never from a count
over ``relay.jobs``. Flask-free: the web app, the CLI and exporters share it.
Every function takes a psycopg connection the caller owns. Readers that
read the counters and then relay.jobs (``queue_depths``) belong on an
autocommit connection: a transaction that kept the counters locked while it
waited for relay.jobs would deadlock with TRUNCATE relay.jobs, which takes
the two the other way round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import admin, migrate
from .errors import BulkActionStopped, RelayError
from .queries import sql
from .states import JobStatus
from .validation import BIGINT_MAX, QUEUE_NAME, check_queue

#: Largest page a listing returns, whatever the caller asks.
MAX_PAGE = 200
#: Characters of ``last_error`` a listing row carries (the job itself has all of it).
LIST_ERROR_CHARS = 500
#: The most recently dead jobs one read returns (the dead view counts its types over them).
RECENTLY_DEAD_MAX = 1000
#: Rows a bulk action changes per transaction.
BULK_BATCH = 1000
#: A worker that has not heartbeated for this long is gone.
DEFAULT_STALE_SECONDS = 60.0
#: Minutes of per-minute outcomes kept before they fold into all-time totals.
OUTCOME_MINUTES_KEPT = 60
#: Advisory-lock key of the counter fold (every key Relay takes: migrate.MIGRATION_LOCK_KEY).
FOLD_LOCK_KEY = 7_265_108_722
#: Deltas of each table one chunk of a worker's fold folds (some 0.15 s of the server's time here) ...
FOLD_CHUNK_ROWS = 50_000
#: ... and how long one fold goes on chunk after chunk (the worker's next fold goes on from there).
FOLD_CHUNK_SECONDS = 2.0
#: How long a worker's fold waits for a lock on a counter table before it lets go (lock_timeout).
FOLD_LOCK_WAIT = "1s"


#: What a queue name may look like (for clients that validate filters up front).
QUEUE_NAME_PATTERN = QUEUE_NAME.pattern


#: The states a listing may filter on, as its error says them (the dashboard calls a claimed job running).
STATUS_CHOICES = "one of " + ", ".join(
    f"{s.value} (shown as running)" if s is JobStatus.CLAIMED else s.value for s in JobStatus
)


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a listing or bulk action means; None matches anything.

    ``q`` is a case-insensitive substring of the type or the last error.
    """

    status: str | None = None
    queue: str | None = None
    type: str | None = None
    q: str | None = None
    #: Bulk requeue only: jobs that ended after this time are left alone.
    finished_by: datetime | None = None

    def __post_init__(self) -> None:
        if self.status is not None and self.status not in {s.value for s in JobStatus}:
            raise RelayError(f"unknown status {self.status!r}: {STATUS_CHOICES}")
        if self.queue is not None:
            check_queue(self.queue)
        for name in ("queue", "type", "q"):
            value = getattr(self, name)
            if value is not None and "\x00" in value:
                raise RelayError(f"{name} must not contain NUL characters")
        if self.finished_by is not None and self.finished_by.utcoffset() is None:
            raise RelayError("finished_by must carry a UTC offset (a timezone-aware datetime)")

    def params(self) -> dict[str, Any]:
        """Parameters shared by the filtered statements."""
        return {
            "status": self.status,
            "queue": self.queue,
            "type": self.type,
            "q": self.q,
            "finished_by": self.finished_by,
        }


@dataclass(frozen=True)
class JobSummary:
    """One row of a job listing (the error cut to :data:`LIST_ERROR_CHARS`)."""

    id: int
    type: str
    queue: str
    priority: int
    status: str
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    claimed_by: str | None
    last_error: str | None


@dataclass(frozen=True)
class JobPage:
    """A page of jobs, newest first; pass ``next_before`` back for the next page."""

    jobs: list[JobSummary]
    next_before: int | None


@dataclass(frozen=True)
class QueueDepth:
    """One queue: its jobs per state, how long its oldest due job has waited, whether it is paused,
    how many live workers serve it, and how many of its claimed jobs have lapsed leases.

    A lapsed lease is a claimed job whose worker stopped heartbeating (killed,
    hung, cut off from the database): it counts as claimed, but nothing runs
    it until a live worker's sweeper puts it back, within a sweep interval of
    the lease running out. Lapsed leases that stay are a queue no live worker
    sweeps.
    """

    queue: str
    counts: dict[str, int]
    oldest_runnable_at: datetime | None
    oldest_runnable_age_seconds: float | None
    paused: bool = False
    live_workers: int = 0
    lapsed_leases: int = 0

    @property
    def unserved(self) -> bool:
        """Jobs wait here and no live worker serves the queue: nothing will run them."""
        return self.counts.get("queued", 0) > 0 and self.live_workers == 0


@dataclass(frozen=True)
class WorkerInfo:
    """One registered worker process and whether it is alive, stopped or gone."""

    id: str
    host: str
    pid: int
    queues: list[str]
    concurrency: int
    #: Jobs it held at its last heartbeat, running or waiting for a slot.
    in_flight: int
    #: Jobs claimed by it now (a gone worker's until the sweeper returns them).
    claimed: int
    started_at: datetime
    last_seen_at: datetime
    stopped_at: datetime | None
    state: str
    seconds_since_seen: float


@dataclass(frozen=True)
class MinuteOutcomes:
    """Attempts that finished within one minute."""

    minute: datetime
    succeeded: int
    failed: int
    dead: int


@dataclass(frozen=True)
class OutcomeTotals:
    """All-time attempts finished for one (queue, type)."""

    queue: str
    type: str
    succeeded: int
    failed: int
    dead: int


@dataclass(frozen=True)
class WorkerCounts:
    """How many registered workers are in each state."""

    alive: int = 0
    stopped: int = 0
    gone: int = 0


@dataclass(frozen=True)
class Stats:
    """Jobs per status now, and how attempts ended over the last minutes."""

    counts: dict[str, int]
    minutes: list[MinuteOutcomes] = field(default_factory=list)

    @property
    def succeeded(self) -> int:
        """Successful attempts in the window."""
        return sum(m.succeeded for m in self.minutes)

    @property
    def failed(self) -> int:
        """Failed attempts (retried or dead) in the window."""
        return sum(m.failed for m in self.minutes)

    @property
    def dead(self) -> int:
        """Jobs that died in the window."""
        return sum(m.dead for m in self.minutes)

    @property
    def failure_rate(self) -> float | None:
        """Failed attempts over finished attempts in the window; None when nothing finished."""
        finished = self.succeeded + self.failed
        return self.failed / finished if finished else None


def _rows(conn: psycopg.Connection, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    # Unprepared on purpose: each call is planned with its real filter values,
    # so "%(x)s IS NULL OR ..." branches vanish and the right index is used.
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql(name), params, prepare=False)
        return cur.fetchall() if cur.description else []


# -- listing -----------------------------------------------------------------


def list_jobs(
    conn: psycopg.Connection, where: JobFilter | None = None, *, limit: int = 50, before: int | None = None
) -> JobPage:
    """A page of jobs matching ``where``, newest first, older than id ``before``."""
    if not 1 <= limit <= MAX_PAGE:
        raise RelayError(f"limit must be between 1 and {MAX_PAGE}")
    if before is not None and not 1 <= before <= BIGINT_MAX:
        raise RelayError("before must be a positive job id")
    params = (where or JobFilter()).params()
    params.update(limit=limit + 1, before=before, error_chars=LIST_ERROR_CHARS)
    rows = _rows(conn, "job_list", params)
    more = len(rows) > limit
    jobs = [JobSummary(**row) for row in rows[:limit]]
    return JobPage(jobs=jobs, next_before=jobs[-1].id if more else None)


def recently_dead(conn: psycopg.Connection, limit: int) -> tuple[list[JobSummary], bool]:
    """The ``limit`` jobs that died last, latest first, and whether more are dead than that."""
    if not 1 <= limit <= RECENTLY_DEAD_MAX:
        raise RelayError(f"limit must be between 1 and {RECENTLY_DEAD_MAX}")
    rows = _rows(conn, "job_list_recently_dead", {"limit": limit + 1, "error_chars": LIST_ERROR_CHARS})
    return [JobSummary(**row) for row in rows[:limit]], len(rows) > limit


# -- bulk actions --------------------------------------------------------------


def _bulk(conn: psycopg.Connection, action: str, statement: str, params: dict[str, Any], batch: int) -> int:
    """Run a batched action over ids up to today's newest (and, for a requeue, jobs ended by now).

    Each batch commits alone. A batch that fails after others committed (a statement timeout, a lost
    connection) raises BulkActionStopped with how many jobs did change, so
    the caller is never told that nothing happened when something did.
    """
    with conn.transaction():
        start = _rows(conn, "job_max_id", {})[0]
    if params.get("finished_by") is None or params["finished_by"] > start["began_at"]:
        # Jobs that end while the walk runs (requeued by someone else, then dead again) are left alone.
        params = dict(params, finished_by=start["began_at"])
    changed, after = 0, 0
    while True:
        try:
            with conn.transaction():
                row = _rows(conn, statement, dict(params, after=after, max_id=start["max_id"], batch=batch))[0]
        except psycopg.Error as exc:
            if changed == 0:
                raise
            raise BulkActionStopped(action, changed) from exc
        changed += row["changed"]
        if row["picked"] < batch or row["last_id"] is None:
            return changed
        after = row["last_id"]


def requeue_matching(conn: psycopg.Connection, where: JobFilter, *, batch: int = BULK_BATCH) -> int:
    """Requeue every dead or cancelled job matching ``where``; return how many changed.

    ``where.status`` may narrow it to ``dead`` or ``cancelled``. Jobs that die
    after the call began are left alone, so the walk always ends.
    """
    if where.status not in (None, JobStatus.DEAD, JobStatus.CANCELLED):
        raise RelayError("only dead or cancelled jobs can be requeued")
    return _bulk(conn, "requeue", "job_requeue_matching", where.params(), batch)


def cancel_matching(conn: psycopg.Connection, where: JobFilter, *, batch: int = BULK_BATCH) -> int:
    """Cancel every queued job matching ``where``; return how many changed."""
    if where.status not in (None, JobStatus.QUEUED):
        raise RelayError("only queued jobs can be cancelled")
    return _bulk(conn, "cancel", "job_cancel_matching", where.params(), batch)


def created_in_this_transaction(conn: psycopg.Connection, job_id: int) -> bool:
    """Whether the open transaction inserted this job (an idempotent enqueue made it new)."""
    rows = _rows(conn, "job_created_here", {"id": job_id})
    return bool(rows and rows[0]["created_here"])


# -- counters ------------------------------------------------------------------


def recount(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Rebuild the counters from the jobs table; the (queue, state) counts that were wrong, as
    ``{"queue", "state", "was", "now"}``.

    The counters are exact while the counting triggers see every write. A
    session that skipped them (``session_replication_role = replica``, a
    ``DISABLE TRIGGER``) or a data-only restore of both tables (its COPY into
    relay.jobs is counted beside the restored deltas) leaves them wrong for
    good; this puts them right. It counts the whole table (about a tenth of a
    second per million jobs); writers go on meanwhile and a fold waits for it.
    Its own transaction, at READ COMMITTED, on a connection not inside one.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise RelayError("recount needs a connection outside a transaction: it commits one of its own")
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.execute(sql("job_counts_recount_lock"), {"key": FOLD_LOCK_KEY})
        return _rows(conn, "job_counts_recount", {})


def fold_counters(conn: psycopg.Connection, *, rows: int | None = None) -> bool:
    """Fold the counter deltas into one row per key; False when it could not fold now.

    Readers call it before reading so the counter tables stay a few rows long
    whatever the write rate; a long-lived process (a worker) may call it on a
    timer so the deltas never pile up while nobody looks. ``rows`` bounds the
    deltas folded of each table, so a reader under a statement timeout folds
    a share of a pile that built up while no worker ran instead of timing out
    on all of it (the reads stay exact either way: they sum what is left).

    The fold commits in a transaction of its own, at READ COMMITTED whatever
    the connection's level. On a connection already inside a transaction it
    folds nothing: held until that transaction ended, the counters' rows
    would be locked ahead of relay.jobs, the reverse of TRUNCATE relay.jobs's
    order, and the two would deadlock. False too while another process folds.
    """
    return _fold(conn, rows, untimed=False) is not None


def fold_counters_in_chunks(
    conn: psycopg.Connection, *, chunk: int = FOLD_CHUNK_ROWS, seconds: float = FOLD_CHUNK_SECONDS
) -> bool:
    """A worker's fold, on its timer: ``chunk`` deltas of each table at a time, each chunk a transaction
    of its own with no statement timeout, until a chunk folds fewer or ``seconds`` have passed (the
    next fold goes on); False when it could not fold now (see ``fold_counters``).

    One fold of every delta, under the role's or the database's
    statement_timeout (meant for the application's statements; autovacuum
    ignores it too), outlasted it once a pile had built up while no worker
    ran: it was rolled back every 30 s while new deltas kept coming, held the
    fold lock the web's folds wait for meanwhile, and the pile only grew.
    """
    ends = time.monotonic() + seconds
    while True:
        folded = _fold(conn, chunk, untimed=True)
        if folded is None:
            return False
        if folded < chunk or time.monotonic() >= ends:
            return True


def _fold(conn: psycopg.Connection, rows: int | None, *, untimed: bool) -> int | None:
    """Fold up to ``rows`` deltas of each counter table in a transaction of its own; the most folded of
    either table, None when it could not fold now.

    ``untimed``: with no statement timeout, and lock waits bounded instead
    (``FOLD_LOCK_WAIT``): a table lock held long (a TRUNCATE or an ALTER in a
    transaction left open) would otherwise hold up the worker's thread of
    duties, the sweeper's among them, for as long as it is held.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return None
    try:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            if untimed:
                conn.execute(
                    "SELECT set_config('statement_timeout', '0', true), set_config('lock_timeout', %s, true)",
                    (FOLD_LOCK_WAIT,),
                )
            if not _rows(conn, "job_counts_fold_lock", {"key": FOLD_LOCK_KEY})[0]["locked"]:
                return None
            counts = _rows(conn, "job_counts_fold", {"rows": rows})[0]["folded"]
            keep = {"rows": rows, "keep_minutes": OUTCOME_MINUTES_KEPT}
            outcomes = _rows(conn, "job_outcomes_fold", keep)[0]["folded"]
    except psycopg.errors.LockNotAvailable:
        if not untimed:
            raise
        return None  # rolled back: the next fold tries again
    return max(counts, outcomes)


def queue_counts(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """Jobs per state of every queue that has any (states with none left out)."""
    counts: dict[str, dict[str, int]] = {}
    for row in _rows(conn, "job_counts_by_queue", {}):
        counts.setdefault(row["queue"], {})[row["state"]] = row["n"]
    return counts


def status_counts(conn: psycopg.Connection) -> dict[str, int]:
    """Jobs per status across all queues, every status present (zero when empty)."""
    totals = {status.value: 0 for status in JobStatus}
    for states in queue_counts(conn).values():
        for state, n in states.items():
            totals[state] += n
    return totals


def queue_depths(conn: psycopg.Connection, *, stale_seconds: float = DEFAULT_STALE_SECONDS) -> list[QueueDepth]:
    """Every queue that holds jobs or is paused, with its depth by state, the age of its oldest due job,
    its live workers (a worker silent for longer than both ``stale_seconds`` and two of its
    heartbeat intervals is gone: ``relay.worker_state``) and its lapsed leases."""
    counts = queue_counts(conn)
    paused = set(admin.paused_queues(conn))
    for queue in sorted(paused - set(counts)):
        counts[queue] = {}
    if not counts:
        return []
    service = {
        row["queue"]: row
        for row in _rows(conn, "queue_service", {"queues": list(counts), "stale_seconds": stale_seconds})
    }
    depths = []
    for queue, states in counts.items():
        full = {status.value: states.get(status.value, 0) for status in JobStatus}
        row = service[queue]
        at = row["oldest_run_at"]
        age = max(0.0, (row["now"] - at).total_seconds()) if at else None
        depths.append(
            QueueDepth(
                queue=queue,
                counts=full,
                oldest_runnable_at=at,
                oldest_runnable_age_seconds=age,
                paused=queue in paused,
                live_workers=row["live_workers"],
                lapsed_leases=row["lapsed_leases"],
            )
        )
    return depths


def outcomes_per_minute(conn: psycopg.Connection, minutes: int = OUTCOME_MINUTES_KEPT) -> list[MinuteOutcomes]:
    """Attempts finished in each of the last ``minutes`` minutes, oldest first."""
    if not 1 <= minutes <= OUTCOME_MINUTES_KEPT:
        raise RelayError(f"minutes must be between 1 and {OUTCOME_MINUTES_KEPT}")
    return [MinuteOutcomes(**row) for row in _rows(conn, "job_outcomes_per_minute", {"minutes": minutes})]


def outcome_totals(conn: psycopg.Connection) -> list[OutcomeTotals]:
    """All-time finished attempts per (queue, type)."""
    return [OutcomeTotals(**row) for row in _rows(conn, "job_outcome_totals", {})]


def stats(conn: psycopg.Connection, minutes: int = OUTCOME_MINUTES_KEPT) -> Stats:
    """Counts by status and the per-minute outcomes of the last ``minutes``."""
    return Stats(counts=status_counts(conn), minutes=outcomes_per_minute(conn, minutes))


# -- workers and health --------------------------------------------------------


def list_workers(
    conn: psycopg.Connection, *, stale_seconds: float = DEFAULT_STALE_SECONDS, limit: int = MAX_PAGE
) -> list[WorkerInfo]:
    """Registered workers, alive ones first, then the most recently seen."""
    rows = _rows(conn, "worker_list", {"stale_seconds": stale_seconds, "limit": limit})
    workers = []
    for row in rows:
        now = row.pop("now")
        seen = max(0.0, (now - row["last_seen_at"]).total_seconds())
        workers.append(WorkerInfo(**row, seconds_since_seen=seen))
    return workers


def worker_counts(conn: psycopg.Connection, *, stale_seconds: float = DEFAULT_STALE_SECONDS) -> WorkerCounts:
    """How many registered workers are alive, stopped and gone."""
    return WorkerCounts(**_rows(conn, "worker_counts", {"stale_seconds": stale_seconds})[0])


def database_now(conn: psycopg.Connection) -> datetime:
    """The database's clock, which stamps every job's times."""
    return _rows(conn, "db_now", {})[0]["now"]


def ping(conn: psycopg.Connection) -> bool:
    """One round trip to the database."""
    return _rows(conn, "database_ping", {})[0]["ok"] == 1


#: What a statement fails with while the schema is behind this release (see ``migrate``).
MISSING_SCHEMA_ERRORS = migrate.MISSING_SCHEMA_ERRORS


def schema_problem(conn: psycopg.Connection) -> str | None:
    """Why the schema is not current, as what to do about it; None when it is (see ``migrate.schema_problem``)."""
    return migrate.schema_problem(conn)
