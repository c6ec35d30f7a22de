"""The event loop of one slot thread, for handlers that return an awaitable.

An ``async def`` handler called by a slot thread returns a coroutine, not its
result: its work happens only once something awaits it. Each slot thread
keeps one event loop of its own (made on its first async job, closed when the
slot ends) and runs the awaitable there to completion, so an async handler
gets the same slots, leases, heartbeats, timeouts, retries and outcomes as a
sync one. One job at a time per loop: concurrency stays ``--concurrency``.

A sync handler hears "stop" only through flags it polls; an async handler
waits in ``await`` and polls nothing. So when the worker sets
``job.lease_lost`` (its timeout passed, its lease was taken over or ran out,
or shutdown is handing it back) or ``job.cancel_requested``, the handler's
task is cancelled: it stops at its next ``await``. The CancelledError that
ends it is reported as what happened (``JobCancelled``, ``LeaseLost``), so the
outcome is what a sync handler that stopped by raising would get.

Cancelling a task does not stop a thread it handed work to
(``asyncio.to_thread``, ``loop.run_in_executor(None, ...)``): that work goes
on. So each job gets a default executor of its own, and its run ends only
when the executor's threads have returned. Until then the slot is busy and
the job's lease is kept, as for a sync handler that has not returned, so the
retry of a timed-out job, or another job of a type with a concurrency limit,
cannot start beside work still running.

Tasks a handler starts and leaves running are not ended with its run: the
loop serves the slot's next jobs, and what a handler keeps on it on purpose
(an async connection pool, one per loop) runs tasks of its own that must
outlive the job. A handler that must not leave work behind, cancelled or
not, starts its tasks in an ``asyncio.TaskGroup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import JobCancelled, LeaseLost
from ..job import Job


class SlotLoop:
    """One slot thread's event loop; used only from that thread."""

    def __init__(self) -> None:
        self._runner: asyncio.Runner | None = None
        #: Set while a handler's awaitable runs here: a shutdown that cancelled it waits for its cleanup.
        self.running = threading.Event()

    def run(self, job: Job, awaitable: Awaitable[Any]) -> Any:
        """Await ``awaitable`` (what ``job``'s handler returned) to its end; return its result or raise."""
        if self._runner is None:
            self._runner = asyncio.Runner()
        threads = ThreadPoolExecutor(thread_name_prefix=f"relay-job-{job.id}")
        self._runner.get_loop().set_default_executor(threads)
        self.running.set()
        try:
            # A context of its own per job: the runner would otherwise carry context
            # variables one job set (a tenant, a trace span) into the next job on this slot.
            return self._runner.run(_supervised(job, awaitable), context=contextvars.copy_context())
        except (SystemExit, KeyboardInterrupt):
            # asyncio raises these out of run() from whichever task raised them: from a task
            # the handler started, the handler's own task is still pending, and it resumed
            # beside its retry when this loop next ran. Closing the loop cancels and ends it
            # (and whatever else runs there) before the attempt's failure is recorded.
            self.close()
            raise
        finally:
            threads.shutdown(wait=True)  # the job's work is over only when its threads are
            self.running.clear()

    def close(self) -> None:
        """Close the loop (cancelling whatever the handlers left running on it)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None


async def _supervised(job: Job, awaitable: Awaitable[Any]) -> Any:
    """Await the handler, cancelling it when the worker tells its job to stop."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    cancelled = False

    def cancel_once() -> None:
        # On the loop's thread. Once per run: a cancel request and then a lease lost (or a
        # timeout) would cancel it twice, and the second would cut short the cleanup the
        # first began in the handler's ``finally``.
        nonlocal cancelled
        if not cancelled:
            cancelled = True
            task.cancel()

    def stop() -> None:
        # Runs on whichever thread set the flag, perhaps under the worker's lock: hand it on, nothing more.
        with contextlib.suppress(RuntimeError):  # the loop is closed: this run ended already
            loop.call_soon_threadsafe(cancel_once)

    unsubscribe = [job._lease_lost.subscribe(stop), job._cancel_requested.subscribe(stop)]
    try:
        return await awaitable
    except asyncio.CancelledError:
        if job.cancel_requested:
            raise JobCancelled(f"job {job.id} was cancelled while running") from None
        if job.lease_lost:
            raise LeaseLost(
                f"job {job.id} was told to stop (its timeout passed, or its lease ran out or was taken over)"
            ) from None
        raise
    finally:
        for undo in unsubscribe:
            undo()
