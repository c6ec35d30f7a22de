"""The Relay app that the tests' worker processes run (``--app tests.apps.worker_app:relay``).

Handlers write to ``relay_test.executions`` so tests can see every run:
``phase`` is 'start' when a handler begins and 'end' when it returns.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import time
import warnings

from psycopg_pool import ConnectionPool

from relay_core import Job, Relay

relay = Relay()
_pool: ConnectionPool | None = None

RECORD = "INSERT INTO relay_test.executions (job_id, pid, attempt, lease_token, phase) VALUES (%s, %s, %s, %s, %s)"


def pool() -> ConnectionPool:
    """A pool for side effects recorded outside the job's completion."""
    global _pool
    if _pool is None:
        _pool = ConnectionPool(
            relay.dsn, min_size=1, max_size=8, open=True, name="test-app", kwargs=relay.connection_options()
        )
        atexit.register(_pool.close)
    return _pool


def record(job: Job, phase: str) -> None:
    """Write one executions row in its own transaction."""
    with pool().connection() as conn:
        conn.execute(RECORD, (job.id, os.getpid(), job.attempt, job.lease_token, phase))


@relay.handler("record", max_attempts=5)
def record_run(job: Job) -> None:
    """Record start, sleep ``payload.sleep`` seconds, record end."""
    record(job, "start")
    time.sleep(float((job.payload or {}).get("sleep", 0)))
    record(job, "end")


@relay.handler("mark", max_attempts=5)
def mark_run(job: Job) -> None:
    """Append the job's id to the file ``payload.path`` as it starts: a job of well under a
    millisecond, so the worker holds many per slot; a written line survives the worker's death."""
    with open(job.payload["path"], "a") as marks:
        marks.write(f"{job.id}\n")


@relay.handler("app_logs", max_attempts=1)
def app_logs_run(job: Job) -> None:
    """Log as an application does, through its own logger and a warning, lines with line breaks in them."""
    logging.getLogger("worker_app").info("imported %s rows\nrow 12 skipped", 41)
    warnings.warn("the v1 export format is deprecated\nuse v2", UserWarning, stacklevel=1)


@relay.handler("hang", max_attempts=5, timeout=0.3)
def hang_run(job: Job) -> None:
    """Record start, then block past its timeout, ignoring ``job.lease_lost``, as a network call
    without a timeout of its own does; it returns only after ``payload.sleep`` seconds (60)."""
    record(job, "start")
    time.sleep(float((job.payload or {}).get("sleep", 60)))


@relay.handler("noop", max_attempts=5)
def noop_run(job: Job) -> None:
    """Do nothing: the shortest job there is, which the worker prefetches most of."""


@relay.handler("record_async", max_attempts=5)
async def record_run_async(job: Job) -> str:
    """The async twin of ``record``: record start, await ``payload.sleep`` seconds, record end."""
    record(job, "start")
    await asyncio.sleep(float((job.payload or {}).get("sleep", 0)))
    record(job, "end")
    return "recorded"


@relay.handler("record_to_thread", max_attempts=5)
async def record_run_to_thread(job: Job) -> None:
    """``record``, its sleep in a thread of its own (``asyncio.to_thread``), as a sync client library's call."""
    record(job, "start")
    await asyncio.to_thread(time.sleep, float((job.payload or {}).get("sleep", 0)))
    record(job, "end")


@relay.handler("record_tx", max_attempts=5)
def record_run_tx(job: Job, conn) -> None:  # type: ignore[no-untyped-def]
    """Sleep, then record the run in the completion's own transaction (exactly once)."""
    time.sleep(float((job.payload or {}).get("sleep", 0)))
    conn.execute(RECORD, (job.id, os.getpid(), job.attempt, job.lease_token, "tx"))


@relay.handler("limited", concurrency=3)
def limited_run(job: Job) -> None:
    """At most three run at once anywhere: record start, sleep, record end."""
    record(job, "start")
    time.sleep(float((job.payload or {}).get("sleep", 0)))
    record(job, "end")


@relay.handler("rate_limited", rate_limit=(5, 2.0))
def rate_limited_run(job: Job) -> None:
    """At most five starts per two seconds anywhere."""
    record(job, "start")
