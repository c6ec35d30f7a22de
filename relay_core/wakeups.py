"""The wake-ups of one Relay's own one-job enqueues: at most one NOTIFY per queue per window.

PostgreSQL lets one transaction that sent a NOTIFY commit at a time: it
holds a server-wide lock from before its commit record until the commit's
WAL flush is done, so notifying enqueues cannot share a flush. Eight
threads each committing one-row inserts on the 2-core development machine
(a listener present, medians of five rounds) made 5,770 inserts/s, and 3,179/s
when each insert also sent a NOTIFY.

An enqueue on Relay's own pool whose job is due at once, sent while another
enqueue of the same Relay is in flight, therefore notifies in its own
statement only when no enqueue of this Relay notified its queue in the last
WAKEUP_WINDOW_SECONDS. Otherwise, once its job is committed, it leaves the
queue's wake-up to a thread that sends one NOTIFY for every queue so left
once the window after the queue's last NOTIFY ends, in a statement that
writes nothing (its commit flushes nothing, so it holds that lock only for
a moment). Every committed job is followed by a NOTIFY of its queue about a
window later at most: none is lost to the coalescing, and threads enqueueing
together send one or two NOTIFYs per window instead of one per job. A
producer alone notifies in each enqueue: its commits come one at a time
anyway, and the thread's statements would cost it what they saved.

An enqueue in the caller's transaction (``conn=``) notifies in it, as
before: only its commit may wake workers, and Relay does not see when that
is. NOTIFY stays a hint either way: workers also poll.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable

from .outages import RepeatedWarning

#: How long after one NOTIFY of a queue the next one may wait; the most a job's wake-up is delayed.
#: Under the 10 ms between jobs of a paced producer at 100/s, whose every job notifies at once.
WAKEUP_WINDOW_SECONDS = 0.002
#: How long ``close`` waits for the wake-ups still owed to be sent.
CLOSE_WAIT_SECONDS = 1.0
#: How long the thread waits with nothing owed before it ends (a new one starts when needed),
#: so that a Relay dropped without ``close`` is not kept alive by it.
IDLE_SECONDS = 1.0
#: Past this many queues remembered, those not notified within the window are forgotten.
REMEMBERED_QUEUES = 1024


class Wakeups:
    """Which queues notify in their enqueue's statement, and a thread for the wake-ups owed by the rest."""

    def __init__(self, send: Callable[[list[str]], None], window: float | None = None) -> None:
        #: Sends one NOTIFY for each of the queues given (on Relay's pool). Held weakly when it is a
        #: method: the thread must not keep a Relay its program has dropped.
        self._send: Callable[[], Callable[[list[str]], None] | None] = (
            weakref.WeakMethod(send) if inspect.ismethod(send) else lambda: send
        )
        self._window = WAKEUP_WINDOW_SECONDS if window is None else window
        self.start_fresh()

    def start_fresh(self) -> None:
        """No wake-ups owed and no thread: in a new Relay, and in a forked child (whose owed ones are the parent's)."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._failed = RepeatedWarning(
            "could not wake workers for jobs just enqueued; they start at the workers' next poll"
        )
        #: When each queue was last notified, or an enqueue decided to notify it (monotonic).
        self._notified_at: dict[str, float] = {}
        #: The queues owed a wake-up, each with when it is due (monotonic), in the order they came.
        self._owed: dict[str, float] = {}
        #: The send held strongly while a wake-up is owed: a Relay dropped within its last window
        #: still sends what it owes (held weakly otherwise, see ``__init__``).
        self._sender: Callable[[list[str]], None] | None = None
        #: This Relay's enqueues between ``notify_now`` and ``sent``.
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._closing = False

    def notify_now(self, queue: str) -> bool:
        """Whether an enqueue of ``queue``, about to be sent, notifies in its own statement.

        Call ``sent`` once it is done, whatever the outcome. Only an enqueue
        sent while another of this Relay's is in flight may leave its NOTIFY
        to the thread: a producer that enqueues one job after another commits
        one at a time anyway, and would only pay for the thread's statements.
        """
        now = time.monotonic()
        with self._lock:
            self._in_flight += 1
            last = self._notified_at.get(queue)
            if self._in_flight > 1 and last is not None and now - last < self._window:
                return False
            if len(self._notified_at) >= REMEMBERED_QUEUES:
                self._notified_at = {q: at for q, at in self._notified_at.items() if now - at < self._window}
            self._notified_at[queue] = now
            return True

    def sent(self, queue: str, owed: bool) -> None:
        """An enqueue that asked ``notify_now`` is done; if ``owed``, its queue's NOTIFY is sent by the window's end.

        Also after an enqueue that failed: whether it committed may be
        unknown (an answer lost with the connection), and a NOTIFY too many
        only wakes workers to find nothing. Never raises: the job is
        committed by now, and its caller must get its id.
        """
        with self._lock:
            self._in_flight -= 1
            if not owed:
                return
            if queue not in self._owed:
                # Due a window after the queue's last NOTIFY, fixed now: an enqueue deciding to
                # notify later (one whose key was held, say, which notifies nothing) moves nothing.
                self._owed[queue] = self._notified_at.get(queue, float("-inf")) + self._window
                self._sender = self._send()
                self._changed.notify()
            if self._thread is not None and self._thread.is_alive():
                return
            self._closing = False
            thread = threading.Thread(target=self._run, name="relay-wakeups", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (a limit, or the interpreter exiting)
                self._owed.clear()
                self._sender = None
                unstarted = exc
            else:
                self._thread = thread
                return
        with contextlib.suppress(Exception):  # said outside the lock, and never instead of the job's id
            self._failed.happened(error=str(unstarted))

    def close(self) -> None:
        """Send the wake-ups still owed (waiting up to CLOSE_WAIT_SECONDS), then end the thread."""
        with self._lock:
            thread = self._thread
            self._closing = True
            self._changed.notify()
        if thread is not None:
            thread.join(CLOSE_WAIT_SECONDS)

    def _run(self) -> None:
        try:
            self._send_when_due()
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None  # ended by an exception: the next owed wake-up starts a thread anew

    def _send_when_due(self) -> None:
        """Send what is owed as it falls due, until closed or idle for IDLE_SECONDS."""
        while True:
            with self._lock:
                while True:
                    if self._owed:
                        wait = min(self._owed.values()) - time.monotonic()
                        if wait <= 0 or self._closing:
                            break
                        self._changed.wait(wait)
                    elif self._closing or (not self._changed.wait(IDLE_SECONDS) and not self._owed):
                        # Cleared in the same hold of the lock as the decision: a ``sent`` after it
                        # starts a new thread rather than count on this one, about to end.
                        self._thread = None
                        return
                queues = list(self._owed)
                self._owed.clear()
                send, self._sender = self._sender, None
                now = time.monotonic()
                for queue in queues:
                    self._notified_at[queue] = now
            if send is None:
                continue
            try:
                send(queues)
            except Exception as exc:  # the wake-up is a hint: workers poll, so the jobs still run
                with contextlib.suppress(Exception):
                    self._failed.happened(queues=queues, error=str(exc))
                    logging.getLogger("relay").debug("wake-up not sent", exc_info=True)
            del send  # not held while waiting: the Relay may be dropped meanwhile
