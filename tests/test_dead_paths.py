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
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Relay
from relay_core.pools import LIVENESS_DEFAULTS, connection_options

from .helpers import job_status, running_worker, wait_for

APPLICATION_NAME = "relay-dead-path-test"


def iptables_usable() -> str | None:
    """Why iptables cannot drop packets here, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    if os.geteuid() != 0:
        return "dropping packets needs root"
    probe = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"iptables cannot be used here: {probe.stderr.strip()}"
    return None


@contextmanager
def dropped(ports: list[int]) -> Iterator[None]:
    """Drop every packet to or from these local ports (both ends of a loopback connection pass OUTPUT)."""
    rules = [
        ["OUTPUT", "-p", "tcp", "-m", "multiport", "--ports", ",".join(map(str, ports[i : i + 15])), "-j", "DROP"]
        for i in range(0, len(ports), 15)
    ]
    added: list[list[str]] = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True)
            added.append(rule)
        yield
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
    reason = iptables_usable()
    if reason:
        pytest.skip(reason)
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
            if any(port < 0 for _, port in sessions):
                pytest.skip("the test server is reached over a Unix socket, which has no packets to drop")
            ran.clear()
            with dropped([port for _, port in sessions]):
                # The old server is gone: its sessions end, and their goodbyes vanish too.
                for pid, _ in sessions:
                    db.execute("SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(1.0)  # the producer's next poll now waits on a dead connection
                gone = time.monotonic()
                second = producer.enqueue("echo")
                assert ran.wait(60), "no job ran in the 60 s after the worker's connections went silent"
                resumed = time.monotonic() - gone
                wait_for(lambda: job_status(db, second) == "succeeded", what="the second job's success")
    finally:
        relay.close()
        producer.close()
    budget = LIVENESS_DEFAULTS["tcp_user_timeout"] / 1000 + LIVENESS_DEFAULTS["keepalives_idle"]
    assert resumed < budget, f"the worker ran a job {resumed:.1f} s after its connections went silent"


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


def test_time_limits_named_by_the_dsn_or_pgconnect_timeout_win(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relay's limits only fill in what the operator left unset."""
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    plain = connection_options("postgresql://u@db.example/app", pooling=False)
    assert {name: plain[name] for name in LIVENESS_DEFAULTS} == LIVENESS_DEFAULTS
    assert "prepare_threshold" not in plain

    named = connection_options("postgresql://u@db.example/app?connect_timeout=3&keepalives=0", pooling=True)
    assert "connect_timeout" not in named and "keepalives" not in named
    assert named["tcp_user_timeout"] == LIVENESS_DEFAULTS["tcp_user_timeout"]
    assert named["prepare_threshold"] is None

    monkeypatch.setenv("PGCONNECT_TIMEOUT", "4")
    assert "connect_timeout" not in connection_options("host=db.example dbname=app", pooling=False)
    with Relay(dsn).connect() as conn:  # libpq takes the environment's value
        assert conninfo.conninfo_to_dict(conn.info.dsn).get("connect_timeout") == "4"
