"""One Relay's one-job enqueues send at most one NOTIFY per queue per window, and every job still wakes workers."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import threading
import time
import weakref
from datetime import UTC, datetime, timedelta

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


def concurrent_enqueues(relay: Relay, threads: int, each: int, **options: object) -> list[int]:
    """``threads`` threads, started together, each enqueueing ``each`` jobs one after another; the ids."""
    ids: list[int] = []
    start = threading.Barrier(threads)

    def enqueue(n: int) -> None:
        start.wait()
        for i in range(each):
            queue = ("mail", "reports")[(n + i) % 2] if options.get("queues") else "default"
            ids.append(relay.enqueue("ping", {"n": n, "i": i}, queue=queue))

    workers = [threading.Thread(target=enqueue, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    return ids


def test_concurrent_enqueues_send_far_fewer_notifies(
    dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each enqueue sent its own NOTIFY, and PostgreSQL lets one notifying transaction commit at a
    time: concurrent producers could not share a flush. Now an enqueue sent while others are in
    flight leaves its NOTIFY to its queue's window, where one is sent for them all."""
    window = 0.2  # wide enough that this machine's speed does not decide the count
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", window)
    relay = Relay(dsn)
    try:
        ids = concurrent_enqueues(relay, threads=4, each=75)
        last_committed = time.monotonic()
        time.sleep(2 * window)  # past the last window: what is owed is sent
        heard = list(listening.heard)
    finally:
        relay.close()
    assert len(ids) == len(set(ids)) == 300
    # One thread alone at the start or the end of the burst notifies each time, as a lone producer does.
    assert 1 <= len(heard) < 150, len(heard)
    assert {queue for queue, _ in heard} == {"default"}
    assert max(at for _, at in heard) <= last_committed + window + 1.0, "owed no longer than its window (and a moment)"


def test_a_producer_alone_notifies_in_each_enqueue(dsn: str, listening: Listening) -> None:
    """Its commits come one at a time anyway: leaving its NOTIFYs to a thread would only add statements."""
    relay = Relay(dsn)
    try:
        for n in range(20):
            relay.enqueue("t", {"n": n})
        wait_for(lambda: len(listening.heard) == 20, timeout=5, what="a NOTIFY per enqueue")
        assert relay._wakeups._thread is None, "no thread started"
    finally:
        relay.close()


def test_idle_workers_run_every_job_of_concurrent_bursts_without_polling(relay: Relay, db: psycopg.Connection) -> None:
    """No wake-up is lost to the coalescing: a worker that polls every 30 s runs each burst at once."""
    relay._wakeups._window = 0.05  # wide enough that jobs are owed on a slow machine too
    ran: list[int] = []
    relay.handler("ping")(lambda job: ran.append(job.id))
    with running_worker(relay, poll_interval=30.0, queues=("mail", "reports")) as worker:
        wait_for(lambda: worker.listener.connected.is_set())
        for _ in range(4):
            time.sleep(0.3)  # the worker idle again, in its 30 s wait
            burst = concurrent_enqueues(relay, threads=4, each=10, queues=True)
            wait_for(lambda burst=burst: set(burst) <= set(ran), timeout=10, what="the burst run, woken")
    assert len(ran) == len(set(ran)) == 160


def test_enqueues_in_the_callers_transactions_each_notify_at_their_commit(
    dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay cannot see when a caller commits, so it cannot owe that job a wake-up: each notifies in it."""
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 30.0)
    relay = Relay(dsn)
    relay._wakeups.notify_now("default")  # as if another enqueue were in flight, its queue just notified
    try:
        with psycopg.connect(dsn) as conn:
            for n in range(5):
                relay.enqueue("t", {"n": n}, conn=conn)
                conn.commit()
        wait_for(lambda: len(listening.heard) == 5, timeout=5, what="one NOTIFY per transaction")
    finally:
        relay._wakeups.sent("default", owed=False)
        relay.close()


def test_a_job_scheduled_later_takes_no_window(dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job with a run_at leaves the NOTIFY to the insert (sent only if it is due), and does not
    hold back the wake-up of the next job due at once."""
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 30.0)
    relay = Relay(dsn)
    relay._wakeups.notify_now("other")  # another enqueue in flight
    try:
        relay.enqueue("t", run_at=datetime.now(UTC) + timedelta(hours=1))
        time.sleep(0.3)  # past the listener's next read
        assert listening.heard == []
        relay.enqueue("t")
        wait_for(lambda: len(listening.heard) == 1, timeout=5, what="the due job's NOTIFY, sent at once")
    finally:
        relay._wakeups.sent("other", owed=False)
        relay.close()


