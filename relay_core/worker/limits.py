"""Publishing what handlers declare per type where others read it: limits for
the claim query, max_attempts for enqueues that have no handler for the type."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import psycopg

from ..handlers import HandlerSpec
from ..logs import event
from ..queries import sql

#: How often a worker checks that a live worker holds the limits of each type it has a handler for.
REPUBLISH_CHECK_SECONDS = 5.0
#: How long that check waits for a row another transaction holds (lock_timeout) before it lets go.
REPUBLISH_LOCK_WAIT = "1s"


def publish(conn: psycopg.Connection, specs: Iterable[HandlerSpec], published_by: str | None = None) -> bool:
    """Write this worker's (``published_by``'s) per-type limits; return whether any type is limited.

    At start, whatever is published: the newest release's workers win a
    deploy as they start. A worker of an older one restarted after them wins
    back its types until it stops; then :func:`republish_unheld` hands them
    to a live worker again.
    """
    limited = False
    for spec in specs:
        limited = spec.has_limits or limited
        _publish_one(conn, spec, published_by)
    conn.commit()
    return limited


def republish_unheld(conn: psycopg.Connection, specs: Iterable[HandlerSpec], worker_id: str) -> list[str]:
    """Publish this worker's limits for the types whose limits no other live worker holds; the types written.

    A row whose publisher is alive is left to it, so two releases running
    side by side in a deploy do not overwrite each other every few seconds.
    Its own transaction, committed before and after: a failure here must not
    undo the schedule ticks the same check enqueued. A row another
    transaction holds is not waited for past REPUBLISH_LOCK_WAIT: the next
    check tries again.
    """
    by_type = {spec.type: spec for spec in specs}
    conn.commit()
    written = []
    try:
        conn.execute(sql("set_lock_timeout"), {"timeout": REPUBLISH_LOCK_WAIT})
        rows = conn.execute(sql("type_limits_held"), {"types": sorted(by_type), "worker_id": worker_id}).fetchall()
        for job_type, published, max_running, rate_limit, period, published_by, mine, held_by_another in rows:
            spec = by_type[job_type]
            if held_by_another or (not published and not spec.has_limits):
                continue
            if published and mine and (max_running, rate_limit, period) == _declared(spec):
                continue
            # Over the row as it was read only: a worker that published meanwhile keeps it.
            if _publish_one(conn, spec, worker_id, seen=(published, published_by)):
                written.append(job_type)
        conn.commit()
    except psycopg.errors.LockNotAvailable:
        conn.rollback()
        return []
    if written:
        event(logging.INFO, "published limits no live worker held", types=written)
    return written


def _declared(spec: HandlerSpec) -> tuple[int | None, int | None, float | None]:
    """``spec``'s limits as relay.type_limits holds them: (max_running, rate_limit, rate_period_seconds)."""
    starts, seconds = spec.rate_limit or (None, None)
    return spec.concurrency, starts, seconds


def _publish_one(
    conn: psycopg.Connection,
    spec: HandlerSpec,
    published_by: str | None,
    seen: tuple[bool, str | None] | None = None,
) -> bool:
    """Write ``spec``'s limits for its type, or delete the type's row where it declares none; whether
    a row changed. ``seen``: (whether a row was there, its publisher) when read, and only over that."""
    values: dict[str, Any] = {"type": spec.type, "published_by": published_by}
    if spec.has_limits:
        max_running, starts, seconds = _declared(spec)
        values.update(max_running=max_running, rate_limit=starts, rate_period_seconds=seconds)
    if seen is None:
        statement = "type_limit_upsert" if spec.has_limits else "type_limit_delete"
    else:
        published, values["seen_by"] = seen
        if not spec.has_limits:
            statement = "type_limit_delete_as_read"
        else:
            statement = "type_limit_update_as_read" if published else "type_limit_insert_unless_published"
    return conn.execute(sql(statement), values).rowcount > 0


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
