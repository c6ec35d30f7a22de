"""The job record a handler receives."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .finite import finite_real
from .validation import storable_text


class Flag(threading.Event):
    """An Event that also calls back: how a flag reaches a handler waiting in an event loop.

    A sync handler polls ``job.lease_lost``; an async handler is suspended in
    ``await`` and polls nothing, so the worker's thread that sets the flag
    must also tell the handler's event loop (see ``relay_core.worker.aio``).
    Callbacks run on the setting thread, often under the worker's lock: they
    must only hand the news on (``loop.call_soon_threadsafe``), never block.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        """Set the flag; the first time, call every callback subscribed to it.

        Only the first time: a second cancel would interrupt the cleanup the
        first one started.
        """
        with self._callbacks_lock:
            if self.is_set():
                return
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once the flag is set (at once if it is set already); returns an unsubscribe."""
        with self._callbacks_lock:
            already = self.is_set()
            if not already:
                self._callbacks.append(callback)
        if already:
            callback()

        def unsubscribe() -> None:
            with self._callbacks_lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe


@dataclass
class Job:
    """A claimed job, as handed to its handler.

    ``attempt`` is 1 on the first run. ``lease_token`` is the fencing token of
    this claim: every write the worker makes about the job carries it.
    """

    id: int
    type: str
    queue: str
    priority: int
    payload: Any
    attempt: int
    max_attempts: int
    lease_token: int
    run_at: datetime
    created_at: datetime
    _lease_lost: Flag = field(default_factory=Flag, repr=False, compare=False)
    _cancel_requested: Flag = field(default_factory=Flag, repr=False, compare=False)
    #: Set as a transactional run starts writing its own success: from then on the job's row
    #: may be succeeded before the ledger hears of it, which a heartbeat must not read as a takeover.
    _success_writing: bool = field(default=False, repr=False, compare=False)
    _report: Callable[[Job, dict[str, Any]], bool] | None = field(default=None, repr=False, compare=False)

    @property
    def lease_lost(self) -> bool:
        """True once the handler should stop: the lease was taken over, or it ran past its timeout.

        Long handlers can check it and stop early: however they return, the
        run is not recorded as a success (a transactional handler's work is
        rolled back); another run owns the job, or the timeout is recorded.
        An async handler need not check: its task is cancelled when this turns true.
        """
        return self._lease_lost.is_set()

    @property
    def cancel_requested(self) -> bool:
        """True once an admin asked this running job to stop (seen at a heartbeat).

        A cooperative handler checks it between steps and raises
        :class:`relay_core.JobCancelled` (or calls :meth:`raise_if_cancelled`).
        An async handler's task is cancelled when this turns true.
        """
        return self._cancel_requested.is_set()

    def raise_if_cancelled(self) -> None:
        """Raise :class:`relay_core.JobCancelled` if cancellation was requested."""
        if self._cancel_requested.is_set():
            from .errors import JobCancelled

            raise JobCancelled(f"job {self.id} was cancelled while running")

    def progress(self, percent: float | None = None, message: str | None = None) -> bool:
        """Report progress (shown on the job's admin page); False if the job is no longer ours,
        or the handler was told to stop (``lease_lost``: past its timeout, say), and then nothing is written.

        Each call is one fenced UPDATE, so report per step, not per item.
        While the database cannot be reached the report is dropped, and the
        answer is whether this worker still holds the lease by its own count
        (``not job.lease_lost``): an outage does not say the job is gone.
        A percent that is not a finite real number (NaN, infinity, text, a
        bool, one too large for a float) raises ValueError and writes
        nothing; finite ones are kept within 0 to 100.
        An async handler awaits :meth:`progress_async` instead.
        """
        if self._report is None:
            return False
        value: dict[str, Any] = {}
        if percent is not None:
            if not finite_real(percent):
                # Text ("50") or a bool would have been read as a number; 10**400 overflowed a float.
                raise ValueError(f"percent must be a finite number, got {percent!r}")
            share = float(percent)  # type: ignore[arg-type]
            value["percent"] = max(0.0, min(100.0, share))
        if message is not None:
            # Text PostgreSQL cannot store (NUL, an undecodable file name's lone surrogates)
            # would fail the report, and with it the attempt: escape it, as error text is.
            value["message"] = storable_text(str(message)[:500])
        return self._report(self, value)

    async def progress_async(self, percent: float | None = None, message: str | None = None) -> bool:
        """:meth:`progress` for an async handler, run in a thread.

        The report waits for a pooled connection and a row lock (a heartbeat
        may hold it); called directly, that wait would stall the handler's
        event loop and every task on it.
        """
        return await asyncio.to_thread(self.progress, percent, message)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Job:
        """Build a job from a row of the claim query."""
        return cls(
            id=row["id"],
            type=row["type"],
            queue=row["queue"],
            priority=row["priority"],
            payload=row["payload"],
            attempt=row["attempts"],
            max_attempts=row["max_attempts"],
            lease_token=row["lease_token"],
            run_at=row["run_at"],
            created_at=row["created_at"],
        )