def test_a_process_exiting_sends_the_wake_ups_still_owed(dsn: str, listening: Listening, python: str) -> None:
    """A script that enqueues and exits without closing its Relay: what it owed is sent at its exit."""
    script = (
        "import os, relay_core.wakeups as w\n"
        "w.WAKEUP_WINDOW_SECONDS = 30.0\n"
        "from relay_core import Relay\n"
        "relay = Relay(os.environ['DATABASE_URL'])\n"
        "relay._wakeups.notify_now('mail')  # as if another enqueue of 'mail' were in flight\n"
        "relay.enqueue('t', queue='mail')\n"
        "relay.enqueue('t', queue='mail')\n"
    )
    began = time.monotonic()
    subprocess.run([python, "-c", script], env={**os.environ, "DATABASE_URL": dsn}, check=True, timeout=60)
    assert time.monotonic() - began < 20, "sent at exit, not 30 s later"
    wait_for(lambda: len(listening.heard) == 1, timeout=5, what="the owed NOTIFY, sent at exit")
    assert listening.heard[0][0] == "mail"


def test_close_sends_the_wake_ups_still_owed() -> None:
    sent: list[list[str]] = []
    owed = Wakeups(sent.append, window=30.0)
    assert owed.notify_now("a") is True
    assert owed.notify_now("a") is False  # the first still in flight, within the window
    owed.sent("a", owed=True)
    owed.sent("a", owed=False)
    assert sent == []
    began = time.monotonic()
    owed.close()
    assert time.monotonic() - began < 1.0
    assert sent == [["a"]]


def test_an_owed_wake_up_waits_out_the_window_and_no_longer() -> None:
    sent: list[tuple[list[str], float]] = []
    owed = Wakeups(lambda queues: sent.append((queues, time.monotonic())), window=0.3)
    try:
        notified = time.monotonic()
        assert owed.notify_now("a") is True
        assert owed.notify_now("a") is False
        assert owed.notify_now("b") is True  # each queue has its own window
        assert owed.notify_now("b") is False
        owed.sent("a", owed=True)
        owed.sent("b", owed=True)
        owed.sent("a", owed=False)
        owed.sent("b", owed=False)
        wait_for(lambda: sent, timeout=5, what="the owed wake-ups")
        ((queues, at),) = sent
        assert queues == ["a", "b"]
        assert 0.3 <= at - notified < 2.0
        assert owed.notify_now("c") is True  # another in flight from here on
        assert owed.notify_now("a") is False  # the owed NOTIFY starts its window anew
        owed.sent("a", owed=False)
        time.sleep(0.35)
        assert owed.notify_now("a") is True  # that window has passed
        owed.sent("a", owed=False)
        owed.sent("c", owed=False)
    finally:
        owed.close()


def test_a_wake_up_that_cannot_be_sent_is_said_and_the_next_still_goes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="relay")
    sent: list[list[str]] = []
    failing = [True]

    def send(queues: list[str]) -> None:
        if failing[0]:
            failing[0] = False
            raise psycopg.OperationalError("the database is down")
        sent.append(queues)

    owed = Wakeups(send, window=0.5)
    try:
        for _ in range(2):
            assert owed.notify_now("q") is True
            assert owed.notify_now("q") is False
            owed.sent("q", owed=True)
            owed.sent("q", owed=False)
            wait_for(lambda: not owed._owed, timeout=5, what="the owed wake-up taken")
        wait_for(lambda: sent == [["q"]], timeout=5, what="the second wake-up sent")
    finally:
        owed.close()
    assert any("could not wake workers" in r.getMessage() for r in caplog.records)


def test_an_enqueue_deciding_to_notify_does_not_put_off_what_is_owed() -> None:
    """The owed wake-up's time was read again from the queue's last NOTIFY decision: enqueues that
    decided to notify but sent none (a key already held inserts nothing) put it off time after time."""
    sent: list[float] = []
    owed = Wakeups(lambda queues: sent.append(time.monotonic()), window=0.3)
    try:
        began = time.monotonic()
        assert owed.notify_now("a") is True
        assert owed.notify_now("a") is False
        owed.sent("a", owed=True)  # due 0.3 s after the first
        owed.sent("a", owed=False)
        while time.monotonic() - began < 3.0 and not sent:
            owed.notify_now("a")  # alone in flight each time, within the window or not: decides to notify
            owed.sent("a", owed=False)
            time.sleep(0.01)
        wait_for(lambda: sent, timeout=5, what="the owed wake-up")
        assert sent[0] - began < 1.5, sent[0] - began  # put off by each decision: about 3.3 s
    finally:
        owed.close()


