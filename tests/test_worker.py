"""The worker runtime in-process: outcomes, retries, dead letters, snooze,
timeouts, scheduling, priorities, queues, heartbeats, the registry, wake-ups."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from relay_core import (
    Backoff,
    ConfigurationError,
    InvalidJobError,
    Job,
    JobCancelled,
    PermanentFailure,
    Relay,
    Snooze,
    Worker,
    monitor,
)
from relay_core.logs import POOL_CONNECT_WARNING, RepeatsFilter
from relay_core.outages import OutageLog
from relay_core.pools import all_in_use, make_pool
from relay_core.queries import sql
from relay_core.worker import completer as completer_module
from relay_core.worker import executor, lease_watch, runtime, startup
from relay_core.worker.aio import SlotLoop
from relay_core.worker.claim import PREFETCH_PAYLOAD_BYTES, hand_back_unheld, prefetch_per_slot
from relay_core.worker.completer import MAX_BATCH, MAX_BATCH_BYTES, ROW_LOCKED, Completer
from relay_core.worker.config import MAX_CONCURRENCY, WorkerConfig
from relay_core.worker.ledger import NOT_BEGUN, Ledger, Slot
from relay_core.worker.listener import NOT_LISTENING
from relay_core.worker.maintenance import Maintenance, heartbeat_once, sweep_once
from relay_core.worker.outcome import Kind, Outcome
from relay_core.worker.retention import Retention
from relay_core.worker.shutdown import HAND_BACK_GRACE_SECONDS, hand_back

from .helpers import (
    AT_COMMIT_SETTINGS,
    RESCUE_PARAMS,
    TcpProxy,
    claim_params,
    free_port,
    job_status,
    running_worker,
    status_counts,
    wait_for,
)

FAST = Backoff(base=0.05, factor=2, cap=1, jitter=0)


def test_handler_success_marks_job_succeeded(relay: Relay, db: psycopg.Connection) -> None:
    seen: list[tuple[int, object, int]] = []

    @relay.handler("send_email")
    def send_email(job: Job) -> None:
        seen.append((job.id, job.payload, job.attempt))

    job_id = relay.enqueue("send_email", {"to": "a@b.c"})
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert seen == [(job_id, {"to": "a@b.c"}, 1)]
    job = relay.get_job(job_id)
    assert job.finished_at is not None and job.started_at is not None and job.claimed_until is None


def test_failures_retry_with_backoff_then_die_with_full_history(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("flaky", max_attempts=3, backoff=Backoff(base=0.3, factor=2, jitter=0))
    def flaky(job: Job) -> None:
        raise ConnectionError(f"smtp down on attempt {job.attempt}")

    job_id = relay.enqueue("flaky")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=30)
    job = relay.get_job(job_id)
    assert job.attempts == 3
    assert job.last_error == "ConnectionError: smtp down on attempt 3"
    assert [e["attempt"] for e in job.errors] == [1, 2, 3]
    assert all(e["type"] == "ConnectionError" and "Traceback" in e["traceback"] for e in job.errors)
    assert all(e["worker"] and e["at"] for e in job.errors)
    # The rescheduling used the handler's backoff: attempt 2 started >= 0.3 s after attempt 1 failed.
    rows = db.execute(
        "SELECT (errors->0->>'at')::timestamptz, (errors->1->>'at')::timestamptz FROM relay.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert rows[1] - rows[0] >= timedelta(seconds=0.3)


def test_permanent_failure_is_dead_at_once(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("charge", max_attempts=10)
    def charge(job: Job) -> None:
        raise PermanentFailure("card number is invalid")

    job_id = relay.enqueue("charge")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "dead")
    job = relay.get_job(job_id)
    assert job.attempts == 1
    assert job.last_error == "PermanentFailure: card number is invalid"


def test_snooze_runs_later_without_spending_an_attempt(relay: Relay, db: psycopg.Connection) -> None:
    runs: list[int] = []

    @relay.handler("poll_export", max_attempts=1)
    def poll_export(job: Job) -> None:
        runs.append(job.attempt)
        if len(runs) < 3:
            raise Snooze(0.1)

    job_id = relay.enqueue("poll_export")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert runs == [1, 1, 1]
    assert relay.get_job(job_id).errors == []


def test_a_snooze_or_backoff_too_long_for_a_readable_run_at_is_refused(relay: Relay, db: psycopg.Connection) -> None:
    """PostgreSQL stores now() + 1e12 s (year 33715), but no Python datetime holds it: the job's
    page and every listing that shows it would fail from then on. Such delays are refused instead."""
    for bad in (1e12, float("inf"), float("nan"), "10", None, True):  # the text and None raised TypeError
        with pytest.raises(ValueError, match="snooze seconds must be a number"):
            Snooze(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            Backoff(base=bad, cap=bad)
    with pytest.raises(ValueError):
        Backoff(cap=60, jitter=1.5)
    for field in ("base", "factor"):  # a negative base retried at once, every time
        with pytest.raises(ValueError, match=f"backoff {field} must not be negative"):
            Backoff(**{field: -1})
    with pytest.raises(InvalidJobError, match=r"must be an instance, such as Backoff\(\)"):
        relay.handler("nap_class", backoff=Backoff)(lambda job: None)  # type: ignore[arg-type]

    @relay.handler("nap", max_attempts=2)
    def nap(job: Job) -> None:
        raise Snooze(1e12)

    job_id = relay.enqueue("nap")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=30)
    job = relay.get_job(job_id)  # still readable
    assert job.attempts == 2 and job.last_error.startswith("ValueError: snooze seconds")
    assert [j.id for j in monitor.list_jobs(db).jobs] == [job_id]


@pytest.mark.parametrize(
    "settings",
    [
        {"lease_seconds": 1e12, "heartbeat_interval": 10.0},  # claimed_until in year 33715: the job unreadable
        {"lease_seconds": float("inf"), "heartbeat_interval": 10.0},
        {"lease_seconds": float("nan"), "heartbeat_interval": 10.0},  # every claim fails: "interval out of range"
        {"heartbeat_interval": float("nan")},
        {"poll_interval": float("inf")},
        {"sweep_interval": float("nan")},
        # A renewal comes a round trip after it is due: so near the lease, a healthy worker's
        # leases ran out between renewals, and its own sweeper started its running jobs again.
        {"lease_seconds": 3.0, "heartbeat_interval": 2.9},
        {"lease_seconds": 30.0, "heartbeat_interval": 15.1},
        {"lease_seconds": 0.5, "heartbeat_interval": 0.1},
    ],
)
def test_a_lease_or_interval_a_worker_cannot_use_is_refused_at_start(
    relay: Relay, monkeypatch: pytest.MonkeyPatch, settings: dict[str, float]
) -> None:
    with pytest.raises(ConfigurationError):
        WorkerConfig(**settings)
    if "lease_seconds" in settings:  # the same values from the environment (a heartbeat by default: a third of it)
        monkeypatch.setenv("RELAY_LEASE_SECONDS", str(settings["lease_seconds"]))
        monkeypatch.setenv("RELAY_HEARTBEAT_INTERVAL", str(settings["heartbeat_interval"]))
        with pytest.raises(ConfigurationError):
            relay.worker()


@pytest.mark.parametrize(
    ("variable", "value", "override"),
    [
        ("RELAY_CONCURRENCY", "abc", {"concurrency": 2}),
        ("RELAY_LEASE_SECONDS", "soon", {"lease_seconds": 12.0}),
        ("RELAY_LISTEN", "maybe", {"listen": False}),
        ("RELAY_PRUNE", "often", {"retention": None}),
    ],
)
def test_a_setting_given_explicitly_wins_over_its_unreadable_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, override: dict[str, object]
) -> None:
    """Every variable was read before the overrides were applied: `relay worker --concurrency 2` refused
    to start over RELAY_CONCURRENCY=abc, though a flag wins over its variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        WorkerConfig.from_env()
    config = WorkerConfig.from_env(**override)
    assert {name: getattr(config, name) for name in override} == override


def test_the_heartbeat_follows_the_lease_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third of the lease given, not of the environment's (or the default) lease: relay.worker(lease_seconds=15)
    was refused with a heartbeat of 10 s, over half of it."""
    monkeypatch.delenv("RELAY_LEASE_SECONDS", raising=False)
    monkeypatch.delenv("RELAY_HEARTBEAT_INTERVAL", raising=False)
    assert WorkerConfig(lease_seconds=15.0).heartbeat_interval == 5.0
    assert WorkerConfig.from_env(lease_seconds=15.0).heartbeat_interval == 5.0
    assert WorkerConfig.from_env().heartbeat_interval == 10.0
    monkeypatch.setenv("RELAY_HEARTBEAT_INTERVAL", "4")
    assert WorkerConfig.from_env(lease_seconds=15.0).heartbeat_interval == 4.0
    with pytest.raises(ConfigurationError, match="at least"):
        WorkerConfig(heartbeat_interval=0.001)


def test_the_stuck_handlers_a_worker_allows_follow_its_concurrency_where_it_owns_its_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As many as the slots it was given, here or in the environment, unless set; a worker in a
    process of the application's, which a stop it did not ask for would leave without one, has no
    limit unless given one."""
    monkeypatch.delenv("RELAY_CONCURRENCY", raising=False)
    monkeypatch.delenv("RELAY_MAX_STUCK_HANDLERS", raising=False)
    assert WorkerConfig().max_stuck_handlers is None
    assert WorkerConfig(owns_process=True).max_stuck_handlers == 8
    assert WorkerConfig.from_env(concurrency=3, owns_process=True).max_stuck_handlers == 3
    monkeypatch.setenv("RELAY_CONCURRENCY", "5")
    assert WorkerConfig.from_env(owns_process=True).max_stuck_handlers == 5
    assert WorkerConfig.from_env().max_stuck_handlers is None
    monkeypatch.setenv("RELAY_MAX_STUCK_HANDLERS", "0")
    assert WorkerConfig.from_env().max_stuck_handlers == 0
    assert WorkerConfig.from_env(owns_process=True).max_stuck_handlers == 0
    for bad in (-1, 1.5, True, "2", MAX_CONCURRENCY + 1):
        with pytest.raises(ConfigurationError, match="max_stuck_handlers must be"):
            WorkerConfig(max_stuck_handlers=bad)  # type: ignore[arg-type]


def test_a_queue_named_twice_is_served_once() -> None:
    assert WorkerConfig(queues=("mail", "default", "mail")).queues == ("mail", "default")


def test_queues_given_as_one_string_are_refused_not_split_into_letters() -> None:
    """queues="emails" became the queues e, m, a, i, l and s: the worker started, served none
    of the queues meant, and said nothing."""
    with pytest.raises(ConfigurationError, match=r"queues=\['emails'\]"):
        WorkerConfig(queues="emails")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "settings",
    [
        {"concurrency": 2.5},  # passed 1 <= x <= 1000, then the worker crashed after registering
        {"concurrency": True},  # one slot, by accident
        {"concurrency": "8"},  # TypeError from the comparison
        {"lease_seconds": "30"},
        {"heartbeat_interval": "3"},
        {"poll_interval": None},
        {"shutdown_timeout": "25"},
        {"sweep_interval": False},
        {"listen": "false"},  # a true value: the worker listened
        {"self_vacuum": "no"},
        {"retention": 3600},  # every prune pass failed, and the registry and rate records were never trimmed
    ],
)
def test_settings_of_the_wrong_type_are_refused_at_start(settings: dict[str, object]) -> None:
    name = next(iter(settings))
    with pytest.raises(ConfigurationError, match=name):
        WorkerConfig(**settings)  # type: ignore[arg-type]
    if settings[name] is not None:  # relay.worker(poll_interval=None) means the default, as an unset CLI option
        with pytest.raises(ConfigurationError, match=name):
            Relay("postgresql://relay@127.0.0.1/relay").worker(**settings)


def test_retention_none_turns_pruning_off_in_a_worker_made_by_relay_worker() -> None:
    """relay.worker(retention=None) was read as "not given": the worker pruned at the default ages."""
    app = Relay("postgresql://relay@127.0.0.1/relay")
    assert app.worker(retention=None).config.retention is None
    assert app.worker(retention=Retention(dead=60)).config.retention == Retention(dead=60)
    assert app.worker().config.retention == Retention()


def test_a_worker_without_handlers_refuses_to_start(relay: Relay, db: psycopg.Connection) -> None:
    """A worker whose app registered no handler (a handlers module never imported) started and claimed
    every job: each attempt failed with HandlerNotFound, and jobs with one attempt ended dead."""
    job_id = relay.enqueue("send_email", max_attempts=1)
    with pytest.raises(ConfigurationError, match="no handlers"):
        relay.run_worker(poll_interval=0.05)
    assert db.execute("SELECT status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "queued",
        0,
    )
    assert db.execute("SELECT count(*) FROM relay.workers").fetchone()[0] == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_shutdown_timeout_a_worker_cannot_keep_is_refused_at_start(
    relay: Relay, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """nan made the worker hand back its jobs at SIGTERM without waiting; inf outwaits any drain window."""
    with pytest.raises(ConfigurationError, match="shutdown_timeout"):
        WorkerConfig(shutdown_timeout=float(value))
    monkeypatch.setenv("RELAY_SHUTDOWN_TIMEOUT", value)
    with pytest.raises(ConfigurationError, match="shutdown_timeout"):
        relay.worker()


def test_unknown_type_fails_naming_type_and_worker(relay: Relay, db: psycopg.Connection) -> None:
    job_id = relay.enqueue("nobody_handles_this", max_attempts=1)
    with running_worker(relay) as worker:
        wait_for(lambda: job_status(db, job_id) == "dead")
    error = relay.get_job(job_id).last_error
    assert "nobody_handles_this" in error and worker.id in error and error.startswith("HandlerNotFound")


def test_handler_past_its_timeout_is_a_failed_attempt(relay: Relay, db: psycopg.Connection) -> None:
    release = threading.Event()

    @relay.handler("hang", timeout=0.5, max_attempts=1)
    def hang(job: Job) -> None:
        release.wait(30)

    @relay.handler("after")
    def after(job: Job) -> None:
        return None

    job_id = relay.enqueue("hang")
    with running_worker(relay, concurrency=1, lease_seconds=1.5, heartbeat_interval=0.3) as worker:
        wait_for(lambda: job_id in worker.ledger.overdue, timeout=15, what="the timeout to pass")
        # The stuck thread does not eat the only slot: the next job still runs.
        next_id = relay.enqueue("after")
        wait_for(lambda: job_status(db, next_id) == "succeeded", timeout=15)
        # Its thread still runs, so the job keeps its lease, renewed past the 1.5 s lease.
        time.sleep(2.0)
        assert job_status(db, job_id) == "claimed"
        release.set()
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
    job = relay.get_job(job_id)
    assert job.last_error.startswith("JobTimeout") and job.attempts == 1
    assert [e["type"] for e in job.errors] == ["JobTimeout"]


def test_a_transactional_handler_that_commits_past_its_timeout_is_counted_as_a_success(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A transactional handler that returned in time, but whose success write waited past the
    timeout (here on a row lock), commits its success through its transaction, fenced by the lease it
    still holds. The worker's count of successes (the stop line's) left it out."""
    started, go = threading.Event(), threading.Event()

    @relay.handler("slow_tx", timeout=0.5, max_attempts=1)
    def slow_tx(job: Job, conn: psycopg.Connection) -> None:
        started.set()
        go.wait(30)

    job_id = relay.enqueue("slow_tx")
    with running_worker(relay, concurrency=1, lease_seconds=3, heartbeat_interval=0.3) as worker:
        wait_for(started.is_set, timeout=15, what="the handler to start")
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
            go.set()  # the handler returns at once; its success write waits for this lock
            wait_for(lambda: job_id in worker.ledger.overdue, timeout=15, what="the timeout to pass")
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=15, what="the commit")
        wait_for(lambda: worker.counters.succeeded == 1, timeout=5, what="the success counted")
    assert (worker.counters.retried, worker.counters.dead, worker.counters.lost) == (0, 0, 0)


def test_async_handlers_cancelled_at_their_timeouts_are_not_stuck_nor_leave_slots_behind(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count of stuck handlers was taken as the timeouts were decided, before a cancelled async
    handler could return: a batch timing out at once stopped the worker though no thread was stuck.
    And each timeout left its slot and event loop in the worker's lists for good."""
    monkeypatch.setattr(runtime, "STUCK_AFTER_SECONDS", 0.5)

    @relay.handler("waits", timeout=0.1, max_attempts=1)
    async def waits(job: Job) -> None:
        await asyncio.sleep(60)

    jobs = [relay.enqueue("waits") for _ in range(20)]
    with running_worker(relay, concurrency=2, max_stuck_handlers=0, poll_interval=0.05) as worker:
        wait_for(lambda: all(job_status(db, j) == "dead" for j in jobs), timeout=30, what="every job to time out")
        time.sleep(1.5)  # past STUCK_AFTER_SECONDS of the last timeout, with the lease watch's checks between
        assert not worker.stopping.is_set() and worker.stopped_for_stuck_handlers == 0
        assert worker.stuck_handlers(time.monotonic()) == 0
        assert len(worker._slots) == 2 and len(worker._slot_loops) == 2
    assert {relay.get_job(j).last_error.split(":")[0] for j in jobs} == {"JobTimeout"}


def test_a_slot_whose_event_loop_failed_to_close_is_not_left_counted_as_stuck(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot left the worker's list only after its loop closed: a close that raised kept an
    abandoned slot there with no thread behind it, counted as stuck for good."""
    monkeypatch.setattr(runtime, "STUCK_AFTER_SECONDS", 0.3)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the slot thread's own failure, expected here
    closing = SlotLoop.close

    def close_then_raise(self: SlotLoop) -> None:
        closing(self)
        raise RuntimeError("a task left on the loop would not cancel")

    monkeypatch.setattr(SlotLoop, "close", close_then_raise)

    @relay.handler("waits", timeout=0.1, max_attempts=1)
    async def waits(job: Job) -> None:
        await asyncio.sleep(60)

    job_id = relay.enqueue("waits")
    with running_worker(relay, concurrency=1, max_stuck_handlers=0) as worker:
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=15, what="the timeout")
        time.sleep(1.0)
        assert worker.stuck_handlers(time.monotonic()) == 0
        assert not worker.stopping.is_set()


def test_a_stuck_handler_whose_job_was_taken_over_still_counts_as_stuck(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stuck handlers were counted from the jobs the worker still held past their timeouts, so one
    whose job another worker took over (its lease lost in an outage) was forgotten while its
    thread ran on, and the limit came back after every outage."""
    monkeypatch.setattr(runtime, "STUCK_AFTER_SECONDS", 0.5)
    release = threading.Event()

    @relay.handler("hangs", timeout=0.2, max_attempts=5)
    def hangs(job: Job) -> None:
        release.wait(60)

    first = relay.enqueue("hangs")
    try:
        with running_worker(
            relay, concurrency=1, max_stuck_handlers=1, lease_seconds=3.0, heartbeat_interval=0.3
        ) as worker:
            wait_for(lambda: first in worker.ledger.overdue, timeout=15, what="the first timeout")
            # Taken over: another claim of the job (its lease token moved on), which the next heartbeat finds.
            db.execute(
                "UPDATE relay.jobs SET lease_token = lease_token + 1, claimed_by = 'other' WHERE id = %s", (first,)
            )
            wait_for(lambda: first not in worker.ledger.overdue, timeout=15, what="the heartbeat to find it lost")
            second = relay.enqueue("hangs")
            wait_for(lambda: worker.stopping.is_set(), timeout=15, what="the worker to stop itself")
            assert worker.stopped_for_stuck_handlers == 2
    finally:
        release.set()
    assert [e["type"] for e in relay.get_job(second).errors] == ["JobTimeout"]


def test_progress_after_the_timeout_tells_the_handler_to_stop_and_writes_nothing(
    relay: Relay, db: psycopg.Connection
) -> None:
    """It answered True past the timeout, renewing the lease: a handler that went on while its
    reports were taken ran on as if its attempt were still open."""
    answers: list[bool] = []

    @relay.handler("reports", timeout=0.3, max_attempts=1)
    def reports(job: Job) -> None:
        while not job.lease_lost:
            time.sleep(0.02)
        answers.append(job.progress(50, "after the timeout"))

    job_id = relay.enqueue("reports")
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
    assert answers == [False]
    job = relay.get_job(job_id)
    assert job.progress is None and job.last_error.startswith("JobTimeout")


def test_a_handler_registered_after_the_worker_was_made_runs_on_it(relay: Relay, db: psycopg.Connection) -> None:
    """The worker kept the handlers registered when it was made: an app that built it first and
    imported its handler modules after had each of their jobs fail as "no handler" until dead."""
    job_id = relay.enqueue("late")
    worker = relay.worker(concurrency=1, poll_interval=0.05)
    relay.handler("late")(lambda job: "ran")
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: job_status(db, job_id) != "queued", timeout=15, what="the job to run")
        wait_for(lambda: job_status(db, job_id) != "claimed", timeout=15, what="the job to end")
    finally:
        worker.stop()
        thread.join(30)
    job = relay.get_job(job_id)
    assert (job.status, job.result, job.errors) == ("succeeded", "ran", []), job


def test_retry_after_a_timeout_waits_for_the_stuck_run_to_end(relay: Relay, db: psycopg.Connection) -> None:
    """Python cannot stop a thread: the retry of a timed-out job starts only once its first run returned."""
    runs: list[tuple[int, float, float]] = []

    @relay.handler("slow_once", timeout=0.3, max_attempts=2, backoff=FAST)
    def slow_once(job: Job) -> str:
        started = time.monotonic()
        if job.attempt == 1:
            time.sleep(2.0)  # ignores job.lease_lost, as a blocking library call would
        runs.append((job.attempt, started, time.monotonic()))
        return "done"

    job_id = relay.enqueue("slow_once")
    with running_worker(relay, concurrency=2, poll_interval=0.05, lease_seconds=3.0, heartbeat_interval=0.5):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20)
    assert [attempt for attempt, _, _ in runs] == [1, 2]
    (_, _, first_end), (_, second_start, _) = runs
    assert second_start >= first_end, "the retry overlapped the run that timed out"
    job = relay.get_job(job_id)
    assert [e["type"] for e in job.errors] == ["JobTimeout"] and job.attempts == 2


