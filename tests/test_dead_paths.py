"""Network paths that go silent: a database failed over, a proxy or NAT that forgot a connection.

Nothing refuses on such a path; packets just vanish. Relay's connections must
give up on it within seconds and reconnect on a path that works, instead of
waiting on libpq's and the kernel's defaults (130 s to connect, about 15
minutes for unacknowledged data, two hours before an idle connection is
probed).

The vanishing packets are real: iptables drops every packet of the worker's
existing connections (matched by their client ports), while new connections
reach the same server. The tests skip where iptables cannot be used.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Job, Relay
from relay_core.connect_options import LIVENESS_DEFAULTS, connection_options
from relay_core.pools import make_pool

from .helpers import job_status, running_worker, wait_for

APPLICATION_NAME = "relay-dead-path-test"
#: Every rule these tests add carries this comment and the adding process's id, so rules a
#: killed run left behind are removed, and not those of a run going on at the same time.
RULE_COMMENT = "relay-dead-path-test"


def iptables_usable() -> str | None:
    """Why iptables cannot drop packets here, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    if os.geteuid() != 0:
        return "dropping packets needs root"
    tag = ["-m", "comment", "--comment", f"{RULE_COMMENT}-probe"]
    probe = ["OUTPUT", "-p", "tcp", "--dport", "9", *tag, "-j", "ACCEPT"]
    added = subprocess.run(["iptables", "-I", *probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"iptables cannot be used here: {added.stderr.strip()}"
    subprocess.run(["iptables", "-D", *probe], check=False)
    return None


def remove_leftover_rules() -> None:
    """Delete the rules of earlier runs that were killed before they could (their process is gone)."""
    listed = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines():
        found = re.search(rf"{RULE_COMMENT}-(\d+)", line)
        if found and line.startswith("-A ") and not Path(f"/proc/{found.group(1)}").exists():
            subprocess.run(["iptables", "-D", *shlex.split(line)[1:]], check=False)


def skip_unless_packets_can_be_dropped(db: psycopg.Connection) -> None:
    """Skip the test unless iptables can drop the packets of connections to the test server."""
    reason = iptables_usable()
    if reason:
        pytest.skip(reason)
    if db.execute("SELECT coalesce(family(inet_server_addr()), 0)").fetchone()[0] != 4:
        pytest.skip("the test server is not reached over IPv4, where iptables drops the packets")


@contextmanager
def dropped(ports: list[int]) -> Iterator[Callable[[], int]]:
    """Drop every packet to or from these local ports (both ends of a loopback connection pass OUTPUT).

    Yields a function that tells how many packets the rules have dropped so far.
    """
    remove_leftover_rules()
    comment = f"{RULE_COMMENT}-{os.getpid()}"
    tag = ["-m", "comment", "--comment", comment]

    def count() -> int:
        listed = subprocess.run(
            ["iptables", "-L", "OUTPUT", "-v", "-n", "-x"], capture_output=True, text=True, check=True
        ).stdout
        return sum(int(line.split()[0]) for line in listed.splitlines() if comment in line)

    rules = [
        ["OUTPUT", "-p", "tcp", "-m", "multiport", "--ports", ",".join(map(str, ports[i : i + 15])), *tag, "-j", "DROP"]
        for i in range(0, len(ports), 15)
    ]
    added: list[list[str]] = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True)
            added.append(rule)
        yield count
    finally:
        for rule in added:
            subprocess.run(["iptables", "-D", *rule], check=False)


@pytest.mark.slow
def test_a_worker_whose_connections_go_silent_reconnects_and_works_within_seconds(
    dsn: str, db: psycopg.Connection
) -> None:
    """The database moved (failover) and every packet of the worker's open connections now
    vanishes: its server sessions are gone, nothing tells the worker. Before, the producer's next
    claim waited on an unacknowledged socket for the kernel's retransmission limit (about 15
    minutes on Linux) and the LISTEN connection for the first keepalive (two hours): no job ran
    meanwhile. The connections' tcp_user_timeout and keepalives now break them within seconds,
    and the worker reconnects and runs the jobs enqueued since."""
    skip_unless_packets_can_be_dropped(db)
    worker_dsn = conninfo.make_conninfo(dsn, application_name=APPLICATION_NAME)
    relay = Relay(worker_dsn)
    producer = Relay(dsn)
    ran = threading.Event()
    relay.handler("echo")(lambda job: ran.set())
    try:
        with running_worker(relay, concurrency=2, poll_interval=0.5, heartbeat_interval=1.0, lease_seconds=60.0):
            first = producer.enqueue("echo")
            wait_for(lambda: job_status(db, first) == "succeeded", what="the first job")
            sessions = db.execute(
                "SELECT pid, client_port FROM pg_stat_activity WHERE application_name = %s", (APPLICATION_NAME,)
            ).fetchall()
            assert len(sessions) >= 3, sessions  # the pool's, the listener's and the heartbeat's
            ran.clear()
            with dropped([port for _, port in sessions]) as dropped_packets:
                # The old server is gone: its sessions end, and their goodbyes vanish too.
                for pid, _ in sessions:
                    db.execute("SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(1.0)  # the producer's next poll now waits on a dead connection
                gone = time.monotonic()
                second = producer.enqueue("echo")
                assert ran.wait(60), "no job ran in the 60 s after the worker's connections went silent"
                resumed = time.monotonic() - gone
                vanished = dropped_packets()
                wait_for(lambda: job_status(db, second) == "succeeded", what="the second job's success")
    finally:
        relay.close()
        producer.close()
    budget = LIVENESS_DEFAULTS["tcp_user_timeout"] / 1000 + LIVENESS_DEFAULTS["keepalives_idle"]
    assert resumed < budget, f"the worker ran a job {resumed:.1f} s after its connections went silent"
    # The sessions' goodbyes vanished: had they arrived, the worker would have heard its sessions end.
    # (Not timed: a claim that checks out a connection idle for over a second tests it first, and
    # replaces it within a second or so, as it should.)
    assert vanished > 0, "no packet of the worker's sessions was dropped"


@pytest.mark.slow
def test_a_transaction_whose_client_went_silent_ends_on_the_server_within_seconds(
    dsn: str, db: psycopg.Connection
) -> None:
    """A worker's host died, or its network path went silent, while one of its transactions was
    open (a transactional handler's, a schedule's tick): nothing told the server, which kept the
    transaction and its locks until its first keepalive probe, two hours later on Linux's defaults.
    Relay's sessions now set the server's keepalives too, and the server ends such a session
    within seconds."""
    skip_unless_packets_can_be_dropped(db)
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4343 AND granted"
    pool = make_pool(dsn, name="silent", min_size=1, max_size=1, application_name=APPLICATION_NAME)
    pool.open(wait=True)
    conn = pool.getconn()
    try:
        conn.execute("SELECT pg_advisory_xact_lock(4343)")  # a transaction holding a lock, then silence
        (port,) = db.execute(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = %s", (APPLICATION_NAME,)
        ).fetchone()
        # Idle: the answer's acknowledgement is through (unacknowledged data is retransmitted,
        # for about 15 minutes, rather than probed).
        time.sleep(0.5)
        with dropped([port]):
            gone = time.monotonic()
            wait_for(lambda: not db.execute(held).fetchone()[0], timeout=90, what="the silent session's lock to go")
            ended = time.monotonic() - gone
    finally:
        pool.putconn(conn)
        pool.close()
    idle = LIVENESS_DEFAULTS["keepalives_idle"]
    budget = idle + LIVENESS_DEFAULTS["keepalives_interval"] * LIVENESS_DEFAULTS["keepalives_count"]
    assert ended < budget + 10, f"the server ended the session {ended:.1f} s after its client went silent"
    # Not at once, either: had the packets not vanished, nothing would have ended it.
    assert ended > idle / 2, f"ended after {ended:.1f} s: nothing was dropped"


def test_a_connection_attempt_to_a_server_that_never_answers_gives_up_in_seconds() -> None:
    """A server (or proxy) that accepts the connection and then says nothing: psycopg waits
    130 s by default, during which a worker's listener or a pool's reconnect is stuck. Relay's
    connections give up after connect_timeout and try again."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes handshakes; nobody answers
    try:
        dsn = f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/test"
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="timeout expired"):
            psycopg.connect(dsn, **connection_options(dsn))
        waited = time.monotonic() - started
    finally:
        silent.close()
    assert waited < LIVENESS_DEFAULTS["connect_timeout"] + 3, f"gave up after {waited:.1f} s"


def test_time_limits_named_by_the_dsn_or_pgconnect_timeout_win(
    dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Relay's limits only fill in what the operator left unset: in the DSN, PGCONNECT_TIMEOUT or
    the service file section the DSN names. The application's own connections get no
    tcp_user_timeout (it would also break a bulk load queued behind a lock)."""
    for name in ("PGCONNECT_TIMEOUT", "PGSERVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PGSERVICEFILE", str(tmp_path / "none.conf"))
    monkeypatch.setenv("PGSYSCONFDIR", str(tmp_path))
    plain = connection_options("postgresql://u@db.example/app", pooling=False)
    assert {name: plain[name] for name in LIVENESS_DEFAULTS} == LIVENESS_DEFAULTS
    assert "prepare_threshold" not in plain

    named = connection_options("postgresql://u@db.example/app?connect_timeout=3&keepalives=0", pooling=True)
    assert "connect_timeout" not in named and "keepalives" not in named
    assert named["tcp_user_timeout"] == LIVENESS_DEFAULTS["tcp_user_timeout"]
    assert named["prepare_threshold"] is None

    apps = Relay("postgresql://u@db.example/app").connection_options()
    assert "tcp_user_timeout" not in apps and apps["connect_timeout"] == LIVENESS_DEFAULTS["connect_timeout"]

    services = tmp_path / "services.conf"
    # As libpq reads it: a comment in another encoding, blanks around lines, the section ending at the next.
    services.write_bytes(
        b"# Base de donn\xe9es\n[prod]\nhost=db.example\n   keepalives=0\ntcp_user_timeout = 0\n"
        b"[other]\nconnect_timeout=3\n"
    )
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    from_service = connection_options("service=prod dbname=app", pooling=False)
    assert "keepalives" not in from_service and "tcp_user_timeout" not in from_service
    assert from_service["connect_timeout"] == LIVENESS_DEFAULTS["connect_timeout"]
    monkeypatch.setenv("PGSERVICE", "prod")
    assert "keepalives" not in connection_options("dbname=app", pooling=False)
    monkeypatch.delenv("PGSERVICE")
    # A section Relay cannot find (libpq may know another file): add no limits, and say so once.
    caplog.set_level("WARNING", logger="relay")
    unread = {"fallback_application_name": "relay"}  # the name is libpq's fallback: any the service gives wins
    assert connection_options("service=elsewhere", pooling=False) == unread
    assert connection_options("service=elsewhere", pooling=False) == unread
    said = [r.getMessage() for r in caplog.records if "elsewhere" in r.getMessage()]
    assert len(said) == 1 and "not found" in said[0]

    monkeypatch.setenv("PGCONNECT_TIMEOUT", "4")
    assert "connect_timeout" not in connection_options("host=db.example dbname=app", pooling=False)
    with Relay(dsn).connect() as conn:  # libpq takes the environment's value
        assert conninfo.conninfo_to_dict(conn.info.dsn).get("connect_timeout") == "4"


def test_a_transactional_handlers_bulk_work_queued_behind_a_lock_is_not_cut_off(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tcp_user_timeout also breaks a connection whose server stops reading while the client
    still has data to send: a handler's pipelined bulk insert queued behind a statement that
    waits on a lock, on a server that is fine. A transactional handler's connection comes from
    the worker's pool, which has the limit; it is lifted while the handler's work runs."""
    if db.execute("SELECT inet_server_addr() IS NULL").fetchone()[0]:
        pytest.skip("the test server is reached over a Unix socket, which has no TCP options")
    monkeypatch.setitem(LIVENESS_DEFAULTS, "tcp_user_timeout", 2_000)  # the same, in seconds not minutes
    relay = Relay(dsn)
    big = "x" * 1_000_000

    @relay.handler("bulk", max_attempts=1)
    def bulk(job: Job, conn: psycopg.Connection) -> None:
        with conn.pipeline():
            conn.execute("SELECT pg_advisory_xact_lock(4242)")
            for _ in range(40):  # 40 MB queued behind the lock: more than the sockets hold
                conn.execute("SELECT length(%s)", (big,))

    db.execute("SELECT pg_advisory_lock(4242)")
    try:
        with running_worker(relay, concurrency=1):
            job_id = relay.enqueue("bulk")
            wait_for(lambda: job_status(db, job_id) == "claimed", what="the handler to start")
            time.sleep(5.0)  # well past the connection's 2 s tcp_user_timeout
            db.execute("SELECT pg_advisory_unlock(4242)")
            wait_for(lambda: job_status(db, job_id) in ("succeeded", "dead"), what="the job to end")
    finally:
        db.execute("SELECT pg_advisory_unlock_all()")
        relay.close()
    assert job_status(db, job_id) == "succeeded", db.execute(
        "SELECT last_error FROM relay.jobs WHERE id = %s", (job_id,)
    ).fetchone()[0]
