"""A worker's account of database outages: the calls that wait for a pooled connection, and the pace of retries.

Every thread of a worker fails at its own pace during an outage; each
reports to one ``relay_core.outages.OutageLog``, which says it once. Calls
waiting on a pool whose connections are all checked out are told apart
(``POOL_EXHAUSTED``): the database is fine, the handlers hold them.
"""

from __future__ import annotations

from collections.abc import Callable

from psycopg_pool import PoolTimeout

from ..outages import OutageLog, Wording

#: The longest a worker's thread waits before trying a database that did not answer again.
RETRY_MAX_SECONDS = 1.0


def next_retry_delay(delay: float) -> float:
    """The wait after ``delay`` before the next try: doubling, but never past RETRY_MAX_SECONDS.

    Short on purpose: a try costs the database one refused connection, and a
    longer wait is only time the worker sits idle after the database is back
    (its pools reconnect at least every 2 s).
    """
    return min(delay * 2, RETRY_MAX_SECONDS)


#: The database answers, but every connection of the worker's pool is checked
#: out: handlers past their timeout that still hold theirs, as a rule. Told
#: apart so that an operator looks at the handlers, not at the database.
POOL_EXHAUSTED = Wording(
    "no free database connection: every pooled connection is in use; claims wait",
    "still no free database connection; claims wait",
    "a database connection is free again",
)


class PooledCallLog:
    """Failures of calls that wait for a pooled connection: a database outage, or a pool held.

    A PoolTimeout while ``held`` names a cause (every connection checked
    out) goes to the exhaustion log, anything else to the outage log; a call
    that gets through ends both.
    """

    def __init__(self, outage: OutageLog, exhaustion: OutageLog, held: Callable[[], str | None]) -> None:
        self.outage = outage
        self.exhaustion = exhaustion
        self._held = held

    def failed(self, during: str, error: BaseException | str, began: float | None = None) -> None:
        """As ``OutageLog.failed``, on the log the failure belongs to."""
        cause = self._held() if isinstance(error, PoolTimeout) else None
        if cause is not None:
            self.exhaustion.failed(during, cause, began=began)
        else:
            self.outage.failed(during, error, began=began)

    def succeeded(self, wrote: bool = True) -> None:
        """A pooled call got through: the database answers and a connection was free (``wrote``: as OutageLog's)."""
        self.outage.succeeded(wrote)
        self.exhaustion.succeeded()
