"""One account of a database outage per process, instead of a warning per failed call.

During an outage every thread of a worker fails at its own pace: the
producer's claims, the completer's writes, a heartbeat each second, the
maintenance duties. A warning for each buried, in
some 130 lines per worker for a 40 s outage, the two facts an operator needs:
when the database stopped answering, and when it answered again. So the first
failure is logged, then a reminder every REPEAT_SECONDS while it lasts, and
one line when a call gets through again, with how long it lasted.

A call that began before the outage ended and fails after it (a connection
wait that started while the server was down, a session the restart broke)
belongs to that outage, not to a new one: it is counted, not announced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg_pool import PoolTimeout

from .logs import event

#: What a worker says of a statement the server cancelled, where it would say the database is unreachable.
STATEMENT_CANCELLED = "statement cancelled by the server (its statement_timeout?); retrying"

#: What a worker says when the database refuses its writes for being read-only, where it would say unreachable.
READ_ONLY = "database refuses writes (read-only: a failover or a standby?); retrying"

#: Errors after which a worker's call is tried again: the database could not be
#: reached, no connection came in time, or the session is on a server that
#: refuses writes (SQLSTATE 25006). That last one is what a worker meets during
#: a failover, on a connection to the demoted primary or on a standby an old
#: DNS answer still names, and during a cutover that sets
#: ``default_transaction_read_only``: it wrote nothing and passes, so a
#: completion or a heartbeat refused that way must wait and try again, not be
#: dropped as one refused for good. The pool replaces its connections when one
#: meets it (``pools.ReconnectingPool``).
RETRYABLE: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
    psycopg.errors.ReadOnlySqlTransaction,
)


def answer_may_be_lost(exc: BaseException) -> bool:
    """Whether a statement that failed with ``exc`` (one of RETRYABLE) may have committed unseen.

    No connection came (PoolTimeout), the server refused it for being
    read-only, or the server cancelled it (its statement_timeout, or a cancel
    request): it committed nothing. Any other break may have come after the
    commit.
    """
    return not isinstance(exc, (PoolTimeout, psycopg.errors.ReadOnlySqlTransaction, psycopg.errors.QueryCanceled))


#: While an outage lasts, how often it is logged again.
REPEAT_SECONDS = 30.0


@dataclass(frozen=True)
class Wording:
    """What an outage log says when calls begin to fail, while they still fail, and when one gets through;
    of a statement the server cancelled, which is no outage; and of a server that refuses writes
    (said as calls begin to fail, and again while they do)."""

    begins: str
    lasts: str
    ends: str
    cancelled: str = STATEMENT_CANCELLED
    read_only: str = READ_ONLY


#: The database did not answer (refused, broken or timed-out connections).
UNREACHABLE = Wording(
    "database unreachable; retrying", "database still unreachable; retrying", "database reachable again"
)


class RepeatedWarning:
    """A warning (or an error, by ``level``) said at most once per REPEAT_SECONDS, with how many times it
    happened since it was last said."""

    def __init__(self, message: str, clock: Callable[[], float] = time.monotonic, level: int = logging.WARNING) -> None:
        self._message = message
        self._clock = clock
        self._level = level
        self._lock = threading.Lock()
        self._said_at = float("-inf")
        self._unsaid = 0

    def happened(self, **fields: object) -> None:
        """It happened again: say so, unless it was said within REPEAT_SECONDS (then count it)."""
        now = self._clock()
        with self._lock:
            if now - self._said_at < REPEAT_SECONDS:
                self._unsaid += 1
                return
            times, self._said_at, self._unsaid = self._unsaid + 1, now, 0
        event(self._level, self._message, times=times, **fields)


class OutageLog:
    """Whether the worker's database calls fail now, since when, and what has been said of it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wording: Wording = UNREACHABLE) -> None:
        self._clock = clock
        self._wording = wording
        self._lock = threading.Lock()
        self._since: float | None = None
        self._refusing_writes = False  # the outage under way has met a write refused as read-only
        self._failures = 0
        self._reported = 0.0
        self._ended = float("-inf")
        self._cancelled = RepeatedWarning(wording.cancelled, clock)
        self._last_length = 0.0

    def failed(self, during: str, error: BaseException | str, began: float | None = None) -> None:
        """A call (``during``: the claim, a completion write, the heartbeat ...) could not reach the database.

        ``began``: when the call started, on this log's clock; one that began
        before the last outage ended is that outage's tail and says nothing.

        A statement the server cancelled (``statement_timeout``; psycopg's
        QueryCanceled is an OperationalError) reached the database: it is said
        as what it is, at most once per REPEAT_SECONDS, and begins no outage.
        Logged as "database unreachable" and then "reachable again", 529 of
        them in 50 s sent an operator to look for an outage that was not there.
        """
        if isinstance(error, psycopg.errors.QueryCanceled):
            self._cancelled.happened(during=during, error=str(error))
            return
        # A server that refuses writes answered: it is no less an outage for a worker, whose
        # leases cannot be renewed, but "unreachable" would send the operator to the network.
        wording = self._wording
        begins, lasts = wording.begins, wording.lasts
        refusing_writes = isinstance(error, psycopg.errors.ReadOnlySqlTransaction)
        if refusing_writes:
            begins = lasts = wording.read_only
        now = self._clock()
        with self._lock:
            if self._since is None and began is not None and began < self._ended:
                return
            first = self._since is None
            # An outage that began unreachable and goes on read-only (the server came back as a
            # standby, or the sessions reconnected to the demoted primary) says so as it turns,
            # once: from then on it is one that only a write ends.
            turned = not first and refusing_writes and not self._refusing_writes
            if first or refusing_writes:
                self._refusing_writes = refusing_writes
            if first:
                self._since, self._failures, self._reported = now, 0, now
            self._failures += 1
            again = not first and (turned or now - self._reported >= REPEAT_SECONDS)
            if again:
                self._reported = now
            since, failures = self._since, self._failures
        if first:
            event(logging.WARNING, begins, during=during, error=str(error))
        elif again:
            event(
                logging.WARNING,
                lasts,
                for_s=round(now - since, 1),
                failed_calls=failures,
                during=during,
                error=str(error),
            )

    def under_way(self) -> bool:
        """Whether calls fail now: the last one failed and none got through since."""
        return self._since is not None

    def long_one_within(self, seconds: float, longer_than: float) -> bool:
        """Whether an outage of ``longer_than`` s or more is under way, or ended less than ``seconds`` ago.

        Only an outage that long can have let leases run out: a blip (a
        listener's session ended by an idle-session timeout) is not one.
        """
        with self._lock:
            now = self._clock()
            if self._since is not None:
                return now - self._since >= longer_than
            return self._last_length >= longer_than and now - self._ended < seconds

    def ended_long_one(self) -> None:
        """Record, without a word, that an outage of unknown length ended now (the worker started during one)."""
        with self._lock:
            self._ended, self._last_length = self._clock(), float("inf")

    def succeeded(self, wrote: bool = True) -> None:
        """A call got through: end the outage, if one was under way, with one line.

        A call that may only have read (``wrote=False``: a LISTEN, maintenance
        that found nothing to change) does not end one that has met a write
        refused as read-only: reads get through there too, and each one ended
        that outage and the next refused write began it anew.
        """
        if self._since is None:  # the usual case, without the lock
            return
        now = self._clock()
        with self._lock:
            if self._refusing_writes and not wrote:
                return
            self._refusing_writes = False
            since, failures = self._since, self._failures
            self._since, self._failures = None, 0
            if since is not None:
                self._ended = now
                self._last_length = now - since
        if since is not None:
            event(logging.WARNING, self._wording.ends, after_s=round(now - since, 1), failed_calls=failures)
