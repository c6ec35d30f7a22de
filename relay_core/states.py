"""The job state machine (README, "The state machine"), written down once.

Every SQL statement that writes ``status`` names its transition beside it
in ``sql/*.sql``; the tests check each one against :data:`TRANSITIONS`.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """Every job is in exactly one of these states."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"


#: The pseudo-state of a job that does not exist yet (enqueue creates it).
NEW = "(new)"

#: Legal transitions: (from, to) -> what causes it.
TRANSITIONS: dict[tuple[str, str], str] = {
    (NEW, "queued"): "enqueue",
    ("queued", "claimed"): "claim",
    ("queued", "cancelled"): "cancel (admin)",
    ("claimed", "succeeded"): "handler returned",
    ("claimed", "queued"): "handler raised with attempts left, snoozed, handed back, or lease expired",
    ("claimed", "dead"): "attempts exhausted or permanent failure",
    ("claimed", "cancelled"): "an admin asked the running job to stop, and the attempt ended (any way but success)",
    ("dead", "queued"): "requeue (admin)",
    ("cancelled", "queued"): "requeue (admin)",
}


def is_legal(from_status: str, to_status: str) -> bool:
    """Whether the state machine allows moving from one status to another."""
    return (from_status, to_status) in TRANSITIONS
