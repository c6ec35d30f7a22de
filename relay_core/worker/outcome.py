"""What became of one run of a job, before it is written down."""

from __future__ import annotations

import json
import traceback as tb
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..job import Job

MAX_TRACEBACK_CHARS = 8000
MAX_MESSAGE_CHARS = 2000


class Kind(StrEnum):
    """How a run ended."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"  # failed, attempts left: back to queued after a delay
    DEAD = "dead"  # failed for good
    SNOOZED = "snoozed"  # back to queued later, attempt not spent
    COMMITTED = "committed"  # transactional success, already written by the run itself


@dataclass
class Outcome:
    """A finished run waiting for the completer to record it."""

    job: Job
    kind: Kind
    duration: float
    delay: float = 0.0
    message: str | None = None
    error: dict[str, Any] | None = None

    def error_json(self) -> str:
        """The error-history entry as JSON text for ``job_fail_many``."""
        return json.dumps(self.error or {}, default=str)


def describe(exc: BaseException, job: Job, worker_id: str) -> tuple[str, dict[str, Any]]:
    """A failed attempt's last_error line and its error-history entry."""
    name = type(exc).__name__
    text = str(exc)
    message = f"{name}: {text}" if text else name
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    trace = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
    if len(trace) > MAX_TRACEBACK_CHARS:
        trace = "…" + trace[-(MAX_TRACEBACK_CHARS - 1) :]
    entry = {
        "attempt": job.attempt,
        "worker": worker_id,
        "type": name,
        "message": message,
        "traceback": trace,
    }
    return message, entry
