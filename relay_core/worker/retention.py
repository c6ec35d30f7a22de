"""Retention: delete finished jobs past their age in small batches.

Small batches with SKIP LOCKED never hold long locks and never block a claim;
the per-minute history the dashboard draws lives in relay.job_outcomes, which
pruning does not touch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import psycopg

from ..errors import ConfigurationError
from ..finite import finite_real
from ..queries import sql
from ..settings import env_float

PRUNE_BATCH = 500
#: Batches per run, so one worker's pass stays short; the next pass continues.
MAX_BATCHES = 20
#: Deletions of one state per pass; a pass that reaches it left work behind.
PASS_CAP = PRUNE_BATCH * MAX_BATCHES
#: The longest retention (about a century). The prune subtracts it from now()
#: in SQL; a value PostgreSQL cannot subtract (or inf, nan) would fail every
#: pass, and nothing of any state would be pruned again.
MAX_RETENTION_SECONDS = 36500 * 86400.0


def hit_cap(deleted: dict[str, int]) -> bool:
    """Whether a pass stopped at its cap (more expired jobs wait): prune again soon."""
    return any(count >= PASS_CAP for count in deleted.values())


@dataclass(frozen=True)
class Retention:
    """How long finished jobs are kept, per final state (seconds; 0 keeps forever)."""

    succeeded: float = 7 * 86400.0
    cancelled: float = 7 * 86400.0
    dead: float = 30 * 86400.0

    def __post_init__(self) -> None:
        for field in fields(self):
            # As a float: the prune passes it to PostgreSQL, which takes no Fraction.
            object.__setattr__(self, field.name, _check_age(f"retention {field.name}", getattr(self, field.name)))

    @classmethod
    def from_env(cls) -> Retention:
        """RELAY_RETENTION_SUCCEEDED / _CANCELLED / _DEAD, in seconds."""
        return cls(
            **{
                field.name: _check_age(
                    f"RELAY_RETENTION_{field.name.upper()}",
                    env_float(f"RELAY_RETENTION_{field.name.upper()}", field.default),  # type: ignore[arg-type]
                )
                for field in fields(cls)
            }
        )


def _check_age(name: str, seconds: float) -> float:
    """A retention is 0 (keep forever) or a finite number of seconds up to MAX_RETENTION_SECONDS, as a float
    (a real number: not a bool, which Python counts as 1 second, nor a string or a Decimal)."""
    if not (finite_real(seconds) and 0 <= seconds <= MAX_RETENTION_SECONDS):
        raise ConfigurationError(
            f"{name} must be a number of seconds from 0 (keep forever) to {MAX_RETENTION_SECONDS:.0f}, got {seconds!r}"
        )
    return float(seconds)


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
    return deleted