def test_timed_out_handler_that_returns_is_still_a_timeout(relay: Relay, db: psycopg.Connection) -> None:
    """A cooperative handler told to stop returns early; that return is not a success."""

    @relay.handler("cooperative", timeout=0.3, max_attempts=1)
    def cooperative(job: Job) -> None:
        while not job.lease_lost:
            time.sleep(0.02)

    job_id = relay.enqueue("cooperative")
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
    assert relay.get_job(job_id).last_error.startswith("JobTimeout")


class RaisingBackoff(Backoff):
    """A handler's own backoff with a bug in it."""

    def delay(self, attempt: int, rand: Any = None) -> float:  # type: ignore[override]
        raise IndexError("no delay for this attempt")


class InterruptingBackoff(Backoff):
    """A handler's own backoff raising what no ``except Exception`` catches."""

    def delay(self, attempt: int, rand: Any = None) -> float:  # type: ignore[override]
        raise KeyboardInterrupt("from the backoff")


class NaNBackoff(Backoff):
    def delay(self, attempt: int, rand: Any = None) -> float:  # type: ignore[override]
        return float("nan")


class UnshowableDelay:
    """What a handler's own backoff gave as a delay: no number, and its repr raises."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class UnshowableDelayBackoff(Backoff):
    def delay(self, attempt: int, rand: Any = None) -> float:  # type: ignore[override]
        return UnshowableDelay()  # type: ignore[return-value]


class SnoozeWithoutSeconds(Snooze):
    def __init__(self) -> None:  # never sets seconds
        Exception.__init__(self, "later")


class SnoozeWhoseSecondsInterrupt(Snooze):
    """A Snooze whose ``seconds`` raises what no ``except Exception`` catches, read as the attempt is classified."""

    def __init__(self) -> None:
        Exception.__init__(self, "later")

    @property  # type: ignore[override]
    def seconds(self) -> float:
        raise KeyboardInterrupt("from seconds")


def test_a_failure_whose_classification_is_interrupted_is_still_a_failed_attempt(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Classifying an attempt runs code of the handler's (a Snooze's ``seconds``): a KeyboardInterrupt
    from it passed ``except Exception`` and ended the slot's thread with its job held."""

    @relay.handler("odd", max_attempts=3)
    def odd(job: Job) -> None:
        if job.payload.get("fail"):
            raise SnoozeWhoseSecondsInterrupt()

    failing = relay.enqueue("odd", {"fail": True})
    with running_worker(relay, concurrency=1):
        wait_for(lambda: relay.get_job(failing).errors, what="the failed attempt recorded")
        after = relay.enqueue("odd", {})
        wait_for(lambda: job_status(db, after) == "succeeded", what="the slot to run the next job")
    [entry] = relay.get_job(failing).errors
    assert entry["message"] == "SnoozeWhoseSecondsInterrupt (and classifying it raised KeyboardInterrupt)"


def test_a_handler_decorator_written_without_its_job_type_is_refused(relay: Relay) -> None:
    """``@relay.handler`` with no parentheses took the function as the type, put the decorator in its
    place and registered nothing: the worker started on its other handlers, and the type's jobs failed
    with "no handler" until they were dead."""
    with pytest.raises(InvalidJobError, match=re.escape("write @relay.handler('send_email'), naming the job type")):

        @relay.handler  # type: ignore[arg-type]
        def send_email(job) -> None:  # type: ignore[no-untyped-def]
            return None

    assert relay.handlers == {}


def test_a_job_cancelled_no_one_asked_for_is_a_failure_with_its_message(relay: Relay, db: psycopg.Connection) -> None:
    """A handler raising JobCancelled when no admin asked ended its job cancelled, without its message
    or an error in its history: a move the state machine keeps for an admin's stop."""

    @relay.handler("gives_up", max_attempts=1)
    def gives_up(job) -> None:  # type: ignore[no-untyped-def]
        raise JobCancelled("the handler decided to give up")

    job_id = relay.enqueue("gives_up")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) in ("dead", "cancelled"), what="the job to end")
    job = relay.get_job(job_id)
    assert (job.status, job.last_error) == ("dead", "JobCancelled: the handler decided to give up")
    assert [entry["type"] for entry in job.errors] == ["JobCancelled"]


def test_an_attempt_whose_classifying_raised_keeps_the_error_type_name_bounded() -> None:
    """The fallback for an attempt whose classifying raised (its Snooze's seconds interrupting) kept the
    exception class's name whole, where every other path keeps 200 characters of it."""
    long_named = type("S" * 5000, (SnoozeWhoseSecondsInterrupt,), {})
    now = datetime.now(UTC)
    job = Job(1, "t", "default", 0, {}, attempt=1, max_attempts=3, lease_token=1, run_at=now, created_at=now)
    outcome = executor._ended_by(long_named(), job, None, "w", 0.0)
    assert outcome.error is not None and outcome.error["type"] == "S" * 200
    assert outcome.message == "S" * 200 + " (and classifying it raised KeyboardInterrupt)"


def test_a_backoff_that_is_no_backoff_is_refused_at_registration(relay: Relay) -> None:
    with pytest.raises(InvalidJobError, match=r"^backoff: must be a relay_core\.Backoff"):
        relay.handler("t", backoff=lambda n: 2**n)(lambda job: None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({"backoff": RaisingBackoff()}, "its backoff raised IndexError; the default backoff was used"),
        ({"backoff": InterruptingBackoff()}, "its backoff raised KeyboardInterrupt; the default backoff was used"),
        ({"backoff": NaNBackoff()}, "its backoff gave a delay of nan"),
        ({"backoff": UnshowableDelayBackoff()}, "its backoff gave a delay of a UnshowableDelay that cannot be shown"),
        ({}, "SnoozeWithoutSeconds without a usable delay"),
    ],
    ids=[
        "backoff-raises",
        "backoff-interrupts",
        "backoff-gives-nan",
        "backoff-gives-unshowable",
        "snooze-without-seconds",
    ],
)
def test_a_failure_whose_classification_fails_is_still_a_failed_attempt_and_the_slot_lives_on(
    relay: Relay, db: psycopg.Connection, spec: dict, said: str
) -> None:
    """The backoff and the Snooze are the handler's code: raising while the attempt was classified
    killed the slot thread, and the job stayed claimed, its lease renewed, forever."""
    ran: list[int] = []

    @relay.handler("odd", max_attempts=3, **spec)
    def odd(job: Job) -> None:
        ran.append(job.id)
        if job.payload.get("fail"):
            raise SnoozeWithoutSeconds() if not spec else RuntimeError("boom")

    failing = relay.enqueue("odd", {"fail": True})
    with running_worker(relay, concurrency=1):
        wait_for(lambda: relay.get_job(failing).errors, what="the failed attempt recorded")
        after = relay.enqueue("odd", {})
        wait_for(lambda: job_status(db, after) == "succeeded", what="the slot to run the next job")
    job = relay.get_job(failing)
    assert said in job.errors[0]["message"], job.errors[0]
    assert job.status in ("queued", "claimed", "dead") and job.errors[0]["attempt"] == 1


@pytest.mark.parametrize(
    "backoff",
    [RaisingBackoff(), InterruptingBackoff(), UnshowableDelayBackoff()],
    ids=["raises", "interrupts", "gives-unshowable"],
)
def test_a_timed_out_run_keeps_its_lease_when_its_backoff_raises(
    relay: Relay, db: psycopg.Connection, backoff: Backoff
) -> None:
    """Past its timeout the run left the ledger's table of running jobs before its outcome was
    decided; deciding raised, so its lease was renewed no more and its retry ran beside it.
    A KeyboardInterrupt from the backoff ended the lease watch's thread, and with it every
    timeout after."""
    runs: list[tuple[int, float, float]] = []

    @relay.handler("slow", timeout=0.5, max_attempts=2, backoff=backoff)
    def slow(job: Job) -> None:
        began = time.monotonic()
        time.sleep(3.0)
        runs.append((job.attempt, began, time.monotonic()))

    job_id = relay.enqueue("slow")
    with running_worker(relay, concurrency=2, lease_seconds=1.0, heartbeat_interval=0.2, sweep_interval=0.3):
        wait_for(lambda: len(runs) == 2, timeout=30, what="both attempts to end")
    (first, second) = sorted(runs)
    assert second[1] >= first[2], f"attempt 2 began at {second[1]:.2f}, before attempt 1 ended at {first[2]:.2f}"
    said = {
        RaisingBackoff: "its backoff raised IndexError",
        InterruptingBackoff: "its backoff raised KeyboardInterrupt",
        UnshowableDelayBackoff: "its backoff gave a delay of a UnshowableDelay that cannot be shown",
    }[type(backoff)]
    assert said in relay.get_job(job_id).errors[0]["message"]


def test_a_task_of_an_async_handler_raising_systemexit_leaves_no_run_behind(
    relay: Relay, db: psycopg.Connection
) -> None:
    """asyncio raises SystemExit out of the loop from any task: the handler's own task stayed pending
    and resumed beside its retry the next time the slot's loop ran."""
    steps: list[tuple[int, int]] = []

    @relay.handler("gives_up", max_attempts=2)
    async def gives_up(job: Job) -> None:
        async def library() -> None:
            await asyncio.sleep(0.05)
            raise SystemExit("a library gave up")

        if job.attempt == 1:
            asyncio.get_running_loop().create_task(library())
        for step in range(10):
            steps.append((job.attempt, step))
            await asyncio.sleep(0.1)

    job_id = relay.enqueue("gives_up")
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=30, what="the retry to succeed")
        time.sleep(0.5)
    assert [step for attempt, step in steps if attempt == 1] == [0], steps
    assert [step for attempt, step in steps if attempt == 2] == list(range(10))


def test_session_settings_a_transactional_handler_leaves_do_not_reach_relays_statements(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A plain SET commits with the success and stayed on the pooled connection: read-only, it made
    the next claim on it fail, and the worker stopped."""
    seen: list[str] = []

    @relay.handler("sets_read_only")
    def sets_read_only(job: Job, conn: psycopg.Connection) -> None:
        seen.append(conn.execute("SHOW default_transaction_read_only").fetchone()[0])
        conn.execute("SET default_transaction_read_only = on")

    ids = relay.enqueue_many([{"type": "sets_read_only"} for _ in range(4)])
    with running_worker(relay, concurrency=1) as worker:
        wait_for(lambda: all(job_status(db, i) == "succeeded" for i in ids), what="every job")
        assert not worker.stopped.is_set()
    assert seen == ["off"] * 4


def test_a_forked_child_of_a_handler_that_exits_ends_its_process(relay: Relay, db: psycopg.Connection) -> None:
    """The child's SystemExit became a job outcome, and the child went back to serving the slot's
    loop for good, holding the worker's database connections."""
    statuses: list[int] = []

    @relay.handler("forks")
    def forks(job: Job) -> None:
        pid = os.fork()
        if pid == 0:
            sys.exit(3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses.append(os.waitstatus_to_exitcode(status))
                return
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise RuntimeError("the child did not exit")

    job_id = relay.enqueue("forks")
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) in ("succeeded", "dead", "queued") and statuses, what="the job")
    assert statuses == [3]
    assert job_status(db, job_id) == "succeeded"


