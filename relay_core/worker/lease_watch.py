"""The worker's watch on its own clock: leases that ran out unrenewed, runs past their timeout, jobs held too long.

A heartbeat that hangs (a database that stalls, a network path that drops
packets) learns nothing until its socket gives up, minutes later, while
another worker's sweeper returns the job and runs it again. The watch's
thread waits on nothing but the ledger's lock, so a handler hears
``lease_lost`` once its lease has surely ended, by this process's own clock,
even when every connection hangs; and a timed-out handler's slot is replaced
on time, which a check on the heartbeat's thread could not promise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from ..backoff import retry_delay
from ..errors import JobTimeout
from ..handlers import HandlerSpec
from ..logs import event
from .claim import PREFETCH_HOLD_SECONDS
from .ledger import Ledger, Running
from .outcome import Kind, Outcome, describe

#: How often the watch compares unrenewed leases with the local clock.
LEASE_WATCH_SECONDS = 0.2


class LeaseWatch:
    """Checks the worker's ledger every LEASE_WATCH_SECONDS until ``stopped`` is set."""

    def __init__(
        self,
        ledger: Ledger,
        handlers: Mapping[str, HandlerSpec],
        worker_id: str,
        start_slot: Callable[[], None],
        stopped: threading.Event,
        check_stuck: Callable[[float], None],
    ) -> None:
        self.ledger = ledger
        self.handlers = handlers
        self.worker_id = worker_id
        #: Starts a fresh slot thread in place of one a timed-out handler still holds.
        self.start_slot = start_slot
        self.stopped = stopped
        #: Looks, at each check, for handlers that run on long after they were told to stop.
        self.check_stuck = check_stuck

    def run(self) -> None:
        """The watch's thread: tell handlers whose leases ran out unrenewed, or whose timeouts passed, to stop."""
        while not self.stopped.wait(LEASE_WATCH_SECONDS):
            try:
                self.check_timeouts()
                self.check_stuck(time.monotonic())
                self.flag_unrenewed(time.monotonic())
                self.hand_back_held(time.monotonic())
            except Exception as exc:  # this thread stops handlers that must stop: it must outlive any bug
                event(logging.ERROR, "lease watch failed", error=repr(exc))

    def flag_unrenewed(self, now: float) -> None:
        """Set ``lease_lost`` on every run whose lease surely ended before ``now``; hand back unstarted ones."""
        expired, unstarted = self.ledger.take_unrenewed(now)
        for job in expired:
            event(logging.WARNING, "lease ran out without a renewal; told the handler to stop", job_id=job.id)
        if unstarted:
            event(
                logging.WARNING,
                "lease ran out without a renewal before a slot was free; handing the jobs back",
                job_ids=sorted(j.id for j in unstarted),
            )

    def hand_back_held(self, now: float) -> None:
        """Give back prefetched jobs held behind long runs, for other workers to run (see ``take_held_back``)."""
        held = self.ledger.take_held_back(now, PREFETCH_HOLD_SECONDS)
        if held:
            event(
                logging.INFO,
                "every slot is busy with a longer job; handing back the jobs waiting for one",
                job_ids=sorted(j.id for j in held),
            )

    def check_timeouts(self) -> None:
        """Give jobs past their timeout up, but keep their leases until their threads return.

        Python cannot stop a thread. Recording the timeout at once would let
        the retry start while the first run goes on, so the outcome is decided
        now and written when the handler returns; meanwhile the lease is
        heartbeated like any running job's and a fresh slot takes the stuck
        one's place. A handler that never returns holds its job until the
        worker stops (or stops itself: see ``Worker.check_stuck``).
        """
        for running in self.ledger.take_timed_out(time.monotonic(), self.timed_out):
            job = running.job
            self.start_slot()  # the stuck thread keeps its slot object; the worker gets a fresh one
            event(
                logging.WARNING,
                "job timed out; its lease is kept until the handler returns",
                job_id=job.id,
                type=job.type,
                attempt=job.attempt,
            )

    def timed_out(self, running: Running, now: float) -> Outcome:
        """The outcome of a run past its handler's timeout at ``now``: a failed attempt (JobTimeout)."""
        job = running.job
        spec = self.handlers.get(job.type)
        exc = JobTimeout(f"handler ran past its timeout of {spec.timeout if spec else '?'}s")
        message, entry = describe(exc, job, self.worker_id)
        entry["traceback"] = None
        kind = Kind.DEAD if job.attempt >= job.max_attempts else Kind.RETRY
        delay, problem = retry_delay(spec.backoff, job.attempt) if spec else (0.0, None)
        if problem:
            message = entry["message"] = f"{message} ({problem})"
        return Outcome(job, kind, now - running.started, delay=delay, message=message, error=entry)
