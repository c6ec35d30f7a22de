"""Relay: a persistent background-job queue that needs nothing but PostgreSQL.

Relay delivers every job at least once. Handlers must be idempotent.
"""

from __future__ import annotations

from .admin import JobDetail
from .backoff import Backoff
from .client import Relay
from .errors import (
    BulkActionStopped,
    ChangedSince,
    ConfigurationError,
    HandlerNotFound,
    IllegalTransition,
    InvalidJobError,
    JobCancelled,
    JobNotFound,
    JobTimeout,
    LeaseLost,
    MigrationError,
    PermanentFailure,
    RelayError,
    Snooze,
    SuccessNotRecorded,
)
from .job import Job
from .states import TRANSITIONS, JobStatus
from .worker import Worker, WorkerConfig

__all__ = [
    "TRANSITIONS",
    "Backoff",
    "BulkActionStopped",
    "ChangedSince",
    "ConfigurationError",
    "HandlerNotFound",
    "IllegalTransition",
    "InvalidJobError",
    "Job",
    "JobCancelled",
    "JobDetail",
    "JobNotFound",
    "JobStatus",
    "JobTimeout",
    "LeaseLost",
    "MigrationError",
    "PermanentFailure",
    "Relay",
    "RelayError",
    "Snooze",
    "SuccessNotRecorded",
    "Worker",
    "WorkerConfig",
]
