"""Retention: delete finished jobs past their age in small batches.

Small batches with SKIP LOCKED never hold long locks and never block a claim;
the per-minute history the dashboard draws lives in relay.job_outcomes, which
pruning does not touch.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from ..queries import sql
from ..settings import env_float

PRUNE_BATCH = 500
#: Batches per run, so one worker's pass stays short; the next pass continues.
MAX_BATCHES = 20
#: Deletions of one state per pass; a pass that reaches it left work behind.
PASS_CAP = PRUNE_BATCH * MAX_BATCHES


def hit_cap(deleted: dict[str, int]) -> bool:
    """Whether a pass stopped at its cap (more expired jobs wait): prune again soon."""
    return any(count >= PASS_CAP for count in deleted.values())


@dataclass(frozen=True)
class Retention:
    """How long finished jobs are kept, per final state (seconds; 0 keeps forever)."""

    succeeded: float = 7 * 86400.0
    cancelled: float = 7 * 86400.0
    dead: float = 30 * 86400.0

    @classmethod
    def from_env(cls) -> Retention:
        """RELAY_RETENTION_SUCCEEDED / _CANCELLED / _DEAD, in seconds."""
        return cls(
            succeeded=env_float("RELAY_RETENTION_SUCCEEDED", cls.succeeded),
            cancelled=env_float("RELAY_RETENTION_CANCELLED", cls.cancelled),
            dead=env_float("RELAY_RETENTION_DEAD", cls.dead),
        )


def prune_once(conn: psycopg.Connection, retention: Retention) -> dict[str, int]:
    """Delete expired finished jobs (bounded work); count deletions per state."""
    deleted = {"succeeded": 0, "cancelled": 0, "dead": 0}
    for status, age in (
        ("succeeded", retention.succeeded),
        ("cancelled", retention.cancelled),
        ("dead", retention.dead),
    ):
        if age <= 0:
            continue
        for _ in range(MAX_BATCHES):
            rows = conn.execute(
                sql("job_prune_finished"), {"status": status, "older_than_seconds": age, "limit": PRUNE_BATCH}
            ).fetchall()
            conn.commit()
            deleted[status] += len(rows)
            if len(rows) < PRUNE_BATCH:
                break
    conn.execute(sql("rate_starts_prune"))
    conn.commit()
    return deleted
