"""Publishing what handlers declare per type where others read it: limits for
the claim query, max_attempts for enqueues that have no handler for the type."""

from __future__ import annotations

from collections.abc import Iterable

import psycopg

from ..handlers import HandlerSpec
from ..queries import sql


def publish(conn: psycopg.Connection, specs: Iterable[HandlerSpec]) -> bool:
    """Write this worker's per-type limits; return whether any type is limited."""
    limited = False
    for spec in specs:
        if spec.has_limits:
            limited = True
            starts, seconds = spec.rate_limit or (None, None)
            conn.execute(
                sql("type_limit_upsert"),
                {
                    "type": spec.type,
                    "max_running": spec.concurrency,
                    "rate_limit": starts,
                    "rate_period_seconds": seconds,
                },
            )
        else:
            conn.execute(sql("type_limit_delete"), {"type": spec.type})
    conn.commit()
    return limited


def publish_max_attempts(conn: psycopg.Connection, specs: Iterable[HandlerSpec]) -> None:
    """Write each handler's ``max_attempts`` to ``relay.job_types``.

    ``relay enqueue``, the admin API and services that only enqueue load no
    handlers; they read this, so their jobs get the attempts the handler's
    author chose rather than their Relay's default.
    """
    for spec in specs:
        conn.execute(sql("job_type_upsert"), {"type": spec.type, "max_attempts": spec.max_attempts})
    conn.commit()


def forget_old_starts(conn: psycopg.Connection) -> None:
    """Delete each type's rate-limit starts older than its window: no claim counts them again.

    Apart from retention, which a worker may have switched off: the starts
    are the limits' bookkeeping, not history anyone keeps.
    """
    conn.execute(sql("rate_starts_prune"))
    conn.commit()