def test_transactional_handler_commits_with_success_or_not_at_all(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    db.execute("CREATE TABLE relay_test.orders_sent (job_id bigint PRIMARY KEY)")
    try:

        @relay.handler("tx_ok")
        def tx_ok(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("INSERT INTO relay_test.orders_sent VALUES (%s)", (job.id,))

        @relay.handler("tx_fail", max_attempts=1)
        def tx_fail(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("INSERT INTO relay_test.orders_sent VALUES (%s)", (job.id,))
            raise RuntimeError("after writing")

        ok_id, fail_id = relay.enqueue("tx_ok"), relay.enqueue("tx_fail")
        with running_worker(relay):
            wait_for(lambda: job_status(db, ok_id) == "succeeded" and job_status(db, fail_id) == "dead")
        sent = [r[0] for r in db.execute("SELECT job_id FROM relay_test.orders_sent")]
        assert sent == [ok_id]
    finally:
        db.execute("DROP TABLE relay_test.orders_sent")


def test_a_transactional_handlers_settings_hold_until_its_commit(relay: Relay, db: psycopg.Connection) -> None:
    """What a handler sets for its transaction (SET LOCAL) is still set as it commits: a deferred trigger
    sees its search_path, and its synchronous_commit decides how the commit waits."""
    db.execute(AT_COMMIT_SETTINGS)
    try:

        @relay.handler("sets_for_its_commit")
        def sets_for_its_commit(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("SET LOCAL synchronous_commit = off")
            conn.execute("SET LOCAL search_path = relay_test, public")
            conn.execute("INSERT INTO handler_rows VALUES (%s)", (job.id,))

        job_id = relay.enqueue("sets_for_its_commit")
        with running_worker(relay, concurrency=1):
            wait_for(lambda: job_status(db, job_id) == "succeeded", what="the job to succeed")
        at_commit = db.execute("SELECT search_path, synchronous_commit FROM relay_test.commit_settings")
        assert at_commit.fetchall() == [("relay_test, public", "off")]
    finally:
        db.execute("DROP TABLE relay_test.handler_rows, relay_test.commit_settings")
        db.execute("DROP FUNCTION relay_test.record_commit_settings()")


def test_a_transactional_handler_that_narrows_its_role_succeeds(relay: Relay, db: psycopg.Connection) -> None:
    """SET LOCAL ROLE, as row-level security asks: Relay wrote the success as that role, which may not
    touch relay.jobs, so every attempt's work was rolled back and the job ended dead."""
    role = f"relay_narrow_test_{os.getpid()}"
    db.execute(f"CREATE ROLE {role} NOLOGIN")
    db.execute("CREATE TABLE relay_test.rows_written (job_id bigint PRIMARY KEY)")
    db.execute(f"GRANT USAGE ON SCHEMA relay_test TO {role}")
    db.execute(f"GRANT INSERT ON relay_test.rows_written TO {role}")
    try:

        @relay.handler("as_tenant", max_attempts=1)
        def as_tenant(job: Job, conn: psycopg.Connection) -> str:
            conn.execute(f"SET LOCAL ROLE {role}")
            conn.execute("INSERT INTO relay_test.rows_written VALUES (%s)", (job.id,))
            return conn.execute("SELECT current_user").fetchone()[0]

        job_id = relay.enqueue("as_tenant")
        with running_worker(relay, concurrency=1):
            wait_for(lambda: job_status(db, job_id) in ("succeeded", "dead"), what="the job to end")
        status, result, last_error = db.execute(
            "SELECT status, result, last_error FROM relay.jobs WHERE id = %s", (job_id,)
        ).fetchone()
        assert (status, last_error) == ("succeeded", None)
        assert result == role  # the handler ran as the role it took
        assert [r[0] for r in db.execute("SELECT job_id FROM relay_test.rows_written")] == [job_id]
    finally:
        db.execute("DROP TABLE relay_test.rows_written")
        db.execute(f"REVOKE USAGE ON SCHEMA relay_test FROM {role}")
        db.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize(
    ("end", "then"),
    [
        ("COMMIT", "returns"),
        ("ROLLBACK", "returns"),
        ("COMMIT", "inserts"),
        ("ROLLBACK", "selects"),
        ("COMMIT", "raises"),
    ],
)
def test_a_transactional_handler_that_ends_its_own_transaction_fails_for_good(
    relay: Relay, db: psycopg.Connection, end: str, then: str
) -> None:
    """psycopg passes a COMMIT or ROLLBACK written in SQL to the server, and the fenced success then
    committed on its own: after a ROLLBACK the job said succeeded with its work gone; after a COMMIT,
    a job whose lease was taken over ran again and kept both runs' work, and one that raised after
    it was retried, committing its work again each time. A statement after the end began a new
    transaction that hid it. Such a job ends dead at once, saying why."""
    db.execute("CREATE TABLE relay_test.own_ends (job_id bigint)")
    try:

        @relay.handler("ends_own", max_attempts=3)
        def ends_own(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("INSERT INTO relay_test.own_ends VALUES (%s)", (job.id,))
            conn.execute(end)
            if then == "inserts":
                conn.execute("INSERT INTO relay_test.own_ends VALUES (-1)")
            elif then == "selects":
                conn.execute("SELECT 1")
            elif then == "raises":
                raise RuntimeError("after its own end")

        job_id = relay.enqueue("ends_own")
        with running_worker(relay):
            wait_for(lambda: job_status(db, job_id) == "dead", what="the job to end dead")
        job = relay.get_job(job_id)
        assert job.attempts == 1 and job.result is None
        assert job.last_error.startswith("PermanentFailure") and "ended its own transaction" in job.last_error
        written = sorted(row[0] for row in db.execute("SELECT job_id FROM relay_test.own_ends"))
        assert written == sorted(([job_id] if end == "COMMIT" else []) + ([-1] if then == "inserts" else []))
    finally:
        db.execute("DROP TABLE relay_test.own_ends")


def test_a_transactional_handler_raising_psycopgs_rollback_fails_its_attempt_at_once(
    relay: Relay, db: psycopg.Connection
) -> None:
    """psycopg.Rollback leaves the transaction block it ends quietly, and the block is Relay's: no
    outcome was written, and the job sat claimed until its lease ran out, then failed as a worker
    that "stopped heartbeating", on every attempt."""

    @relay.handler("rolls_back", max_attempts=1)
    def rolls_back(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("SELECT 1")
        raise psycopg.Rollback()

    job_id = relay.enqueue("rolls_back")
    with running_worker(relay, lease_seconds=30):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=10, what="the attempt to fail")
    job = relay.get_job(job_id)
    assert job.last_error.startswith("RuntimeError") and "raised psycopg.Rollback" in job.last_error


def test_a_transactional_handlers_success_is_stamped_when_it_ends_not_when_it_began(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The success is written in the handler's transaction, whose now() is when the handler began:
    finished_at said so, and retention measured the job's age from there."""

    @relay.handler("tx_slow")
    def tx_slow(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("SELECT 1")
        time.sleep(1.5)

    job_id = relay.enqueue("tx_slow")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    record = relay.get_job(job_id)
    assert (record.finished_at - record.started_at).total_seconds() >= 1.4


def test_a_transactional_handler_at_a_stricter_isolation_level_is_told_why_its_success_was_not_written(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Heartbeats renew the job's row; REPEATABLE READ cannot then update it, and the error says so."""
    db.execute("CREATE TABLE relay_test.strict_writes (job_id bigint)")
    try:

        @relay.handler("strict", max_attempts=1)
        def strict(job: Job, conn: psycopg.Connection) -> None:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("INSERT INTO relay_test.strict_writes VALUES (%s)", (job.id,))  # the snapshot is taken
            time.sleep(1.2)  # heartbeats every 0.3 s renew the lease meanwhile

        job_id = relay.enqueue("strict")
        with running_worker(relay, concurrency=1, lease_seconds=1.5, heartbeat_interval=0.3):
            wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
        job = relay.get_job(job_id)
        assert job.last_error.startswith("SuccessNotRecorded"), job.last_error
        assert "READ COMMITTED" in job.last_error and "heartbeat" in job.last_error
        assert db.execute("SELECT count(*) FROM relay_test.strict_writes").fetchone()[0] == 0, "its work rolled back"
    finally:
        db.execute("DROP TABLE relay_test.strict_writes")


def test_scheduled_job_waits_for_its_time(relay: Relay, db: psycopg.Connection) -> None:
    started: dict[int, float] = {}

    @relay.handler("later")
    def later(job: Job) -> None:
        started[job.id] = time.time()

    db_now = db.execute("SELECT now()").fetchone()[0]
    run_at = db_now + timedelta(seconds=1.5)
    with running_worker(relay, poll_interval=0.2):
        job_id = relay.enqueue("later", run_at=run_at)
        time.sleep(0.5)
        assert job_status(db, job_id) == "queued"
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=10)
    lag = db.execute(
        "SELECT extract(epoch FROM started_at - run_at) FROM relay.jobs WHERE id = %s", (job_id,)
    ).fetchone()[0]
    assert 0 <= lag < 1.0, f"started {lag}s after its run_at"


def test_lower_priority_number_runs_first_then_older(relay: Relay, db: psycopg.Connection) -> None:
    order: list[str] = []

    @relay.handler("p")
    def p(job: Job) -> None:
        order.append(job.payload["name"])

    relay.enqueue("p", {"name": "normal-1"})
    relay.enqueue("p", {"name": "urgent"}, priority=-10)
    relay.enqueue("p", {"name": "normal-2"})
    relay.enqueue("p", {"name": "bulk"}, priority=10)
    with running_worker(relay, concurrency=1):
        wait_for(lambda: len(order) == 4)
    assert order == ["urgent", "normal-1", "normal-2", "bulk"]


def test_worker_serves_only_its_queues(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("q")
    def q(job: Job) -> None:
        return None

    mine = [relay.enqueue("q", queue="emails"), relay.enqueue("q", queue="reports")]
    other = relay.enqueue("q", queue="default")
    with running_worker(relay, queues=("emails", "reports")):
        wait_for(lambda: all(job_status(db, j) == "succeeded" for j in mine))
        time.sleep(0.5)
        assert job_status(db, other) == "queued"


def test_heartbeats_keep_a_long_job_from_running_twice(relay: Relay, db: psycopg.Connection) -> None:
    runs: list[int] = []

    @relay.handler("long")
    def long_job(job: Job) -> None:
        runs.append(job.id)
        time.sleep(4)

    job_id = relay.enqueue("long")
    with (
        running_worker(relay, lease_seconds=1.5, heartbeat_interval=0.3, sweep_interval=0.2),
        running_worker(relay, lease_seconds=1.5, heartbeat_interval=0.3, sweep_interval=0.2),
    ):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20)
    assert runs == [job_id], "a job longer than its lease ran twice"
    assert relay.get_job(job_id).errors == []


def test_worker_registry_records_and_retires_a_worker(relay: Relay, db: psycopg.Connection) -> None:
    with running_worker(relay, queues=("a", "b"), concurrency=3, heartbeat_interval=0.3) as worker:
        row = wait_for(
            lambda: db.execute(
                "SELECT queues, concurrency, pid, stopped_at FROM relay.workers WHERE id = %s", (worker.id,)
            ).fetchone()
        )
        assert row[0] == ["a", "b"] and row[1] == 3 and row[3] is None
        first_seen = db.execute("SELECT last_seen_at FROM relay.workers WHERE id = %s", (worker.id,)).fetchone()[0]
        wait_for(
            lambda: (
                db.execute("SELECT last_seen_at FROM relay.workers WHERE id = %s", (worker.id,)).fetchone()[0]
                > first_seen
            ),
            what="registry heartbeat",
        )
    stopped = db.execute("SELECT stopped_at FROM relay.workers WHERE id = %s", (worker.id,)).fetchone()[0]
    assert stopped is not None


def test_notify_wakes_an_idle_worker_long_before_its_poll(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("ping")
    def ping(job: Job) -> None:
        return None

    with running_worker(relay, poll_interval=30.0) as worker:
        wait_for(lambda: worker.listener.connected.is_set())
        time.sleep(0.3)  # let the worker settle into its 30 s wait
        job_id = relay.enqueue("ping")
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=10, what="woken by NOTIFY")


def test_listener_listens_again_after_its_connection_is_killed(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("ping")
    def ping(job: Job) -> None:
        return None

    with running_worker(relay, poll_interval=30.0) as worker:
        wait_for(lambda: worker.listener.connected.is_set())
        killed = db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN relay_jobs%%' "
            "AND datname = current_database()"
        ).fetchall()
        assert killed and all(r[0] for r in killed)
        wait_for(lambda: worker.listener.reconnects >= 1 and worker.listener.connected.is_set(), timeout=15)
        time.sleep(0.3)
        job_id = relay.enqueue("ping")
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=10, what="woken after re-LISTEN")


def test_poll_only_mode_still_finds_every_job(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("ping")
    def ping(job: Job) -> None:
        return None

    with running_worker(relay, listen=False, poll_interval=0.2) as worker:
        assert worker.listener is None
        ids = [relay.enqueue("ping") for _ in range(20)]
        wait_for(lambda: all(job_status(db, j) == "succeeded" for j in ids))


def test_worker_survives_its_connections_being_killed(relay: Relay, db: psycopg.Connection) -> None:
    done: set[int] = set()

    @relay.handler("n")
    def n(job: Job) -> None:
        done.add(job.id)

    with running_worker(relay, poll_interval=0.1):
        first = relay.enqueue_many([{"type": "n"} for _ in range(50)])
        wait_for(lambda: all(job_status(db, j) == "succeeded" for j in first))
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        # The client's pooled connections died too; a fresh client stands in for the application.
        producer = Relay(relay.dsn)
        try:
            second = producer.enqueue_many([{"type": "n"} for _ in range(50)])
        finally:
            producer.close()
        wait_for(lambda: all(job_status(db, j) == "succeeded" for j in second), timeout=30)
    assert done == set(first) | set(second)


def _end_idle_worker_sessions(db: psycopg.Connection) -> int:
    """End the worker's connections that sit idle in its pool (as a restart or an idle-session killer would)."""
    return db.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE 'relay-worker%%' AND state = 'idle' AND pid <> pg_backend_pid()"
    ).fetchone()[0]


def test_a_transactional_job_given_a_connection_the_server_ended_runs_on_another(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool tests only connections idle for over a second; one ended sooner failed Relay's own BEGIN,
    before the handler started, and the attempt was spent: 33 of 40 such jobs with max_attempts=1 ended
    dead (AdminShutdown) in a review's run, where plain handlers' jobs all succeeded."""
    caplog.set_level("INFO", logger="relay")

    @relay.handler("tx", transactional=True, max_attempts=1)
    def tx(job: Job, conn: psycopg.Connection) -> None:
        conn.execute(
            "INSERT INTO relay_test.executions (job_id, pid, attempt, lease_token, phase)"
            " VALUES (%s, %s, %s, %s, 'ran')",
            (job.id, os.getpid(), job.attempt, job.lease_token),
        )

    ids: list[int] = []
    with running_worker(relay, concurrency=4, poll_interval=0.05):
        for _ in range(6):
            warm = relay.enqueue_many([{"type": "tx"} for _ in range(4)])
            wait_for(lambda w=warm: all(job_status(db, j) == "succeeded" for j in w))
            time.sleep(0.2)  # the connections are back in the pool, well under a second ago
            assert _end_idle_worker_sessions(db) > 0
            fresh = relay.enqueue_many([{"type": "tx"} for _ in range(4)])
            ids += warm + fresh
            wait_for(lambda f=fresh: all(job_status(db, j) in ("succeeded", "dead") for j in f), timeout=30)
            if any(r.getMessage().startswith("transaction not begun") for r in caplog.records):
                break
    assert status_counts(db) == {"succeeded": len(ids)}
    runs = db.execute("SELECT job_id, count(*) FROM relay_test.executions GROUP BY job_id").fetchall()
    assert sorted(runs) == sorted((j, 1) for j in ids)
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE errors <> '[]'").fetchone()[0] == 0
    assert any(r.getMessage().startswith("transaction not begun") for r in caplog.records), "no BEGIN failed"


def test_progress_during_a_lost_connection_does_not_say_the_job_is_gone(relay: Relay, db: psycopg.Connection) -> None:
    """A report on a connection the server had just ended returned False, which a handler reads as
    "stop, the job is no longer yours": 20 of 40 handlers in a review's run stopped halfway while
    their jobs were still theirs, and the jobs ended succeeded with half their work undone."""
    sessions_ended = threading.Event()
    answers: list[bool] = []

    @relay.handler("steps")
    def steps(job: Job) -> None:
        assert _end_idle_worker_sessions(db) > 0  # the claim's connection came back just now
        sessions_ended.set()
        answers.append(job.progress(50, "halfway"))

    job_id = relay.enqueue("steps")
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert sessions_ended.is_set() and answers == [True]


def test_error_text_with_nul_characters_is_recorded(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("nul", max_attempts=1)
    def nul(job: Job) -> None:
        raise ValueError("bad byte \x00 in input")

    @relay.handler("fine")
    def fine(job: Job) -> None:
        return None

    bad, good = relay.enqueue("nul"), relay.enqueue("fine")
    with running_worker(relay):
        wait_for(lambda: job_status(db, bad) == "dead" and job_status(db, good) == "succeeded")
    assert relay.get_job(bad).last_error == "ValueError: bad byte \\x00 in input"


class Unprintable(Exception):
    """An error whose text cannot be read: its ``__str__`` raises, and not an Exception."""

    def __str__(self) -> str:
        raise KeyboardInterrupt("from __str__")


class NameRaises(type):
    """A metaclass whose classes' ``__name__`` raises: read while the error is recorded."""

    @property
    def __name__(cls) -> str:  # type: ignore[override]
        raise KeyboardInterrupt("raised while reading __name__")


class Nameless(Exception, metaclass=NameRaises):
    """An error whose class's name cannot be read through the class."""


class UnformattableTraceback(Exception):
    """An error whose traceback cannot be formatted: reading its ``__notes__`` raises, and not an Exception."""

    @property
    def __notes__(self) -> list[str]:
        raise KeyboardInterrupt("raised while reading __notes__")


@pytest.mark.parametrize(
    ("error", "said", "traceback_says"),
    [
        # __str__ raising: the text cannot be read, the traceback can.
        (Unprintable(), "Unprintable: <unprintable Unprintable>", "Unprintable"),
        # __notes__ raising, read while the traceback is formatted: that KeyboardInterrupt
        # ended the slot's thread, its job claimed and heartbeated for the worker's life.
        (UnformattableTraceback("boom"), "UnformattableTraceback: boom", "could not be formatted: doing so raised"),
        # __name__ raising through the metaclass: the fallback read it again, and the slot's thread died.
        (Nameless("boom"), "Nameless: boom", "Nameless"),
    ],
    ids=["text", "traceback", "class-name"],
)
def test_an_error_that_cannot_be_read_or_formatted_fails_its_job_and_the_slot_goes_on(
    relay: Relay, db: psycopg.Connection, error: Exception, said: str, traceback_says: str
) -> None:
    @relay.handler("odd_error", max_attempts=1)
    def odd_error(job: Job) -> None:
        raise error

    @relay.handler("fine")
    def fine(job: Job) -> None:
        return None

    bad = relay.enqueue("odd_error")
    good = [relay.enqueue("fine") for _ in range(3)]
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, bad) == "dead" and all(job_status(db, j) == "succeeded" for j in good))
    job = relay.get_job(bad)
    [entry] = job.errors
    assert job.last_error == entry["message"] == said
    assert traceback_says in entry["traceback"], entry["traceback"]


def test_a_handler_that_returns_a_generator_is_dead_not_a_success(relay: Relay, db: psycopg.Connection) -> None:
    """Registration refuses a generator function; a callable that returns a generator is caught at run time."""
    ran: list[int] = []

    def rows(job: Job):  # type: ignore[no-untyped-def]
        ran.append(job.id)
        yield job.id

    with pytest.raises(InvalidJobError, match="a generator function cannot be a handler"):
        relay.handler("rows")(rows)
    assert "rows" not in relay.handlers
    relay.handler("rows_later", max_attempts=5)(lambda job: rows(job))
    job_id = relay.enqueue("rows_later")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "dead")
    job = relay.get_job(job_id)
    assert job.attempts == 1 and ran == []
    assert job.last_error.startswith("PermanentFailure: the handler of 'rows_later' returned a generator")


def test_progress_with_text_postgresql_cannot_store_is_kept_escaped(relay: Relay, db: psycopg.Connection) -> None:
    reported: list[bool] = []

    @relay.handler("import_file")
    def import_file(job: Job) -> None:
        reported.append(job.progress(10, "reading b\x00d.csv"))
        reported.append(job.progress(20, "reading \udcff.csv"))  # an undecodable file name's byte

    job_id = relay.enqueue("import_file")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    job = relay.get_job(job_id)
    assert reported == [True, True] and job.attempts == 1
    assert job.progress == {"percent": 20.0, "message": "reading \\udcff.csv"}


def test_progress_with_a_percent_that_is_not_a_number_is_refused_and_writes_nothing(
    relay: Relay, db: psycopg.Connection
) -> None:
    """``max(0.0, min(100.0, nan))`` is 100.0: a NaN was recorded as done."""
    refused: list[str] = []

    @relay.handler("import_file")
    def import_file(job: Job) -> None:
        job.progress(30, "reading")
        for bad in (float("nan"), float("inf"), float("-inf"), "50", True, 10**400):
            try:
                job.progress(bad, "never written")
            except ValueError as exc:
                refused.append(str(exc).split(", got ")[1][:10])

    job_id = relay.enqueue("import_file")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    # Text and a bool were read as numbers; 10**400 raised OverflowError.
    assert refused == ["nan", "inf", "-inf", "'50'", "True", "1" + "0" * 9]
    assert relay.get_job(job_id).progress == {"percent": 30.0, "message": "reading"}


def test_a_handler_reporting_progress_without_pause_keeps_its_lease(relay: Relay, db: psycopg.Connection) -> None:
    """Each report holds the job's row for its transaction, and the heartbeat skips a held row:
    reports back to back left no heartbeat a chance, the lease ran out under a live worker and the
    attempt was spent as lost. A report renews the lease itself now."""
    reports: list[bool] = []

    @relay.handler("chatty")
    def chatty(job: Job) -> None:
        ends = time.monotonic() + 4.0
        while time.monotonic() < ends:
            reports.append(job.progress(len(reports) % 100))
        if job.lease_lost:
            raise RuntimeError("the lease was lost")

    job_id = relay.enqueue("chatty", max_attempts=1)
    with running_worker(relay, lease_seconds=1.0, heartbeat_interval=0.3):
        wait_for(lambda: job_status(db, job_id) in ("succeeded", "dead"), what="the job to end")
    record = relay.get_job(job_id)
    assert (record.status, record.attempts, record.errors) == ("succeeded", 1, [])
    assert len(reports) > 100 and all(reports)


def test_a_progress_report_tells_the_handler_of_a_cancel_request_before_the_next_heartbeat(
    relay: Relay, db: psycopg.Connection
) -> None:
    asked = threading.Event()
    seen: list[bool] = []

    @relay.handler("long_import")
    def long_import(job: Job) -> None:
        asked.wait(20)
        seen.append(job.cancel_requested)
        job.progress(50, "half way")
        seen.append(job.cancel_requested)
        job.raise_if_cancelled()

    job_id = relay.enqueue("long_import")
    with running_worker(relay, lease_seconds=60.0, heartbeat_interval=25.0):
        wait_for(lambda: job_status(db, job_id) == "claimed", what="the job to start")
        relay.cancel(job_id)
        asked.set()
        wait_for(lambda: job_status(db, job_id) != "claimed", what="the job to end")
    assert seen == [False, True]
    assert job_status(db, job_id) == "cancelled"


def test_a_handler_that_fails_after_its_cancel_request_arrived_keeps_its_error(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Once the worker knew of the cancel, any exception ended the job cancelled with no error
    recorded; the same failure before the heartbeat brought the request was kept. Either way the
    job ends cancelled, and the attempt's error is in its history."""
    asked = threading.Event()

    @relay.handler("import_rows")
    def import_rows(job: Job) -> None:
        asked.wait(20)
        job.progress(10)  # brings the cancel request
        assert job.cancel_requested
        raise ValueError("row 12 has no date")

    job_id = relay.enqueue("import_rows", max_attempts=1)
    with running_worker(relay, lease_seconds=60.0, heartbeat_interval=25.0):
        wait_for(lambda: job_status(db, job_id) == "claimed", what="the job to start")
        relay.cancel(job_id)
        asked.set()
        wait_for(lambda: job_status(db, job_id) != "claimed", what="the job to end")
    job = relay.get_job(job_id)
    assert (job.status, job.attempts) == ("cancelled", 1)
    assert job.last_error is not None and "row 12 has no date" in job.last_error
    assert [entry["type"] for entry in job.errors] == ["ValueError"]


def test_a_heartbeat_renews_what_it_can_and_skips_a_row_another_transaction_holds(
    relay: Relay, db: psycopg.Connection, dsn: str
) -> None:
    """Waiting for one held row held up every other lease's renewal until they ran out, and the
    sweeper took those jobs from a live worker."""
    held_elsewhere, free, taken_over = relay.enqueue_many([{"type": "h"}] * 3)
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = 1, claimed_by = 'w-1',"
        " claimed_until = now() + interval '5 seconds'"
    )
    db.execute("UPDATE relay.jobs SET lease_token = 2, claimed_by = 'w-2' WHERE id = %s", (taken_over,))
    with psycopg.connect(dsn) as operator, psycopg.connect(dsn, autocommit=True) as conn:
        operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (held_elsewhere,))
        conn.execute("SET lock_timeout = '5s'")  # the heartbeat used to wait for the row
        renewed, lost, cancel = heartbeat_once(conn, {held_elsewhere: 1, free: 1, taken_over: 1}, 60.0)
        operator.rollback()
    assert renewed == {free: 1}
    assert lost == {taken_over: 1}, "the held row is still this worker's: not lost, just not renewed yet"
    assert cancel == set()
    leases = dict(
        db.execute(
            "SELECT id, claimed_until > now() + interval '30 seconds' FROM relay.jobs WHERE id = ANY(%s)",
            ([held_elsewhere, free],),
        ).fetchall()
    )
    assert leases == {held_elsewhere: False, free: True}


#: What each outcome kind writes for a job still held by its worker.
WRITTEN_STATUS = {
    Kind.SUCCEEDED: "succeeded",
    Kind.RETRY: "queued",
    Kind.DEAD: "dead",
    Kind.SNOOZED: "queued",
    Kind.CANCELLED: "cancelled",
}


def an_outcome(job: Job, kind: Kind) -> Outcome:
    """An outcome of ``kind`` for ``job``, with what a failure carries."""
    return Outcome(job, kind, 0.0, delay=60.0, message="boom", error={"type": "RuntimeError"})


@pytest.mark.parametrize("kind", list(WRITTEN_STATUS), ids=[kind.value for kind in WRITTEN_STATUS])
def test_a_completion_skips_a_row_another_session_holds_and_writes_the_rest(
    relay: Relay, dsn: str, db: psycopg.Connection, kind: Kind
) -> None:
    """An operator's SELECT ... FOR UPDATE left open on one job held up the whole batch, and every
    write after it: the completion waited for the lock. Each kind of outcome now skips that row, says
    so (ROW_LOCKED), and writes the others; a success of another job rides along in the batch, so the
    outcomes of other kinds go as one message of two statements."""
    relay.enqueue_many([{"type": "c"}] * 3)
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        held, free, other = [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=3))]
    batch = [an_outcome(held, kind), an_outcome(free, kind), an_outcome(other, Kind.SUCCEEDED)]
    pool = make_pool(dsn, name="completion", min_size=1, max_size=1)
    pool.open(wait=True)
    try:
        completer = Completer(pool, lambda batch, done: None)
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (held.id,))
            answers: list[dict[int, str]] = []
            writer = threading.Thread(target=lambda: answers.append(completer.write(batch)), daemon=True)
            writer.start()
            writer.join(10)
            assert not writer.is_alive(), "the completion waited for the row lock"
            assert answers == [{held.id: ROW_LOCKED, free.id: WRITTEN_STATUS[kind], other.id: "succeeded"}]
            assert job_status(db, held.id) == "claimed"
            operator.rollback()
        assert completer.write(batch[:1]) == {held.id: WRITTEN_STATUS[kind]}
    finally:
        pool.close()
    statuses = dict(db.execute("SELECT id, status::text FROM relay.jobs").fetchall())
    assert statuses == {held.id: WRITTEN_STATUS[kind], free.id: WRITTEN_STATUS[kind], other.id: "succeeded"}


