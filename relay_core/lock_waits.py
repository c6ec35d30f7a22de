"""Who holds up a session's lock request, and waiting, without a lock request queued, until they are gone.

A migration that waited too long for a table lets go and tries again. Tried
again after a fixed pause while the transaction that held it up was still
open (an application's request that enqueued and then ran long, a
``pg_dump`` under a migration that needs the table to itself), each try
queued every claim and enqueue behind it for its whole wait. Knowing whom it
waited for, it tries again once they have ended instead, and queues nothing
meanwhile.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime

import psycopg

from .connect_options import connection_options

#: The sessions holding up ``%(pid)s``'s lock request (those holding a lock it conflicts with, and
#: those queued ahead of it for one), each with the start of its transaction: a session that ended
#: that transaction and began another holds up nothing it held before.
_BLOCKERS = """
SELECT pid, xact_start FROM pg_stat_activity
WHERE pid = ANY (pg_blocking_pids(%(pid)s)) AND xact_start IS NOT NULL
"""

#: How many of the transactions (pid, start) are still open.
_STILL_OPEN = """
SELECT count(*) FROM pg_stat_activity AS a
JOIN unnest(%(pids)s::integer[], %(starts)s::timestamptz[]) AS b(pid, xact_start)
  ON a.pid = b.pid AND a.xact_start = b.xact_start
"""

#: How often a watch looks who holds up the session it watches.
WATCH_EVERY_SECONDS = 0.1
#: How long the end of a watch waits for a look under way. Behind a transaction pooler whose server
#: connections are all in use (the watched transaction's among them), a look waits for one until
#: the watched transaction ends, which waits for the watch to end.
WATCH_END_SECONDS = 1.0
#: How often a wait looks whether those transactions have ended.
POLL_SECONDS = 0.25


class BlockerWatch:
    """Notes, from a connection of its own, who holds up ``pid``'s lock request while it waits.

    Started as the request may begin to wait, stopped once it ended: the
    waiting session cannot ask while it waits. ``blockers`` keeps the last
    sessions seen, so a request that gave up leaves whom it waited for.
    """

    def __init__(self, dsn: str, pid: int) -> None:
        self._dsn = dsn
        self._pid = pid
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="relay-lock-watch", daemon=True)
        #: (pid, transaction start) of each session last seen holding the request up.
        self.blockers: list[tuple[int, datetime]] = []

    def __enter__(self) -> BlockerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        self._thread.join(WATCH_END_SECONDS)  # a look still waiting then ends on its own, and is not kept

    def _watch(self) -> None:
        # Connected only once the request has lasted a look's interval: most end sooner.
        if self._stopped.wait(WATCH_EVERY_SECONDS):
            return
        # Nothing prepared: behind a transaction pooler (declared or not) a prepared look would be
        # missing on the next server connection.
        options = {**connection_options(self._dsn), "prepare_threshold": None}
        try:
            with psycopg.connect(self._dsn, autocommit=True, **options) as conn:
                while True:
                    seen = conn.execute(_BLOCKERS, {"pid": self._pid}).fetchall()
                    if self._stopped.is_set():
                        return  # a look answered after the watch ended: the pid may serve another by now
                    if seen:
                        self.blockers = seen
                    if self._stopped.wait(WATCH_EVERY_SECONDS):
                        return
        except psycopg.Error:
            pass  # no connection to spare (too many clients, say): the try is retried as it was, after a pause


def wait_until_ended(conn: psycopg.Connection, transactions: list[tuple[int, datetime]], until: float) -> None:
    """Return once each transaction (pid, start) has ended, or at ``until`` (monotonic).

    Run outside a transaction: pg_stat_activity is read once per transaction
    and kept, and a transaction open meanwhile would hold back every vacuum.
    """
    if not transactions:
        return
    params = {"pids": [pid for pid, _ in transactions], "starts": [start for _, start in transactions]}
    # Never prepared, as the watch's look: behind a transaction pooler a prepared statement is missing
    # on the next server connection.
    while time.monotonic() < until and conn.execute(_STILL_OPEN, params, prepare=False).fetchone()[0]:
        time.sleep(POLL_SECONDS)
