"""``async def`` handlers, run by a real worker against the real database.

An async handler returns a coroutine; until the worker awaited it, its work
never ran, and the job was recorded a success all the same. Each test reads
the outcome back from the database.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
import time

import psycopg
import pytest

from relay_core import Backoff, InvalidJobError, Job, PermanentFailure, Relay, Snooze
from relay_core.queries import sql

from .helpers import RESCUE_PARAMS, job_status, running_worker, wait_for

FAST = Backoff(base=0.05, factor=2, cap=1, jitter=0)
RECORD = "INSERT INTO relay_test.executions (job_id, pid, attempt, lease_token, phase) VALUES (%s, %s, %s, %s, %s)"


async def record(dsn: str, job: Job, phase: str) -> None:
    """One executions row, written through an async connection (as an asyncio application would)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(RECORD, (job.id, os.getpid(), job.attempt, job.lease_token, phase))


async def wait_until_stopped(dsn: str, job: Job) -> None:
    """Await forever; record 'stopped' when cancelled, and let the cancellation go on."""
    try:
        await asyncio.sleep(600)
    except asyncio.CancelledError:
        await record(dsn, job, "stopped")
        raise


def phases(db: psycopg.Connection, job_id: int) -> list[tuple[int, str]]:
    """(attempt, phase) of every recorded step of ``job_id``, in order."""
    return db.execute(
        "SELECT attempt, phase FROM relay_test.executions WHERE job_id = %s ORDER BY at", (job_id,)
    ).fetchall()