def test_a_completion_is_not_held_up_by_a_foreign_key_check_on_its_job(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A row of the application's that references the job, inserted in a transaction still open,
    holds the job's row FOR KEY SHARE. The completion's FOR UPDATE conflicted with that lock, which
    the UPDATE it makes does not, and it skipped the job as locked."""
    relay.enqueue("c")
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        (job,) = [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=1))]
    db.execute("CREATE TABLE receipts (job_id bigint REFERENCES relay.jobs (id))")
    pool = make_pool(dsn, name="completion", min_size=1, max_size=1)
    pool.open(wait=True)
    try:
        with psycopg.connect(dsn) as app:
            app.execute("INSERT INTO receipts VALUES (%s)", (job.id,))
            written = Completer(pool, lambda batch, done: None).write([Outcome(job, Kind.SUCCEEDED, 0.0)])
            app.rollback()
    finally:
        pool.close()
        db.execute("DROP TABLE receipts")
    assert written == {job.id: "succeeded"}


def test_a_worker_writes_other_outcomes_while_one_row_is_locked_and_that_one_once_it_is_released(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's completer resent the same batch, held by one locked row, and wrote nothing else
    until the lock was released. It now writes the others, says once which rows stay locked (past
    LOCKED_WARN_SECONDS), and writes the held outcome after the release: counted once, as a success,
    never as lost."""
    caplog.set_level("WARNING", logger="relay")
    go = threading.Event()

    @relay.handler("held")
    def held_job(job: Job) -> str:
        go.wait(30)
        return "done"

    relay.handler("quick")(lambda job: None)
    held_id = relay.enqueue("held")
    with running_worker(relay, concurrency=2, poll_interval=0.05) as worker:
        wait_for(lambda: job_status(db, held_id) == "claimed", what="the held job to start")
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (held_id,))
            go.set()
            wait_for(lambda: held_id in worker.ledger.awaiting_write, timeout=10, what="the held outcome queued")
            quick = [relay.enqueue("quick") for _ in range(5)]
            wait_for(
                lambda: all(job_status(db, j) == "succeeded" for j in quick),
                timeout=10,
                what="the other jobs to be written while the row is locked",
            )
            assert job_status(db, held_id) == "claimed"
            wait_for(lambda: said_locked(caplog), timeout=10, what="the lock outlasting LOCKED_WARN_SECONDS said")
            assert job_status(db, held_id) == "claimed"
            operator.rollback()
        wait_for(lambda: job_status(db, held_id) == "succeeded", timeout=10, what="the held outcome written")
        wait_for(lambda: worker.counters.succeeded == 6, timeout=5, what="every success counted")
    assert relay.get_job(held_id).result == "done"
    assert worker.counters.lost == 0
    said = said_locked(caplog)
    assert len(said) == 1 and said[0].job_ids == [held_id]


