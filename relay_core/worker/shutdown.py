"""The last writes of a worker that stops with jobs it could not finish.

A job whose handler did not return within the shutdown timeout goes back to
the queue with its attempt given back (a hand-back); one whose handler ran
past its own timeout and never returned has that timeout recorded instead,
so a handler that hangs every time still reaches dead. Both are fenced by
the lease token, and both let go of the leases the ledger held for them,
written or not: a failed write leaves the jobs to the sweeper.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import psycopg
from psycopg_pool import PoolTimeout

from ..logs import event
from ..outages import RETRYABLE
from ..pools import RelayPool
from ..queries import sql
from ..stalls import SHORTEST_CUT_SECONDS, cut_at, seconds_until
from .completer import Completer, split_locked
from .ledger import Ledger, Running
from .outcome import Outcome

if TYPE_CHECKING:
    from .runtime import Worker

#: A job handed back at shutdown while its handler thread still ran waits this
#: long after the shutdown's last write ends before another worker may start
#: it: the thread stops only when the worker process exits, a moment later.
HAND_BACK_GRACE_SECONDS = 2.0
#: After the in-flight wait of a shutdown, what is left to write (outcomes, hand-backs, the
#: registry's stop) shares this many seconds: with the database down none of it can be
#: written, and waiting for each in turn would outlast a platform's drain window.
SHUTDOWN_WRITES_SECONDS = 2.5
#: Of a shutdown write's time, the last this many seconds are left for its statement timeout's
#: answer: past them the connection is cut, since the database stopped answering and the timeout
#: never arrives (see ``stalls``).
CUT_GRACE_SECONDS = 0.5
#: What each of a shutdown's writes still to come is kept of their shared time while one
#: before it waits (on a lock, a slow database), where that time allows as much for each:
#: a write needs a connection and several round trips, and across a network of 60 ms each
#: way the 0.05 s a write was kept (``SHORTEST_CUT_SECONDS``) never got a connection.
WRITE_RESERVE_SECONDS = 0.5
#: The pause before a hand-back that met a broken connection or an outage tries again.
HAND_BACK_RETRY_SECONDS = 0.1


class WriteTime:
    """The time a shutdown's last writes share, each taking what is left of it in turn.

    A write is given what is left less what each write after it is kept
    (WRITE_RESERVE_SECONDS, or an equal share of what is left when that is
    less), so a database or a lock that holds up one write (the completer's,
    on a connection that stopped answering; the registry's, behind a
    migration's lock on its table) leaves the others their try without the
    last one ending past the shared end.
    """

    def __init__(self, end: float, writes: int) -> None:
        self._end = end  # a time.monotonic()
        self._writes_left = writes

    def next(self) -> float:
        """Seconds for the next write."""
        self._writes_left = max(self._writes_left - 1, 0)
        left = self._end - time.monotonic()
        kept = max(min(WRITE_RESERVE_SECONDS, left / (self._writes_left + 1)), SHORTEST_CUT_SECONDS)
        return seconds_until(self._end - self._writes_left * kept)

    def left(self) -> float:
        """Seconds until the last write ends."""
        return seconds_until(self._end)


def still_running_delay(writes_left: float) -> float:
    """How long a job whose handler thread still runs waits before it may run again, from its write.

    The write's ``now()`` is when its transaction began; a lock or a slow
    database may hold that write, and the writes after it, for up to
    ``writes_left`` seconds. Counted from the transaction's start, a grace of
    its own would be spent by then, and another worker could start the job
    while the thread, which stops only as the process exits, still ran it.
    """
    return writes_left + HAND_BACK_GRACE_SECONDS


@contextmanager
def write_within(pool: RelayPool, timeout: float) -> Iterator[psycopg.Connection]:
    """A pooled connection for a shutdown write, in a transaction that ends within ``timeout`` s.

    The wait for the connection counts, and a statement the database holds
    up ends by then too (a lock on the jobs table: the server's statement
    timeout; a database that stopped answering: the connection is cut): the
    drain window is not the place to wait for either.
    """
    end = time.monotonic() + timeout
    with pool.connection(timeout=timeout) as conn:
        left = seconds_until(end)
        statement_seconds = max(left - CUT_GRACE_SECONDS, left / 2)
        with cut_at(conn, end), conn.transaction():
            # The idle limit ends it on the server too should the process freeze between its statements
            # (the cut is a thread of this process): it holds the rows of the jobs it hands back.
            limit = f"{int(statement_seconds * 1000)}ms"
            conn.execute(
                "SELECT set_config('statement_timeout', %s, true), "
                "set_config('idle_in_transaction_session_timeout', %s, true)",
                (limit, limit),
            )
            yield conn


def hand_back(
    pool: RelayPool, ledger: Ledger, unfinished: list[Running], timeout: float, writes_left: float | None = None
) -> int:
    """Return unfinished jobs to the queue, fenced, with their attempt given back; how many went back.

    Until then their leases are in the ledger's ``closing``, which heartbeats renew.
    Jobs whose handlers still run are handed back among the shutdown's last
    writes: nothing but those writes, which end within ``writes_left`` seconds
    (``timeout`` when none follow), and the process's exit come after it.
    """
    jobs = [r.job for r in unfinished]
    # A job that never left the prefetch can run elsewhere at once; one whose thread still runs waits.
    still_running = still_running_delay(timeout if writes_left is None else max(writes_left, timeout))
    delays = [0.0 if r.slot is None else still_running for r in unfinished]
    params = {"ids": [j.id for j in jobs], "tokens": [j.lease_token for j in jobs], "delays": delays}
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                with write_within(pool, seconds_until(end)) as conn:
                    rows = conn.execute(sql("job_hand_back_many"), params).fetchall()
                # Counted once committed: a COMMIT that failed handed nothing back.
                event(logging.WARNING, "handed back unfinished jobs", job_ids=sorted(r[0] for r in rows))
                return len(rows)
            except (psycopg.Error, PoolTimeout) as exc:
                # Tried again while there is time, on another connection: the pool hands out one
                # returned within the last second unchecked, and one an outage or a restart broke
                # failed the only try, leaving the sweeper to spend attempts no handler used.
                # Fenced, a try again hands back nothing a lost answer's try already did.
                if isinstance(exc, RETRYABLE) and seconds_until(end) > HAND_BACK_RETRY_SECONDS * 2:
                    time.sleep(HAND_BACK_RETRY_SECONDS)
                    continue
                event(
                    logging.ERROR,
                    "hand-back failed; the sweeper will return these jobs when their leases expire",
                    error=str(exc),
                    job_ids=[j.id for j in jobs],
                )
                return 0
    finally:
        ledger.release(jobs)


def record_overdue(
    completer: Completer,
    ledger: Ledger,
    decided: list[Outcome],
    timeout: float,
    writes_left: float,
    on_written: Callable[[list[Outcome], dict[int, str]], None],
) -> None:
    """Write the timeouts of handlers that never returned: the attempt counts.

    Handing them back would give the attempt back, and a handler that
    hangs every time would then never reach dead. Their threads still run,
    so their retry waits as a handed-back job's does, until the grace after
    the shutdown's writes, which end within ``writes_left`` seconds. Each
    keeps that grace as its ``claimed_until``, which a requeue waits out and
    until which the claim counts it against its type's ``concurrency``.
    """
    for outcome in decided:
        outcome.runs_on = still_running_delay(writes_left)
        outcome.delay = max(outcome.delay, outcome.runs_on)
    try:
        written = completer.write_through_locks(decided, timeout)
    except (psycopg.Error, PoolTimeout) as exc:
        event(
            logging.ERROR,
            "timeouts not written; the sweeper will return these jobs when their leases expire",
            error=str(exc),
            job_ids=[o.job.id for o in decided],
        )
        return
    finally:
        ledger.release([o.job for o in decided])
    done, locked = split_locked(decided, written)
    if locked:
        event(
            logging.ERROR,
            "timeouts not written: job rows locked by another session (or by a handler's own "
            "transaction, still open); the sweeper will return these jobs when their leases expire",
            job_ids=[o.job.id for o in locked],
        )
    on_written(done, written)


#: ``relay worker``'s exit status when it stopped itself because too many handlers were stuck
#: past their timeouts (``max_stuck_handlers``): not 0, so a supervisor that restarts failed
#: processes only (systemd's Restart=on-failure) starts it again.
STUCK_EXIT_STATUS = 3


def exit_now(status: int = 0) -> None:
    """End the process at once with ``status``, without waiting for its threads.

    Handlers still running at the end of a shutdown had their jobs handed back
    (or their timeouts recorded), and another worker may start those jobs
    after a short grace: their threads must stop before then. A slot's thread
    dies with the process, but a thread a handler started may not (a thread
    of ``asyncio.to_thread``, which the interpreter waits for at exit).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def end_owned_process(worker: Worker) -> None:
    """After ``worker.run()`` returned in a process the worker owns (``relay worker``, ``Relay.run_worker``).

    A worker that stopped itself for handlers stuck past their timeouts ends
    the process with STUCK_EXIT_STATUS, to be started again; one that left
    handlers running ends it at once (see ``exit_now``). Otherwise the
    process goes on to its own end.
    """
    if worker.stopped_for_stuck_handlers:
        exit_now(STUCK_EXIT_STATUS)
    if worker.handlers_left_running:
        exit_now()
