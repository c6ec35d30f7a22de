"""What a worker says and counts once a run's outcome is written.

A line per run, at a level that matches what became of it (a success is
INFO, a retry WARNING, a dead job ERROR), and the worker's running totals for
logs and exporters. Told only after the write, with the status the database
gave, so a run whose lease was taken over is counted as lost, not as what its
handler returned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..logs import event
from .ledger import UNSTARTED_REASONS
from .outcome import Kind, Outcome


@dataclass
class Counters:
    """Totals since the worker started, for logs and exporters."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    snoozed: int = 0
    cancelled: int = 0
    lost: int = 0

    def tell(self, outcome: Outcome, status: str | None) -> None:
        """Count and log what was written for one run (``status`` None: the lease was taken over)."""
        duration_ms = round(outcome.duration * 1000, 3)
        if status is None and outcome.message in UNSTARTED_REASONS:
            self._count("lost", logging.WARNING, "unstarted job not handed back: its lease was taken over", outcome)
        elif status is None:
            self._count(
                "lost",
                logging.WARNING,
                "job outcome discarded: lease was taken over",
                outcome,
                outcome=outcome.kind.value,
            )
        elif status == "cancelled":
            self._count(
                "cancelled", logging.INFO, "job cancelled", outcome, ended=outcome.kind.value, error=outcome.message
            )
        elif outcome.kind in (Kind.SUCCEEDED, Kind.COMMITTED):
            self._count("succeeded", logging.INFO, "job succeeded", outcome, duration_ms=duration_ms)
        elif outcome.kind is Kind.RETRY:
            self._count(
                "retried",
                logging.WARNING,
                "job failed; will retry",
                outcome,
                duration_ms=duration_ms,
                retry_in_s=round(outcome.delay, 3),
                error=outcome.message,
            )
        elif outcome.kind is Kind.DEAD:
            self._count("dead", logging.ERROR, "job dead", outcome, duration_ms=duration_ms, error=outcome.message)
        elif outcome.message in UNSTARTED_REASONS:
            self._count("snoozed", logging.INFO, "job handed back", outcome, reason=outcome.message)
        else:
            self._count("snoozed", logging.INFO, "job snoozed", outcome, snooze_s=outcome.delay)

    def _count(self, counter: str, level: int, message: str, run: Outcome, **fields: object) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        event(level, message, job_id=run.job.id, type=run.job.type, attempt=run.job.attempt, **fields)