def test_an_async_handler_does_its_work_and_its_return_value_is_the_result(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    @relay.handler("send_receipt")
    async def send_receipt(job: Job) -> dict:
        await asyncio.sleep(0.01)
        await record(dsn, job, "sent")
        return {"sent_to": job.payload["to"]}

    job_id = relay.enqueue("send_receipt", {"to": "a@b.c"})
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert phases(db, job_id) == [(1, "sent")]
    assert relay.get_job(job_id).result == {"sent_to": "a@b.c"}


def test_handlers_that_return_an_awaitable_some_other_way_are_awaited(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A partial of an async function, an object with an async __call__, a plain def returning a coroutine."""

    async def tagged(job: Job, tag: str) -> str:
        await record(dsn, job, tag)
        return tag

    class Notifier:
        async def __call__(self, job: Job) -> str:
            return await tagged(job, "callable")

    def wrapper(job: Job):  # type: ignore[no-untyped-def]
        return tagged(job, "wrapper")

    relay.handler("partial")(functools.partial(tagged, tag="partial"))
    relay.handler("callable")(Notifier())
    relay.handler("wrapper")(wrapper)
    ids = {tag: relay.enqueue(tag) for tag in ("partial", "callable", "wrapper")}
    with running_worker(relay):
        wait_for(lambda: all(job_status(db, i) == "succeeded" for i in ids.values()))
    for tag, job_id in ids.items():
        assert phases(db, job_id) == [(1, tag)]
        assert relay.get_job(job_id).result == tag


def test_an_async_handler_that_raises_is_retried_then_dead_with_its_history(
    relay: Relay, db: psycopg.Connection
) -> None:
    @relay.handler("flaky", max_attempts=3, backoff=FAST)
    async def flaky(job: Job) -> None:
        await asyncio.sleep(0)
        raise ConnectionError(f"smtp down on attempt {job.attempt}")

    job_id = relay.enqueue("flaky")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=30)
    job = relay.get_job(job_id)
    assert job.attempts == 3 and job.last_error == "ConnectionError: smtp down on attempt 3"
    assert [e["attempt"] for e in job.errors] == [1, 2, 3]
    assert all(e["type"] == "ConnectionError" and "in flaky" in e["traceback"] for e in job.errors)


def test_snooze_and_permanent_failure_from_an_async_handler(relay: Relay, db: psycopg.Connection) -> None:
    runs: list[int] = []

    @relay.handler("poll_export", max_attempts=1)
    async def poll_export(job: Job) -> str:
        runs.append(job.attempt)
        await asyncio.sleep(0)
        if len(runs) < 3:
            raise Snooze(0.05)
        return "ready"

    @relay.handler("charge", max_attempts=10)
    async def charge(job: Job) -> None:
        await asyncio.sleep(0)
        raise PermanentFailure("card number is invalid")

    snoozer, charger = relay.enqueue("poll_export"), relay.enqueue("charge")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: job_status(db, snoozer) == "succeeded" and job_status(db, charger) == "dead")
    assert runs == [1, 1, 1]
    assert relay.get_job(snoozer).errors == [] and relay.get_job(snoozer).result == "ready"
    charged = relay.get_job(charger)
    assert charged.attempts == 1 and charged.last_error == "PermanentFailure: card number is invalid"


def test_a_task_group_whose_every_task_gave_up_ends_the_job_dead(relay: Relay, db: psycopg.Connection) -> None:
    """asyncio.TaskGroup raises an ExceptionGroup of its tasks' errors: PermanentFailures alone give up;
    a group holding any other error is a failed attempt, retried."""

    async def refuse(reason: str) -> None:
        await asyncio.sleep(0)
        raise PermanentFailure(reason)

    async def flake() -> None:
        await asyncio.sleep(0)
        raise ConnectionError("smtp down")

    @relay.handler("charge_all", max_attempts=10)
    async def charge_all(job: Job) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(refuse("card 1 is invalid"))
            tasks.create_task(refuse("card 2 is invalid"))

    @relay.handler("charge_nested", max_attempts=10)
    def charge_nested(job: Job) -> None:
        raise ExceptionGroup("outer", [PermanentFailure("a"), ExceptionGroup("inner", [PermanentFailure("b")])])

    @relay.handler("charge_mixed", max_attempts=2, backoff=FAST)
    async def charge_mixed(job: Job) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(refuse("card 1 is invalid"))
            tasks.create_task(flake())

    given_up = [relay.enqueue("charge_all"), relay.enqueue("charge_nested")]
    mixed = relay.enqueue("charge_mixed")
    with running_worker(relay, poll_interval=0.05):
        wait_for(lambda: all(job_status(db, j) == "dead" for j in [*given_up, mixed]))
    for job_id in given_up:
        job = relay.get_job(job_id)
        assert job.attempts == 1, job
        assert job.errors[0]["type"] == "ExceptionGroup"
    assert relay.get_job(mixed).attempts == 2


def test_an_awaiting_async_handler_is_stopped_at_its_timeout_and_the_attempt_fails(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Its task is cancelled, so it stops at its await instead of holding the job until the worker stops."""

    @relay.handler("slow_api", timeout=0.3, max_attempts=2, backoff=FAST)
    async def slow_api(job: Job) -> str:
        await record(dsn, job, "start")
        if job.attempt == 1:
            await wait_until_stopped(dsn, job)
        return "answered"

    job_id = relay.enqueue("slow_api")
    with running_worker(relay, concurrency=1, poll_interval=0.05, lease_seconds=3.0, heartbeat_interval=0.5):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20)
    # The retry started only once the first run had stopped.
    assert phases(db, job_id) == [(1, "start"), (1, "stopped"), (2, "start")]
    job = relay.get_job(job_id)
    assert job.attempts == 2 and job.result == "answered"
    assert [e["type"] for e in job.errors] == ["JobTimeout"]


def test_a_timed_out_async_handlers_thread_work_ends_before_its_retry_starts(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Cancelling the task leaves asyncio.to_thread's thread running: the lease is kept until it returns."""

    def blocking_call(job: Job) -> None:  # a sync client library, in a thread of its own
        time.sleep(1.5 if job.attempt == 1 else 0)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(RECORD, (job.id, os.getpid(), job.attempt, job.lease_token, "thread done"))

    @relay.handler("sync_sdk", timeout=0.3, max_attempts=2, backoff=FAST)
    async def sync_sdk(job: Job) -> None:
        await record(dsn, job, "start")
        await asyncio.to_thread(blocking_call, job)

    job_id = relay.enqueue("sync_sdk")
    with running_worker(relay, concurrency=2, poll_interval=0.05, lease_seconds=3.0, heartbeat_interval=0.5):
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20)
    assert phases(db, job_id) == [(1, "start"), (1, "thread done"), (2, "start"), (2, "thread done")]
    assert [e["type"] for e in relay.get_job(job_id).errors] == ["JobTimeout"]


def test_an_async_handler_on_its_last_attempt_is_dead_at_its_timeout(relay: Relay, db: psycopg.Connection) -> None:
    @relay.handler("hang", timeout=0.3, max_attempts=1)
    async def hang(job: Job) -> None:
        await asyncio.Event().wait()  # nothing ever sets it

    job_id = relay.enqueue("hang")
    with running_worker(relay, concurrency=1) as worker:
        wait_for(lambda: job_status(db, job_id) == "dead", timeout=15)
        wait_for(lambda: worker.in_flight() == 0 and not worker.ledger.overdue, what="the stopped run to be let go")
    job = relay.get_job(job_id)
    assert job.last_error.startswith("JobTimeout") and [e["type"] for e in job.errors] == ["JobTimeout"]


TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


def test_context_variables_one_async_job_sets_do_not_reach_the_next_on_its_slot(relay: Relay) -> None:
    seen: list[tuple[int, str]] = []

    @relay.handler("tenant_report")
    async def tenant_report(job: Job) -> None:
        seen.append((job.payload["n"], TENANT.get()))
        TENANT.set(job.payload["tenant"])

    for n in range(3):
        relay.enqueue("tenant_report", {"n": n, "tenant": f"t{n}"})
    with running_worker(relay, concurrency=1):
        wait_for(lambda: len(seen) == 3, what="three jobs on one slot")
    assert sorted(seen) == [(0, "none"), (1, "none"), (2, "none")]


def test_async_jobs_run_at_once_across_slots_each_on_its_own_loop(relay: Relay, db: psycopg.Connection) -> None:
    """Four jobs, four slots: none can finish until all four are running together."""
    together = threading.Barrier(4)
    loops: list[tuple[int, int]] = []

    @relay.handler("fan_out", max_attempts=1)
    async def fan_out(job: Job) -> int:
        loops.append((threading.get_ident(), id(asyncio.get_running_loop())))
        await asyncio.to_thread(together.wait, 20)  # raises BrokenBarrierError unless all four arrive
        return job.payload["n"]

    ids = relay.enqueue_many([{"type": "fan_out", "payload": {"n": n}} for n in range(4)])
    with running_worker(relay, concurrency=4):
        wait_for(lambda: all(job_status(db, i) == "succeeded" for i in ids), timeout=30)
    assert [relay.get_job(i).result for i in ids] == [0, 1, 2, 3]
    assert len(set(loops)) == 4 and len({thread for thread, _ in loops}) == 4


def test_cancelling_a_running_async_job_stops_it_at_its_await(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    @relay.handler("export", max_attempts=3)
    async def export(job: Job) -> None:
        await record(dsn, job, "start")
        await wait_until_stopped(dsn, job)

    job_id = relay.enqueue("export")
    with running_worker(relay, heartbeat_interval=0.3, lease_seconds=3.0):
        wait_for(lambda: phases(db, job_id) == [(1, "start")])
        relay.cancel(job_id)
        wait_for(lambda: job_status(db, job_id) == "cancelled", timeout=15)
    assert phases(db, job_id) == [(1, "start"), (1, "stopped")]
    assert relay.get_job(job_id).attempts == 1


def test_an_async_run_whose_lease_was_taken_over_is_stopped(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    """The lease ran out and a sweeper returned the job: the stale run stops instead of working on beside the next."""

    @relay.handler("sync_catalog", max_attempts=3)
    async def sync_catalog(job: Job) -> str:
        await record(dsn, job, "start")
        if job.attempt == 1:
            await wait_until_stopped(dsn, job)
        return "synced"

    job_id = relay.enqueue("sync_catalog")
    with running_worker(relay, concurrency=2, lease_seconds=30.0, heartbeat_interval=0.3, poll_interval=0.05):
        wait_for(lambda: phases(db, job_id) == [(1, "start")])
        with db.transaction():  # the lease runs out, and a sweeper returns the job
            db.execute("UPDATE relay.jobs SET claimed_until = now() - interval '1 second' WHERE id = %s", (job_id,))
            rescued = db.execute(sql("job_rescue_expired"), RESCUE_PARAMS).fetchall()
            assert [row[:2] for row in rescued] == [(job_id, "queued")]
        wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20)
        wait_for(lambda: (1, "stopped") in phases(db, job_id), what="the stale run to stop")
    assert relay.get_job(job_id).result == "synced"
    assert sorted(phases(db, job_id)) == [(1, "start"), (1, "stopped"), (2, "start")]


def test_an_async_handler_cannot_be_transactional(relay: Relay) -> None:
    async def apply_refund(job: Job, conn: psycopg.Connection) -> None: ...

    async def one_arg(job: Job) -> None: ...

    class Refunder:
        async def __call__(self, job: Job, conn: psycopg.Connection) -> None: ...

    for func, options in [
        (apply_refund, {}),
        (functools.partial(apply_refund), {}),
        (Refunder(), {}),
        (one_arg, {"transactional": True}),
    ]:
        with pytest.raises(InvalidJobError, match="async") as refused:
            relay.handler("refund", **options)(func)
        assert refused.value.field == "transactional"
    assert "refund" not in relay.handlers

    async def own_option(job: Job, conn: psycopg.Connection | None = None) -> None: ...

    relay.handler("refund", transactional=False)(own_option)  # a second parameter of its own is fine
    assert not relay.handlers["refund"].transactional
    with pytest.raises(InvalidJobError, match=r"cannot be called as handler\(job\)"):
        relay.handler("refund_later", transactional=False)(apply_refund)  # it would never get its conn


def test_an_async_generator_is_refused_as_a_handler(relay: Relay) -> None:
    async def pages(job: Job):  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises(InvalidJobError, match="a generator function cannot be a handler"):
        relay.handler("pages")(pages)


def test_a_transactional_handler_that_returns_a_coroutine_is_dead_and_commits_nothing(
    relay: Relay, db: psycopg.Connection
) -> None:
    """Registration cannot see through a plain def; the worker refuses to record its success."""
    ran: list[int] = []

    async def refund(job: Job, conn: psycopg.Connection) -> None:
        ran.append(job.id)

    @relay.handler("refund", max_attempts=5)
    def refund_entry(job: Job, conn: psycopg.Connection):  # type: ignore[no-untyped-def]
        conn.execute(RECORD, (job.id, 0, job.attempt, job.lease_token, "tx"))
        return refund(job, conn)

    job_id = relay.enqueue("refund")
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "dead")
    job = relay.get_job(job_id)
    assert job.attempts == 1 and job.last_error.startswith("PermanentFailure") and "awaitable" in job.last_error
    assert phases(db, job_id) == [] and ran == []


def test_a_cancelled_async_handlers_cleanup_is_not_cut_short_by_its_timeout(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """A cancel, then the timeout passing during the cleanup the cancel began: the second
    cancellation interrupted that cleanup. A run is cancelled once."""

    @relay.handler("tidy", max_attempts=3, timeout=2.0)
    async def tidy(job: Job) -> None:
        await record(dsn, job, "start")
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            await asyncio.sleep(2.5)  # past the timeout
            await record(dsn, job, "cleaned up")
            raise

    job_id = relay.enqueue("tidy")
    with running_worker(relay, concurrency=1, heartbeat_interval=0.3, lease_seconds=3.0):
        wait_for(lambda: phases(db, job_id) == [(1, "start")])
        relay.cancel(job_id)
        wait_for(lambda: job_status(db, job_id) != "claimed", timeout=20)
    assert phases(db, job_id) == [(1, "start"), (1, "cleaned up")]


def test_an_async_handler_that_returns_what_it_forgot_to_await_is_not_a_success(
    relay: Relay, db: psycopg.Connection
) -> None:
    """`return post_webhook(...)` without await: the coroutine was stored as an unstorable result and
    the job succeeded, with nothing sent. Its work never ran: the job fails for good, and says why."""

    async def post_webhook() -> None:
        raise AssertionError("never awaited")

    async def stream():  # type: ignore[no-untyped-def]
        yield 1

    @relay.handler("notify", max_attempts=3)
    async def notify(job: Job):  # type: ignore[no-untyped-def]
        return post_webhook()

    @relay.handler("notify_stream", max_attempts=3)
    async def notify_stream(job: Job):  # type: ignore[no-untyped-def]
        return stream()

    ids = [relay.enqueue("notify"), relay.enqueue("notify_stream")]
    with running_worker(relay, concurrency=1):
        wait_for(lambda: all(job_status(db, i) == "dead" for i in ids), timeout=15)
    for job_id, kind in zip(ids, ["coroutine", "async_generator"], strict=True):
        job = relay.get_job(job_id)
        assert job.attempts == 1 and job.result is None
        assert job.last_error.startswith(f"PermanentFailure: the handler of {job.type!r} returned a {kind}")


def test_progress_from_an_async_handler_leaves_its_event_loop_running(relay: Relay, db: psycopg.Connection) -> None:
    """A report waits for the job's row; while it waits, the handler's other tasks go on."""
    ticks: list[float] = []
    waiting_for_lock = threading.Event()
    locked = threading.Event()
    reported: list[int] = []  # ticks counted when the report began

    @relay.handler("import_pages")
    async def import_pages(job: Job) -> bool:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        waiting_for_lock.set()
        await asyncio.to_thread(locked.wait, 10)
        reported.append(len(ticks))
        try:
            return await job.progress_async(40, "page 2 of 5")
        finally:
            ticker.cancel()

    job_id = relay.enqueue("import_pages")
    with running_worker(relay):
        wait_for(waiting_for_lock.is_set)
        with db.transaction():
            db.execute("SELECT 1 FROM relay.jobs WHERE id = %s FOR UPDATE", (job_id,))
            locked.set()
            wait_for(lambda: bool(reported))
            # The report is blocked on the row lock held here, yet the ticker keeps ticking.
            wait_for(lambda: len(ticks) >= reported[0] + 10, what="the event loop to run during the report")
            assert relay.get_job(job_id).progress is None
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    job = relay.get_job(job_id)
    assert job.progress == {"percent": 40.0, "message": "page 2 of 5"}
    assert job.result is True


def test_an_async_handler_handed_back_at_shutdown_finishes_its_cleanup_before_the_worker_stops(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """The hand-back cancelled the handler, and the worker stopped (the process exited) 12 ms later:
    no handler's ``finally`` got past its first await, though the README promises that cleanup."""
    cleaned: list[float] = []

    @relay.handler("tidy_at_shutdown")
    async def tidy(job: Job) -> None:
        await record(dsn, job, "start")
        try:
            await asyncio.sleep(600)
        finally:
            await asyncio.sleep(0.2)
            cleaned.append(time.monotonic())

    job_id = relay.enqueue("tidy_at_shutdown")
    worker = relay.worker(concurrency=1, shutdown_timeout=0.2, listen=False, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: phases(db, job_id) == [(1, "start")], what="the handler to start")
        worker.stop()
        assert worker.stopped.wait(30), "the worker never stopped"
        stopped_at = time.monotonic()
    finally:
        worker.stop()
        thread.join(30)
    assert cleaned and cleaned[0] <= stopped_at, "the worker stopped before the handler's cleanup ended"
    assert db.execute("SELECT status::text, attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone() == (
        "queued",
        0,
    )
