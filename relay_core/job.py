"""The job record a handler receives."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


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
    _lease_lost: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    @property
    def lease_lost(self) -> bool:
        """True once this worker learned it no longer owns the job.

        Long handlers can check it and stop early: whatever they do next will
        not be recorded, because another run now owns the job.
        """
        return self._lease_lost.is_set()

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
