"""Database outages on a PostgreSQL of the tests' own: restarts, crashes and longer downtime.

Relay's workers must come through a database that goes away and comes back by
themselves: no job lost, none run twice at once, and work resumes as soon as
the server answers again.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Job, Relay
from relay_core.client import DEFAULT_DB_WAIT_SECONDS
from relay_core.demo import Demo
from relay_core.migrate import migrate
from relay_core.pools import RECONNECT_MAX_DELAY_SECONDS
from relay_core.worker.outage import RETRY_MAX_SECONDS
from relay_core.worker.runtime import SHUTDOWN_OVERRUN_SECONDS

from .helpers import ROOT, TcpProxy, job_status, running_worker, wait_for
from .pgcluster import Cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A server these tests may stop and crash."""
    server = Cluster()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def outage_dsn(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database on the test's own server."""
    name = "outage_" + request.node.name.lower()[:40].replace("[", "_").replace("]", "")
    dsn = cluster.create_database(name)
    migrate(dsn)
    yield dsn
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_worker_works_again_within_seconds_of_a_long_outage_ending(
    cluster: Cluster, outage_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection pool retries connecting with a growing delay; uncapped, it doubled past the
    length of the outage (1, 2, 4, 8 s ...), and a worker sat idle for as long again after the
    server came back: no claims, no completions, no sweeps.

    Its log tells the outage once, and its end, rather than a warning per failed call (the
    heartbeat alone wrote one a second)."""
    caplog.set_level("INFO", logger="relay")
    relay = Relay(outage_dsn)
    done = threading.Event()
    relay.handler("echo")(lambda job: done.set())
    try:
        with running_worker(relay, concurrency=1, listen=False, poll_interval=0.1):
            first = relay.enqueue("echo")
            with psycopg.connect(outage_dsn, autocommit=True) as db:
                wait_for(lambda: job_status(db, first) == "succeeded", what="the first job")
            done.clear()
            cluster.stop("immediate")
            time.sleep(9)  # the pool's attempts so far: at about 0, 1, 3 and 7 s; uncapped, the next at 15 s
            cluster.start()
            back = time.monotonic()
            second = relay.enqueue("echo")
            assert done.wait(20), "the worker never ran a job after the outage"
            # At worst the pool's next attempt (capped) lands as the claim loop starts its backoff.
            bound = RECONNECT_MAX_DELAY_SECONDS + RETRY_MAX_SECONDS + 1.0
            resumed = time.monotonic() - back
            assert resumed < bound, f"the worker resumed {resumed:.1f} s after the outage"
            with psycopg.connect(outage_dsn, autocommit=True) as db:
                wait_for(lambda: job_status(db, second) == "succeeded", what="the second job's success")
    finally:
        relay.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "relay" and r.levelname == "WARNING"]
    assert warnings.count("database unreachable; retrying") == 1, warnings
    assert warnings.count("database reachable again") == 1, warnings
    assert len(warnings) <= 4, warnings


def test_an_enqueue_while_the_database_is_down_fails_within_seconds(cluster: Cluster, outage_dsn: str) -> None:
    """An enqueue without ``conn`` waited 30 s for a pooled connection when the database was down,
    past the 30 s a platform's router gives a web request: the user saw the router's error page,
    not the application's. It now raises after RELAY_DB_WAIT_SECONDS (5), and works again once
    the database is back."""
    relay = Relay(outage_dsn)
    waits: list[float] = []
    try:
        relay.enqueue("echo")
        cluster.stop("immediate")
        for _ in range(3):  # a connection that broke fails at once; then the pool has none to give
            started = time.monotonic()
            with pytest.raises(psycopg.OperationalError):
                relay.enqueue("echo")
            waits.append(time.monotonic() - started)
        cluster.start()
        wait_for(lambda: _enqueued(relay), timeout=20, what="an enqueue to succeed again")
    finally:
        relay.close()
    assert max(waits) >= DEFAULT_DB_WAIT_SECONDS - 0.5, waits  # the pool's wait, not a broken connection's error
    assert max(waits) < DEFAULT_DB_WAIT_SECONDS + 2, waits


def _enqueued(relay: Relay) -> bool:
    """Whether an enqueue gets through now."""
    try:
        relay.enqueue("echo")
    except psycopg.OperationalError:
        return False
    return True


def test_a_job_finished_during_an_outage_longer_than_its_lease_is_recorded_not_run_again(
    cluster: Cluster, outage_dsn: str
) -> None:
    """A handler finished while the server was down, for longer than the lease. When the server
    is back, every lease in it has run out only because nobody could renew it, and the first
    sweeper to get through (any worker's) returned every running job, the jobs of workers that
    were alive and about to record them too: finished work ran again. After the server starts,
    sweepers leave leases alone for one lease, and the workers that hold them renew them."""
    proxy = TcpProxy("127.0.0.1", cluster.port)
    holder = Relay(conninfo.make_conninfo(outage_dsn, port=str(proxy.port)))
    other = Relay(outage_dsn)
    runs: list[int] = []
    started = threading.Event()

    def finish(job: Job) -> None:
        runs.append(job.lease_token)
        started.set()
        time.sleep(1.0)

    for app in (holder, other):
        app.handler("finish")(finish)
    settings = {"lease_seconds": 4.0, "heartbeat_interval": 1.0, "listen": False, "poll_interval": 0.1}
    try:
        with running_worker(holder, concurrency=1, sweep_interval=60, **settings):
            job_id = other.enqueue("finish")
            assert started.wait(15)
            cluster.stop("immediate")  # the handler returns while the server is down
            time.sleep(5.0)  # longer than the lease
            proxy.flowing.clear()  # the holder gets through a moment after the others
            cluster.start()
            with running_worker(other, concurrency=1, sweep_interval=0.2, **settings):
                time.sleep(1.5)  # the other worker sweeps every 0.2 s
                proxy.flowing.set()
                with psycopg.connect(outage_dsn, autocommit=True) as db:
                    wait_for(lambda: job_status(db, job_id) == "succeeded", timeout=20, what="the job's success")
                    (attempts,) = db.execute("SELECT attempts FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    finally:
        holder.close()
        other.close()
        proxy.close()
    assert runs == [1], "the job ran again though its first run had finished"
    assert attempts == 1


def test_a_worker_told_to_stop_while_its_database_is_down_exits_within_its_drain_window(
    cluster: Cluster, outage_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM during an outage: the in-flight wait ends at the shutdown timeout, and what is left
    (the finished jobs' outcomes, the hand-back, the registry's stop) cannot be written. Each of
    those waits used to run its own course (the completer 10 s, then 5 s each for the stop and the
    hand-back), 20 s past the shutdown timeout, well past a platform's SIGKILL; a worker killed
    then loses nothing, but the drain window is a promise. They now share a few seconds."""
    caplog.set_level("INFO", logger="relay")
    relay = Relay(outage_dsn)
    finished = threading.Event()

    @relay.handler("quick")
    def quick(job: Job) -> None:
        time.sleep(0.5)
        finished.set()

    @relay.handler("long")
    def long(job: Job) -> None:
        time.sleep(30)  # past every deadline here, and deaf to lease_lost

    worker = relay.worker(concurrency=2, listen=False, poll_interval=0.1, shutdown_timeout=1.0)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        quick_id, long_id = relay.enqueue("quick"), relay.enqueue("long")
        with psycopg.connect(outage_dsn, autocommit=True) as db:
            wait_for(
                lambda: db.execute("SELECT count(*) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0] == 2,
                what="both jobs to start",
            )
        cluster.stop("immediate")
        assert finished.wait(10)
        time.sleep(0.5)  # the quick job's success is waiting in the completer, which cannot write it
        told = time.monotonic()
        worker.stop()
        assert worker.stopped.wait(30), "the worker never stopped"
        took = time.monotonic() - told
        limit = 1.0 + SHUTDOWN_OVERRUN_SECONDS
        assert took < limit, f"the worker stopped {took:.1f} s after it was told to; the bound is {limit:.1f} s"
    finally:
        worker.stop()
        cluster.start()
        relay.close()
    with psycopg.connect(outage_dsn, autocommit=True) as db:
        # Nothing was written: both jobs wait, claimed, for the sweeper once their leases end.
        statuses = db.execute("SELECT id, status::text FROM relay.jobs ORDER BY id").fetchall()
    assert statuses == [(quick_id, "claimed"), (long_id, "claimed")]
    # Its last line says so, rather than counting the failed hand-back as done.
    (stopped,) = [r for r in caplog.records if r.getMessage() == "worker stopped"]
    assert (stopped.handed_back, stopped.not_handed_back) == (0, 1)


def test_the_web_app_is_ready_again_within_seconds_of_a_long_outage_ending(cluster: Cluster, outage_dsn: str) -> None:
    """While the database is down the admin app answers 503 problem+json; once it is back,
    /readyz must say so within seconds. Its pool's reconnection delay doubled without bound,
    and after a 40 s outage the app (and the dashboard an operator needs then) answered 503
    for another 20 s, with load balancers taking it out of rotation."""
    from relay_web import create_app

    config = {"TESTING": True, "RELAY_DATABASE_URL": outage_dsn, "JWT_SECRET_KEY": "k" * 48, "RELAY_DB_WAIT_SECONDS": 1}
    app = create_app(config)
    client = app.test_client()
    try:
        assert client.get("/readyz").status_code == 200
        cluster.stop("immediate")
        started = time.monotonic()
        # A load balancer's probes all through the outage; the pool's attempts at about 0, 1, 3, 7
        # and 15 s, and uncapped the next at 31.
        while time.monotonic() - started < 16:
            response = client.get("/readyz")
            assert response.status_code == 503
            assert response.content_type == "application/problem+json"
            time.sleep(0.5)
        cluster.start()
        back = time.monotonic()
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=30, what="/readyz to answer 200")
        assert time.monotonic() - back < 4.0, f"ready {time.monotonic() - back:.1f} s after the database came back"
    finally:
        app.extensions["relay.close"]()


def test_the_demo_shops_order_stream_carries_on_through_a_database_restart(cluster: Cluster, outage_dsn: str) -> None:
    """`relay demo` stops everything when one of its processes exits, and the order producer
    exited on the first order it could not place after its database restarted."""
    env = dict(
        os.environ,
        RELAY_DATABASE_URL=outage_dsn,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]),
        PYTHONUNBUFFERED="1",
    )
    env.pop("DATABASE_URL", None)
    producer = subprocess.Popen(
        [sys.executable, "-m", "relay_shop.producer", "--per-minute", "600", "--limit", "30"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert producer.stdout is not None
        for line in producer.stdout:  # a few orders placed: the engine holds a live connection
            if line.startswith("order 5 placed"):
                break
        cluster.restart("immediate")
        out, _ = producer.communicate(timeout=60)
    finally:
        if producer.poll() is None:
            producer.kill()
    assert producer.returncode == 0, out
    assert "producer stopped after 30 order(s)" in out, out
    with psycopg.connect(outage_dsn) as db:
        assert db.execute("SELECT count(*) FROM shop.orders").fetchone()[0] == 30


def test_the_demos_status_line_carries_on_through_a_database_restart(cluster: Cluster, outage_dsn: str) -> None:
    """The demo prints the queue's counts every few seconds on one connection; when the database
    restarted, the error ended the demo and stopped every process it had started."""
    out = io.StringIO()
    demo = Demo(out=out)
    failures: list[BaseException] = []

    def watch() -> None:
        try:
            demo.watch(outage_dsn, interval=0.2)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "queued" in out.getvalue(), what="a status line")
        cluster.restart("immediate")
        printed = len(out.getvalue())
        wait_for(lambda: "queued" in out.getvalue()[printed:], timeout=15, what="status lines after the restart")
    finally:
        demo.stopping.set()
        thread.join(10)
    assert not failures, failures