def test_a_dropped_relay_is_not_kept_by_its_wake_up_thread(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread held its Relay (and its pool and connection) for the life of the process."""
    monkeypatch.setattr(wakeups, "IDLE_SECONDS", 0.2)
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 0.3)
    relay = Relay(dsn)
    relay._wakeups.notify_now("default")
    relay.enqueue("t")  # owed: starts the thread
    relay._wakeups.sent("default", owed=False)
    thread = relay._wakeups._thread
    assert thread is not None
    gone = weakref.ref(relay)
    pool = relay._pool
    del relay
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the idle thread ended"
    gc.collect()
    assert gone() is None, "the Relay was collected"
    assert pool is not None
    pool.close()


def test_an_enqueue_whose_wake_up_finds_no_thread_still_returns_its_id(
    dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread that could not start (a limit, the interpreter exiting) raised out of the enqueue,
    its job committed; and its queue stayed owed with no thread, so no later wake-up went either."""
    caplog.set_level(logging.WARNING, logger="relay")
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 5.0)
    relay = Relay(dsn)
    unstarted = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name == "relay-wakeups":
            raise RuntimeError("can't start new thread")
        unstarted(self)

    try:
        relay._wakeups.notify_now("default")
        monkeypatch.setattr(threading.Thread, "start", refuse)
        job_id = relay.enqueue("t")
        assert isinstance(job_id, int)
        assert any("could not wake workers" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(threading.Thread, "start", unstarted)
        listening.heard.clear()
        relay.enqueue("t")  # owed again (another in flight): a thread starts and sends it
        assert relay._wakeups._thread is not None
        relay.close()  # sends it now rather than 5 s from the first
        wait_for(lambda: listening.heard, timeout=5, what="the next wake-up sent")
    finally:
        relay._wakeups.sent("default", owed=False)
        relay.close()


def test_a_relay_dropped_within_its_window_still_sends_what_it_owes(
    dsn: str, listening: Listening, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread held its Relay weakly, and a Relay freed before the window's end sent nothing."""
    monkeypatch.setattr(wakeups, "WAKEUP_WINDOW_SECONDS", 0.3)

    def enqueue_and_drop() -> None:
        relay = Relay(dsn)
        relay._wakeups.notify_now("default")  # another enqueue in flight, its queue just notified
        relay.enqueue("t")  # owed, 0.3 s from now
        relay._wakeups.sent("default", owed=False)

    enqueue_and_drop()
    gc.collect()
    wait_for(lambda: listening.heard, timeout=5, what="the owed NOTIFY of a dropped Relay")


def test_a_wake_up_owed_as_the_idle_thread_ends_starts_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread cleared itself only after it let go of the lock it decided to end under: a wake-up
    owed in between found it still alive, counted on it, and was never sent."""
    monkeypatch.setattr(wakeups, "IDLE_SECONDS", 0.5)  # the first send is seen, and cleared, before it ends
    sent: list[list[str]] = []
    ending = threading.Event()
    resume = threading.Event()

    class SlowToEnd(Wakeups):
        def _send_when_due(self) -> None:
            super()._send_when_due()
            if not sent:
                ending.set()
                resume.wait(5)  # the first thread, between its decision to end and its end

    owed = SlowToEnd(sent.append, window=0.05)
    try:
        owed.notify_now("a")
        owed.notify_now("a")
        owed.sent("a", owed=False)
        owed.sent("a", owed=True)  # starts the thread, which sends it
        wait_for(lambda: sent == [["a"]], timeout=5, what="the first wake-up")
        sent.clear()
        wait_for(ending.is_set, timeout=5, what="the thread ending, idle")
        owed.notify_now("b")
        owed.notify_now("b")
        owed.sent("b", owed=False)
        owed.sent("b", owed=True)
        wait_for(lambda: sent == [["b"]], timeout=5, what="the wake-up owed as the thread ended")
    finally:
        resume.set()
        owed.close()
