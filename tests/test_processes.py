"""Real worker processes and real signals: fencing (SIGSTOP/SIGCONT),
graceful shutdown (SIGTERM), crashes (SIGKILL), and the zero-duplicate proof."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from relay_core import Relay, queries

from .helpers import ROOT, TcpProxy, run_relay, start_worker_process, status_counts, stop_process, wait_for

pytestmark = pytest.mark.slow


def executions(db: psycopg.Connection, job_id: int | None = None) -> list[tuple]:
    sql = "SELECT job_id, pid, attempt, lease_token, phase FROM relay_test.executions"
    if job_id is None:
        return db.execute(sql + " ORDER BY at").fetchall()
    return db.execute(sql + " WHERE job_id = %s ORDER BY at", (job_id,)).fetchall()


def job_row(db: psycopg.Connection, job_id: int) -> tuple:
    return db.execute(
        "SELECT status::text, attempts, lease_token, claimed_by, finished_at FROM relay.jobs WHERE id = %s", (job_id,)
    ).fetchone()


def claim_sizes(db: psycopg.Connection, job_type: str) -> list[int]:
    """How many jobs of ``job_type`` each claim took: a claim stamps its jobs' started_at with its now()."""
    query = "SELECT count(*) FROM relay.jobs WHERE type = %s AND started_at IS NOT NULL GROUP BY started_at"
    return [row[0] for row in db.execute(query, (job_type,))]


