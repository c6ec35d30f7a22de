"""One Relay's one-job enqueues send at most one NOTIFY per queue per window, and every job still wakes workers."""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import psycopg
import pytest

from relay_core import Relay, wakeups
from relay_core.wakeups import Wakeups

from .helpers import running_worker, wait_for


class Listening:
    """A LISTEN on relay_jobs, read by a thread: each notification's queue and when it arrived (monotonic)."""

    def __init__(self, dsn: str) -> None:
        self.heard: list[tuple[str, float]] = []
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._conn.execute("LISTEN relay_jobs")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            for note in self._conn.notifies(timeout=0.05):
                self.heard.append((note.payload, time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()


@pytest.fixture
def listening(dsn: str):
    heard = Listening(dsn)
    yield heard
    heard.close()


def test_a_burst_of_enqueues_sends_a_notify_per_window_and_one_after_its_last_job(
    dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each enqueue sent its own NOTIFY, and PostgreSQL lets one notifying transaction commit at a
    time: concurrent producers could not share a flush. Now a burst sends one or two per window,
    the last after its last job was committed."""
    window = 0.2  # wide enough that this machine's speed does not decide the count
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", window)
    relay = Relay(dsn)
    try:
        began = time.monotonic()
        ids = [relay.enqueue("t", {"n": n}) for n in range(300)]
        last_committed = time.monotonic()
        wait_for(lambda: any(at > last_committed for _, at in listening.heard), timeout=5, what="a wake-up after")
        # Nothing more is owed: no later one comes.
        time.sleep(2 * window)
        heard = list(listening.heard)
    finally:
        relay.close()
    assert len(ids) == len(set(ids)) == 300
    windows = math.ceil((last_committed - began) / window) + 1
    assert 1 <= len(heard) <= 2 * windows, (len(heard), windows)
    assert {queue for queue, _ in heard} == {"default"}
    assert max(at for _, at in heard) <= last_committed + window + 1.0, "owed no longer than its window (and a moment)"


def test_each_queue_is_woken_for_its_own_jobs(dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 0.2)
    relay = Relay(dsn)
    try:
        for n in range(20):
            relay.enqueue("t", {"n": n}, queue="mail" if n % 2 else "reports")
        done = time.monotonic()
        wait_for(
            lambda: {q for q, at in listening.heard if at > done} == {"mail", "reports"},
            timeout=5,
            what="both queues woken after their last jobs",
        )
    finally:
        relay.close()


def test_idle_workers_run_every_job_of_bursts_without_polling(relay: Relay, db: psycopg.Connection) -> None:
    """No wake-up is lost to the coalescing: a worker that polls every 30 s runs each burst at once."""
    ran: list[int] = []
    relay.handler("ping")(lambda job: ran.append(job.id))
    with running_worker(relay, poll_interval=30.0) as worker:
        wait_for(lambda: worker.listener.connected.is_set())
        for _ in range(5):
            time.sleep(0.3)  # the worker idle again, in its 30 s wait
            burst = [relay.enqueue("ping") for _ in range(50)]
            wait_for(lambda burst=burst: set(burst) <= set(ran), timeout=10, what="the burst run, woken")
    assert len(ran) == len(set(ran)) == 250


def test_enqueues_in_the_callers_transactions_each_notify_at_their_commit(
    relay: Relay, dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay cannot see when a caller commits, so it cannot owe that job a wake-up: each notifies in it."""
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 10.0)
    relay.enqueue("t")  # notified; the next enqueues on the pool, within the window, would be owed
    with psycopg.connect(dsn) as conn:
        for n in range(5):
            relay.enqueue("t", {"n": n}, conn=conn)
            conn.commit()
    wait_for(lambda: len(listening.heard) == 6, timeout=5, what="one NOTIFY per transaction")
    relay.close()


def test_a_job_scheduled_later_does_not_hold_back_the_next_wake_up(
    relay: Relay, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job with a run_at leaves the NOTIFY to the insert (sent only if it is due), and takes no window."""
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 10.0)
    from datetime import UTC, datetime, timedelta

    relay.enqueue("t", run_at=datetime.now(UTC) + timedelta(hours=1))
    assert listening.heard == []
    relay.enqueue("t")
    wait_for(lambda: len(listening.heard) == 1, timeout=5, what="the due job's NOTIFY, sent at once")


def test_close_sends_the_wake_ups_still_owed(dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 30.0)
    relay = Relay(dsn)
    relay.enqueue("t")
    wait_for(lambda: len(listening.heard) == 1, timeout=5, what="the first job's NOTIFY")
    relay.enqueue("t")  # owed, 30 s from now
    began = time.monotonic()
    relay.close()
    assert time.monotonic() - began < 2.0
    wait_for(lambda: len(listening.heard) == 2, timeout=5, what="the owed NOTIFY, sent by close")


def test_a_process_exiting_sends_the_wake_ups_still_owed(dsn: str, listening: Listening, python: str) -> None:
    """A script that enqueues a few jobs and exits without closing its Relay."""
    script = (
        "import os, relay_core.wakeups as w\n"
        "w.WAKEUP_WINDOW_SECONDS = 30.0\n"
        "from relay_core import Relay\n"
        "relay = Relay(os.environ['DATABASE_URL'])\n"
        "relay.enqueue('t')\n"
        "relay.enqueue('t', queue='mail')\n"
        "relay.enqueue('t', queue='mail')\n"
    )
    import subprocess

    began = time.monotonic()
    subprocess.run([python, "-c", script], env={**os.environ, "DATABASE_URL": dsn}, check=True, timeout=60)
    assert time.monotonic() - began < 20
    wait_for(lambda: len(listening.heard) == 3, timeout=5, what="two at once, the owed one at exit")
    assert sorted(q for q, _ in listening.heard) == ["default", "mail", "mail"]


def test_a_wake_up_that_cannot_be_sent_is_said_and_the_next_still_goes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relay")
    sent: list[list[str]] = []
    failing = [True]

    def send(queues: list[str]) -> None:
        if failing[0]:
            failing[0] = False
            raise psycopg.OperationalError("the database is down")
        sent.append(queues)

    owed = Wakeups(send, window=0.05)
    try:
        assert owed.notify_now("q") is True
        assert owed.notify_now("q") is False
        owed.owed("q")
        wait_for(lambda: any("could not wake workers" in r.getMessage() for r in caplog.records), timeout=5)
        owed.owed("q")
        wait_for(lambda: sent == [["q"]], timeout=5, what="the next wake-up sent")
    finally:
        owed.close()


def test_an_owed_wake_up_waits_out_the_window_and_no_longer() -> None:
    sent: list[tuple[list[str], float]] = []
    owed = Wakeups(lambda queues: sent.append((queues, time.monotonic())), window=0.3)
    try:
        assert owed.notify_now("a") is True
        notified = time.monotonic()
        assert owed.notify_now("a") is False
        assert owed.notify_now("b") is True  # each queue has its own window
        owed.owed("a")
        wait_for(lambda: sent, timeout=5, what="the owed wake-up")
        ((queues, at),) = sent
        assert queues == ["a"]
        assert 0.3 <= at - notified < 2.0
        time.sleep(0.35)
        assert owed.notify_now("a") is True  # the window since the owed one has passed
    finally:
        owed.close()
