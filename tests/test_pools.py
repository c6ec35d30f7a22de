"""Relay's connection pools: which idle connection is handed out, the kept cursor, and outdated prepared statements."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg_pool import PoolTimeout

from relay_core import Relay
from relay_core.connections import fetch_first_value
from relay_core.job import Job
from relay_core.migrate import migrate
from relay_core.pools import (
    IDLE_CHECK_FLOOR_SECONDS,
    IDLE_CHECK_SECONDS,
    ReconnectingPool,
    RelayConnection,
    make_pool,
)
from relay_core.queries import sql
from relay_core.stalls import WATCHDOG, cut_after
from relay_core.worker.completer import MAX_BATCH_BYTES, Completer
from relay_core.worker.outcome import Kind, Outcome

from .helpers import TcpProxy, claim_params, running_worker, suppress_errors, wait_for


def test_the_pool_hands_out_the_connection_returned_last(dsn: str) -> None:
    pool = make_pool(dsn, name="t", min_size=2, max_size=2, autocommit=True)
    pool.open(wait=True)
    try:
        first, second = pool.getconn(), pool.getconn()
        pool.putconn(first)
        pool.putconn(second)
        taken = [pool.getconn()]
        pool.putconn(taken[0])
        for _ in range(5):
            taken.append(pool.getconn())
            pool.putconn(taken[-1])
        # In turn (psycopg_pool's own order) they would alternate: first, second, first, ...
        assert all(conn is second for conn in taken)
        # Two taken at once are still two connections, and the one returned last comes first.
        a, b = pool.getconn(), pool.getconn()
        assert a is not b
        pool.putconn(b)
        pool.putconn(a)
        assert pool.getconn() is a
    finally:
        pool.close()


def test_a_checkout_ends_in_its_timeout_when_the_database_stopped_answering(dsn: str) -> None:
    """A connection idle for over a second is checked with an empty query before it is handed out.

    With the database behind a proxy that stopped forwarding (TCP still
    acknowledges, so no keepalive or tcp_user_timeout fires), that check
    waited for an answer until the database answered again, whatever the
    checkout's timeout said. Now the connection is cut and the checkout
    ends in its timeout; once the database answers, the pool works again.
    """
    proxy = TcpProxy.in_front_of(dsn)
    pool = make_pool(proxy.dsn, name="t", min_size=1, max_size=1)
    pool.open(wait=True)
    try:
        with pool.connection() as conn:
            conn.execute("SELECT 1")
        time.sleep(IDLE_CHECK_SECONDS + 0.2)  # idle long enough to be checked
        proxy.flowing.clear()
        began = time.monotonic()
        with pytest.raises(PoolTimeout), pool.connection(timeout=2.0):
            pass
        assert time.monotonic() - began < 2.0 + IDLE_CHECK_FLOOR_SECONDS + 1.0
        proxy.flowing.set()
        with pool.connection(timeout=15.0) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        proxy.flowing.set()
        pool.close()
        proxy.close()


def test_the_kept_cursor_serves_again_after_a_failed_statement_and_after_being_closed(dsn: str) -> None:
    pool = make_pool(dsn, name="t", min_size=1, max_size=1, autocommit=True)
    pool.open(wait=True)
    try:
        with pool.connection() as conn:
            assert isinstance(conn, RelayConnection)
            assert conn.kept_cursor() is conn.kept_cursor()
            assert fetch_first_value(conn, "SELECT %(n)s::int", {"n": 41}) == 41
            assert conn.kept_cursor().pgresult is not None, "the statement ran on the kept cursor"
            with pytest.raises(psycopg.errors.DivisionByZero):
                fetch_first_value(conn, "SELECT 1 / %(zero)s", {"zero": 0})
            assert fetch_first_value(conn, "SELECT %(n)s::int + 1", {"n": 1}) == 2
            conn.kept_cursor().close()
            assert fetch_first_value(conn, "SELECT %(n)s::int + 2", {"n": 1}) == 3
            assert fetch_first_value(conn, "SELECT 1 WHERE false", {}) is None
    finally:
        pool.close()


def test_a_column_retyped_under_prepared_statements_costs_no_claim_and_no_enqueue(
    unmigrated_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A retyped column (by hand, or a restored dump) outdates the prepared claim and inserts that return it.

    The server refuses such a statement on every connection that prepared it;
    a worker's claim used to fail so until the process restarted, and so did
    a Relay's enqueues. Now each pool replaces its connections at the first
    refusal, a worker claims on at its next try, and an enqueue is sent again.
    """
    dsn = unmigrated_dsn
    migrate(dsn)
    # One client connection: the pool grows to a second one when its first enqueue finds the first
    # still connecting, and an enqueue on a connection that never prepared the insert is not refused.
    app = Relay(dsn, pool_size=1)
    ran: list[int] = []
    app.handler("note")(lambda job: ran.append(job.id))
    caplog.set_level(logging.WARNING, logger="relay")
    try:
        with running_worker(app), psycopg.connect(dsn, autocommit=True) as db:
            before = [app.enqueue("note", {}), *app.enqueue_many([{"type": "note"}])]
            wait_for(lambda: sorted(ran) == before, what="the jobs enqueued before the change ran")

            # bigint -> integer: the claim and the inserts return it.
            db.execute("ALTER TABLE relay.jobs ALTER COLUMN id TYPE integer")

            # A job from a process that prepared nothing: the worker's prepared claim is outdated.
            other = Relay(dsn)
            try:
                from_other = other.enqueue("note", {})
            finally:
                other.close()
            wait_for(lambda: from_other in ran, what="the worker claimed after the change")
            # This Relay's prepared one-job and bulk inserts are outdated too: each is sent again.
            after = [app.enqueue("note", {}), *app.enqueue_many([{"type": "note"}, {"type": "note"}])]
            wait_for(lambda: set(after) <= set(ran), what="the jobs enqueued after the change ran")

            # The completions are outdated too (they return the id): each is sent again, not left
            # to a lease that runs out and a second run.
            def all_succeeded() -> list[tuple] | None:
                rows = db.execute("SELECT id, status::text FROM relay.jobs ORDER BY id").fetchall()
                return rows if all(status == "succeeded" for _, status in rows) else None

            rows = wait_for(all_succeeded, timeout=15, what="every completion written")
    finally:
        app.close()
    everything = [*before, from_other, *after]
    assert rows == [(job_id, "succeeded") for job_id in everything], "each enqueue inserted one job, each ran"
    assert sorted(ran) == everything, "each job ran once"
    replaced = [r.getMessage() for r in caplog.records if "outdated the statements prepared" in r.getMessage()]
    assert any("'relay-client'" in message for message in replaced), replaced
    assert any("'relay-worker-" in message for message in replaced), replaced