@pytest.mark.parametrize("how", ["completer-stop", "write-through-locks"])
def test_a_row_locked_for_a_moment_at_shutdown_is_written_all_the_same(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A row found locked was written again only 0.5 s later, past the give-up of a stop given 1 s
    (what a shutdown with four writes to make gives the completer), and a shutdown's write of the
    timeouts tried once: a success whose row was held for a moment (the worker's own heartbeat
    renewing it) was left to the sweeper, to run again. Nor is such a moment worth a warning."""
    caplog.set_level("WARNING", logger="relay")
    relay.enqueue("c")
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        (job,) = [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=1))]
    told: dict[int, str] = {}
    pool = make_pool(dsn, name="completion", min_size=1, max_size=2)
    pool.open(wait=True)
    try:
        completer = Completer(pool, lambda batch, done: told.update(done))
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (job.id,))
            release = threading.Timer(0.1, operator.rollback)
            release.start()
            if how == "completer-stop":
                completer.start()
                completer.put(Outcome(job, Kind.SUCCEEDED, 0.0))
                completer.stop(1.0)
            else:
                told.update(completer.write_through_locks([Outcome(job, Kind.SUCCEEDED, 0.0)], 1.0))
            release.join()
    finally:
        pool.close()
    assert told == {job.id: "succeeded"}
    assert job_status(db, job.id) == "succeeded"
    assert said_locked(caplog) == []


def test_outcomes_held_back_on_locked_rows_go_again_within_the_batch_limits() -> None:
    """Every held outcome went in the next batch whatever MAX_BATCH and MAX_BATCH_BYTES said: an
    operator's lock on the claimed jobs of a busy worker made one statement of 1,500 failures with
    their tracebacks, the buffer growth those limits keep out."""
    now = datetime.now(UTC)
    completer = Completer(None, lambda batch, done: None)  # type: ignore[arg-type]  # takes batches only
    error = {"traceback": "x" * 20_000}
    outcomes = [
        Outcome(Job(i, "t", "default", 0, {}, 1, 3, 1, now, now), Kind.RETRY, 0.0, message="boom", error=error)
        for i in range(1, 1501)
    ]
    completer._hold_locked(outcomes, dict.fromkeys(range(1, 1501), ROW_LOCKED))
    completer._held_until = 0.0  # due now
    sizes = []
    while completer._held:
        batch, _ = completer._take_batch(0.0)
        assert batch and sum(o.text_bytes() for o in batch[:-1]) < MAX_BATCH_BYTES and len(batch) <= MAX_BATCH
        sizes.append(len(batch))
    assert sum(sizes) == 1500 and len(sizes) > 1, sizes


def claimed_jobs(relay: Relay, dsn: str, count: int) -> list[Job]:
    """``count`` jobs enqueued and claimed by hand, as a worker would hold them."""
    relay.enqueue_many([{"type": "c"}] * count)
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        return [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=count))]


def test_held_outcomes_split_by_the_batch_limits_wait_their_turn_and_leave_room_for_others(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held outcomes more than one batch holds went round with no wait while their rows stayed locked,
    one full batch after another (thousands of statements a second), and an outcome queued meanwhile
    for a row nobody held waited for the lock to end."""
    monkeypatch.setattr(completer_module, "MAX_BATCH", 2)
    *locked, free = claimed_jobs(relay, dsn, 4)
    writes: list[int] = []
    pool = make_pool(dsn, name="completion", min_size=1, max_size=2)
    pool.open(wait=True)
    completer = Completer(pool, lambda batch, done: None)
    uncounted = completer.write

    def write(batch: list[Outcome], *args: Any, **kwargs: Any) -> dict[int, str]:
        writes.append(len(batch))
        return uncounted(batch, *args, **kwargs)

    monkeypatch.setattr(completer, "write", write)
    try:
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = ANY(%s) FOR UPDATE", ([j.id for j in locked],))
            completer.start()
            held = [Outcome(job, Kind.SUCCEEDED, 0.0) for job in locked]
            for outcome in held:
                completer.put(outcome)
            wait_for(lambda: all(o.locked_since for o in held), timeout=5, what="the locked outcomes held")
            completer.put(Outcome(free, Kind.SUCCEEDED, 0.0))
            wait_for(lambda: job_status(db, free.id) == "succeeded", timeout=5, what="the free job written")
            writes.clear()
            time.sleep(1.0)
            assert len(writes) <= 20, f"{len(writes)} writes in 1 s while the rows stayed locked"
            operator.rollback()
        wait_for(lambda: all(job_status(db, j.id) == "succeeded" for j in locked), timeout=5, what="the rest")
    finally:
        completer.stop(2.0)
        pool.close()


@pytest.mark.parametrize("jobs", [1, 3], ids=["one-batch", "three-batches"])
def test_a_stopping_completer_tries_its_held_outcomes_once_more_at_its_give_up(
    relay: Relay, dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    """The wait for the retry of a held outcome was capped at the give-up, but the outcome was taken
    only once its retry was due: a lock released before the give-up, after the last retry, left the
    job to the sweeper, to run again. Then only the first batch of them got that last try."""
    monkeypatch.setattr(completer_module, "LOCKED_RETRY_FIRST_SECONDS", 5.0)  # no retry before the give-up
    monkeypatch.setattr(completer_module, "MAX_BATCH", 1)
    held = claimed_jobs(relay, dsn, jobs)
    told: dict[int, str] = {}
    pool = make_pool(dsn, name="completion", min_size=1, max_size=2)
    pool.open(wait=True)
    try:
        completer = Completer(pool, lambda batch, done: told.update(done))
        with psycopg.connect(dsn) as operator:
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = ANY(%s) FOR UPDATE", ([j.id for j in held],))
            completer.start()
            outcomes = [Outcome(job, Kind.SUCCEEDED, 0.0) for job in held]
            for outcome in outcomes:
                completer.put(outcome)
            wait_for(lambda: all(o.locked_since for o in outcomes), timeout=5, what="the outcomes held")
            release = threading.Timer(0.2, operator.rollback)
            release.start()
            completer.stop(2.0)  # gives up after 1.5 s, well after the release even on a loaded machine
            release.join()
    finally:
        pool.close()
    assert told == {job.id: "succeeded" for job in held}
    assert {job_status(db, job.id) for job in held} == {"succeeded"}


def test_a_stopping_completer_refused_at_once_still_waits_between_its_tries(
    relay: Relay, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() wakes a write's backoff so it hears of the give-up, and left it woken: a server that
    refused every write at once (read-only, during a failover) got them back to back, over a
    thousand a second, until the give-up."""
    (job,) = claimed_jobs(relay, dsn, 1)
    read_only = conninfo.make_conninfo(dsn, options="-c default_transaction_read_only=on")
    pool = make_pool(read_only, name="completion", min_size=1, max_size=1)
    pool.open(wait=True)
    completer = Completer(pool, lambda batch, done: None)
    writes: list[float] = []
    unwatched = completer.write

    def write(batch: list[Outcome], *args: Any, **kwargs: Any) -> dict[int, str]:
        writes.append(time.monotonic())
        return unwatched(batch, *args, **kwargs)

    monkeypatch.setattr(completer, "write", write)
    try:
        completer.start()
        completer.put(Outcome(job, Kind.SUCCEEDED, 0.0))
        wait_for(lambda: writes, timeout=5, what="the first write")
        stopped_at = time.monotonic()
        completer.stop(2.0)
    finally:
        pool.close()
    after_stop = [at for at in writes if at > stopped_at]
    assert 1 <= len(after_stop) <= 20, f"{len(after_stop)} writes in the 1.5 s before the give-up"


def test_a_write_through_locks_whose_locker_took_the_job_reports_it_taken_not_locked(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A row found locked by a session that then took the job (a sweeper returning it) stayed
    ROW_LOCKED: the shutdown tried it until its time ran out, then said the row was locked, and the
    run was never counted as lost."""
    (job,) = claimed_jobs(relay, dsn, 1)
    pool = make_pool(dsn, name="completion", min_size=1, max_size=2)
    pool.open(wait=True)
    try:
        completer = Completer(pool, lambda batch, done: None)
        with psycopg.connect(dsn) as sweeper:
            sweeper.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (job.id,))
            sweeper.execute(
                "UPDATE relay.jobs SET status = 'queued', claimed_by = NULL, claimed_until = NULL WHERE id = %s",
                (job.id,),
            )
            took = threading.Timer(0.1, sweeper.commit)
            took.start()
            started = time.monotonic()
            written = completer.write_through_locks([Outcome(job, Kind.SUCCEEDED, 0.0)], 3.0)
            took.join()
    finally:
        pool.close()
    assert written == {}, "taken over: neither written nor locked"
    assert time.monotonic() - started < 2.0, "not tried until the time ran out"
    assert job_status(db, job.id) == "queued"


def said_locked(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The completer's warnings that it found job rows locked by another session."""
    return [r for r in caplog.records if r.getMessage().startswith("job rows locked by another session;")]


def test_a_worker_stopping_while_a_row_is_locked_gives_that_outcome_up_in_time_and_says_so(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """At shutdown the outcome of a locked row is tried until the completer's give-up, then named
    as left to the sweeper; the worker stops within its shutdown time, with the row still held."""
    caplog.set_level("WARNING", logger="relay")
    go = threading.Event()
    relay.handler("held")(lambda job: go.wait(30))
    held_id = relay.enqueue("held")
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig(poll_interval=0.05, shutdown_timeout=1.0))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    with psycopg.connect(dsn) as operator:
        try:
            wait_for(lambda: job_status(db, held_id) == "claimed", what="the held job to start")
            operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (held_id,))
            go.set()
            wait_for(lambda: said_locked(caplog), timeout=10, what="the held outcome to be skipped")
            stopped_at = time.monotonic()
            worker.stop()
            thread.join(20)
            assert not thread.is_alive()
            took = time.monotonic() - stopped_at
        finally:
            go.set()
            worker.stop()
        assert job_status(db, held_id) == "claimed", "left to the sweeper"
        operator.rollback()
    gave_up = [r for r in caplog.records if "job rows locked by another session; the sweeper" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].job_ids == [held_id]
    assert took < 10, took


def test_a_handlers_timeout_is_acted_on_while_the_heartbeat_hangs(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stuck job's slot is replaced at its timeout, so the next job runs, though no heartbeat returns."""
    release = threading.Event()
    monkeypatch.setattr(Maintenance, "heartbeat", lambda self: release.wait(30))  # a stalled network path

    @relay.handler("stuck", timeout=0.3, max_attempts=1)
    def stuck(job: Job) -> None:
        release.wait(30)

    @relay.handler("next")
    def next_job(job: Job) -> None:
        return None

    stuck_id = relay.enqueue("stuck")
    with running_worker(relay, concurrency=1, heartbeat_interval=0.1, poll_interval=0.05):
        wait_for(lambda: job_status(db, stuck_id) == "claimed")
        next_id = relay.enqueue("next")
        try:
            wait_for(lambda: job_status(db, next_id) == "succeeded", timeout=10)
        finally:
            release.set()
        wait_for(lambda: job_status(db, stuck_id) == "dead")
    assert relay.get_job(stuck_id).last_error.startswith("JobTimeout")


def test_worker_refuses_to_start_on_an_unmigrated_database(database_url: str, python: str, worker_env: dict) -> None:
    import subprocess
    import uuid

    from psycopg import conninfo

    name = f"relay_unmigrated_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = dict(worker_env, RELAY_DATABASE_URL=conninfo.make_conninfo(database_url, dbname=name))
        result = subprocess.run(
            [python, "-m", "relay_core", "worker", "--app", "tests.apps.worker_app:relay"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0
        assert "run `relay migrate` first" in result.stderr
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_scheduled_job_starts_on_time_while_workers_are_busy(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("busy")
    def busy(job: Job) -> None:
        time.sleep(0.05)

    @relay.handler("on_time")
    def on_time(job: Job) -> None:
        return None

    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            # About half of what two slots of 0.05 s jobs take: busy, without a backlog that would
            # (by run_at, as the claim orders) rightly run ahead of the scheduled job.
            relay.enqueue_many([{"type": "busy"} for _ in range(2)])
            time.sleep(0.1)

    with running_worker(relay, concurrency=2, poll_interval=0.2):
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            run_at = db.execute("SELECT now() + interval '1.5 seconds'").fetchone()[0]
            job_id = relay.enqueue("on_time", run_at=run_at)
            wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=15)
        finally:
            stop.set()
            feeder.join(5)
    lag, busy_done = db.execute(
        "SELECT extract(epoch FROM started_at - run_at), "
        "(SELECT count(*) FROM relay.jobs WHERE type = 'busy' AND status = 'succeeded') "
        "FROM relay.jobs WHERE id = %s",
        (job_id,),
    ).fetchone()
    assert busy_done > 10, "the workers were busy meanwhile"
    assert 0 <= lag < 1.0, f"started {lag}s after its run_at"


def test_json_log_lines_carry_job_fields(relay: Relay, python: str, worker_env: dict, tmp_path) -> None:
    import json as jsonlib

    from .helpers import start_worker_process, stop_process

    log = tmp_path / "worker.log"
    env = dict(worker_env, RELAY_LOG_FORMAT="json")
    proc = start_worker_process(python, env, log=log)
    try:
        job_id = relay.enqueue("record")
        wait_for(lambda: relay.get_job(job_id).status == "succeeded", timeout=30)
    finally:
        stop_process(proc)
    lines = [jsonlib.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    by_message = {line["message"]: line for line in lines if line.get("job_id") == job_id}
    assert {"job claimed", "job succeeded"} <= set(by_message)
    done = by_message["job succeeded"]
    assert done["type"] == "record" and done["attempt"] == 1 and done["duration_ms"] >= 0
    assert done["level"] == "info" and done["logger"] == "relay"


def test_prefetch_holds_about_ten_milliseconds_of_short_work_per_slot_and_none_of_long() -> None:
    from relay_core.worker.claim import MAX_PREFETCH_PER_SLOT, prefetch_per_slot

    assert prefetch_per_slot(0.00005) == MAX_PREFETCH_PER_SLOT  # no-op jobs: capped
    assert prefetch_per_slot(0.002) == 5  # 5 x 2 ms = 10 ms of waiting at most
    assert prefetch_per_slot(0.02) == 1  # at least the next job
    assert prefetch_per_slot(0.05) == 0  # long jobs are left for idle workers
    assert prefetch_per_slot(3.0) == 0


def test_jobs_enqueued_with_notify_off_are_found_by_polling(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    @relay.handler("ping")
    def ping(job: Job) -> None:
        return None

    quiet = Relay(dsn, notify=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as listener, running_worker(relay, poll_interval=0.2) as worker:
            listener.execute("LISTEN relay_jobs")
            wait_for(lambda: worker.listener.connected.is_set())
            ids = [quiet.enqueue("ping") for _ in range(5)] + quiet.enqueue_many([{"type": "ping"}] * 5)
            wait_for(lambda: all(job_status(db, j) == "succeeded" for j in ids), timeout=10, what="found by polling")
            assert list(listener.notifies(timeout=0.2)) == [], "no wake-up was sent: polling found them"
    finally:
        quiet.close()


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_handler_hung_past_its_timeout_at_shutdown_spends_its_attempt(
    relay: Relay, db: psycopg.Connection, max_attempts: int
) -> None:
    """Handing it back would refund the attempt: a handler that hangs every time would never reach dead."""
    release = threading.Event()

    @relay.handler("hangs", timeout=0.3, max_attempts=max_attempts)
    def hangs(job: Job) -> None:
        release.wait(30)

    job_id = relay.enqueue("hangs")
    try:
        with running_worker(relay, concurrency=1) as worker:
            wait_for(lambda: job_id in worker.ledger.overdue, timeout=15, what="the timeout to pass")
        row = db.execute(
            "SELECT status::text, attempts, jsonb_array_length(errors), run_at > now() + interval '1 second' "
            "FROM relay.jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
    finally:
        release.set()
    if max_attempts == 1:
        assert row[:3] == ("dead", 1, 1)
    else:
        # Its retry waits out the grace in which the stuck thread may still run.
        assert row == ("queued", 1, 1, True)
    assert relay.get_job(job_id).last_error.startswith("JobTimeout")


def test_a_hung_handlers_timeout_at_shutdown_on_a_locked_row_is_left_to_the_sweeper_uncounted(
    relay: Relay, dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The shutdown's write of a hung handler's timeout skips a row another session holds locked, as
    the completer does: the job is named as left to the sweeper, and not counted as a retry that
    was never written."""
    caplog.set_level("WARNING", logger="relay")
    release = threading.Event()

    @relay.handler("hangs", timeout=0.3, max_attempts=3)
    def hangs(job: Job) -> None:
        release.wait(30)

    job_id = relay.enqueue("hangs")
    try:
        with psycopg.connect(dsn) as operator:
            with running_worker(relay, concurrency=1) as worker:
                wait_for(lambda: job_id in worker.ledger.overdue, timeout=15, what="the timeout to pass")
                operator.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
            assert job_status(db, job_id) == "claimed"
            operator.rollback()
    finally:
        release.set()
    assert (worker.counters.retried, worker.counters.dead, worker.counters.lost) == (0, 0, 0)
    said = [r for r in caplog.records if r.getMessage().startswith("timeouts not written: job rows locked by another")]
    assert len(said) == 1 and said[0].job_ids == [job_id]


@pytest.mark.parametrize("ends", ["dead", "cancelled"])
@pytest.mark.parametrize("requeue", ["one", "matching"])
@pytest.mark.parametrize("cancelled_between", [False, True], ids=["requeued", "requeued-cancelled-requeued"])
def test_a_job_that_ended_at_shutdown_beside_its_running_thread_is_requeued_to_run_after_that_thread(
    relay: Relay, db: psycopg.Connection, ends: str, requeue: str, cancelled_between: bool
) -> None:
    """At shutdown, a hung handler's timeout is written (dead on its last attempt) and a job an admin
    asked to stop is handed back cancelled while their threads still run until the process exits.
    A requeue at once made the job due: another worker started it beside the old thread (7 runs of 8).
    The requeued job keeps that time while it is ahead: a requeue cleared it, so a cancel and a
    second requeue made the job due at once."""
    release = threading.Event()

    @relay.handler("hangs", timeout=0.3 if ends == "dead" else None, max_attempts=1)
    def hangs(job: Job) -> None:
        release.wait(30)

    def requeue_it(status: str) -> None:
        if requeue == "one":
            relay.requeue(job_id)
        else:
            with psycopg.connect(relay.dsn, autocommit=True) as conn:
                assert monitor.requeue_matching(conn, monitor.JobFilter(status=status)) == 1

    job_id = relay.enqueue("hangs")
    try:
        with running_worker(relay, concurrency=1, shutdown_timeout=0.5) as worker:
            if ends == "dead":
                wait_for(lambda: job_id in worker.ledger.overdue, timeout=15, what="the timeout to pass")
            else:
                wait_for(lambda: job_status(db, job_id) == "claimed", what="the job to start")
                relay.cancel(job_id)
        assert job_status(db, job_id) == ends
        requeue_it(ends)
        if cancelled_between:
            if requeue == "one":
                relay.cancel(job_id)
            else:
                with psycopg.connect(relay.dsn, autocommit=True) as conn:
                    assert monitor.cancel_matching(conn, monitor.JobFilter(status="queued")) == 1
            assert job_status(db, job_id) == "cancelled"
            requeue_it("cancelled")
        status, wait, lease_kept = db.execute(
            "SELECT status::text, extract(epoch FROM run_at - now()), claimed_until = run_at"
            " FROM relay.jobs WHERE id = %s",
            (job_id,),
        ).fetchone()
    finally:
        release.set()
    # Due only once the grace in which the old thread may still run is over, like a retry's.
    assert status == "queued"
    assert wait > HAND_BACK_GRACE_SECONDS / 2, wait
    assert lease_kept, "the requeued job no longer says when the old thread stops"


def test_transactional_handler_stopping_after_its_timeout_commits_nothing(relay: Relay, db: psycopg.Connection) -> None:
    db.execute("CREATE TABLE relay_test.report_rows (job_id bigint, n integer)")
    try:

        @relay.handler("batch_insert", timeout=0.3, max_attempts=1)
        def batch_insert(job: Job, conn: psycopg.Connection) -> None:
            for n in range(100):
                if job.lease_lost:
                    return  # told to stop: the half-done batch must not commit as a success
                conn.execute("INSERT INTO relay_test.report_rows VALUES (%s, %s)", (job.id, n))
                time.sleep(0.02)

        job_id = relay.enqueue("batch_insert")
        with running_worker(relay, concurrency=1):
            wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
        assert db.execute("SELECT count(*) FROM relay_test.report_rows").fetchone()[0] == 0
        assert relay.get_job(job_id).last_error.startswith("JobTimeout")
    finally:
        db.execute("DROP TABLE relay_test.report_rows")


@pytest.mark.slow
def test_a_pool_held_by_handlers_past_their_timeout_is_not_called_a_database_outage(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Transactional handlers that hang past their timeout keep their connections, and the
    worker runs other jobs meanwhile, until every pooled connection is held and claims wait.
    The worker said "database unreachable", again and again, while the database answered:
    an operator would look at the wrong thing. It now says what holds the connections, for
    the claims and for every other duty that waits on the pool (maintenance waits 10 s)."""
    caplog.set_level("INFO", logger="relay")
    release = threading.Event()

    @relay.handler("hangs", timeout=0.2, max_attempts=1)
    def hangs(job: Job, conn: psycopg.Connection) -> None:
        conn.execute("SELECT 1")
        release.wait(60)

    relay.handler("quick")(lambda job: None)
    hanging = [relay.enqueue("hangs") for _ in range(6)]
    try:
        with running_worker(relay, concurrency=1) as worker:
            pool_max = worker.pool.max_size
            wait_for(
                lambda: any(r.getMessage().startswith("no free database connection") for r in caplog.records),
                timeout=20,
                what="the worker to say its pool is held",
            )
            quick = relay.enqueue("quick")
            time.sleep(12)  # claims keep waiting on the pool; maintenance's 10 s wait for a connection runs out
            assert job_status(db, quick) == "queued"
            release.set()
            wait_for(lambda: job_status(db, quick) == "succeeded", timeout=15, what="the quick job")
    finally:
        release.set()
    messages = [r.getMessage() for r in caplog.records if r.name == "relay" and r.levelname == "WARNING"]
    assert not [m for m in messages if "unreachable" in m], messages
    (held,) = [r for r in caplog.records if r.getMessage().startswith("no free database connection")]
    assert held.error.startswith(f"all {pool_max} connections are checked out; 5 job(s) past their timeout")
    assert "a database connection is free again" in messages
    assert {job_status(db, job_id) for job_id in hanging[:5]} == {"dead"}


def test_a_pool_whose_connections_broke_is_not_taken_for_a_held_one(dsn: str, db: psycopg.Connection) -> None:
    """The pool's own size counts connections it is reconnecting, and stays at its maximum
    through an outage: read as "every connection checked out", a real outage would have been
    logged as a held pool. Only connections handed out and not returned count."""
    role = f"relay_pool_test_{os.getpid()}"
    db.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
    pool = make_pool(conninfo.make_conninfo(dsn, user=role), name="t", min_size=1, max_size=3, timeout=1.0)
    try:
        pool.open(wait=True)
        held = [pool.getconn() for _ in range(3)]
        assert all_in_use(pool)
        for conn in held:
            pool.putconn(conn)
        assert not all_in_use(pool)
        # The database stops letting the pool in and ends its sessions: every connection breaks,
        # and the pool keeps trying to reconnect.
        db.execute(f"ALTER ROLE {role} NOLOGIN")
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        timed_out = False
        for _ in range(10):  # the broken connections are handed out and discarded, then there are none
            try:
                with pool.connection(timeout=1.0) as conn:
                    conn.execute("SELECT 1")
            except PoolTimeout:  # an OperationalError too: first
                timed_out = True
                break
            except psycopg.OperationalError:
                continue
        assert timed_out
        assert pool.get_stats()["pool_size"] == 3  # what the pool's own numbers read as "all in use"
        assert not all_in_use(pool)
    finally:
        pool.close(timeout=1.0)
        db.execute(f"DROP ROLE {role}")


def test_a_stale_heartbeat_answer_does_not_flag_the_next_run_of_the_same_job(relay: Relay) -> None:
    """A heartbeat that renewed (job, token 1) may answer after the job was claimed again (token 2)."""

    @relay.handler("twice")
    def twice(job: Job) -> None:
        return None

    job_id = relay.enqueue("twice")
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig())
    worker.pool.open(wait=True)
    try:
        (job,) = worker.claim(1)
        worker._dispatch([job])
        worker._on_lost({job_id: job.lease_token - 1})  # the lease of an earlier run
        assert not job.lease_lost and worker.ledger.held_leases() == {job_id: job.lease_token}
        worker._on_lost({job_id: job.lease_token})
        assert job.lease_lost and worker.in_flight() == 0  # never started: no longer counted, nor renewed
        assert worker.ledger.held_leases() == {}
        # Prefetched and never started: a slot drops it instead of running it.
        assert not worker._bind(Slot(0), job) and worker.in_flight() == 0
    finally:
        worker.pool.close()


def test_a_prefetched_job_whose_lease_ran_out_unrenewed_goes_back_with_its_attempt(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A job claimed ahead of a free slot whose lease ran out by the worker's own clock (no
    heartbeat got through in time, so the lease watch flagged it) was dropped when a slot took
    it, and waited for the sweeper, which counts the attempt it never used: a job with one
    attempt ended dead without ever running. Nobody is known to have taken it, so the worker
    gives it back at once, fenced, with the attempt."""
    relay.handler("once", max_attempts=1)(lambda job: None)
    job_id = relay.enqueue("once")
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig())
    worker.pool.open(wait=True)
    worker.completer.start()
    try:
        (job,) = worker.claim(1)
        worker._dispatch([job])
        with worker.ledger.lock:
            worker.ledger.running[job_id].lease_expires = 0.0  # no renewal got through
        worker.lease_watch.flag_unrenewed(time.monotonic())
        assert job.lease_lost
        wait_for(lambda: job_status(db, job_id) == "queued", timeout=10, what="the job back in the queue")
        assert db.execute("SELECT attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == 0
        wait_for(lambda: not worker.ledger.held_leases(), timeout=5, what="the lease to be let go")
        assert not worker._bind(Slot(0), job)  # a slot that takes it from the inbox skips it
    finally:
        worker.completer.stop()
        worker.pool.close()
    with running_worker(relay, concurrency=1):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=15, what="the job's one run")
    assert db.execute("SELECT attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == 1


def test_a_run_whose_job_this_worker_claims_again_is_told_its_lease_is_lost(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The lease ran out under a running handler (its heartbeats did not get through) and the
    sweeper returned the job; this worker's next claim took it again before a heartbeat said the
    first run was lost. The first run must still be told (``job.lease_lost``)."""
    runs: dict[int, dict[str, float | bool]] = {}
    first_started = threading.Event()

    @relay.handler("long")
    def long_job(job: Job) -> None:
        run = runs.setdefault(job.lease_token, {"start": time.monotonic(), "told": False})
        first_started.set()
        deadline = time.monotonic() + (8.0 if len(runs) == 1 else 0.5)
        while time.monotonic() < deadline:
            if job.lease_lost:
                run["told"] = True
                break
            time.sleep(0.01)
        run["end"] = time.monotonic()

    job_id = relay.enqueue("long", max_attempts=3)
    # A free slot and frequent polls, so the claim comes before the next heartbeat.
    with running_worker(relay, concurrency=2, lease_seconds=30.0, heartbeat_interval=2.0, poll_interval=0.05) as worker:
        assert first_started.wait(10)
        with db.transaction():  # the lease runs out, and a sweeper returns the job
            db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (job_id,))
            rescued = db.execute(sql("job_rescue_expired"), RESCUE_PARAMS).fetchall()
            assert [row[:2] for row in rescued] == [(job_id, "queued")]
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20, what="the second run")
        assert worker.in_flight() == 0
    first, second = (runs[token] for token in sorted(runs))
    assert first["told"], "the first run was never told that its lease was lost"
    assert first["end"] < second["start"] + 1.0, "the first run went on beside the second"


def test_a_prefetched_job_this_worker_claims_again_runs_under_its_new_claim(dsn: str) -> None:
    """A prefetched job's lease ran out before a slot took it, the sweeper returned it and this
    worker claimed it again: both claims sit in the inbox. The earlier one must be dropped and
    the newer one run; binding the earlier one removed the newer claim's entry, so it never ran
    and nothing renewed its lease."""
    worker = Worker(dsn, {}, WorkerConfig(concurrency=1, listen=False))
    now = datetime.now(UTC)

    def claim(token: int) -> Job:
        return Job(
            id=7, type="t", queue="default", priority=0, payload={}, attempt=token,
            max_attempts=5, lease_token=token, run_at=now, created_at=now,
        )  # fmt: skip

    earlier, newer = claim(1), claim(2)
    worker._dispatch([earlier])
    worker._dispatch([newer])
    assert earlier.lease_lost and not newer.lease_lost
    slot = Slot(0)
    assert worker._bind(slot, earlier) is False
    assert worker._bind(slot, newer) is True
    assert worker.ledger.held_leases() == {7: 2}
    assert worker.in_flight() == 1


def test_leases_are_renewed_while_handlers_hold_every_pooled_connection(relay: Relay, db: psycopg.Connection) -> None:
    """Transactional handlers hold pooled connections; the heartbeat must not wait for one."""
    started = threading.Event()

    @relay.handler("long_report")
    def long_report(job: Job) -> None:
        started.set()
        time.sleep(4.0)

    job_id = relay.enqueue("long_report")
    with running_worker(relay, concurrency=1, lease_seconds=1.5, heartbeat_interval=0.3, sweep_interval=60) as worker:
        assert started.wait(15)
        held = [worker.pool.getconn() for _ in range(worker.pool.max_size)]
        try:
            time.sleep(2.5)  # past the 1.5 s lease: only heartbeats keep it
            rescued = sweep_once(db)
            assert rescued == {"queued": 0, "dead": 0, "cancelled": 0}, "the lease expired while the pool was exhausted"
        finally:
            for conn in held:
                worker.pool.putconn(conn)
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=15)
    job = relay.get_job(job_id)
    assert job.attempts == 1 and job.errors == []


def test_a_bookkeeping_failure_after_a_write_does_not_stop_the_completer(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("plain")
    def plain(job: Job) -> None:
        return None

    with running_worker(relay, concurrency=1) as worker:
        tell = worker.counters.tell
        failures: list[int] = []

        def tell_failing_once(outcome, status):  # type: ignore[no-untyped-def]
            if not failures:
                failures.append(outcome.job.id)
                raise RuntimeError("a log handler broke")
            tell(outcome, status)

        worker.counters.tell = tell_failing_once  # type: ignore[method-assign]
        first = relay.enqueue("plain")
        wait_for(lambda: failures == [first], what="the failing bookkeeping")
        second = relay.enqueue("plain")
        wait_for(lambda: job_status(db, second) == "succeeded", timeout=10, what="a write after the failure")
    assert job_status(db, first) == "succeeded"


def test_undecodable_text_in_an_error_or_a_result_is_kept_escaped(relay: Relay, db: psycopg.Connection) -> None:
    """Python spells undecodable bytes (file names) as lone surrogates, which UTF-8 and jsonb cannot hold."""
    name = b"caf\xe9.txt".decode("utf-8", "surrogateescape")

    @relay.handler("open_file", max_attempts=1)
    def open_file(job: Job) -> None:
        raise ValueError(f"cannot open {name}")

    @relay.handler("list_files")
    def list_files(job: Job) -> list[str]:
        return [name]

    failing, listing = relay.enqueue("open_file"), relay.enqueue("list_files")
    with running_worker(relay, concurrency=1) as worker:
        wait_for(lambda: job_status(db, failing) == "dead", timeout=15)
        wait_for(lambda: job_status(db, listing) == "succeeded", timeout=15)
        # The completer is still writing: a job after them is recorded too.
        after = relay.enqueue("list_files")
        wait_for(lambda: job_status(db, after) == "succeeded", timeout=15)
        assert worker.completer._thread.is_alive()
    assert relay.get_job(failing).last_error == "ValueError: cannot open caf\\udce9.txt"
    assert relay.get_job(listing).result == {"unstored_result": "contains text that is not valid Unicode"}


def test_an_outcome_queued_as_shutdown_begins_is_still_written(relay: Relay, db: psycopg.Connection) -> None:
    """The slot hands its outcome to the completer while the worker decides nothing is in flight."""
    returned = threading.Event()

    @relay.handler("quick")
    def quick(job: Job) -> None:
        returned.set()

    with running_worker(relay, concurrency=1, listen=False) as worker:
        put = worker.completer.put
        slowed: list[int] = []

        def slow_put(outcome):  # type: ignore[no-untyped-def]
            slowed.append(outcome.job.id)
            time.sleep(1.0)  # the slot thread loses the processor between its bookkeeping and the queue
            put(outcome)

        worker.completer.put = slow_put  # type: ignore[method-assign]
        job_id = relay.enqueue("quick")
        assert returned.wait(10)
    assert slowed == [job_id], "the outcome went to the completer through the slowed put"
    assert job_status(db, job_id) == "succeeded"


def test_a_huge_backoff_factor_reaches_the_cap_instead_of_overflowing() -> None:
    assert Backoff(base=2.0, factor=1e6, cap=3600, jitter=0).delay(64) == 3600


def test_a_worker_started_while_the_database_is_down_waits_for_it_then_works(
    dsn: str, relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    # The worker's database is a port nothing listens on yet, for longer than any
    # single connection wait; the worker must neither exit nor give up.
    port = free_port()
    params = conninfo.conninfo_to_dict(dsn)
    down = conninfo.make_conninfo(dsn, host="127.0.0.1", port=str(port))  # where the forwarder will listen
    worker_app = Relay(down)
    ran: list[int] = []
    worker_app.handler("echo")(lambda job: ran.append(job.id))
    worker = worker_app.worker(concurrency=1, listen=False, poll_interval=0.1)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            worker.run(install_signals=False)
        except BaseException as exc:
            failures.append(exc)

    caplog.set_level("WARNING", logger="relay")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    forwarder = None
    try:
        # Old behaviour: one pool-opening wait of 30 s, then the worker raised and was gone.
        wait_for(
            lambda: any("database unreachable; retrying" in r.getMessage() for r in caplog.records),
            timeout=20,
            what="the worker to report the database unreachable",
        )
        time.sleep(3)  # several tries (their waits double to 1 s), said once
        assert not failures, failures
        assert thread.is_alive()
        assert sum("unreachable" in r.getMessage() for r in caplog.records if r.name == "relay") == 1
        forwarder = TcpProxy(str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)), listen_port=port)
        job_id = relay.enqueue("echo", {})
        wait_for(
            lambda: job_status(db, job_id) == "succeeded", timeout=30, what="the job to run once the database is up"
        )
        assert ran == [job_id]
    finally:
        worker.stop()
        thread.join(30)
        worker_app.close()
        if forwarder is not None:
            forwarder.close()
    assert not thread.is_alive()
    assert not failures, failures


def test_a_worker_whose_database_refuses_it_says_refused_not_unreachable(
    dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that answers and refuses (here: no such database) is no network outage: the worker said
    "database unreachable" while the server told it exactly what was wrong."""
    missing = f"relay_refused_{os.getpid()}"
    worker_app = Relay(conninfo.make_conninfo(dsn, dbname=missing))
    worker_app.handler("echo")(lambda job: None)
    worker = worker_app.worker(concurrency=1, listen=False, poll_interval=0.1)
    caplog.set_level("WARNING", logger="relay")
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: any("database refused the connection; retrying" in r.getMessage() for r in caplog.records),
            timeout=20,
            what="the worker to say the database refused it",
        )
        assert thread.is_alive()
    finally:
        worker.stop()
        thread.join(30)
        worker_app.close()
    assert not thread.is_alive()
    refusals = [r for r in caplog.records if "database refused the connection" in r.getMessage()]
    assert all(f'database "{missing}" does not exist' in str(r.__dict__.get("error")) for r in refusals), [
        r.__dict__ for r in refusals
    ]
    assert not any("database unreachable" in r.getMessage() for r in caplog.records)


def test_a_start_that_waits_says_so_at_first_then_every_repeat_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker started against a database that never came logged a line at each try, every second:
    about 1,200 an hour, where a running worker tells an outage once and then every 30 s."""
    monkeypatch.setattr(startup, "REPEAT_SECONDS", 1.0)
    caplog.set_level("WARNING", logger="relay")
    stopping, tries = threading.Event(), []

    def connect() -> None:
        tries.append(time.monotonic())
        raise psycopg.OperationalError('connection to server at "db", port 5432 failed: Connection refused')

    timer = threading.Timer(3.0, stopping.set)
    timer.start()
    try:
        assert startup.retry_until_stopped(connect, stopping, "postgresql://db/app") is True
    finally:
        timer.cancel()
    said = [r for r in caplog.records if r.name == "relay"]
    assert [r.getMessage() for r in said][:2] == [
        "database unreachable; retrying",
        "database still unreachable; retrying",
    ]
    assert {r.getMessage() for r in said[1:]} == {"database still unreachable; retrying"}
    assert len(said) <= 3 < len(tries)
    assert said[1].tries > 1 and said[1].for_s >= 1.0


def test_a_start_whose_tries_fail_for_alternating_reasons_says_each_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Any change of reason was said at once: tries alternating between a refusal (too many clients) and
    an unreachable server logged a line each."""
    monkeypatch.setattr(startup, "next_retry_delay", lambda delay: 0.01)
    caplog.set_level("WARNING", logger="relay")
    stopping, tries = threading.Event(), []
    reasons = [
        'connection to server at "db", port 5432 failed: Connection refused',
        'connection to server at "db", port 5432 failed: FATAL:  sorry, too many clients already',
    ]

    def connect() -> None:
        tries.append(1)
        raise psycopg.OperationalError(reasons[len(tries) % 2])

    timer = threading.Timer(1.0, stopping.set)
    timer.start()
    try:
        startup.retry_until_stopped(connect, stopping, "postgresql://db/app")
    finally:
        timer.cancel()
    said = sorted(r.getMessage() for r in caplog.records if r.name == "relay")
    assert said == ["database refused the connection; retrying", "database unreachable; retrying"]
    assert len(tries) > 10


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (
            'connection to server at "db", port 5432 failed: FATAL:  password authentication failed for user "app"',
            "refused",
        ),
        ('connection to server at "db", port 5432 failed: FATAL:  sorry, too many clients already', "refused"),
        # A restart or a failover in progress is the outage a worker waits out, not a setting to fix.
        ('connection to server at "db", port 5432 failed: FATAL:  the database system is starting up', "unreachable"),
        (
            'connection to server at "db", port 5432 failed: FATAL:  the database system is in recovery mode',
            "unreachable",
        ),
        ('connection to server at "db", port 5432 failed: Connection refused', "unreachable"),
    ],
)
def test_the_start_tells_a_refusal_from_an_outage(error: str, said: str) -> None:
    assert startup.retry_message(error) == (
        "database refused the connection; retrying" if said == "refused" else "database unreachable; retrying"
    )


def test_pool_connect_warnings_are_throttled_per_pool_and_only_for_relays_pools() -> None:
    """One throttle for every psycopg pool in the process silenced an application's own pool for 30 s
    after any of Relay's warned, the first warning of its own outage included."""
    throttle = RepeatsFilter(POOL_CONNECT_WARNING)

    def warned(pool: str) -> bool:
        record = logging.LogRecord(
            "psycopg.pool", logging.WARNING, "", 0, "error connecting in %r: %s", (pool, "x"), None
        )
        return throttle.filter(record)

    assert [warned("relay-client"), warned("relay-client"), warned("relay-web"), warned("relay-web")] == [
        True,
        False,
        True,
        False,
    ]
    assert [warned("app"), warned("app")] == [True, True]


def test_a_worker_stopped_before_the_database_ever_answered_exits_at_once(dsn: str) -> None:
    worker_app = Relay(conninfo.make_conninfo(dsn, port=str(free_port())))
    worker = worker_app.worker(concurrency=1, listen=False)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        time.sleep(1)
        started = time.monotonic()
        worker.stop()
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - started < 5
        assert worker.stopped.is_set()
    finally:
        worker_app.close()


def test_a_worker_stopped_while_its_start_retries_after_registering_records_its_stop(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Registration commits before the handlers' settings are published. A stop during a retry of
    the publishing must still end in the worker's stop record: the registry showed it alive until
    it went stale, and its schedule checks counted as running meanwhile."""
    relay.handler("echo")(lambda job: None)
    db.execute(
        "CREATE FUNCTION relay_test.refuse_publish() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'publishing held up' USING ERRCODE = 'query_canceled'; END $$"
    )
    db.execute(
        "CREATE TRIGGER refuse_publish BEFORE INSERT OR UPDATE ON relay.job_types "
        "FOR EACH ROW EXECUTE FUNCTION relay_test.refuse_publish()"
    )
    worker = relay.worker(concurrency=1, listen=False)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    try:
        thread.start()
        wait_for(
            lambda: db.execute("SELECT count(*) FROM relay.workers WHERE id = %s", (worker.id,)).fetchone()[0] == 1,
            timeout=15,
            what="the registration to commit while publishing is refused",
        )
        worker.stop()
        thread.join(15)
        assert not thread.is_alive()
    finally:
        db.execute("DROP TRIGGER IF EXISTS refuse_publish ON relay.job_types")
        db.execute("DROP FUNCTION IF EXISTS relay_test.refuse_publish()")
    (stopped_at,) = db.execute("SELECT stopped_at FROM relay.workers WHERE id = %s", (worker.id,)).fetchone()
    assert stopped_at is not None


def test_a_worker_that_cannot_log_in_says_why_while_it_retries(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    worker_app = Relay(conninfo.make_conninfo(dsn, dbname="relay_no_such_database"))
    worker = worker_app.worker(concurrency=1, listen=False)
    caplog.set_level("WARNING", logger="relay")
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: any(
                getattr(r, "error", "").endswith('"relay_no_such_database" does not exist') for r in caplog.records
            ),
            timeout=15,
            what="the retry log line to carry the server's reason",
        )
    finally:
        worker.stop()
        thread.join(10)
        worker_app.close()
    assert not thread.is_alive()


def test_a_handler_hears_its_lease_ran_out_while_the_database_stalls(dsn: str, relay: Relay) -> None:
    """Every connection of the worker hangs (the database stalls, or the network drops packets):
    heartbeats cannot renew, the lease runs out in the database, and another worker's sweeper would
    start the job again. The handler must hear ``lease_lost`` by then, from the worker's own clock.

    A handler that then stops early and returns has not done its work: when the database answers
    again, that return is a failed attempt, not a success (no sweeper took the job meanwhile, so a
    success would have been recorded and the work never done)."""
    proxy = TcpProxy.in_front_of(dsn)
    through = Relay(proxy.dsn)
    started, told = threading.Event(), threading.Event()

    @through.handler("long", backoff=Backoff(base=0.1, jitter=0))
    def long_job(job: Job) -> None:
        if job.attempt > 1:
            return
        started.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not job.lease_lost:
            time.sleep(0.02)
        if job.lease_lost:
            told.set()

    job_id = relay.enqueue("long")
    settings = {"lease_seconds": 2.0, "heartbeat_interval": 0.5, "sweep_interval": 60, "listen": False}
    try:
        with running_worker(through, **settings):
            assert started.wait(15)
            time.sleep(3)  # longer than the lease: heartbeats keep renewing it
            assert not told.is_set(), "told to stop while its lease was being renewed"
            proxy.flowing.clear()
            stalled = time.monotonic()
            try:
                assert told.wait(8), "the handler was never told its lease ran out"
                assert time.monotonic() - stalled < 3.0  # the lease (2 s) from the last renewal
            finally:
                proxy.flowing.set()
            wait_for(lambda: relay.get_job(job_id).status == "succeeded", timeout=30, what="the retry to succeed")
    finally:
        through.close()
        proxy.close()
    record = relay.get_job(job_id)
    assert record.attempts == 2
    assert [e["type"] for e in record.errors] == ["LeaseLost"], record.errors


def test_a_worker_told_to_stop_while_its_database_stalls_exits_within_its_drain_window(
    dsn: str, relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Every connection hangs (storage stopped, a proxy stopped forwarding) and SIGTERM comes: the
    schedules' stop, the duty in progress, the finished job's outcome, the registry's stop and the
    hand-back each waited their own course, and the worker exited some 7 s past its shutdown timeout:
    with the default 25 s, after Render's and Heroku's SIGKILL at 30 s. What is left after the
    in-flight wait now shares ``SHUTDOWN_WRITES_SECONDS``, whatever came before it took.
    (tests/test_processes.py measures a real process's exit after SIGTERM.)"""
    caplog.set_level("INFO", logger="relay")
    proxy = TcpProxy.in_front_of(dsn)
    through = Relay(proxy.dsn)
    quick_started, finish_quick, release_long = threading.Event(), threading.Event(), threading.Event()

    @through.handler("quick")
    def quick(job: Job) -> None:
        quick_started.set()
        finish_quick.wait(30)

    @through.handler("long")
    def long(job: Job) -> None:
        release_long.wait(60)

    through.handler("tick", cron="0 0 1 1 *")(lambda job: None)  # the schedules' stop is written at shutdown
    quick_id, long_id = relay.enqueue("quick"), relay.enqueue("long")
    settings = {"concurrency": 2, "shutdown_timeout": 2.0, "sweep_interval": 0.1, "listen": False}
    worker = Worker(through.dsn, through.handlers, WorkerConfig(**settings))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: status_counts(db).get("claimed") == 2, what="both jobs to start")
        assert quick_started.wait(10)
        proxy.flowing.clear()
        time.sleep(0.3)  # a sweep is under way, waiting for its answer
        finish_quick.set()  # its success waits in the completer, which cannot write it
        time.sleep(0.2)
        told = time.monotonic()
        worker.stop()
        assert worker.stopped.wait(30), "the worker never stopped"
        took = time.monotonic() - told
    finally:
        worker.stop()
        release_long.set()
        proxy.flowing.set()
        thread.join(30)
        through.close()
        proxy.close()
    limit = 2.0 + runtime.SHUTDOWN_OVERRUN_SECONDS
    assert took < limit, f"stopped {took:.1f} s after it was told to; the drain window promised {limit:.1f} s"
    (stopped,) = [r for r in caplog.records if r.getMessage() == "worker stopped"]
    assert (stopped.handed_back, stopped.not_handed_back) == (0, 1)
    # Nothing was lost: each job is still claimed (the sweeper's once its lease ends) or was written after all.
    assert {job_status(db, quick_id), job_status(db, long_id)} <= {"claimed", "succeeded"}


@contextmanager
def a_claim_whose_answer_is_held(
    dsn: str, relay: Relay, db: psycopg.Connection, ran: list[int]
) -> Iterator[tuple[Worker, TcpProxy, int]]:
    """A worker behind a proxy whose claim of a fresh one-attempt job ("once", noted in ``ran`` when it
    runs) has committed, and whose answer the proxy holds: (the worker, the proxy, the job's id)."""
    proxy = TcpProxy.in_front_of(dsn)
    through = Relay(proxy.dsn)
    through.handler("once", max_attempts=1)(lambda job: ran.append(job.id))
    settings = {"concurrency": 1, "lease_seconds": 60.0, "heartbeat_interval": 20.0, "listen": False}
    try:
        with running_worker(through, **settings) as worker:
            warm = relay.enqueue("once")
            wait_for(lambda: job_status(db, warm) == "succeeded", what="a first job through the proxy")
            proxy.hold_answers_with = b"lost-answer-7f3a"  # only the claim's answer carries the payload
            job_id = relay.enqueue("once", {"marker": "lost-answer-7f3a"})
            wait_for(lambda: job_status(db, job_id) == "claimed", what="the claim to commit")
            yield worker, proxy, job_id
    finally:
        through.close()
        proxy.close()


def test_jobs_a_claim_took_whose_answer_was_lost_go_back_with_their_attempt(
    dsn: str, relay: Relay, db: psycopg.Connection
) -> None:
    """The claim commits, its answer never arrives (the connection breaks on the way): the worker
    never learns of the jobs. It returns them once it reaches the database again, before the lease
    would have let the sweeper take them with their attempt spent: a job with one attempt runs,
    instead of ending dead without having run."""
    ran: list[int] = []
    with a_claim_whose_answer_is_held(dsn, relay, db, ran) as (worker, proxy, job_id):
        assert job_id not in worker.ledger.held_leases(), "its answer has not arrived"
        proxy.cut()
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20, what="the job to run")
    record = relay.get_job(job_id)
    assert (record.attempts, record.errors, ran.count(job_id)) == (1, [], 1)


def test_a_worker_stopped_while_a_claims_answer_is_lost_returns_that_claims_jobs(
    dsn: str, relay: Relay, db: psycopg.Connection
) -> None:
    """A stop (a deploy's SIGTERM) between a claim whose answer was lost and the next claim: the
    jobs that claim took stayed claimed under the stopped worker's id, and once their leases ran
    out the sweeper spent their attempt: a job with one attempt ended dead without having run."""
    ran: list[int] = []
    with a_claim_whose_answer_is_held(dsn, relay, db, ran) as (worker, proxy, job_id):
        worker.stop()
        proxy.cut()
    assert worker.stopped.is_set()
    record = relay.get_job(job_id)
    assert (record.status, record.attempts, record.errors, ran.count(job_id)) == ("queued", 0, [], 0)


def test_a_job_holding_a_number_too_long_for_int_runs_and_the_worker_carries_on(
    relay: Relay, db: psycopg.Connection
) -> None:
    """jsonb writes 1e5000 out in full, and Python reads no integer of over 4,300 digits from text:
    a claim that returned such a job (inserted with SQL by another program) raised in the producer
    thread, the worker stopped claiming for good, and the next worker to claim the job likewise."""
    seen: list[object] = []
    relay.handler("big")(lambda job: seen.append(job.payload["n"]))
    insert = """INSERT INTO relay.jobs (type, payload) VALUES ('big', '{"n": 1e5000}') RETURNING id"""
    (big,) = db.execute(insert).fetchone()
    with running_worker(relay, concurrency=2):
        wait_for(lambda: job_status(db, big) == "succeeded", what="the job with the long number")
        after = relay.enqueue("big", {"n": 7})
        wait_for(lambda: job_status(db, after) == "succeeded", what="a job after it")
    assert seen == [Decimal("1e5000"), 7]


def test_a_job_holding_fractions_past_a_floats_range_reads_them_exactly(relay: Relay, db: psycopg.Connection) -> None:
    """jsonb holds fractions exactly; read as floats, one past a float's range became inf and 1e-400
    became 0.0. A handler reads them as Decimals, and every other fraction as the nearest float:
    12345678901234567.5 too, as avg() in SQL writes such digits and handlers compute with floats."""
    seen: list[object] = []
    relay.handler("odd")(lambda job: seen.append(job.payload))
    huge = "1" + "0" * 400 + ".5"
    payload = f'{{"huge": {huge}, "tiny": 1e-400, "long": 12345678901234567.5, "plain": [0.1, 2.5, 1e-300, 0.0]}}'
    insert = "INSERT INTO relay.jobs (type, payload) VALUES ('odd', %s) RETURNING id"
    (job_id,) = db.execute(insert, (payload,)).fetchone()
    with running_worker(relay, concurrency=2):
        wait_for(lambda: job_status(db, job_id) == "succeeded", what="the job with the exact fractions")
    exact = {"huge": Decimal(huge), "tiny": Decimal("1e-400")}
    assert seen == [{**exact, "long": 12345678901234567.5, "plain": [0.1, 2.5, 1e-300, 0.0]}]
    assert [type(number) for number in [seen[0]["long"], *seen[0]["plain"]]] == [float] * 5
    assert relay.get_job(job_id).payload == seen[0]


@pytest.mark.parametrize(
    ("history", "kept"), [('{"note": "imported"}', [{"note": "imported"}]), ('"text"', ["text"]), ("null", [])]
)
def test_an_error_history_that_is_no_array_takes_failures_and_sweeps(
    relay: Relay, db: psycopg.Connection, history: str, kept: list[object]
) -> None:
    """jsonb_array_length raised on a history another program wrote as no array: the failed attempt's
    batch was refused, the job stayed claimed until its lease ran out, and then every sweep, on every
    worker, failed on it, so no expired lease anywhere was recovered again. The history is kept as
    its first entry, as the job's page reads it."""
    relay.handler("fails", max_attempts=3)(lambda job: 1 / 0)
    failing = relay.enqueue("fails")
    db.execute("UPDATE relay.jobs SET errors = %s::jsonb WHERE id = %s", (history, failing))
    with running_worker(relay):
        wait_for(lambda: relay.get_job(failing).attempts == 1 and job_status(db, failing) == "queued")
    (errors,) = db.execute("SELECT errors FROM relay.jobs WHERE id = %s", (failing,)).fetchone()
    assert errors[: len(kept)] == kept and [e["type"] for e in errors[len(kept) :]] == ["ZeroDivisionError"]
    # Two leases expired: the odd history's, and another job's behind it.
    lost = [relay.enqueue("lost"), relay.enqueue("lost")]
    expire = (
        "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = lease_token + 1, claimed_by = 'gone',"
        " claimed_until = now() - %s::interval, errors = %s::jsonb WHERE id = %s"
    )
    db.execute(expire, ("2 minutes", history, lost[0]))
    db.execute(expire, ("1 minute", "[]", lost[1]))
    assert sweep_once(db) == {"queued": 2, "dead": 0, "cancelled": 0}
    (errors,) = db.execute("SELECT errors FROM relay.jobs WHERE id = %s", (lost[0],)).fetchone()
    assert errors[: len(kept)] == kept and [e["type"] for e in errors[len(kept) :]] == ["LeaseExpired"]


@pytest.mark.parametrize("column", ["attempts", "lease_token"])
def test_a_job_at_the_integer_limit_is_claimed_and_its_queue_flows(
    relay: Relay, db: psycopg.Connection, column: str
) -> None:
    """The claim added 1 to attempts and to lease_token: a row written with SQL holding 2147483647 in
    either failed every claim of its queue, so no job of it ran. Attempts stop at the limit (such a
    job is on its last attempt) and the token turns over to 1 (0 is a job never claimed), which fences
    the holder of 2147483647."""
    ran: list[int] = []
    relay.handler("limit", max_attempts=3)(lambda job: ran.append(job.id))
    odd = relay.enqueue("limit")
    db.execute(f"UPDATE relay.jobs SET {column} = 2147483647 WHERE id = %s", (odd,))
    others = relay.enqueue_many([{"type": "limit"} for _ in range(3)])
    with running_worker(relay):
        wait_for(lambda: all(job_status(db, job_id) == "succeeded" for job_id in [odd, *others]), what="the queue")
    assert sorted(ran) == sorted([odd, *others])
    (value,) = db.execute(f"SELECT {column} FROM relay.jobs WHERE id = %s", (odd,)).fetchone()
    assert value == (2147483647 if column == "attempts" else 1)


def test_a_job_whose_payload_nests_deeper_than_python_reads_dies_alone_and_the_worker_carries_on(
    relay: Relay, db: psycopg.Connection
) -> None:
    """jsonb stores 3,000 nested arrays; Python's parser recurses per level and gives up near 1,000.
    Reading the claim's answer raised RecursionError after the claim committed: the worker stopped,
    the jobs claimed beside the unreadable one waited out their leases with an attempt spent, and
    every worker that claimed them next went the same way."""
    ran: list[int] = []
    relay.handler("deep")(lambda job: ran.append(job.id))
    deep_payload = "[" * 3000 + "]" * 3000
    (deep,) = db.execute(
        "INSERT INTO relay.jobs (type, payload) VALUES ('deep', %s::jsonb) RETURNING id", (deep_payload,)
    ).fetchone()
    beside = relay.enqueue_many([{"type": "deep", "payload": {"n": n}} for n in range(3)])
    with running_worker(relay, concurrency=4):
        wait_for(lambda: job_status(db, deep) == "dead", what="the unreadable job to die")
        wait_for(lambda: all(job_status(db, job_id) == "succeeded" for job_id in beside), what="the jobs beside it")
        after = relay.enqueue("deep", {"n": 7})
        wait_for(lambda: job_status(db, after) == "succeeded", what="a job after it")
    record = relay.get_job(deep)
    assert record.attempts == 1 and record.max_attempts == 20, "no attempt is spent retrying what no attempt can read"
    assert "cannot be read" in record.last_error and "nested deeper than Python reads" in record.last_error
    assert sorted(ran) == sorted([*beside, after])


def test_a_job_with_times_no_datetime_holds_runs_and_the_worker_carries_on(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A program writing with SQL can store run_at '-infinity' (run first) or a year BC; Python's
    datetime holds neither, and the claim that returned such a job failed, stopping the worker."""
    seen: dict[int, tuple[datetime, datetime]] = {}
    relay.handler("odd_times")(lambda job: seen.update({job.id: (job.run_at, job.created_at)}))
    ids = [
        row[0]
        for row in db.execute(
            "INSERT INTO relay.jobs (type, run_at, created_at) VALUES "
            "('odd_times', '-infinity', now()), ('odd_times', '4713-01-01 BC', 'infinity') RETURNING id"
        )
    ]
    with running_worker(relay, concurrency=2):
        wait_for(lambda: {job_status(db, i) for i in ids} == {"succeeded"}, what="the jobs with odd times")
        after = relay.enqueue("odd_times")
        wait_for(lambda: job_status(db, after) == "succeeded", what="a job after them")
    earliest, latest = datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert seen[ids[0]][0] == seen[ids[1]][0] == earliest
    assert seen[ids[1]][1] == latest


def test_only_unheld_jobs_claimed_under_the_workers_own_id_are_returned(relay: Relay, db: psycopg.Connection) -> None:
    held, lost, newer, elsewhere = relay.enqueue_many([{"type": "t"} for _ in range(4)])
    for job_id, worker in ((held, "w-1"), (lost, "w-1"), (newer, "w-1"), (elsewhere, "w-2")):
        db.execute(
            "UPDATE relay.jobs SET status = 'claimed', claimed_by = %s, claimed_until = now() + interval '1 minute', "
            "attempts = attempts + 1, lease_token = lease_token + 1, started_at = now() WHERE id = %s",
            (worker, job_id),
        )
    tokens = dict(db.execute("SELECT id, lease_token FROM relay.jobs").fetchall())
    # The worker holds ``held``, and an earlier lease of ``newer``, which was claimed again since.
    holding = {held: tokens[held], newer: tokens[newer] - 1}
    assert sorted(hand_back_unheld(relay.pool, "w-1", holding)) == sorted([lost, newer])
    rows = {row[0]: row[1:] for row in db.execute("SELECT id, status::text, attempts FROM relay.jobs")}
    assert rows == {held: ("claimed", 1), lost: ("queued", 0), newer: ("queued", 0), elsewhere: ("claimed", 1)}


def test_a_worker_id_given_in_the_settings_may_be_shared_one_made_for_the_process_is_not() -> None:
    assert WorkerConfig().owns_worker_id and not WorkerConfig(worker_id="steady").owns_worker_id
    assert WorkerConfig().worker_id != WorkerConfig().worker_id


def test_a_claim_that_waited_for_a_pooled_connection_counts_its_lease_from_the_claim(
    relay: Relay, db: psycopg.Connection
) -> None:
    """After an outage, or with every pooled connection busy, a claim can wait seconds for a
    connection before it is sent. The lease starts when the claim runs in the database, so the
    worker's own clock must count it from there: counted from before the wait, a fresh claim was
    told at once that its lease had run out, and the job spent an attempt for nothing."""
    told: list[bool] = []

    @relay.handler("short")
    def short(job: Job) -> None:
        time.sleep(0.5)
        told.append(job.lease_lost)

    settings = {"concurrency": 1, "lease_seconds": 2.0, "heartbeat_interval": 0.6, "listen": False}
    with running_worker(relay, poll_interval=0.05, **settings) as worker:
        wait_for(lambda: worker.maintenance.registered_at is not None, what="the worker to start")
        held = [worker.pool.getconn() for _ in range(worker.pool.max_size)]
        try:
            job_id = relay.enqueue("short")
            time.sleep(3.0)  # the producer waits for a connection, longer than the lease
        finally:
            for conn in held:
                worker.pool.putconn(conn)
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=15, what="the job to run")
    assert told == [False], "a fresh claim was told its lease had run out"


def test_an_outage_is_logged_when_it_starts_every_half_minute_while_it_lasts_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    outage = OutageLog(clock=lambda: now[0])
    caplog.set_level("INFO", logger="relay")
    outage.succeeded()  # no outage: nothing to say
    for _ in range(40):  # every thread failing, about once a second
        for during in ("claim", "heartbeat", "completion write"):
            outage.failed(during, "connection refused")
        now[0] += 1.0
    outage.succeeded()
    outage.succeeded()
    lines = [(r.getMessage(), getattr(r, "during", None)) for r in caplog.records]
    assert lines == [
        ("database unreachable; retrying", "claim"),
        ("database still unreachable; retrying", "claim"),
        ("database reachable again", None),
    ]
    assert caplog.records[1].for_s == 30.0 and caplog.records[2].failed_calls == 120
    assert caplog.records[2].after_s == 40.0


def test_a_call_that_began_during_an_ended_outage_and_fails_after_it_is_not_a_new_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    outage = OutageLog(clock=lambda: now[0])
    caplog.set_level("INFO", logger="relay")
    outage.failed("claim", "connection refused", began=100.0)
    now[0] = 110.0
    outage.succeeded()  # the server is back: one thread got through
    now[0] = 110.5
    # A connection wait that began while the server was down, and a session the restart broke.
    outage.failed("maintenance", "couldn't get a connection after 1.00 sec", began=109.5)
    outage.failed("listen", "server closed the connection unexpectedly", began=50.0)
    now[0] = 120.0
    outage.failed("claim", "connection refused", began=119.9)  # a call begun after the return: a new outage
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "database unreachable; retrying",
        "database reachable again",
        "database unreachable; retrying",
    ]
    assert caplog.records[2].during == "claim"


def test_worker_run_returns_to_its_caller_with_a_handler_left_running(relay: Relay, db: psycopg.Connection) -> None:
    """Run on the main thread with its signal handlers (an application's own script, a test), the
    worker ended the process when a handler outlived the shutdown: only ``relay worker`` and
    ``Relay.run_worker``, which own their process, do that. The caller is told how many run on."""
    started, release = threading.Event(), threading.Event()
    relay.handler("stuck")(lambda job: (started.set(), release.wait(30)))
    job_id = relay.enqueue("stuck")
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig(poll_interval=0.1, shutdown_timeout=0.2))
    # Its handler started, not only claimed: a job claimed and not yet started is handed back unrun.
    stopper = threading.Thread(target=lambda: (wait_for(started.is_set, what="the handler to start"), worker.stop()))
    stopper.start()
    try:
        worker.run()  # the main thread: it installs its signal handlers
    finally:
        release.set()
        stopper.join(30)
    assert worker.handlers_left_running == 1
    assert job_status(db, job_id) == "queued", "handed back"


def test_a_hand_back_held_up_by_a_row_lock_still_waits_out_the_grace_after_it(
    relay: Relay, db: psycopg.Connection
) -> None:
    """A job handed back while its handler still runs must not start elsewhere until the stopping
    process is gone. Its retry was counted from the hand-back's transaction start: a hand-back that
    waited on a row lock (an admin's bulk operation) committed with most of the grace spent."""
    release = threading.Event()
    relay.handler("stuck")(lambda job: release.wait(30))
    job_id = relay.enqueue("stuck")
    worker = Worker(relay.dsn, relay.handlers, WorkerConfig(poll_interval=0.1, shutdown_timeout=0.2))
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: job_status(db, job_id) == "claimed", what="the job to start")
        with psycopg.connect(relay.dsn) as blocker:
            blocker.execute("SELECT FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
            worker.stop()
            wait_for(
                lambda: db.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (blocker.info.backend_pid,),
                ).fetchone()[0],
                what="the hand-back to wait on the lock",
            )
            time.sleep(1.0)
            released_at = blocker.execute("SELECT clock_timestamp()").fetchone()[0]
        thread.join(10)
        assert not thread.is_alive()
    finally:
        release.set()
    status, run_at = db.execute("SELECT status::text, run_at FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert status == "queued", "handed back"
    assert run_at - released_at >= timedelta(seconds=HAND_BACK_GRACE_SECONDS)


def test_a_registry_stop_held_by_a_lock_leaves_the_hand_back_its_time(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The registry's stop is written before the hand-back and took all of the writes' time but
    0.05 s while a lock on relay.workers (a migration's ALTER) held it: across a network of 60 ms
    each way, the hand-back then never got a connection, and every unfinished job stayed claimed
    with its attempt spent. The registry's stop only says "stopped" rather than, 60 s on, "gone"."""
    caplog.set_level("INFO", logger="relay")
    proxy = TcpProxy.in_front_of(relay.dsn)
    through = Relay(proxy.dsn)
    release = threading.Event()
    through.handler("stuck")(lambda job: release.wait(30))
    job_id = relay.enqueue("stuck")
    config = WorkerConfig(poll_interval=0.1, shutdown_timeout=0.5, listen=False)
    worker = Worker(through.dsn, through.handlers, config)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: job_status(db, job_id) == "claimed", what="the job to start")
        proxy.latency = 0.06
        with psycopg.connect(relay.dsn) as blocker:
            blocker.execute("LOCK relay.workers IN ACCESS EXCLUSIVE MODE")
            worker.stop()
            assert worker.stopped.wait(30), "the worker never stopped"
    finally:
        release.set()
        proxy.latency = 0.0
        thread.join(30)
        through.close()
        proxy.close()
    (stopped,) = [r for r in caplog.records if r.getMessage() == "worker stopped"]
    assert (stopped.handed_back, stopped.not_handed_back) == (1, 0)
    assert db.execute("SELECT status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "queued",
        0,
    )


def test_a_maintenance_duty_that_raises_leaves_the_sweeper_running(relay: Relay, db: psycopg.Connection) -> None:
    """Only database errors were caught: anything else a duty raised (a bug, an odd schedule row) ended
    the maintenance thread, and the worker claimed on with no sweeper, pruner or periodic jobs."""
    ran: list[int] = []
    relay.handler("orphan")(lambda job: ran.append(job.id))
    config = WorkerConfig(poll_interval=0.2, sweep_interval=0.5, lease_seconds=10.0, shutdown_timeout=5.0)
    worker = Worker(relay.dsn, relay.handlers, config)
    failures: list[float] = []

    def broken_periodic() -> float:
        failures.append(time.monotonic())
        raise RuntimeError("a duty's bug")

    worker.maintenance.run_periodic = broken_periodic  # type: ignore[method-assign]
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(failures) >= 2, what="the failing duty to run twice")
        job_id = relay.enqueue("orphan", queue="elsewhere")
        db.execute(
            "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = 1, claimed_by = 'gone',"
            " claimed_until = now() - interval '1 second', queue = 'default' WHERE id = %s",
            (job_id,),
        )
        wait_for(lambda: job_status(db, job_id) == "succeeded", what="the sweeper to return the dead worker's job")
    finally:
        worker.stop()
        thread.join(30)
    assert ran == [job_id]


def test_a_long_lease_does_not_hold_the_sweeper_off_for_that_long_after_a_server_start(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The sweeper holds off after the server starts so live workers can renew leases an outage
    let run out; they retry every second, so a minute is plenty. A worker with a lease of years
    (allowed) must not leave a dead worker's jobs unswept for years after every server start."""
    relay.handler("report")(lambda job: None)
    job_id = relay.enqueue("report")
    db.execute(
        "UPDATE relay.jobs SET status = 'claimed', claimed_by = 'gone:1', attempts = 1, lease_token = 1, "
        "started_at = now(), claimed_until = now() - interval '1 second' WHERE id = %s",
        (job_id,),
    )
    db.commit()
    started = db.execute("SELECT now() - pg_postmaster_start_time() < interval '3 years'").fetchone()[0]
    assert started, "this test needs a server started within the lease below"
    with running_worker(relay, lease_seconds=10.0**8, sweep_interval=0.2):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20, what="the dead worker's job to run")
    assert [e["type"] for e in relay.get_job(job_id).errors] == ["LeaseExpired"]


def test_a_success_whose_completion_answer_was_lost_is_counted_a_success(
    dsn: str, relay: Relay, db: psycopg.Connection
) -> None:
    """The completion commits, its answer is lost on the way, and the retry finds nothing left to
    write: the worker logged the run as lost to a lease taken over, and counted it so. It now reads
    its own success back by the lease token."""
    proxy = TcpProxy.in_front_of(dsn)
    through = Relay(proxy.dsn)
    through.handler("note")(lambda job: None)
    settings = {"concurrency": 1, "lease_seconds": 60.0, "heartbeat_interval": 20.0, "listen": False}
    try:
        with running_worker(through, **settings) as worker:
            warm = relay.enqueue("note")
            wait_for(lambda: worker.counters.succeeded == 1, what="a first job through the proxy")
            assert job_status(db, warm) == "succeeded"
            proxy.hold_answers_with = b"succeeded"  # only a completion's answer carries the status
            job_id = relay.enqueue("note")
            wait_for(lambda: job_status(db, job_id) == "succeeded", what="the completion to commit")
            assert worker.counters.succeeded == 1, "its answer has not arrived"
            proxy.cut()
            wait_for(lambda: worker.counters.succeeded + worker.counters.lost == 2, what="the retried completion")
            assert (worker.counters.succeeded, worker.counters.lost) == (2, 0)
    finally:
        through.close()
        proxy.close()


def test_a_busy_worker_holds_few_jobs_on_their_last_attempt_however_high_its_prefetch(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Prefetch trained on no-op jobs takes many jobs a claim; jobs on their last attempt that
    wait behind busy slots are counted against the room of the next claims, or each claim would
    add its share and a SIGKILL would spend the last attempt of every one of them."""
    gate = threading.Event()
    relay.handler("quick")(lambda job: None)
    relay.handler("blocking")(lambda job: gate.wait(30))
    relay.enqueue_many([{"type": "quick", "max_attempts": 2} for _ in range(2000)])
    try:
        with running_worker(relay, concurrency=2, poll_interval=0.05, listen=False) as worker:
            wait_for(lambda: status_counts(db).get("succeeded") == 2000, what="the quick jobs")
            assert worker.prefetch() > 2 * 2, "the prefetch is trained high"
            relay.enqueue_many([{"type": "blocking", "max_attempts": 1} for _ in range(100)])
            wait_for(lambda: worker.in_flight() >= 2, what="both slots busy")
            time.sleep(1.0)  # twenty polls, each a claim while every slot is busy
            waiting = worker.ledger.waiting_on_last_attempt()
            claimed = status_counts(db).get("claimed", 0)
            gate.set()
        assert waiting <= 2 * 2, waiting
        assert claimed <= 2 + 2 * 2, claimed
    finally:
        gate.set()


def test_prefetch_holds_a_bounded_amount_of_payload(relay: Relay, db: psycopg.Connection) -> None:
    """Prefetch was sized by run time alone: no-op jobs of 200 KB payloads (within the default
    RELAY_MAX_PAYLOAD_BYTES) were held 16 a slot, and at concurrency 8 a worker held 136 of them,
    80-120 MB. It now holds at most PREFETCH_PAYLOAD_BYTES of typical payloads; small ones, as many
    as their run time asks for."""
    blob = "x" * 200_000
    relay.handler("big")(lambda job: None)
    relay.handler("small")(lambda job: None)
    relay.enqueue_many([{"type": "big", "payload": {"blob": blob}} for _ in range(150)])
    with running_worker(relay, concurrency=2, poll_interval=0.05, listen=False) as worker:
        wait_for(lambda: status_counts(db).get("succeeded") == 150, what="the big jobs")
        held = worker.prefetch()
        relay.enqueue_many([{"type": "small"} for _ in range(2000)])
        wait_for(lambda: status_counts(db).get("succeeded") == 2150, what="the small jobs")
        held_small = worker.prefetch()
    assert 1 <= held <= PREFETCH_PAYLOAD_BYTES // 200_000 < prefetch_per_slot(0.0005) * 2, held
    assert held_small > held, (held_small, held)


def _quick_states(db: psycopg.Connection) -> dict[str, int]:
    rows = db.execute("SELECT status::text, count(*) FROM relay.jobs WHERE type = 'quick' GROUP BY 1").fetchall()
    return dict(rows)


def _train_prefetch_then_block_both_slots(relay: Relay, db: psycopg.Connection, worker: Worker, quick: int) -> None:
    """Train ``worker`` (two slots) on quick jobs, then have one claim take two blocking jobs and ``quick`` more."""
    wait_for(lambda: _quick_states(db).get("succeeded") == 300, what="the training jobs")
    assert worker.prefetch() > 2 * 2, "the prefetch is trained high"
    db.execute("DELETE FROM relay.jobs")
    relay.enqueue_many(
        [{"type": "blocking", "priority": 0} for _ in range(2)]
        + [{"type": "quick", "priority": 1} for _ in range(quick)]
    )
    wait_for(lambda: worker.ledger.long_runs(time.monotonic(), 0.05) == 2, what="both slots held by blocking jobs")


def test_jobs_prefetched_behind_long_runs_go_back_for_an_idle_worker(relay: Relay, db: psycopg.Connection) -> None:
    """Prefetch trained on quick jobs took 32 of them in the claim that also took two long jobs.
    Both slots took the long ones, and the quick ones stayed claimed (heartbeated) until those
    ended, while a second worker sat idle. They go back to the queue unstarted, with the attempt
    they never used, and the busy worker does not claim them again."""
    gate = threading.Event()
    relay.handler("quick")(lambda job: None)
    relay.handler("blocking")(lambda job: gate.wait(60))
    relay.enqueue_many([{"type": "quick"} for _ in range(300)])
    try:
        with running_worker(relay, concurrency=2, poll_interval=0.05, listen=False) as busy:
            _train_prefetch_then_block_both_slots(relay, db, busy, quick=40)
            assert _quick_states(db).get("claimed", 0) > 0, "quick jobs were prefetched behind the blocking ones"
            with running_worker(relay, concurrency=2, poll_interval=0.05, listen=False) as idle:
                wait_for(lambda: _quick_states(db) == {"succeeded": 40}, timeout=15, what="the quick jobs to run")
                assert not gate.is_set()
                ran_on = db.execute("SELECT DISTINCT claimed_by FROM relay.jobs WHERE type = 'quick'").fetchall()
                assert ran_on == [(idle.id,)], "the busy worker ran none of them"
                attempts = db.execute("SELECT DISTINCT attempts FROM relay.jobs WHERE type = 'quick'").fetchall()
                assert attempts == [(1,)], "a job handed back unstarted keeps the attempt it never used"
                assert busy.in_flight() == 2
            gate.set()
    finally:
        gate.set()


def test_a_stop_hands_back_the_jobs_waiting_for_a_slot_before_the_drain(
    relay: Relay, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The jobs waiting for a slot went back only after the drain wait for the running ones: up to
    the whole shutdown timeout later, and a SIGKILL at its end spent their attempts."""
    monkeypatch.setattr(lease_watch, "PREFETCH_HOLD_SECONDS", 600.0)  # only the stop hands them back
    gate = threading.Event()
    relay.handler("quick")(lambda job: None)
    relay.handler("blocking")(lambda job: gate.wait(60))
    relay.enqueue_many([{"type": "quick"} for _ in range(300)])
    try:
        with running_worker(relay, concurrency=2, poll_interval=0.05, listen=False, shutdown_timeout=20) as worker:
            _train_prefetch_then_block_both_slots(relay, db, worker, quick=20)
            wait_for(lambda: worker.in_flight() > 2, what="quick jobs waiting for a slot")
            worker.stop()
            wait_for(lambda: _quick_states(db).get("claimed", 0) == 0, timeout=5, what="the waiting jobs handed back")
            assert not gate.is_set() and not worker.stopped.is_set(), "handed back while the drain goes on"
            assert db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0] == 2
            assert db.execute("SELECT max(attempts) FROM relay.jobs WHERE type = 'quick'").fetchone()[0] == 0
            gate.set()
    finally:
        gate.set()


def test_a_second_parameter_with_a_default_is_the_handlers_own_option_not_a_connection(
    relay: Relay, db: psycopg.Connection
) -> None:
    """def build(job, dry_run=False) was taken as transactional: dry_run got a connection (truthy), so the
    work was skipped inside a transaction held open for the whole run, and the job succeeded."""
    seen: list[object] = []

    @relay.handler("report")
    def build(job: Job, dry_run: bool = False) -> str:
        seen.append(dry_run)
        return "skipped" if dry_run else "built"

    assert not relay.handlers["report"].transactional
    job_id = relay.enqueue("report")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded", what="the report to be built")
    assert seen == [False] and relay.get_job(job_id).result == "built"


def test_a_handler_the_worker_could_not_call_is_refused_at_registration(relay: Relay) -> None:
    """Each was accepted, and every attempt failed with a TypeError until the job was dead."""

    def no_job() -> None: ...

    def keyword_job(*, job: Job) -> None: ...

    def one_arg(job: Job) -> None: ...

    for func, options, said in [
        (no_job, {}, "cannot be called as handler(job)"),
        (keyword_job, {}, "cannot be called as handler(job)"),
        (one_arg, {"transactional": True}, "cannot be called as handler(job, conn)"),
        (5, {}, "must be a function (or other callable), got int"),
        ("reports.build", {}, "must be a function (or other callable), got str"),
    ]:
        with pytest.raises(InvalidJobError, match=re.escape(said)) as refused:
            relay.handler("refused", **options)(func)  # type: ignore[arg-type]
        assert refused.value.field == "handler"
    assert "refused" not in relay.handlers

    def flexible(*args: object) -> None: ...

    relay.handler("flexible")(flexible)  # takes (job) as well as (job, conn)
    relay.handler("flexible_tx", transactional=True)(flexible)
    assert relay.handlers["flexible_tx"].transactional and not relay.handlers["flexible"].transactional


def test_a_completion_written_while_a_heartbeat_runs_is_not_reported_as_a_lease_taken_over(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat reads the held leases, the completer commits an outcome, the heartbeat finds that lease
    no longer claimed: it warned "leases taken over by another worker" with one worker running, before the
    completer let go of the lease. The completer's fenced write is what knows; the heartbeat leaves it to it."""

    @relay.handler("quick")
    def quick(job) -> None:
        pass

    caplog.set_level("INFO", logger="relay")
    job_id = relay.enqueue("quick")
    # Heartbeats every 100 s: none runs on its own while the test beats by hand.
    with running_worker(relay, lease_seconds=300.0, heartbeat_interval=None) as worker:
        wait_for(lambda: relay.get_job(job_id).status == "succeeded", what="the job to succeed")
        wait_for(lambda: not worker.ledger.awaiting_write, what="the completer to let go of the lease")
        (token,) = db.execute("SELECT lease_token FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
        # The moment of the race: written, and the completer not yet back to the ledger.
        with worker.ledger.lock:
            worker.ledger.awaiting_write[job_id] = token
        worker.maintenance.heartbeat()
        assert worker.ledger.awaiting_write == {job_id: token}
    warnings = [r.getMessage() for r in caplog.records if r.name == "relay" and r.levelname == "WARNING"]
    assert not [m for m in warnings if "taken over" in m], warnings


def test_a_worker_does_not_sweep_a_lease_it_still_holds(relay: Relay, db: psycopg.Connection) -> None:
    """After an outage longer than the lease, a worker's own sweep could get through before its heartbeat
    and completer did, and return jobs it was running or about to record: they ran a second time."""
    release = threading.Event()
    runs: list[int] = []

    @relay.handler("held")
    def held(job) -> None:
        runs.append(job.id)
        release.wait(30)

    job_id = relay.enqueue("held")
    # Heartbeats every 100 s: the lease set back below stays run out while the sweeper passes many times.
    with running_worker(relay, lease_seconds=300.0, heartbeat_interval=None, sweep_interval=0.1) as worker:
        wait_for(lambda: runs == [job_id], what="the job to start")
        (token,) = db.execute("SELECT lease_token FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
        db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (job_id,))
        swept = worker.maintenance.sweeps
        wait_for(lambda: worker.maintenance.sweeps >= swept + 3, what="three sweeps")
        assert db.execute("SELECT status::text, lease_token FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
            "claimed",
            token,
        )
        # Another worker's sweeper, which does not hold it, still returns it.
        assert sweep_once(db, held={job_id: token + 1})["queued"] == 1
        release.set()
        wait_for(lambda: not worker.ledger.awaiting_write and worker.in_flight() == 0, what="the run to end")
    assert runs[0] == job_id


@contextmanager
def _a_long_job_running(app: Relay, **settings: object) -> Iterator[tuple[Worker, int, threading.Event]]:
    """A worker running one job whose handler holds its slot until the event is set (set on the way out too)."""
    started = threading.Event()
    release = threading.Event()

    @app.handler("long")
    def long(job: Job) -> None:
        started.set()
        release.wait(20)

    try:
        with running_worker(app, **settings) as worker:
            job_id = app.enqueue("long")
            assert started.wait(10)
            yield worker, job_id, release
            release.set()
    finally:
        release.set()


@contextmanager
def _an_app_under_a_role_of_its_own(dsn: str, db: psycopg.Connection, name: str) -> Iterator[tuple[Relay, str]]:
    """A Relay app logging in as a new superuser role, which a test may bar from logging in (NOLOGIN) while
    its open sessions go on; dropped afterwards with every session it left."""
    role = f"relay_{name}_test_{os.getpid()}"
    db.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
    app = Relay(conninfo.make_conninfo(dsn, user=role))
    try:
        yield app, role
    finally:
        app.close()
        db.execute(f"ALTER ROLE {role} LOGIN")
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
        db.execute(f"DROP ROLE {role}")


def test_a_heartbeat_whose_own_connection_is_refused_renews_on_a_pooled_one(
    dsn: str, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The server ended the heartbeat's session and refused new ones (too many clients) while the pool's open
    sessions worked: the worker went on claiming and running through its pool, every lease it held ran out,
    and another worker ran its jobs beside its handlers (about 17 s of one job running twice, in a review)."""
    settings = {"lease_seconds": 3.0, "heartbeat_interval": 0.5, "concurrency": 2, "poll_interval": 0.1}
    with (
        _an_app_under_a_role_of_its_own(dsn, db, "heartbeat") as (app, role),
        _a_long_job_running(app, **settings) as (_, job_id, release),
    ):
        heartbeats = (
            "SELECT {} FROM pg_stat_activity"
            " WHERE usename = %s AND query LIKE 'UPDATE relay.workers SET last_seen_at%%'"
        )
        wait_for(lambda: db.execute(heartbeats.format("count(*)"), (role,)).fetchone()[0] == 1, 10, what="a heartbeat")
        db.execute(f"ALTER ROLE {role} NOLOGIN")  # no new session; those open go on
        ended = db.execute(heartbeats.format("count(pg_terminate_backend(pid))"), (role,)).fetchone()[0]
        assert ended == 1, "the heartbeat's own session"
        cut = db.execute("SELECT claimed_until FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0]
        time.sleep(4.5)  # past the lease the job held when the heartbeat's session ended
        lease, status, attempts = db.execute(
            "SELECT claimed_until, status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)
        ).fetchone()
        assert (status, attempts) == ("claimed", 1)
        assert lease > cut and lease > db.execute("SELECT now()").fetchone()[0], "renewed while cut off"
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("heartbeat sent on a pooled")]
        assert said == ["heartbeat sent on a pooled connection: its own was refused"]  # once, not per heartbeat
        db.execute(f"ALTER ROLE {role} LOGIN")
        release.set()
        wait_for(lambda: job_status(db, job_id) == "succeeded", 10, what="the job to succeed")


def claim_a_transactional_job(relay: Relay, dsn: str, **options: Any) -> tuple[Job, list[int]]:
    """A claimed job of a transactional handler ("tx", max_attempts=1, ``options``), and the ids it ran."""
    ran: list[int] = []

    @relay.handler("tx", transactional=True, max_attempts=1, **options)
    def tx(job: Job, conn: psycopg.Connection) -> None:
        ran.append(job.id)

    relay.enqueue("tx")
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        (job,) = [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=1))]
    return job, ran


def run_while_no_connection_comes(relay: Relay, job: Job, pool: ConnectionPool) -> Outcome:
    """Run ``job`` on ``pool`` (of one connection, a 0.5 s wait) with that connection held meanwhile."""
    held = pool.getconn()
    try:
        return executor.run(job, relay.handlers, pool, "w", SlotLoop(), 30.0)
    finally:
        pool.putconn(held)


def test_a_transactional_run_whose_timeout_passed_while_no_connection_came_goes_back_unspent(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Its deadline ran while it waited for a connection for its transaction (a pool held by stuck
    handlers), so the run was past its timeout when it came back not begun: the timeout decided
    then was recorded, and a job with max_attempts=1 ended dead without its handler ever starting."""
    job, ran = claim_a_transactional_job(relay, dsn, timeout=0.1)
    pool = make_pool(dsn, name="no-connection", min_size=1, max_size=1, timeout=0.5)
    pool.open(wait=True)
    completer = Completer(pool, lambda batch, done: None)
    ledger = Ledger(completer)
    watch = lease_watch.LeaseWatch(ledger, relay.handlers, "w", lambda: None, threading.Event(), lambda now: None)
    try:
        ledger.claimed([job], time.monotonic() + 30)
        slot = Slot(0)
        assert ledger.bind(slot, job, time.monotonic(), 0.1)
        outcome = run_while_no_connection_comes(relay, job, pool)
        watch.check_timeouts()  # as the lease watch did during that wait: 0.1 s had passed
        assert job.id in ledger.overdue
        ledger.finished(slot, job, outcome)
        completer.start()
        completer.stop()
    finally:
        pool.close()
    assert ran == []
    row = db.execute("SELECT status::text, attempts, errors FROM relay.jobs WHERE id = %s", (job.id,)).fetchone()
    assert row == ("queued", 0, [])


@pytest.mark.parametrize("lease_lost", [False, True], ids=["lease-held", "lease-flagged-lost-during-the-wait"])
def test_a_transactional_job_that_gets_no_connection_goes_back_with_the_attempt_it_never_used(
    relay: Relay, dsn: str, db: psycopg.Connection, lease_lost: bool
) -> None:
    """The pool's wait running out (the database down for longer than it, or out of connections) was the
    attempt's failure: a job with max_attempts=1 ended dead with PoolTimeout, its handler never started.
    A lease flagged lost during the wait (a short lease, an outage) still hands it back: the write is
    fenced by the lease token, so it changes nothing if another worker has the job."""
    job, ran = claim_a_transactional_job(relay, dsn)
    pool = make_pool(dsn, name="no-connection", min_size=1, max_size=1, timeout=0.5)
    pool.open(wait=True)
    try:
        if lease_lost:
            job._lease_lost.set()  # as the lease watch flags a lease that ran out unrenewed
        outcome = run_while_no_connection_comes(relay, job, pool)
        assert (outcome.kind, outcome.message, outcome.handler_started) == (Kind.SNOOZED, NOT_BEGUN, False)
        Completer(pool, lambda batch, done: None)._write_until_done([outcome])
    finally:
        pool.close()
    assert ran == []
    row = db.execute("SELECT status::text, attempts, errors FROM relay.jobs WHERE id = %s", (job.id,)).fetchone()
    assert row == ("queued", 0, [])
    with running_worker(relay):
        wait_for(lambda: job_status(db, job.id) == "succeeded")
    assert ran == [job.id]


def test_a_statement_the_server_cancelled_is_said_as_such_not_as_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """psycopg's QueryCanceled is an OperationalError: 529 statement timeouts in 50 s were logged as the
    database unreachable, then reachable again, by three workers."""
    now = [100.0]
    outage = OutageLog(clock=lambda: now[0])
    caplog.set_level("INFO", logger="relay")
    timeout = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    for _ in range(40):
        outage.failed("heartbeat", timeout)
        now[0] += 1.0
    outage.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "statement cancelled by the server (its statement_timeout?); retrying",
        "statement cancelled by the server (its statement_timeout?); retrying",
    ]
    assert not outage.long_one_within(3600.0, longer_than=0.0)  # no outage began


def test_the_sweeper_waits_the_restart_grace_after_its_own_worker_saw_the_database_come_back(
    dsn: str, relay: Relay, db: psycopg.Connection
) -> None:
    """The grace ran from the server's start, which comes before its crash recovery: with 7.7 s of WAL to
    replay and a 6 s lease, the first sweeper through took a live worker's lease 0.12 s after the server
    took connections, and the job, finished and waiting for its success to be written, ran again."""
    job_id = relay.enqueue("t")
    db.execute(sql("job_claim"), claim_params(worker_id="holder", lease_seconds=5))
    db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (job_id,))
    now = [1000.0]
    outage = OutageLog(clock=lambda: now[0])
    pool = make_pool(dsn, name="sweeper", min_size=1, max_size=2)
    pool.open(wait=True)
    try:
        maintenance = Maintenance(
            pool,
            dsn=dsn,
            worker_id="sweeper",
            lease_seconds=5.0,
            heartbeat_interval=1.0,
            sweep_interval=1.0,
            held_leases=dict,
            on_lost=lambda lost: None,
            on_cancel=lambda ids: None,
            in_flight=lambda: 0,
            outage=outage,
        )
        outage.failed("listen", "server closed the connection unexpectedly")  # a blip: holds nothing off
        now[0] += 0.5
        outage.succeeded()
        assert not maintenance.in_restart_grace()
        outage.failed("claim", "connection refused")  # the server restarted: this worker saw it too
        now[0] += 4.0  # longer than a lease less a heartbeat interval: leases may have run out
        assert maintenance.in_restart_grace()
        now[0] += 4.0
        outage.succeeded()
        now[0] += 4.9
        assert maintenance.sweep() == {"queued": 0, "dead": 0, "cancelled": 0}
        assert job_status(db, job_id) == "claimed"
        now[0] += 0.2  # the grace (the lease, 5 s) is over: the holder had its chance to renew
        assert maintenance.sweep()["queued"] == 1
        assert job_status(db, job_id) == "queued"
    finally:
        pool.close()


def test_a_heartbeat_whose_connection_ended_while_idle_renews_on_a_new_one_at_once(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle_session_timeout (or a restart) ended the heartbeat's session between two renewals: the renewal
    failed, waited a second, and each such end was logged as an outage and its end."""
    caplog.set_level("INFO", logger="relay")
    with _a_long_job_running(relay, lease_seconds=3.0, heartbeat_interval=0.5) as (worker, job_id, release):
        wait_for(lambda: worker.maintenance._heartbeat_conn is not None, 10, what="the heartbeat's connection")
        before = db.execute("SELECT claimed_until FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0]
        # Ended while idle, as an idle-session timeout ends it (not in the middle of its first renewal).
        idle = "SELECT state = 'idle' AND state_change < now() - interval '50 ms' FROM pg_stat_activity WHERE pid = %s"
        for _ in range(3):
            pid = worker.maintenance._heartbeat_conn.info.backend_pid
            wait_for(lambda p=pid: db.execute(idle, (p,)).fetchone() == (True,), 10, what="an idle session")
            db.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_for(lambda p=pid: worker.maintenance._heartbeat_conn.info.backend_pid != p, 10, what="a new one")
        wait_for(
            lambda: db.execute("SELECT claimed_until FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] > before,
            5,
            what="a renewal",
        )
        release.set()
        wait_for(lambda: job_status(db, job_id) == "succeeded", 10)
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "unreachable" in m or "reachable again" in m], said


def test_a_lease_taken_over_is_reported_once_not_at_every_heartbeat(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The run whose lease was taken over stays in the ledger while its handler runs on: each heartbeat
    renewed its old token again, found it taken again, and said so again."""
    caplog.set_level("INFO", logger="relay")
    with _a_long_job_running(relay, lease_seconds=3.0, heartbeat_interval=0.3) as (_, job_id, _):
        # Another worker has it now: a sweeper put it back and that worker claimed it.
        db.execute("UPDATE relay.jobs SET lease_token = lease_token + 1, claimed_by = 'other' WHERE id = %s", (job_id,))
        wait_for(lambda: "leases taken over by another worker" in caplog.text, 10, what="the report")
        time.sleep(1.5)  # five more heartbeats
    reports = [r for r in caplog.records if r.getMessage() == "leases taken over by another worker"]
    assert len(reports) == 1, [r.job_ids for r in reports]


def test_a_worker_that_started_while_the_database_was_down_gives_live_workers_the_restart_grace(
    dsn: str, db: psycopg.Connection
) -> None:
    """Started during an outage (an orchestrator restarting containers while the database recovers), a
    worker saw no outage end and swept at once: 0.85 s after the server took connections it took the lease
    of a live worker that had not renewed yet, and that worker's finished job ran again."""
    job_id = db.execute("INSERT INTO relay.jobs (type, queue) VALUES ('t', 'elsewhere') RETURNING id").fetchone()[0]
    db.execute(sql("job_claim"), claim_params(queues=["elsewhere"], worker_id="holder", lease_seconds=60))
    db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (job_id,))
    with _an_app_under_a_role_of_its_own(dsn, db, "late_start") as (app, role):
        app.handler("other")(lambda job: None)
        db.execute(f"ALTER ROLE {role} NOLOGIN")  # the database does not answer this worker yet
        with running_worker(app, lease_seconds=3.0, heartbeat_interval=1.0, sweep_interval=0.2) as worker:
            time.sleep(1.0)
            db.execute(f"ALTER ROLE {role} LOGIN")  # back
            wait_for(lambda: worker.maintenance.registered_at is not None, 15, what="the worker's registration")
            time.sleep(1.5)  # several sweeps' time, within the grace (the lease, 3 s)
            assert job_status(db, job_id) == "claimed", "swept before the live holder could renew"
            wait_for(lambda: job_status(db, job_id) == "queued", 10, what="the sweep after the grace")


def test_a_listening_session_the_server_ended_is_replaced_without_calling_it_an_outage(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle_session_timeout ends an idle LISTEN session every few seconds: each end was logged as the
    database unreachable, then reachable again (60 times in a review's run on a healthy server)."""
    ran = threading.Event()
    relay.handler("woken")(lambda job: ran.set())
    caplog.set_level("INFO", logger="relay")
    listening = (
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'LISTEN relay_jobs' AND state = 'idle'"
    )
    with running_worker(relay, poll_interval=60.0) as worker:
        for ended in range(1, 4):
            wait_for(lambda: worker.listener.connected.is_set(), 10, what="a listening session")
            time.sleep(1.2)  # it has listened a while, as a session an idle timeout ends has
            (pid,) = db.execute(listening).fetchone()
            db.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_for(lambda n=ended: worker.listener.reconnects == n, 10, what="the session replaced")
        wait_for(lambda: worker.listener.connected.is_set(), 10, what="a listening session")
        relay.enqueue("woken")
        assert ran.wait(5), "the new session did not wake the worker (it polls only every 60 s)"
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "unreachable" in m or "reachable again" in m], said


def test_a_shutdown_hand_back_that_meets_a_broken_connection_tries_another(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A stop just after the database ended the worker's sessions (a restart during a deploy): the
    pool handed out its connection unchecked (returned within the last second), the one try failed
    on it, and the jobs waiting for a slot were left to the sweeper, which spent their one attempt:
    dead, never run."""
    relay.handler("once", max_attempts=1)(lambda job: None)
    relay.enqueue_many([{"type": "once"}, {"type": "once"}])
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as claimer:
        jobs = [Job.from_row(row) for row in claimer.execute(sql("job_claim"), claim_params(limit=2))]
    assert len(jobs) == 2
    pool = make_pool(dsn, name="broken-at-stop", min_size=1, max_size=1, timeout=2.0)
    pool.open(wait=True)
    ledger = Ledger(Completer(pool, lambda batch, done: None))
    try:
        with pool.connection() as conn:  # used and returned just now: handed out again unchecked
            pid = conn.info.backend_pid
        db.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        ledger.claimed(jobs, time.monotonic() + 30)
        unstarted = ledger.close_unstarted()
        assert hand_back(pool, ledger, unstarted, 3.0) == 2
    finally:
        pool.close()
    rows = db.execute("SELECT status, attempts FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [("queued", 0), ("queued", 0)]
    assert not ledger.closing, "their leases are let go of"


def test_a_listener_refused_alone_says_so_in_its_own_words_not_as_an_outage(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """New connections refused while the worker's open ones work (a connection limit the pools filled after
    a restart): each of the listener's tries began an outage that the next claim ended, about once a second,
    and nothing said that new jobs now waited for a poll."""
    ran = threading.Event()
    relay.handler("found")(lambda job: ran.set())
    caplog.set_level("INFO", logger="relay")
    database = db.execute("SELECT current_database()").fetchone()[0]
    listening = (
        "SELECT pid FROM pg_stat_activity"
        " WHERE datname = current_database() AND query = 'LISTEN relay_jobs' AND state = 'idle'"
    )
    server = psycopg.connect(conninfo.make_conninfo(relay.dsn, dbname="postgres"), autocommit=True)
    with server, running_worker(relay, poll_interval=0.3) as worker:
        wait_for(lambda: worker.listener.connected.is_set(), 10, what="a listening session")
        time.sleep(0.5)  # the pools have their connections
        server.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        try:
            db.execute("SELECT pg_terminate_backend(pid) FROM (" + listening + ") AS l")
            wait_for(
                lambda: NOT_LISTENING.begins in [r.getMessage() for r in caplog.records],
                15,
                what="the listener saying it cannot listen",
            )
            relay.enqueue("found", conn=db)  # on a connection already open
            assert ran.wait(5), "polling found it"
        finally:
            server.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        wait_for(lambda: worker.listener.connected.is_set(), 15, what="listening again")
    said = [r.getMessage() for r in caplog.records if r.name == "relay"]
    assert not [m for m in said if "unreachable" in m or "reachable again" in m], said
    assert [m for m in said if "listen" in m] == [NOT_LISTENING.begins, NOT_LISTENING.ends], said


def test_a_claim_refused_for_good_is_said_once_not_at_every_try(
    relay: Relay, db: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """A permission revoked or a table renamed: each claim (about one a second) logged an ERROR of its own."""
    caplog.set_level("INFO", logger="relay")
    relay.handler("anything")(lambda job: None)
    with running_worker(relay, poll_interval=0.05):
        first = relay.enqueue("anything")
        wait_for(lambda: job_status(db, first) == "succeeded", 10, what="claims that work")
        db.execute("ALTER TABLE relay.jobs RENAME TO jobs_away")
        try:
            time.sleep(4)  # some four tries at the retry's pace
        finally:
            db.execute("ALTER TABLE relay.jobs_away RENAME TO jobs")
    refused = [r for r in caplog.records if r.getMessage().startswith("claim refused")]
    assert len(refused) == 1, [r.getMessage() for r in caplog.records]
    assert refused[0].levelname == "ERROR" and "jobs" in refused[0].error


def _claimed_for(db: psycopg.Connection, relay: Relay, lease_seconds: float) -> tuple[int, int]:
    relay.enqueue("slow")
    assert len(db.execute(sql("job_claim"), claim_params(lease_seconds=lease_seconds)).fetchall()) == 1
    return db.execute("SELECT id, lease_token FROM relay.jobs").fetchone()


def _during_a_table_lock(dsn: str, seconds: float, *calls: tuple[float, Callable[[], None]]) -> None:
    """Hold relay.jobs' SHARE lock (writes wait) for ``seconds``, starting each call at its offset."""
    threads = []
    with psycopg.connect(dsn) as locker:
        locker.execute("LOCK TABLE relay.jobs IN SHARE MODE")
        began = time.monotonic()
        for offset, call in calls:
            time.sleep(max(0.0, began + offset - time.monotonic()))
            threads.append(threading.Thread(target=call))
            threads[-1].start()
        time.sleep(max(0.0, began + seconds - time.monotonic()))
        locker.commit()
    for thread in threads:
        thread.join(10)


def test_a_sweep_held_up_by_a_table_lock_takes_no_lease_that_ran_out_meanwhile(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """An index build, a VACUUM FULL, an ALTER TABLE: renewals and sweeps all wait on the lock, and a sweep
    issued after a lease ran out took the job as the lock went, from a worker alive all along that could
    not renew it: the job ran twice at once. Such a sweep now leaves the leases to the next one."""
    job_id, _ = _claimed_for(db, relay, lease_seconds=2)
    swept: list[dict[str, int]] = []

    def sweep() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            swept.append(sweep_once(conn))

    _during_a_table_lock(dsn, 5.0, (2.5, sweep))  # it waits 2.5 s, longer than SWEEP_STALL_SECONDS
    assert swept == [{"queued": 0, "dead": 0, "cancelled": 0}]
    assert job_status(db, job_id) == "claimed"
    assert sweep_once(db)["queued"] == 1, "a sweep that did not wait takes a lease no one renewed"


def test_a_renewal_held_up_by_a_table_lock_counts_its_lease_from_when_it_is_written(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """It counted the lease from when it was sent: a renewal that waited longer than the lease wrote one
    already run out, and the next sweep took the job from its live worker."""
    job_id, token = _claimed_for(db, relay, lease_seconds=2)
    renewed: list[dict[int, int]] = []

    def heartbeat() -> None:
        with psycopg.connect(dsn) as conn:
            renewed.append(heartbeat_once(conn, {job_id: token}, 2.0)[0])

    _during_a_table_lock(dsn, 3.0, (0.2, heartbeat))
    assert renewed == [{job_id: token}]
    lease = db.execute("SELECT claimed_until > now() FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0]
    assert lease, "renewed from when it was written"
    assert sweep_once(db)["queued"] == 0
