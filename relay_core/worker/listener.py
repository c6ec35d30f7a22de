"""Wakes the producer when jobs are enqueued (LISTEN/NOTIFY).

NOTIFY is only a hint: polling still finds every job. After any connection
error the listener reconnects with backoff, LISTENs again and wakes the
producer once, since notifications sent while it was away are gone.

What it fails to do it says in a log of its own (``NOT_LISTENING``), not in
the worker's account of the database's outages: its connections can be
refused while the worker's others work (a role's or a database's connection
limit filled by the pools after a restart, a pooler's), and each of its tries
began an outage that the next claim ended, a line each about once a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg

from ..connect_options import connection_options
from ..outages import OutageLog, Wording
from .outage import next_retry_delay

CHANNEL = "relay_jobs"
#: How long one wait for notifications lasts: a stop is heard within about this long.
NOTIFY_WAIT_SECONDS = 0.2
#: A session that listened at least this long and then ended is replaced at once, without a word.
REPLACE_AT_ONCE_AFTER_SECONDS = 1.0
#: How long the listener's tries fail before it says so (``NOT_LISTENING``).
SAY_NOT_LISTENING_AFTER_SECONDS = 5.0
#: What the listener says while it cannot listen: new jobs still start, found by the producer's polls.
NOT_LISTENING = Wording(
    "cannot listen for new jobs; they start at the next poll (poll_interval) meanwhile; retrying",
    "still cannot listen for new jobs; they start at the next poll meanwhile; retrying",
    "listening for new jobs again",
    # A standby refuses LISTEN as it refuses writes (SQLSTATE 25006).
    read_only="cannot listen for new jobs on a read-only database (a standby?); they start at the next poll; retrying",
)


class Listener:
    """A thread holding one LISTEN connection."""

    def __init__(
        self,
        dsn: str,
        queues: tuple[str, ...],
        wake: Callable[[], None],
        *,
        application_name: str = "relay",
    ) -> None:
        self._dsn = dsn
        self._application_name = application_name
        self._outage = OutageLog(wording=NOT_LISTENING)
        self._queues = frozenset(queues)
        self._wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="relay-listener", daemon=True)
        self.connected = threading.Event()
        self.reconnects = 0

    def start(self) -> None:
        """Start listening."""
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop listening; wait up to ``timeout`` s for the thread to end (``NOTIFY_WAIT_SECONDS`` is enough)."""
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        """Listen, reconnecting after any error.

        A session that was listening and then ended (the server's
        ``idle_session_timeout`` ends an idle LISTEN session every few
        seconds, as a restart does) is replaced at once and says nothing;
        only a new session that fails too is an outage. Each such end was
        logged as the database unreachable, then reachable again: 60 times
        in a review's run on a healthy server.
        """
        delay = 0.1
        failing_since: float | None = None  # since when no try has listened
        while not self._stop.is_set():
            began = time.monotonic()  # a session broken by an outage that has since ended is its tail
            listened: float | None = None  # since when this session listened
            try:
                options = connection_options(self._dsn, application_name=self._application_name)
                with psycopg.connect(self._dsn, autocommit=True, **options) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    listened = time.monotonic()
                    failing_since = None
                    self.connected.set()
                    self._outage.succeeded()
                    self._wake()  # anything enqueued while we were not listening
                    delay = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=NOTIFY_WAIT_SECONDS):
                            if note.payload in self._queues:
                                self._wake()
            except psycopg.Error as exc:
                self.connected.clear()
                self.reconnects += 1
                # At once only after a session that lasted: one ended as soon as it began is no idle timeout.
                if listened is not None and time.monotonic() - listened >= REPLACE_AT_ONCE_AFTER_SECONDS:
                    continue
                failing_since = began if failing_since is None else failing_since
                # A try or two that fail as sessions are ended around it (a restart, a failover)
                # say nothing: the worker's own account says what the database did.
                if time.monotonic() - failing_since >= SAY_NOT_LISTENING_AFTER_SECONDS:
                    self._outage.failed("listen", exc, began=failing_since)
                self._stop.wait(delay)
                delay = next_retry_delay(delay)
        self.connected.clear()