def test_threads_sharing_one_pooled_connection_each_read_their_own_results(dsn: str) -> None:
    """A transactional handler's connection, passed as conn= to enqueues from several threads."""
    pool = make_pool(dsn, name="t", min_size=1, max_size=1, autocommit=True)
    pool.open(wait=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, between a statement and its fetch
    try:
        with pool.connection() as conn:
            wrong: list[tuple[int, object]] = []

            def work(me: int) -> None:
                for i in range(5000):
                    expected = me * 100_000 + i
                    try:
                        got = fetch_first_value(conn, "SELECT %(v)s::int", {"v": expected})
                    except psycopg.Error as exc:
                        got = exc
                    if got != expected:
                        wrong.append((expected, got))

            threads = [threading.Thread(target=work, args=(n,)) for n in (1, 2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert wrong == []
    finally:
        sys.setswitchinterval(interval)
        pool.close()


def test_a_pool_made_before_a_fork_belongs_to_the_process_that_opens_it(
    python: str, worker_env: dict[str, str]
) -> None:
    script = Path(__file__).parent / "apps" / "fork_unopened_pool.py"
    result = subprocess.run([python, str(script)], env=worker_env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.split()) == (0, ["child", "1", "parent", "2", "0"]), result.stderr


def test_a_forked_child_leaves_the_parents_armed_connections_alone(dsn: str) -> None:
    """A child copied the parent's deadlines, and its own first deadline started a watchdog that cut
    the socket it shares with the parent: the parent's connection broke."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        handle = WATCHDOG.arm(conn, 0.5)
        pid = os.fork()
        if pid == 0:  # the child: a deadline of its own, then outlive the parent's
            try:
                with psycopg.connect(dsn, autocommit=True) as own, cut_after(own, 5.0):
                    own.execute("SELECT 1")
                time.sleep(1.5)
            finally:
                os._exit(0)
        WATCHDOG.disarm(handle)  # the parent's block ended in time
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_child_forked_while_another_thread_held_the_pool_lock_can_enqueue(
    relay: Relay, db: psycopg.Connection
) -> None:
    """The pool's lock, held by another thread (closing the pool, or opening it) at the fork, stayed
    held in the child, where that thread does not exist: the child's first enqueue hung for good."""
    relay.enqueue("before_fork")
    relay._pool_lock.acquire()  # as a thread inside close() or the pool's opening holds it
    try:
        pid = os.fork()
        if pid == 0:  # the child: its enqueue makes a pool of its own, or the alarm ends it
            code = 1
            try:
                signal.alarm(10)
                relay.enqueue("from_child")
                code = 0
            finally:
                os._exit(code)
    finally:
        relay._pool_lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'from_child'").fetchone()[0] == 1
    relay.enqueue("after_fork")  # the parent's pool and lock work as before


def test_an_enqueue_that_finds_every_connection_in_use_says_so(dsn: str, db: psycopg.Connection) -> None:
    """The error said only "couldn't get a connection after 0.50 sec", as if the database were down."""
    small = Relay(dsn, pool_size=1, db_wait=0.5)
    try:
        # The pool's only connection, held (a slow request, a leak).
        with small.pool.connection(), pytest.raises(PoolTimeout) as waited:
            small.enqueue("t")
        said = "couldn't get a connection after 0.50 sec: all 1 of the pool's connections were in use"
        assert str(waited.value) == said
        small.enqueue("t")  # returned, the connection serves again
    finally:
        small.close()
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1


def test_threads_that_enqueue_first_at_once_all_get_an_open_pool(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool was stored before it was opened: a thread that read it in between (without the lock)
    got "the pool 'relay-client' is not open yet" from its enqueue. Opening is slowed here so that
    the threads meet that moment every time, not once in many CI runs."""
    opening = ReconnectingPool._open

    def slow_open(pool: ReconnectingPool, *args: object, **kwargs: object) -> None:
        time.sleep(0.05)
        opening(pool, *args, **kwargs)

    monkeypatch.setattr(ReconnectingPool, "_open", slow_open)
    failures: list[BaseException] = []
    for _ in range(15):
        fresh = Relay(dsn)
        barrier = threading.Barrier(6)

        def enqueue(relay: Relay = fresh, barrier: threading.Barrier = barrier) -> None:
            barrier.wait(timeout=30)
            try:
                relay.enqueue("first")
            except Exception as exc:
                failures.append(exc)

        threads = [threading.Thread(target=enqueue) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        fresh.close()
    assert failures == []
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'first'").fetchone()[0] == 90


def test_a_pool_left_open_is_closed_as_the_process_exits(dsn: str, db: psycopg.Connection) -> None:
    """A pool never closed (``relay = Relay()`` at module level) was closed by its finaliser during
    interpreter shutdown, when Python 3.13 and newer can no longer join its threads: a program that
    enqueued one job and ended then waited 5 s for each of the pool's four threads. Relay closes
    the pools still open at exit, while their threads can still be joined."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.WARNING)\n"
        "logging.getLogger('psycopg.pool').setLevel(logging.DEBUG)\n"
        "from relay_core import Relay\n"
        f"relay = Relay({dsn!r})\n"
        "relay.enqueue('left_open')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pool 'relay-client' closed" in done.stderr, done.stderr[-2000:]
    assert "couldn't stop thread" not in done.stderr
    assert db.execute("SELECT count(*) FROM relay.jobs WHERE type = 'left_open'").fetchone()[0] == 1


def migrated_with_claimed_notes(dsn: str, count: int) -> list[Job]:
    """Migrate the database at ``dsn``, enqueue ``count`` jobs of type ``note`` and claim them all."""
    migrate(dsn)
    app = Relay(dsn)
    try:
        app.enqueue_many([{"type": "note"} for _ in range(count)])
    finally:
        app.close()
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as db:
        jobs = [Job.from_row(row) for row in db.execute(sql("job_claim"), claim_params(limit=count))]
    assert len(jobs) == count
    return jobs


def mixed_outcomes(succeeded: Job, failed: Job) -> list[Outcome]:
    """A completion batch of two outcome kinds: one transaction of two statements."""
    retry = Outcome(failed, Kind.RETRY, 0.0, delay=60.0, message="boom", error={"type": "RuntimeError"})
    return [Outcome(succeeded, Kind.SUCCEEDED, 0.0, result='{"ok": true}'), retry]


@pytest.mark.parametrize("mixed", [False, True], ids=["one-kind", "mixed-kinds"])
def test_a_completion_outdated_by_a_retyped_column_is_sent_again_not_left_to_its_lease(
    unmigrated_dsn: str, mixed: bool
) -> None:
    """The completion returns the id too: once a column changed type under it, the server refused
    the prepared statement, and the completer gave the job up to its lease (a second run 30 s later).
    A batch of several outcome kinds runs by statements its connection's session prepared, refused
    alike: it goes once more, whole, on a fresh connection."""
    dsn = unmigrated_dsn
    jobs = migrated_with_claimed_notes(dsn, 7)
    if mixed:
        before = [mixed_outcomes(jobs[0], jobs[1])]  # prepares the statements on the session
        after = mixed_outcomes(jobs[2], jobs[3])
    else:
        # One at a time on the pool's one connection, which then prepares the statement.
        before = [[Outcome(job, Kind.SUCCEEDED, 0.0)] for job in jobs[:6]]
        # One outcome alone: a refused batch of several is split and each sent again, which hid this.
        after = [Outcome(jobs[6], Kind.SUCCEEDED, 0.0)]
    outcomes = [outcome for batch in [*before, after] for outcome in batch]
    expected = {o.job.id: "queued" if o.kind is Kind.RETRY else "succeeded" for o in outcomes}
    with psycopg.connect(dsn, autocommit=True) as db:
        pool = make_pool(dsn, name="completer-test", min_size=1, max_size=1)
        pool.open(wait=True)
        written: dict[int, str] = {}
        completer = Completer(pool, lambda batch, done: written.update(done))
        try:
            for batch in before:
                completer._write_until_done(batch)
            db.execute("ALTER TABLE relay.jobs ALTER COLUMN id TYPE integer")
            completer._write_until_done(after)
        finally:
            pool.close()
        statuses = dict(db.execute("SELECT id, status::text FROM relay.jobs WHERE id = ANY(%s)", (list(expected),)))
    assert statuses == expected
    assert written == expected


@pytest.mark.parametrize(
    "text",
    ["値" * 1900, "\x01" * 1900],  # three bytes each in UTF-8; six each as JSON escapes them
    ids=["non-ascii", "control-characters"],
)
def test_a_completion_statement_carries_a_bounded_amount_of_text(unmigrated_dsn: str, text: str) -> None:
    """Up to 1,000 outcomes went in one statement whatever their size: failures with long messages
    and tracebacks (up to 12,000 characters each) made statements of megabytes, and libpq keeps each
    connection's buffer at the size of the largest message it sent, so a worker whose jobs failed so
    held about 110 MB at concurrency 8. A batch stops once its outcomes carry MAX_BATCH_BYTES, counted
    as sent: UTF-8 (the error entry's JSON no longer escapes each such character as six bytes), and
    the escapes JSON cannot do without (control characters) counted as written."""
    jobs = migrated_with_claimed_notes(unmigrated_dsn, 150)
    message = "ValueError: " + text
    outcomes = [
        Outcome(
            job,
            Kind.DEAD if n % 2 else Kind.RETRY,
            0.0,
            delay=60.0,
            message=message,
            error={"attempt": 1, "type": "ValueError", "message": message, "traceback": "t" * 8000},
        )
        for n, job in enumerate(jobs)
    ]

    def sent(batch: list[Outcome]) -> int:
        return sum(len(o.message.encode()) + len(o.error_json().encode()) for o in batch)

    largest = max(sent([outcome]) for outcome in outcomes)
    assert largest > 19_000
    batches: list[list[Outcome]] = []
    written: dict[int, str] = {}

    def on_written(batch: list[Outcome], done: dict[int, str]) -> None:
        batches.append(batch)
        written.update(done)

    pool = make_pool(unmigrated_dsn, name="completer-text", min_size=1, max_size=1)
    pool.open(wait=True)
    completer = Completer(pool, on_written)
    try:
        for outcome in outcomes:  # all queued before the thread starts: it could take them in one batch
            completer.put(outcome)
        completer.start()
        completer.stop()
    finally:
        pool.close()
    assert sorted(written) == sorted(job.id for job in jobs)
    assert len(batches) > 1
    assert all(sent(batch) <= MAX_BATCH_BYTES + largest for batch in batches), [sent(batch) for batch in batches]
    with psycopg.connect(unmigrated_dsn) as db:
        statuses = dict(db.execute("SELECT status::text, count(*) FROM relay.jobs GROUP BY status").fetchall())
        stored = db.execute("SELECT last_error, errors -> 0 ->> 'message' FROM relay.jobs LIMIT 1").fetchone()
    assert statuses == {"dead": 75, "queued": 75}
    assert stored == (message, message)


def test_a_worker_frozen_right_after_its_first_send_of_a_mixed_completion_batch_leaves_no_rows_locked(
    relay: Relay, dsn: str
) -> None:
    """A batch of several outcome kinds is one transaction. psycopg's ``transaction()`` in a pipeline
    sends BEGIN first and the COMMIT once the statements' results are back: a worker frozen in between
    (stopped, its host paused) left its transaction open, its jobs' rows locked, until the server
    dropped its connection. The whole transaction now travels in one message."""

    relay.enqueue_many([{"type": "note"} for _ in range(4)])
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as db:
        jobs = [Job.from_row(row) for row in db.execute(sql("job_claim"), claim_params(limit=4))]
        proxy = TcpProxy.in_front_of(dsn)
        pool = make_pool(proxy.dsn, name="frozen", min_size=1, max_size=1)
        pool.open(wait=True)
        completer = Completer(pool, lambda batch, done: None)
        # The first checkout checks the connection, the first mixed batch prepares its statements:
        # the batch below then sends nothing before its own message.
        assert completer.write(mixed_outcomes(jobs[0], jobs[1])) == {jobs[0].id: "succeeded", jobs[1].id: "queued"}
        proxy.stall_after_next_write.set()  # the worker freezes once its first write is out
        batch = mixed_outcomes(jobs[2], jobs[3])
        writer = threading.Thread(target=lambda: suppress_errors(completer.write, batch), daemon=True)
        writer.start()
        try:
            # The server committed the batch without another byte from the worker.
            status = "SELECT status::text FROM relay.jobs WHERE id = %s"
            wait_for(
                lambda: (
                    [db.execute(status, (job.id,)).fetchone()["status"] for job in jobs[2:]] == ["succeeded", "queued"]
                ),
                timeout=10,
                what="the frozen worker's batch committed",
            )
        finally:
            proxy.close()
            writer.join(timeout=10)
            pool.close()


def test_a_completion_stuck_on_a_stalled_connection_at_stop_is_named_in_the_log(
    relay: Relay, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A write sent just before the database stopped answering never came back by the stop: the worker
    said it stopped with nothing left claimed, and its jobs waited out their leases with no line naming them."""
    from psycopg.rows import dict_row

    from relay_core.job import Job
    from relay_core.queries import sql
    from relay_core.worker.completer import Completer
    from relay_core.worker.outcome import Kind, Outcome

    caplog.set_level("INFO", logger="relay")
    relay.enqueue_many([{"type": "note"} for _ in range(2)])
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as db:
        first, second = [Job.from_row(row) for row in db.execute(sql("job_claim"), claim_params(limit=2))]
    proxy = TcpProxy.in_front_of(dsn)
    pool = make_pool(proxy.dsn, name="stuck-completer", min_size=1, max_size=1)
    pool.open(wait=True)
    completer = Completer(pool, lambda batch, done: None)
    completer.start()
    try:
        with pool.connection() as conn:  # used just now: the pool hands it out unchecked
            conn.execute("SELECT 1")
        proxy.flowing.clear()
        completer.put(Outcome(first, Kind.SUCCEEDED, 0.0))
        time.sleep(0.5)  # sent, and unanswered
        completer.put(Outcome(second, Kind.SUCCEEDED, 0.0))  # queued behind it
        completer.stop(0.5)
        (line,) = [r for r in caplog.records if r.getMessage().startswith("completion still unanswered")]
        assert line.levelname == "ERROR"
        assert line.job_ids == [first.id, second.id]
    finally:
        proxy.close()
        pool.close(timeout=1)


def test_a_checkout_that_finds_its_idle_connections_ended_takes_a_new_one_within_its_timeout(
    dsn: str, db: psycopg.Connection
) -> None:
    """After a restart, or a server's idle_session_timeout, every idle connection is dead: psycopg_pool
    sleeps 1 s after the second one whose check fails, so a claim (1 s to get a connection) failed with
    PoolTimeout on a database that was back, and the worker logged an outage."""
    pool = make_pool(dsn, name="ended", min_size=3, max_size=3, autocommit=True)
    pool.open(wait=True)
    try:
        held = [pool.getconn() for _ in range(3)]
        pids = [conn.info.backend_pid for conn in held]
        for conn in held:
            pool.putconn(conn)
        db.execute("SELECT pg_terminate_backend(pid, 5000) FROM unnest(%s::int[]) AS pid", (pids,))
        time.sleep(IDLE_CHECK_SECONDS + 0.1)  # idle long enough to be checked
        with pool.connection(timeout=1.0) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert conn.info.backend_pid not in pids
    finally:
        pool.close()


def test_an_enqueue_after_a_borrower_turned_autocommit_off_is_committed(dsn: str, db: psycopg.Connection) -> None:
    """The pool is public: a connection given back with autocommit off ran the next enqueue in a transaction
    the pool rolled back as it came back, and the enqueue had returned the lost job's id."""
    relay = Relay(dsn, pool_size=1)
    try:
        with relay.pool.connection() as lent:
            lent.autocommit = False
        job_id = relay.enqueue("kept")
        ids = relay.enqueue_many([{"type": "kept"}])
    finally:
        relay.close()
    assert db.execute("SELECT array_agg(id ORDER BY id) FROM relay.jobs").fetchone()[0] == [job_id, *ids]