def test_paused_worker_cannot_complete_a_job_taken_over(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    env = dict(worker_env, RELAY_SWEEP_INTERVAL="0.3", RELAY_POLL_INTERVAL="0.2")
    log_a = tmp_path / "worker-a.log"
    worker_a = start_worker_process(python, env, "--lease", "2", "--concurrency", "1", log=log_a)
    worker_b = None
    try:
        job_id = relay.enqueue("record", {"sleep": 3})
        wait_for(lambda: executions(db, job_id), what="worker A to start the job")
        os.kill(worker_a.pid, signal.SIGSTOP)
        worker_b = start_worker_process(python, env, "--lease", "2", "--concurrency", "1")
        # A's lease runs out, a sweeper returns the job, B claims it and finishes it.
        wait_for(lambda: job_row(db, job_id)[0] == "succeeded", timeout=30, what="worker B to finish the job")
        after_b = job_row(db, job_id)
        assert after_b[2] == 2, "B ran the job under the second lease"
        os.kill(worker_a.pid, signal.SIGCONT)
        # A wakes, its handler returns and records 'end', then its completion is fenced out.
        wait_for(
            lambda: any(row[1] == worker_a.pid and row[4] == "end" for row in executions(db, job_id)),
            what="worker A to finish its stale run",
        )
        wait_for(lambda: "lease was taken over" in log_a.read_text(), timeout=15, what="A to learn it lost the job")
        assert job_row(db, job_id) == after_b, "the stale completion changed the job"
        runs = executions(db, job_id)
        assert {(r[1], r[3]) for r in runs} == {(worker_a.pid, 1), (worker_b.pid, 2)}
    finally:
        if worker_a.poll() is None:
            os.kill(worker_a.pid, signal.SIGCONT)
        stop_process(worker_a)
        if worker_b is not None:
            stop_process(worker_b)


def terminate(worker: subprocess.Popen, log: Path, within: float) -> None:
    """SIGTERM ``worker`` and wait for it to exit cleanly, failing with its log if it takes over ``within`` s."""
    worker.send_signal(signal.SIGTERM)
    try:
        code = worker.wait(within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker was still running {within} s after SIGTERM; its log:\n" + log.read_text())
    assert code == 0, log.read_text()


@pytest.mark.parametrize("job_type", ["record", "record_async", "record_to_thread"])
def test_sigterm_hands_back_unfinished_jobs_at_once(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path, job_type: str
) -> None:
    log = tmp_path / "worker.log"
    worker = start_worker_process(python, worker_env, "--lease", "60", "--shutdown-timeout", "0.5", log=log)
    try:
        job_id = relay.enqueue(job_type, {"sleep": 30})
        wait_for(lambda: executions(db, job_id), what="the job to start")
        started = time.monotonic()
        terminate(worker, log, within=15)
        assert time.monotonic() - started < 10
        status, attempts, _token, _by, _finished = job_row(db, job_id)
        # Back in the queue now, not after the 60 s lease, and the interrupted run spent no attempt.
        assert (status, attempts) == ("queued", 0)
        assert [row[4] for row in executions(db, job_id)] == ["start"]
        stopped = db.execute("SELECT stopped_at FROM relay.workers").fetchall()
        assert stopped and stopped[0][0] is not None
    finally:
        stop_process(worker)


@contextmanager
def a_job_running_behind_a_proxy(
    relay: Relay, db: psycopg.Connection, dsn: str, python: str, worker_env: dict, log: Path, *args: str, **env: str
) -> Iterator[tuple[subprocess.Popen, TcpProxy, int]]:
    """A worker process started with ``args`` and ``env`` whose database is reached through a proxy
    (clear ``flowing`` to stall it), running a job that sleeps two minutes: (the worker, the proxy,
    the job's id). On the way out the proxy flows again, and the worker is stopped."""
    proxy = TcpProxy.in_front_of(dsn)
    worker = start_worker_process(python, dict(worker_env, RELAY_DATABASE_URL=proxy.dsn, **env), *args, log=log)
    try:
        job_id = relay.enqueue("record", {"sleep": 120})
        wait_for(lambda: executions(db, job_id), what="the job to start")
        yield worker, proxy, job_id
    finally:
        proxy.flowing.set()
        stop_process(worker)
        proxy.close()


def seconds_to_exit(worker: subprocess.Popen, log: Path) -> float:
    """SIGTERM ``worker`` (see ``terminate``) and return how long it took to exit."""
    signalled = time.monotonic()
    terminate(worker, log, within=30)
    return time.monotonic() - signalled


def test_a_second_sigterm_cuts_the_wait_for_a_duty_short(
    relay: Relay, db: psycopg.Connection, dsn: str, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """A second signal cuts the shutdown's wait short: the operator pressing Ctrl-C twice, or a
    platform that sends SIGTERM again. It ended the wait for running jobs, but not the wait for a
    duty in progress (a sweep whose database stopped answering): that still took the whole
    shutdown timeout, 60 s here."""
    log = tmp_path / "worker.log"
    args = ("--lease", "90", "--shutdown-timeout", "60")
    with a_job_running_behind_a_proxy(relay, db, dsn, python, worker_env, log, *args, RELAY_SWEEP_INTERVAL="0.2") as (
        worker,
        proxy,
        job_id,
    ):
        proxy.flowing.clear()
        time.sleep(1.0)  # a sweep is waiting for its answer
        worker.send_signal(signal.SIGTERM)
        time.sleep(3.0)  # past the claim's cut: the shutdown is waiting for the duty
        took = seconds_to_exit(worker, log)
    assert took < 5.0, f"exited {took:.1f} s after the second SIGTERM; its log:\n" + log.read_text()
    assert "second signal" in log.read_text()
    # Not lost: the job stays the stopped worker's until its lease expires and a sweeper returns it.
    assert job_row(db, job_id)[0] == "claimed"


def test_sigterm_stops_the_worker_in_time_while_a_lock_on_the_jobs_table_holds_up_its_statements(
    relay: Relay, db: psycopg.Connection, dsn: str, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """A migration's index build or a VACUUM FULL locks relay.jobs: the claim and the hand-back wait on it.

    Before, the claim held up the shutdown until the lock went (and the
    platform's SIGKILL came first); now a stop cancels the claim, and the
    shutdown's writes give up within their share of the drain window.
    """
    log = tmp_path / "worker.log"
    worker = start_worker_process(python, worker_env, "--lease", "60", "--shutdown-timeout", "1", log=log)
    locker = psycopg.connect(dsn)
    try:
        job_id = relay.enqueue("record", {"sleep": 30})
        wait_for(lambda: executions(db, job_id), what="the job to start")
        locker.execute("LOCK TABLE relay.jobs IN ACCESS EXCLUSIVE MODE")
        blocked = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND application_name LIKE 'relay-worker%%'"
            # The claim, written out or (under limits) by its prepared name.
            " AND (query LIKE '%%room AS%%' OR query LIKE '%%EXECUTE relay_job_claim%%')"
        )
        wait_for(lambda: db.execute(blocked).fetchone()[0], what="a claim waiting for the lock")
        terminate(worker, log, within=15)
        # The hand-back could not be written: the job stays the stopped worker's until its lease
        # expires and a sweeper returns it, as after a SIGKILL.
        assert "hand-back failed" in log.read_text()
    finally:
        locker.close()
        stop_process(worker)
    assert job_row(db, job_id)[0] == "claimed"


@pytest.mark.parametrize("shutdown_timeout", [0, 1])
def test_sigterm_stops_the_worker_in_time_while_its_database_connection_has_stalled(
    relay: Relay,
    db: psycopg.Connection,
    dsn: str,
    python: str,
    worker_env: dict,
    tmp_path: Path,
    shutdown_timeout: int,
) -> None:
    """A database (or a proxy in front of it) that stops answering while TCP still acknowledges.

    Neither keepalives nor tcp_user_timeout end a wait on such a connection,
    a cancel request stalls on its way like everything else, and the
    server's statement_timeout never arrives. Before, the worker's claim (or
    the check of an idle pooled connection before it) waited until the
    database answered again, however long the platform's SIGKILL took: now
    the stop cuts the stalled connection, and the shutdown's writes give up
    within their share of the drain window.

    The process exits within the shutdown timeout and 4 s of the SIGTERM, as
    the docs promise (25 s and 4 s inside Render's and Heroku's 30 s): it
    took up to 4.6 s past a timeout of 0 when each step had its own floor.
    """
    log = tmp_path / "worker.log"
    args = ("--concurrency", "2", "--lease", "60", "--shutdown-timeout", str(shutdown_timeout))
    with a_job_running_behind_a_proxy(relay, db, dsn, python, worker_env, log, *args, RELAY_HEARTBEAT_INTERVAL="1") as (
        worker,
        proxy,
        job_id,
    ):
        proxy.flowing.clear()
        time.sleep(3)  # the next claim (or the idle check before it) and a heartbeat wait on the stalled connection
        took = seconds_to_exit(worker, log)
    assert took < shutdown_timeout + 4.0, f"exited {took:.2f} s after SIGTERM; its log:\n" + log.read_text()
    assert "hand-back failed" in log.read_text()
    # Not lost: the job stays the stopped worker's until its lease expires and a sweeper returns it.
    assert job_row(db, job_id)[0] == "claimed"


def test_a_sigkilled_worker_held_few_jobs_on_their_last_attempt_ahead_of_its_slots(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """Attempts are counted at claim time, so a worker killed outright spends the attempt of every job it held.

    Short jobs are prefetched, up to 16 per slot; with one attempt each, all
    those caught unstarted ended dead without having run. The claim now takes
    jobs on their last attempt only into idle slots and LAST_ATTEMPTS_AHEAD_PER_SLOT
    per slot beyond, so at most that many plus one per slot are caught.
    """
    from relay_core.worker.runtime import LAST_ATTEMPTS_AHEAD_PER_SLOT

    log = tmp_path / "worker.log"
    marks = tmp_path / "started"
    marks.touch()
    concurrency = 2
    most = concurrency * (1 + LAST_ATTEMPTS_AHEAD_PER_SLOT)
    ids = relay.enqueue_many(
        [{"type": "mark", "payload": {"path": str(marks)}, "max_attempts": 1} for _ in range(10000)]
    )

    def started() -> set[int]:
        return {int(line) for line in marks.read_text().split()}

    def claimed() -> set[int]:
        return {row[0] for row in db.execute("SELECT id FROM relay.jobs WHERE status = 'claimed'")}

    def unstarted() -> int:
        """Claimed and not started: read in that order, so never more than were at the first read."""
        held = claimed()
        return len(held - started())

    doomed = start_worker_process(python, worker_env, "--concurrency", str(concurrency), "--lease", "2", log=log)
    try:
        # Well into the run, with prefetch sized for jobs this short.
        samples: list[int] = []
        wait_for(lambda: samples.append(unstarted()) or len(started()) > 2000, what="the worker to run 2,000 jobs")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
    finally:
        stop_process(doomed)
    # A claim the server was running at the kill still commits: its jobs are caught too.
    sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s"
    wait_for(
        lambda: not db.execute(sessions, (f"relay-worker %:{doomed.pid}:%",)).fetchone()[0],
        what="the killed worker's sessions to end",
    )
    assert max(samples) <= most, samples
    caught = claimed() - started()
    assert len(caught) <= most, sorted(caught)
    rescuer = start_worker_process(python, worker_env, "--concurrency", str(concurrency), log=log)
    try:
        wait_for(
            lambda: not {"queued", "claimed"} & set(status_counts(db)),
            timeout=120,
            what="the rest drained after the leases expired",
        )
    finally:
        stop_process(rescuer)
    ran = started()
    dead = [row[0] for row in db.execute("SELECT id FROM relay.jobs WHERE status = 'dead'")]
    assert sorted(job_id for job_id in dead if job_id not in ran) == sorted(caught)
    assert status_counts(db).get("succeeded", 0) + len(dead) == len(ids)
    # Not one claim, by either worker, took more than the room: the jobs a claim took share its started_at.
    assert max(claim_sizes(db, "mark")) <= most
    # Jobs as short with attempts to spare are prefetched as before: more than the room for last attempts.
    relay.enqueue_many([{"type": "noop", "max_attempts": 2} for _ in range(10000)])
    spared = start_worker_process(python, worker_env, "--concurrency", str(concurrency), "--lease", "2", log=log)
    try:
        wait_for(lambda: status_counts(db).get("succeeded", 0) > len(ids) + 2000, what="2,000 more jobs")
    finally:
        stop_process(spared)
    assert max(claim_sizes(db, "noop")) > most


def test_sigterm_lets_an_async_handler_in_flight_finish_within_the_shutdown_timeout(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    worker = start_worker_process(python, worker_env, "--shutdown-timeout", "20", log=log)
    try:
        job_id = relay.enqueue("record_async", {"sleep": 1.5})
        wait_for(lambda: executions(db, job_id), what="the job to start")
        terminate(worker, log, within=20)
        status, attempts, *_ = job_row(db, job_id)
        assert (status, attempts) == ("succeeded", 1)
        assert [row[4] for row in executions(db, job_id)] == ["start", "end"]
        assert relay.get_job(job_id).result == "recorded"
    finally:
        stop_process(worker)


def test_sigterm_while_the_main_thread_holds_the_wake_events_lock_stops_the_worker(
    dsn: str, python: str, worker_env: dict
) -> None:
    # The claim loop clears its wake event before each claim; a SIGTERM landing inside that
    # clear ran a handler that waited for the event's lock on the thread holding it, forever.
    proc = subprocess.Popen(
        [python, "-m", "tests.apps.signal_in_lock", dsn],
        env=worker_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail("the worker hung after a SIGTERM that arrived inside its wake event's lock:\n" + out)
    assert proc.returncode == 0, out
    assert out.strip().endswith("stopped"), out
    assert "shutdown requested" in out


def test_job_handed_back_with_its_handler_running_starts_elsewhere_only_after_the_process_exits(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    env = dict(worker_env, RELAY_POLL_INTERVAL="0.05")
    worker_a = start_worker_process(python, env, "--lease", "60", "--shutdown-timeout", "0.3", "--concurrency", "1")
    assert_handed_back_job_starts_on_another_worker_after_the_first_exits(relay, db, python, env, worker_a, "record")


def test_run_worker_ends_its_process_when_a_handed_back_handler_runs_on(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    """``Relay.run_worker`` returned after the shutdown, and the interpreter's exit waited for the
    handler's ``asyncio.to_thread`` thread: the handed-back job started on worker B while A's run
    went on. It now ends its process as ``relay worker`` does, and B starts the job after that."""
    env = dict(worker_env, RELAY_POLL_INTERVAL="0.05")
    run_worker = (
        "from tests.apps.worker_app import relay; "
        "relay.run_worker(concurrency=1, lease_seconds=60, shutdown_timeout=0.3)"
    )
    worker_a = subprocess.Popen([python, "-c", run_worker], env=env, cwd=ROOT)
    assert_handed_back_job_starts_on_another_worker_after_the_first_exits(
        relay, db, python, env, worker_a, "record_to_thread"
    )


@pytest.mark.parametrize("runner", ["relay worker", "Relay.run_worker"])
def test_a_worker_whose_handlers_hang_past_their_timeouts_stops_and_exits_3_for_a_restart(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path, runner: str
) -> None:
    """Each handler stuck past its timeout got a fresh slot thread, and kept its job claimed, for the
    life of the process: a handler that hung on every job grew the worker a thread a job and held
    every job it took. Past RELAY_MAX_STUCK_HANDLERS (here 1, at concurrency 1) handlers stuck for
    over STUCK_AFTER_SECONDS, the worker stops itself, records their timeouts, and exits 3, which
    a supervisor restarts."""
    env = dict(worker_env, RELAY_POLL_INTERVAL="0.05", RELAY_MAX_STUCK_HANDLERS="1")
    log = tmp_path / "worker.log"
    hanging = [relay.enqueue("hang") for _ in range(3)]
    if runner == "relay worker":
        worker = start_worker_process(python, env, "--concurrency", "1", "--shutdown-timeout", "0.5", log=log)
    else:
        code = "from tests.apps.worker_app import relay; relay.run_worker(concurrency=1, shutdown_timeout=0.5)"
        with open(log, "ab") as out:
            worker = subprocess.Popen([python, "-c", code], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        status = worker.wait(30)
    finally:
        stop_process(worker)
    output = log.read_text()
    assert status == 3, output
    assert "too many handlers are stuck past their timeouts" in output
    # Each started on a fresh slot as the one before timed out, and each timeout is recorded.
    for job_id in hanging:
        assert [row[4] for row in executions(db, job_id)] == ["start"], output
        job = relay.get_job(job_id)
        assert (job.status, job.attempts) == ("queued", 1), job
        assert [e["type"] for e in job.errors] == ["JobTimeout"]


def test_a_sigterm_while_a_worker_stops_itself_is_its_first_signal(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """A platform's SIGTERM after the worker began to stop for stuck handlers was taken as a second
    signal, and the healthy jobs in flight were handed back at once rather than given their
    shutdown timeout."""
    env = dict(worker_env, RELAY_POLL_INTERVAL="0.05", RELAY_MAX_STUCK_HANDLERS="0")
    log = tmp_path / "worker.log"
    healthy = relay.enqueue("record", {"sleep": 9})
    worker = start_worker_process(python, env, "--concurrency", "2", "--shutdown-timeout", "15", log=log)
    try:
        wait_for(lambda: executions(db, healthy), what="the healthy job to start")
        stuck = relay.enqueue("hang")
        wait_for(lambda: "too many handlers are stuck" in log.read_text(), timeout=20, what="the worker to stop itself")
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(30)
    finally:
        stop_process(worker)
    output = log.read_text()
    assert status == 3, output
    assert "second signal" not in output
    assert job_row(db, healthy)[:2] == ("succeeded", 1), output
    assert [e["type"] for e in relay.get_job(stuck).errors] == ["JobTimeout"]


def test_handlers_a_shutdown_left_running_count_against_their_type_limit_until_their_process_exits(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    """Worker A runs three ``limited`` jobs (three at once at most) and is sent SIGTERM with a short
    shutdown timeout: it hands them back while their threads run on until its process exits.
    Worker B, with three more waiting, started those at once, beside A's three: six ran at once
    for about a second. B now starts none before A's process has ended, and then all six."""
    env = dict(worker_env, RELAY_POLL_INTERVAL="0.05")
    args = ("--lease", "60", "--shutdown-timeout", "0.3", "--concurrency", "3")
    worker_a = start_worker_process(python, env, *args)
    worker_b = None

    def started_by(pid: int) -> set[int]:
        rows = db.execute(
            "SELECT DISTINCT job_id FROM relay_test.executions WHERE pid = %s AND phase = 'start'", (pid,)
        ).fetchall()
        return {row[0] for row in rows}

    try:
        running = {relay.enqueue("limited", {"sleep": 30}) for _ in range(3)}
        wait_for(lambda: started_by(worker_a.pid) == running, timeout=30, what="worker A to start three jobs")
        waiting = {relay.enqueue("limited", {"sleep": 0}) for _ in range(3)}
        worker_b = start_worker_process(python, env, *args)
        # B claims (an unlimited job shows it), but no limited job while A's three run.
        probe = relay.enqueue("record", {})
        wait_for(lambda: probe in started_by(worker_b.pid), timeout=30, what="worker B to claim")
        assert not started_by(worker_b.pid) & (running | waiting)
        worker_a.send_signal(signal.SIGTERM)
        assert worker_a.wait(15) == 0
        (a_gone,) = db.execute("SELECT clock_timestamp()").fetchone()
        wait_for(lambda: started_by(worker_b.pid) >= running | waiting, timeout=30, what="worker B to start all six")
        (b_first,) = db.execute(
            "SELECT min(at) FROM relay_test.executions WHERE pid = %s AND phase = 'start' AND job_id = ANY(%s)",
            (worker_b.pid, list(running | waiting)),
        ).fetchone()
        assert b_first > a_gone, "B started a limited job while A's handed-back handlers still ran"
    finally:
        stop_process(worker_a)
        if worker_b is not None:
            stop_process(worker_b)


def assert_handed_back_job_starts_on_another_worker_after_the_first_exits(
    relay: Relay, db: psycopg.Connection, python: str, env: dict, worker_a: subprocess.Popen, job_type: str
) -> None:
    """Worker A starts a 30-second job and is sent SIGTERM: it hands the job back and exits at once
    (status 0), and worker B starts the job only after A's process, and so A's run, has ended."""
    worker_b = None
    try:
        job_id = relay.enqueue(job_type, {"sleep": 30})
        wait_for(lambda: executions(db, job_id), timeout=30, what="worker A to start the job")
        worker_b = start_worker_process(python, env, "--lease", "60", "--shutdown-timeout", "0.3")
        worker_a.send_signal(signal.SIGTERM)
        assert worker_a.wait(15) == 0, "the process waited for the handler's thread"
        (a_gone,) = db.execute("SELECT clock_timestamp()").fetchone()
        wait_for(
            lambda: any(row[1] == worker_b.pid for row in executions(db, job_id)),
            timeout=20,
            what="worker B to start the handed-back job",
        )
        (b_started,) = db.execute(
            "SELECT min(at) FROM relay_test.executions WHERE job_id = %s AND pid = %s", (job_id, worker_b.pid)
        ).fetchone()
        # A's handler thread ran until A's process exited; B started only after that.
        assert b_started > a_gone
        assert [row[1] for row in executions(db, job_id)] == [worker_a.pid, worker_b.pid], "A's run never ended"
    finally:
        stop_process(worker_a)
        if worker_b is not None:
            stop_process(worker_b)


def run_crash_drill(
    relay: Relay, db: psycopg.Connection, python: str, env: dict, job_type: str, total: int
) -> tuple[int, int]:
    """Drain ``total`` jobs with three workers; SIGTERM one and SIGKILL another mid-batch."""
    env = dict(env, RELAY_SWEEP_INTERVAL="0.5")
    relay.enqueue_many([{"type": job_type, "payload": {"sleep": 0.02}} for _ in range(total)])
    args = ("--lease", "3", "--concurrency", "4")
    workers = [start_worker_process(python, env, *args) for _ in range(3)]
    graceful, crashed, _survivor = workers
    try:
        # Both workers about to be signalled must be running jobs first: a worker whose
        # interpreter started late would otherwise be signalled before its first claim.
        wait_for(
            lambda: {graceful.pid, crashed.pid} <= {row[1] for row in executions(db)},
            timeout=60,
            what="both signalled workers to start jobs",
        )
        wait_for(lambda: status_counts(db).get("succeeded", 0) >= total // 5, timeout=60, what="progress")
        graceful.send_signal(signal.SIGTERM)
        crashed.send_signal(signal.SIGKILL)
        assert graceful.wait(30) == 0
        assert crashed.wait(10) == -signal.SIGKILL
        wait_for(lambda: status_counts(db) == {"succeeded": total}, timeout=120, what="every job to succeed")
    finally:
        for proc in workers:
            stop_process(proc)
    return graceful.pid, crashed.pid


def test_sigterm_and_sigkill_mid_batch_with_transactional_completion_run_each_job_once(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    total = 400
    run_crash_drill(relay, db, python, worker_env, "record_tx", total)
    per_job = db.execute("SELECT job_id, count(*) FROM relay_test.executions GROUP BY job_id").fetchall()
    assert len(per_job) == total
    assert all(count == 1 for _job, count in per_job), "a job's transactional work committed twice"


def test_sigterm_and_sigkill_mid_batch_rerun_only_jobs_in_flight_in_the_killed_process(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    total = 400
    graceful_pid, crashed_pid = run_crash_drill(relay, db, python, worker_env, "record", total)
    ends = db.execute("SELECT job_id, count(*) FROM relay_test.executions WHERE phase = 'end' GROUP BY 1").fetchall()
    assert len(ends) == total
    rerun = db.execute(
        "SELECT job_id, array_agg(pid ORDER BY at) FROM relay_test.executions WHERE phase = 'start' "
        "GROUP BY job_id HAVING count(*) > 1"
    ).fetchall()
    for job_id, pids in rerun:
        assert pids[0] == crashed_pid, f"job {job_id} re-ran though its first run was in {pids[0]}"
    ran_in = dict(db.execute("SELECT pid, count(*) FROM relay_test.executions GROUP BY pid").fetchall())
    assert ran_in.get(crashed_pid) and ran_in.get(graceful_pid), "both signalled workers were mid-batch"


def test_relay_prove_finds_no_duplicates_and_loses_nothing(dsn: str, worker_env: dict, python: str) -> None:
    prove = ["prove", "--workers", "3", "--jobs", "5000", "--concurrency", "4"]
    result = run_relay(python, worker_env, *prove, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    assert lines["workers"].strip() == "3 processes"
    assert lines["jobs"].strip() == "5000"
    assert lines["succeeded"].strip() == "5000"
    assert lines["duplicates found"].strip() == "0"
    assert lines["jobs lost"].strip() == "0"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(DISTINCT job_id) FROM relay_proof.executions").fetchone()[0] == 5000
        assert (
            conn.execute(
                "SELECT count(*) FROM (SELECT job_id FROM relay_proof.executions GROUP BY 1 HAVING count(*) > 1) d"
            ).fetchone()[0]
            == 0
        )


def test_relay_prove_checks_the_workers_settings_before_it_enqueues(dsn: str, worker_env: dict, python: str) -> None:
    """A bad RELAY_* setting stopped every worker at its start, after the jobs were enqueued, and the
    proof then reported every job as lost."""
    env = dict(worker_env, RELAY_LEASE_SECONDS="abc")
    result = run_relay(python, env, "prove", "--workers", "2", "--jobs", "300", timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "RELAY_LEASE_SECONDS must be a number" in result.stderr and "jobs lost" not in result.stdout
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM relay.jobs WHERE queue = 'relay_proof'").fetchone() == (0,)


def test_relay_prove_calls_jobs_it_had_no_time_for_unfinished_not_lost(dsn: str, worker_env: dict, python: str) -> None:
    """A proof that ran out of time counted every job still queued as lost, and exited 1 claiming data loss."""
    prove = ["prove", "--workers", "1", "--concurrency", "1", "--jobs", "20000", "--timeout", "1"]
    result = run_relay(python, worker_env, *prove, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines() if ":" in line)
    succeeded = int(lines["succeeded"])
    assert lines["jobs lost"].strip() == "0" and lines["duplicates found"].strip() == "0"
    unfinished = lines["unfinished"].strip()
    assert unfinished == (
        f"{20000 - succeeded} still queued or claimed: the proof stopped after 1 s (--timeout)"
        " (deleted, not left queued)"
    )
    # Nothing else serves the proof's queue: left there, they waited for the next proof.
    with psycopg.connect(dsn) as conn:
        left = conn.execute("SELECT status, count(*) FROM relay.jobs WHERE queue = 'relay_proof' GROUP BY 1")
        assert dict(left.fetchall()) == {"succeeded": succeeded}


def proof_workers(proof: int) -> list[int]:
    """The process ids of the workers the proof ``proof`` (its process id) started, running now."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RELAY_PROOF_PARENT={proof}".encode() in environ:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    ("stop", "whole_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGKILL, False)],
    ids=["ctrl-c", "sigterm-to-the-proof", "sigkill-to-the-proof"],
)
def test_relay_prove_stopped_leaves_no_worker_and_no_proof_job_behind(
    dsn: str, worker_env: dict, python: str, stop: signal.Signals, whole_group: bool
) -> None:
    """Ctrl-C stops the proof's workers with it; the jobs they had not run stayed queued, served by
    nobody. A SIGTERM sent to the proof alone (kill PID, a supervisor) ended it at once: its cleanup
    never ran, and its workers went on serving the proof's queue on the user's database. Killed
    outright, it cannot stop them: they now stop themselves once it is gone (and the jobs they did not
    run stay queued, handed back, until the next proof)."""
    command = [python, "-m", "relay_core", "prove", "--workers", "1", "--concurrency", "1", "--jobs", "20000"]
    proof = subprocess.Popen(command, env=worker_env, cwd=ROOT, start_new_session=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = "SELECT count(*) FROM relay.jobs WHERE queue = 'relay_proof' AND status = 'succeeded'"
            wait_for(lambda: conn.execute(started).fetchone()[0] > 0, what="the proof's workers to run jobs")
            assert proof_workers(proof.pid)
            if whole_group:
                os.killpg(proof.pid, stop)  # what Ctrl-C sends: the proof and its workers
            else:
                proof.send_signal(stop)
            assert proof.wait(60) == (-signal.SIGKILL if stop == signal.SIGKILL else 1)
            wait_for(lambda: not proof_workers(proof.pid), timeout=30, what="the proof's workers to stop")
            unrun = "SELECT status, count(*) FROM relay.jobs WHERE queue = 'relay_proof' AND status <> 'succeeded'"
            left = dict(conn.execute(unrun + " GROUP BY 1").fetchall())
            assert "claimed" not in left, "a worker that stopped gracefully holds nothing"
            assert stop == signal.SIGKILL or left == {}, left
    finally:
        if proof.poll() is None:
            os.killpg(proof.pid, signal.SIGKILL)
            proof.wait()
        for pid in proof_workers(proof.pid):
            os.kill(pid, signal.SIGKILL)


def test_the_proof_counts_a_job_marked_succeeded_that_never_ran_as_lost(db: psycopg.Connection) -> None:
    """A job counted as succeeded by its row alone: a queue that ended jobs without running them passed."""
    db.execute(queries.sql("proof_setup"))
    ran, skipped = (
        db.execute(
            "INSERT INTO relay.jobs (type, queue) VALUES ('relay.proof', 'relay_proof') RETURNING id"
        ).fetchone()[0]
        for _ in range(2)
    )
    db.execute("UPDATE relay.jobs SET status = 'succeeded', attempts = 1, finished_at = now()")
    db.execute(queries.sql("proof_enqueued"), {"ids": [ran, skipped]})
    db.execute(queries.sql("proof_record_execution"), {"job_id": ran, "worker": "w", "attempt": 1})
    succeeded, pruned, lost, unfinished = db.execute(queries.sql("proof_outcome")).fetchone()
    assert (succeeded, pruned, lost, unfinished) == (1, 0, 1, 0)


def test_json_logs_stay_json_when_the_database_drops_the_workers_connections(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """A log shipper parses every line: the connection pool's own warnings are JSON too."""
    env = dict(worker_env, RELAY_LOG_FORMAT="json", RELAY_POLL_INTERVAL="0.1")
    log = tmp_path / "worker.log"
    worker = start_worker_process(python, env, log=log)
    try:
        wait_for(lambda: "worker started" in log.read_text(), what="the worker to start")
        # What a database restart does to every open connection.
        db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        wait_for(lambda: "discarding" in log.read_text(), what="the pool to drop a dead connection")
        job_id = relay.enqueue("record")
        wait_for(lambda: status_counts(db).get("succeeded") == 1, what=f"job {job_id} to run after reconnecting")
    finally:
        stop_process(worker)
    lines = log.read_text().splitlines()
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    assert any(e["logger"] == "psycopg.pool" and e["level"] == "warning" for e in entries), lines
    assert any(e["message"] == "job succeeded" and e["job_id"] == job_id for e in entries), lines


def test_with_json_logs_the_applications_own_log_lines_and_warnings_are_json_too(
    relay: Relay, db: psycopg.Connection, python: str, worker_env: dict, tmp_path: Path
) -> None:
    """Only Relay's loggers wrote JSON: a handler's own logger.info was dropped, its warnings came out
    as bare text over several lines, and a log pipeline parsing each line as JSON broke on them."""
    log = tmp_path / "worker.log"
    job_id = relay.enqueue("app_logs")
    command = [python, "-m", "relay_core", "--log-format", "json", "worker", "--app", "tests.apps.worker_app:relay"]
    with open(log, "ab") as out:
        worker = subprocess.Popen(command, env=worker_env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: status_counts(db).get("succeeded") == 1, what="the job to run")
        wait_for(lambda: "deprecated" in log.read_text(), what="the warning logged")
    finally:
        stop_process(worker)
    entries = [json.loads(line) for line in log.read_text().splitlines()]  # every line is one JSON object
    messages = [entry["message"] for entry in entries]
    assert "imported 41 rows\nrow 12 skipped" in messages
    assert any("the v1 export format is deprecated\nuse v2" in message for message in messages)
    assert any(entry.get("job_id") == job_id and entry["message"] == "job succeeded" for entry in entries)


def test_relay_prove_counts_a_job_retention_pruned_after_it_ran_as_succeeded(
    dsn: str, worker_env: dict, python: str
) -> None:
    """Retention deletes finished jobs, the proof's own workers' too: a proof that outlasted it counted
    every pruned row as lost, though each of those jobs ran once."""
    prove = [python, "-m", "relay_core", "prove", "--workers", "2", "--jobs", "3000"]
    proof = subprocess.Popen(prove, env=worker_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pruned = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while proof.poll() is None:  # retention, as fast as it can go
            prune = "DELETE FROM relay.jobs WHERE queue = 'relay_proof' AND status = 'succeeded'"
            pruned += conn.execute(prune).rowcount
            time.sleep(0.02)
    out, err = proof.communicate()
    assert proof.returncode == 0, out + err
    lines = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    assert lines["jobs lost"].strip() == "0" and lines["duplicates found"].strip() == "0"
    assert pruned > 0 and lines["succeeded"].strip().startswith("3000 (")
    assert "pruned by retention after they ran" in lines["succeeded"]


def test_a_running_worker_publishes_its_limits_again_once_their_publisher_is_gone(
    db: psycopg.Connection, python: str, worker_env: dict
) -> None:
    """A worker of an old release restarted mid-deploy wrote its own limit for ``limited`` over the new
    release's, and stopped: the old limit stayed until a worker of the new release next started. The
    running worker now takes the row back within its check interval."""
    worker = start_worker_process(python, worker_env, "--concurrency", "2")
    try:
        published = "SELECT max_running, published_by FROM relay.type_limits WHERE type = 'limited'"
        wait_for(lambda: db.execute(published).fetchone(), timeout=30, what="the worker to publish its limits")
        (_, worker_id) = db.execute(published).fetchone()
        db.execute("UPDATE relay.type_limits SET max_running = 1, published_by = 'a-stopped-worker'")
        db.commit()
        wait_for(lambda: db.execute(published).fetchone() == (3, worker_id), timeout=20, what="the limit taken back")
    finally:
        stop_process(worker)
