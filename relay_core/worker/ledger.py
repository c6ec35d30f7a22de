"""Which jobs a worker holds a lease on, at which stage, under one lock.

From its claim until its lease is given up, a job this worker holds is in
exactly one of four tables:

- ``running``: claimed, waiting in the inbox for a slot or running in one;
- ``overdue``: past its handler's timeout with the thread still running, its
  outcome decided and written only when the thread returns;
- ``awaiting_write``: finished, its outcome queued for the completer;
- ``closing``: at shutdown, not yet handed back.

Heartbeats renew every one of them (:meth:`Ledger.held_leases`). Every move
between them happens under the one lock, and so does queueing an outcome for
the completer: once a job has left ``running``, a shutdown that sees nothing
in flight stops the completer, and the outcome must be in its queue by then.
The ledger decides and moves; the worker starts threads and logs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..job import Job
from ..logs import event
from .completer import Completer
from .outcome import Kind, Outcome

#: Why a prefetched job went back to the queue unstarted (see ``Ledger.take_unrenewed``).
NOT_STARTED = "not started: its lease ran out unrenewed while it waited for a slot"
#: ... or (see ``Ledger.take_held_back``).
HELD_BEHIND = "not started: every slot was busy with a longer job, so another worker may run it"
#: ... or (see ``executor.run``): a transactional job's handler needs a connection, and none came.
NOT_BEGUN = "not started: no working database connection came for its transaction"
#: All: the job goes back to the queue unstarted, with the attempt it never used.
UNSTARTED_REASONS = frozenset({NOT_STARTED, HELD_BEHIND, NOT_BEGUN})


@dataclass
class Slot:
    """One handler thread; abandoned when its job timed out or was handed back."""

    index: int
    abandoned: threading.Event = field(default_factory=threading.Event)
    #: When it was abandoned (monotonic): its handler was told to stop then, and runs on only if it ignores that.
    abandoned_at: float | None = None

    def abandon(self) -> None:
        """Leave the thread to its handler, told to stop; the worker runs its jobs on a fresh slot."""
        if self.abandoned_at is None:
            self.abandoned_at = time.monotonic()
        self.abandoned.set()


@dataclass
class Running:
    """A job in a slot, with its deadline (monotonic) if its handler has a timeout."""

    job: Job
    slot: Slot | None = None  # None until a slot thread takes the job
    deadline: float | None = None
    started: float = 0.0
    #: When the lease surely ran out (monotonic) unless a heartbeat renewed it since:
    #: counted from before the claim or the renewing heartbeat was sent.
    lease_expires: float = float("inf")
    #: When the worker took it from the claim (monotonic): how long it has waited for a slot.
    claimed_at: float = field(default_factory=time.monotonic)
    #: A heartbeat found its lease taken over: it is no longer renewed, nor reported again.
    taken_over: bool = False


class Ledger:
    """The leases one worker holds; outcomes go to ``completer``'s queue."""

    def __init__(self, completer: Completer) -> None:
        self._completer = completer
        self.lock = threading.Lock()
        self.running: dict[int, Running] = {}
        self.awaiting_write: dict[int, int] = {}  # id -> token: finished, not yet recorded
        # id -> (run, decided outcome): past their timeout, handler thread still running.
        self.overdue: dict[int, tuple[Running, Outcome]] = {}
        self.closing: dict[int, int] = {}  # id -> token: shutting down, not yet handed back

    # -- what is held --------------------------------------------------------

    def in_flight(self) -> int:
        """Jobs claimed and not yet finished: waiting for a slot or running in one."""
        with self.lock:
            return len(self.running)

    def waiting_on_last_attempt(self) -> int:
        """Jobs on their last attempt claimed and waiting for a slot (their attempt already charged)."""
        with self.lock:
            return sum(1 for r in self.running.values() if r.slot is None and r.job.attempt >= r.job.max_attempts)

    def overdue_count(self) -> int:
        """Jobs past their timeout whose handlers still run."""
        with self.lock:
            return len(self.overdue)

    def held_leases(self) -> dict[int, int]:
        """Every lease the worker must keep alive (id -> token): running, overdue, awaiting its write or closing."""
        with self.lock:
            held = dict(self.awaiting_write)
            held.update(self.closing)
            held.update((jid, r.job.lease_token) for jid, (r, _) in self.overdue.items() if not r.taken_over)
            # Last, so a job claimed again has its newest lease renewed, not the earlier run's. Not one
            # taken over: its renewal changed nothing, and each heartbeat reported it taken over again.
            held.update((jid, r.job.lease_token) for jid, r in self.running.items() if not r.taken_over)
            return held

    # -- a run's life ----------------------------------------------------------

    def claimed(self, jobs: Iterable[Job], lease_expires: float) -> int:
        """Enter freshly claimed jobs as running; how many slots earlier runs of them leave to replace."""
        replaced = 0
        with self.lock:
            for job in jobs:
                replaced += self._drop_earlier_run(job)
                self.running[job.id] = Running(job, lease_expires=lease_expires)
        return replaced

    def _drop_earlier_run(self, job: Job) -> int:
        """Tell an earlier run of ``job`` still held here that its lease is gone; 1 if its slot needs replacing.

        Called with the lock held. This claim could only take the job because
        the earlier run's lease ran out and the sweeper returned it; a
        heartbeat would have said so, but the claim came first. Replacing the
        entry silently would leave that run untold (``lease_lost``), uncounted
        in flight and not waited for at shutdown.
        """
        earlier = self.running.get(job.id)
        # An overdue run was told to stop at its timeout; the sweeper decided it, so its thread's end changes nothing.
        self.overdue.pop(job.id, None)
        if earlier is None:
            return 0
        earlier.job._lease_lost.set()
        event(logging.WARNING, "lease taken over by a new claim of the same job", job_id=job.id, type=job.type)
        if earlier.slot is None:
            return 0
        earlier.slot.abandon()
        return 1

    def bind(self, slot: Slot, job: Job, now: float, timeout: float | None) -> bool:
        """Mark ``job`` as running in ``slot`` from ``now`` (monotonic); False when it must not run."""
        with self.lock:
            running = self.running.get(job.id)
            if running is None or running.job is not job:
                # Handed back, or an earlier claim of a job this worker has claimed again
                # since: the newer claim is bound when it leaves the inbox.
                return False
            if job.lease_lost:
                # Prefetched, and taken over by another worker before it started.
                del self.running[job.id]
                return False
            running.slot = slot
            running.started = now
            running.deadline = now + timeout if timeout else None
            return True

    def finished(self, slot: Slot, job: Job, outcome: Outcome) -> bool:
        """A handler in ``slot`` returned ``outcome``; True when it is recorded as this run's end.

        False when there was nothing to record (handed back, or taken over) or
        when the run was past its timeout: then the timeout decided earlier is
        what gets recorded.
        """
        with self.lock:
            overdue = self.overdue.get(job.id)
            if overdue is not None and overdue[0].slot is slot:
                self._finish_overdue(job, outcome, overdue[1])
                return False
            running = self.running.get(job.id)
            if slot.abandoned.is_set() or running is None or running.slot is not slot:
                return False
            del self.running[job.id]
            if outcome.kind is not Kind.COMMITTED:
                self.awaiting_write[job.id] = job.lease_token
            self._completer.put(outcome)
            return True

    def _finish_overdue(self, job: Job, outcome: Outcome, decided: Outcome) -> None:
        """A handler past its timeout has returned: record the timeout, now that it cannot run on.

        Called with the lock held. What the handler returned does not count
        (unless it never started: then there was no run to time out):
        it was told to stop (``lease_lost``), and a cooperative handler that
        stops early returns as if it had finished. A transactional handler
        that committed its success anyway has already recorded it; it is
        counted as a success all the same.
        """
        del self.overdue[job.id]
        if outcome.kind is Kind.COMMITTED:
            event(logging.INFO, "job past its timeout committed its success", job_id=job.id, type=job.type)
            self._completer.put(outcome)  # writes nothing: counted and logged as a success
            return
        # Not begun (NOT_BEGUN): the deadline ran while its transaction waited for a connection that
        # never came, so the handler never ran and the job goes back with its attempt.
        recorded = decided if outcome.handler_started else outcome
        self.awaiting_write[job.id] = job.lease_token
        self._completer.put(recorded)
        if recorded is decided:
            event(logging.INFO, "job past its timeout returned; its timeout is recorded", job_id=job.id, type=job.type)

    def take_timed_out(self, now: float, decide: Callable[[Running, float], Outcome]) -> list[Running]:
        """Move runs past their deadline at ``now`` to overdue, their outcome ``decide``d; those runs.

        Their slots are abandoned (the worker starts fresh ones) and their
        handlers told to stop; their leases stay held until the threads return.
        """
        expired: list[Running] = []
        with self.lock:
            for jid, running in list(self.running.items()):
                if running.slot is not None and running.deadline is not None and now > running.deadline:
                    # Decided before it leaves ``running``: were deciding to raise, the run would be
                    # in none of the ledger's tables, its lease no longer renewed while it runs on.
                    decided = decide(running, now)
                    expired.append(running)
                    del self.running[jid]
                    self.overdue[jid] = (running, decided)
                    running.slot.abandon()
                    running.job._lease_lost.set()  # tells a cooperative handler to stop
        return expired

    def written(self, batch: Iterable[Outcome]) -> None:
        """The completer recorded (or found taken over) these outcomes: their leases are no longer held."""
        with self.lock:
            for outcome in batch:
                if self.awaiting_write.get(outcome.job.id) == outcome.job.lease_token:
                    del self.awaiting_write[outcome.job.id]

    # -- what heartbeats and the lease watch learn ------------------------------

    def renewed(self, renewed: Mapping[int, int], expires: float) -> None:
        """A heartbeat extended these leases (id -> token) to at least ``expires`` (monotonic)."""
        with self.lock:
            for jid, token in renewed.items():
                running = self.running.get(jid)
                if running is not None and running.job.lease_token == token:
                    running.lease_expires = max(running.lease_expires, expires)

    def take_unrenewed(self, now: float) -> tuple[list[Job], list[Job]]:
        """Flag every run whose lease surely ended before ``now`` (monotonic): (told to stop, handed back).

        A job claimed ahead of a free slot goes back to the queue at once
        instead: nobody is known to have taken it, so it is handed back,
        fenced, with the attempt it never used. Left to the sweeper, that
        attempt would count, and a job with one attempt would end dead
        without ever running (unless another worker's sweeper gets to it
        first, as it must when this worker is cut off).
        """
        expired: list[Job] = []
        unstarted: list[Job] = []
        with self.lock:
            for running in list(self.running.values()):
                if now > running.lease_expires and not running.job._lease_lost.is_set():
                    if running.slot is None:
                        unstarted.append(self._give_back_unstarted(running, NOT_STARTED))
                    else:
                        running.job._lease_lost.set()
                        expired.append(running.job)
        return expired, unstarted

    def take_held_back(self, now: float, longest_wait: float) -> list[Job]:
        """Give back every job that has waited for a slot longer than ``longest_wait`` s at ``now``; those jobs.

        A job is claimed ahead of a free slot only while jobs finish in
        milliseconds. When every slot then takes a long job, the ones waiting
        would wait for the long ones to end, while another worker may sit
        idle: they go back to the queue, fenced, with the attempt they never
        used, as ``take_unrenewed`` gives back a job whose lease ran out.
        """
        with self.lock:
            return [
                self._give_back_unstarted(running, HELD_BEHIND)
                for running in list(self.running.values())
                if running.slot is None and now - running.claimed_at > longest_wait and not running.job.lease_lost
            ]

    def _give_back_unstarted(self, running: Running, reason: str) -> Job:
        """Queue the write that returns a job no slot has taken (called with the lock held); the job."""
        job = running.job
        job._lease_lost.set()
        del self.running[job.id]  # a slot that takes it from the inbox now skips it
        self.awaiting_write[job.id] = job.lease_token
        self._completer.put(Outcome(job, Kind.SNOOZED, 0.0, message=reason))
        return job

    def long_runs(self, now: float, longer_than: float) -> int:
        """How many slots have been running their job for longer than ``longer_than`` s at ``now``."""
        with self.lock:
            return sum(1 for r in self.running.values() if r.slot is not None and now - r.started > longer_than)

    def lost(self, lost: Mapping[int, int]) -> list[int]:
        """Let go of the runs whose leases (id -> token) a heartbeat found taken over; their ids.

        Matched by token, not id alone: between the heartbeat's snapshot and its
        answer a job may have finished and been claimed again by this worker,
        and that new run's lease is valid. A job whose completion was written
        while the heartbeat ran is not among them.

        Nor is any job awaiting its write: the completer may have committed it
        between the heartbeat's snapshot and its renewal, and not yet said so
        (``written``). Its fenced write knows whether the lease was taken over,
        and reports it then. So does a transactional run writing its own
        success (its job's ``_success_writing``): committed, its row is no
        longer claimed before the run has ended in the ledger.
        """
        taken: list[int] = []
        with self.lock:
            for jid, token in lost.items():
                running = self.running.get(jid)
                overdue = self.overdue.get(jid)
                if running is not None and running.job._success_writing:
                    continue
                if running is not None and running.job.lease_token == token:
                    running.job._lease_lost.set()
                    running.taken_over = True
                    if running.slot is None:
                        del self.running[jid]  # never started: a slot that takes it from the inbox skips it
                    taken.append(jid)
                elif overdue is not None and overdue[0].job.lease_token == token:
                    del self.overdue[jid]  # the sweeper decided it; the thread's end changes nothing
                    taken.append(jid)
                elif self.closing.get(jid) == token:
                    del self.closing[jid]
                    taken.append(jid)
        return taken

    def cancel(self, ids: Iterable[int]) -> list[Job]:
        """Ask the held runs of these jobs to stop; the jobs newly asked."""
        asked: list[Job] = []
        with self.lock:
            for jid in ids:
                running = self.running.get(jid) or (self.overdue[jid][0] if jid in self.overdue else None)
                if running is not None and not running.job.cancel_requested:
                    running.job._cancel_requested.set()
                    asked.append(running.job)
        return asked

    # -- shutdown ----------------------------------------------------------------

    def close_unstarted(self) -> list[Running]:
        """Move every job no slot has taken to closing, so none starts now: at shutdown, they go back first."""
        with self.lock:
            unstarted = [r for r in self.running.values() if r.slot is None]
            for running in unstarted:
                del self.running[running.job.id]
            self._to_closing(unstarted)
        return unstarted

    def close(self) -> tuple[list[Running], list[tuple[Running, Outcome]]]:
        """Move every running and overdue job to closing, its handler told to stop: (unfinished, overdue)."""
        with self.lock:
            unfinished = list(self.running.values())
            overdue = list(self.overdue.values())
            self.running.clear()
            self.overdue.clear()
            self._to_closing(unfinished + [run for run, _ in overdue])
        return unfinished, overdue

    def _to_closing(self, runs: Iterable[Running]) -> None:
        """Hold these runs' leases in closing, their handlers (if started) told to stop; called with the lock held."""
        for running in runs:
            if running.slot is not None:
                running.slot.abandon()
            running.job._lease_lost.set()
            self.closing[running.job.id] = running.job.lease_token

    def release(self, jobs: Iterable[Job]) -> None:
        """Stop holding the leases of jobs whose shutdown write is done (or failed)."""
        with self.lock:
            for job in jobs:
                if self.closing.get(job.id) == job.lease_token:
                    del self.closing[job.id]
