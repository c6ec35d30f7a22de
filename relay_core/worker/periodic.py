"""Periodic (cron) jobs: publish schedules, enqueue each due tick exactly once.

Every worker runs :func:`enqueue_due` about once a second. Exactly one of them
enqueues a given tick: advancing ``relay.schedules.last_tick`` is a guarded
UPDATE in the same transaction as the enqueue, and the job also carries the
idempotency key ``cron:<type>:<tick>``. The same transaction records the tick
and its job as the schedule's last run (``last_enqueued_tick``, ``last_job_id``):
``last_tick`` also moves for ticks that enqueue nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from datetime import datetime
from typing import NamedTuple

import psycopg

from ..handlers import HandlerSpec
from ..logs import event
from ..queries import sql
from ..schedule import is_missed, next_tick, previous_tick, ticks_between

#: How long a schedule's tick may sit idle in its transaction before the server ends it (see tick_begin).
#: A live worker runs the tick's statements back to back; only a frozen one waits this long.
TICK_IDLE_LIMIT_MS = 5000


def _db_now(conn: psycopg.Connection) -> datetime:
    """The database's clock, which decides every tick."""
    return conn.execute(sql("db_now")).fetchone()[0]


def _worker_was_running(conn: psycopg.Connection, spec: HandlerSpec, at: datetime) -> bool:
    """Whether a worker that serves ``spec``'s queue and checks its schedule was running at ``at``."""
    params = {"queue": spec.queue, "type": spec.type, "at": at}
    return bool(conn.execute(sql("worker_was_running_at"), params).fetchone()[0])


def checked_schedule_definitions(specs: Iterable[HandlerSpec]) -> str:
    """The schedules a worker with these handlers checks, in full, as JSON for the registry.

    Another worker whose published schedule matches one of these leaves it to
    this one rather than take it over (``schedule_advance``).
    """
    definitions = [
        {"type": spec.type, "cron": spec.cron, "timezone": spec.timezone, "queue": spec.queue}
        for spec in sorted(specs, key=lambda spec: spec.type)
        if spec.cron
    ]
    return json.dumps(definitions)


def publish(conn: psycopg.Connection, specs: Iterable[HandlerSpec], published_by: str | None = None) -> None:
    """Record this worker's (``published_by``'s) schedules; a new one, or one whose cron or time zone
    changed, starts from now."""
    now = _db_now(conn)
    for spec in specs:
        if spec.cron:
            _publish_one(conn, spec, now, published_by)
    conn.commit()


def _publish_one(conn: psycopg.Connection, spec: HandlerSpec, now: datetime, published_by: str | None) -> None:
    conn.execute(
        sql("schedule_upsert"),
        {
            "type": spec.type,
            "cron": spec.cron,
            "timezone": spec.timezone,
            "queue": spec.queue,
            "last_tick": previous_tick(spec.cron, spec.timezone, now),
            "next_tick": next_tick(spec.cron, spec.timezone, now),
            "published_by": published_by,
        },
    )


#: The schedules this process found published differently from its own, each warned about once.
_OUTDATED_WARNED: set[tuple[str, ...]] = set()


def _report_outdated(spec: HandlerSpec, published: list[str]) -> None:
    """Warn, once per process and schedule, that another worker published a different one.

    In a rolling deploy that changes a schedule, the workers of the old
    release leave its ticks to the new ones, which published theirs when they
    started, while the worker that published it still checks it.
    """
    key = (spec.type, spec.cron, spec.timezone, spec.queue, *published)
    if key in _OUTDATED_WARNED:
        return
    _OUTDATED_WARNED.add(key)
    event(
        logging.WARNING,
        "another worker published a different schedule for this type; this worker leaves its ticks to those",
        type=spec.type,
        **_both_schedules(spec, published),
    )


def _both_schedules(spec: HandlerSpec, published: list[str]) -> dict[str, str]:
    """This worker's schedule for ``spec``'s type and the one published, as log fields."""
    cron, timezone, queue = published
    return {
        "schedule": f"{spec.cron} ({spec.timezone}, queue {spec.queue})",
        "published": f"{cron} ({timezone}, queue {queue})",
    }


#: The schedules this process found with a last tick later than the database's clock, each warned about once.
_AHEAD_WARNED: set[tuple[str, datetime]] = set()


def _report_ahead(spec: HandlerSpec, last_tick: datetime, now: datetime) -> None:
    """Warn, once per process and tick, that a schedule's last tick is later than the next tick due now.

    A tick is taken only past the last one, so a last tick in the future
    (written while the database's clock ran ahead, then stepped back) holds
    every tick off until the clock passes it: the schedule stopped, and no
    line said why. Not moved back here: every worker would, each with its
    own idea of the clock.
    """
    key = (spec.type, last_tick)
    if key in _AHEAD_WARNED:
        return
    _AHEAD_WARNED.add(key)
    event(
        logging.WARNING,
        "a periodic schedule's last tick is later than the database's clock (did the clock step back?); "
        "no tick is enqueued until then: to resume now, set relay.schedules.last_tick to the past",
        type=spec.type,
        last_tick=last_tick.isoformat(),
        now=now.isoformat(),
    )


#: How many passed ticks a warning counts exactly (an every-second schedule after a long outage passes thousands).
PASSED_TICKS_COUNTED = 1000


def _report_passed_ticks(spec: HandlerSpec, previous: datetime | None, tick: datetime) -> None:
    """Warn when ticks fell due between the schedule's last tick and this one: they are not enqueued.

    A check runs only the latest due tick. Ticks that passed while the check
    was held up (a database outage, a long vacuum on the maintenance thread)
    or while every worker was down are folded into it, not enqueued one by one.
    """
    if previous is None:
        return
    passed = ticks_between(spec.cron, spec.timezone, previous, tick, PASSED_TICKS_COUNTED)  # type: ignore[arg-type]
    if passed:
        event(
            logging.WARNING,
            "periodic ticks passed between two checks; only the latest is enqueued",
            type=spec.type,
            passed=passed if passed < PASSED_TICKS_COUNTED else f"{PASSED_TICKS_COUNTED} or more",
            since=previous.isoformat(),
            tick=tick.isoformat(),
        )


def enqueue_due(
    conn: psycopg.Connection,
    specs: Iterable[HandlerSpec],
    *,
    clock: datetime | None = None,
    running_since: datetime | None = None,
    queues: Iterable[str] = (),
    worker_id: str | None = None,
) -> list[tuple[str, str]]:
    """Enqueue every schedule's latest due tick that nobody enqueued yet; return (type, tick) pairs.

    Only the latest due tick is enqueued: earlier ones that passed since the
    schedule's last tick are logged (``_report_passed_ticks``), not run. That
    tick is missed (skipped unless the schedule catches up) only when it is
    over MISSED_AFTER_SECONDS old and no worker serving its queue was running
    when it fell due, by the registry: a worker that was running saw it fall
    due, so it runs however late a check comes (a long prune or vacuum on a
    maintenance thread, a database outage), whichever worker gets to it.
    ``clock`` stands in for the database's ``now()``, so tests can walk
    through a night the clocks change in; workers never pass it.

    A worker passes its own registration (``running_since``) and the
    ``queues`` it serves: alive now and registered before a tick, it was
    running when the tick fell due, whatever its last heartbeat says (they
    come every lease / 3, which a long lease makes longer than the registry
    check's reach).
    """
    serving = frozenset(queues)
    enqueued: list[tuple[str, str]] = []
    # Each schedule's tick is a transaction of its own. On a connection already in one (the
    # worker's check reads first, outside autocommit) they were savepoints of that one: a schedule
    # whose session the server ended took back the ticks of those before it, logged as enqueued.
    conn.commit()
    for spec in specs:
        if not spec.cron:
            continue
        checker_since = running_since if spec.queue in serving else None
        try:
            tick = _enqueue_latest_tick(conn, spec, clock, checker_since, worker_id)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise  # the database is out of reach: every schedule waits for it (the caller's outage handling)
            # One schedule's failure (a trigger or constraint of the application's that refuses
            # its job, say) must not keep the schedules after it from running; it is retried
            # at the next check.
            event(logging.ERROR, "periodic schedule failed", type=spec.type, error=str(exc))
            continue
        if tick is not None:
            enqueued.append((spec.type, tick.isoformat()))
    return enqueued


class _Advance(NamedTuple):
    """What one schedule's check did: the tick it enqueued, if any, and the tick it moved on from when
    it moved ``last_tick`` on (whose passed ticks are then told)."""

    enqueued: datetime | None
    moved_from: datetime | None
    tick: datetime


def _enqueue_latest_tick(
    conn: psycopg.Connection,
    spec: HandlerSpec,
    clock: datetime | None,
    checker_since: datetime | None,
    worker_id: str | None,
) -> datetime | None:
    """Enqueue ``spec``'s latest due tick if nobody has and it is not missed, in one transaction; that tick.

    The ticks passed over are counted once that transaction has ended. Counted
    inside it, with the schedule's row locked and the tick's idle limit on,
    a thousand of them (an every-second schedule after a 17-minute outage)
    took seconds on a worker whose handlers kept the interpreter busy: the
    server ended the session, the advance rolled back, and the next check
    did the same, for as long as the load lasted.
    """
    with conn.transaction():
        advance = _advance(conn, spec, clock, checker_since, worker_id)
    if advance.moved_from is not None:
        _report_passed_ticks(spec, advance.moved_from, advance.tick)
    if advance.enqueued is not None:
        event(logging.INFO, "periodic job enqueued", type=spec.type, tick=advance.enqueued.isoformat())
    return advance.enqueued


def _advance(
    conn: psycopg.Connection,
    spec: HandlerSpec,
    clock: datetime | None,
    checker_since: datetime | None,
    worker_id: str | None,
) -> _Advance:
    """The statements of ``_enqueue_latest_tick``'s transaction.

    ``checker_since``: when the worker checking, which serves the schedule's queue, registered.
    A schedule published differently is left alone while the worker that
    published it checks it, and taken over (``spec`` published, starting from
    now) once it does not.
    """
    db_now = conn.execute(sql("tick_begin"), {"idle_ms": str(TICK_IDLE_LIMIT_MS)}).fetchone()[0]
    now = clock or db_now
    tick = previous_tick(spec.cron, spec.timezone, now)
    nothing = _Advance(None, None, tick)
    following = next_tick(spec.cron, spec.timezone, now)
    advance = {
        "type": spec.type,
        "cron": spec.cron,
        "timezone": spec.timezone,
        "queue": spec.queue,
        "tick": tick,
        "next_tick": following,
        "worker_id": worker_id,
    }
    row = conn.execute(sql("schedule_advance"), advance).fetchone()
    if row is None:
        # Deleted by hand while this worker still has the schedule: it stopped on every worker,
        # silently, until one restarted and published it again.
        _publish_one(conn, spec, now, worker_id)
        event(
            logging.WARNING,
            "published again a periodic schedule missing from relay.schedules, starting from now; "
            "to remove a schedule, remove it from the handler, deploy, then delete its row",
            type=spec.type,
            schedule=f"{spec.cron} ({spec.timezone}, queue {spec.queue})",
        )
        return nothing
    won, previous, current, publisher_checks, seen_last_tick, *published = row
    if not current:
        if publisher_checks:
            _report_outdated(spec, published)
            return nothing
        if conn.execute(sql("schedule_take_over_lock"), {"type": spec.type}).fetchone() is None:
            return nothing  # held by another transaction: the next check tries again
        _publish_one(conn, spec, now, worker_id)
        event(
            logging.WARNING,
            "took over a periodic schedule whose publisher no longer checks it",
            type=spec.type,
            **_both_schedules(spec, published),
        )
        return nothing
    if not won:
        if seen_last_tick is not None and seen_last_tick > following:
            _report_ahead(spec, seen_last_tick, now)
        return nothing
    if (
        is_missed(tick, now)
        and not spec.catch_up
        and not (checker_since is not None and checker_since <= tick)
        and not _worker_was_running(conn, spec, tick)
    ):
        event(
            logging.WARNING,
            "skipped a periodic tick missed while no worker ran",
            type=spec.type,
            tick=tick.isoformat(),
        )
        return _Advance(None, previous, tick)
    key = f"cron:{spec.type}:{tick.isoformat()}"
    conn.execute(
        sql("job_insert_keyed"),
        {
            "type": spec.type,
            "payload": json.dumps({"scheduled_for": tick.isoformat()}),
            "queue": spec.queue,
            "priority": 0,
            "run_at": None,
            "max_attempts": spec.max_attempts,
            "idempotency_key": key,
            "notify": True,
            "published": False,
        },
    )
    conn.execute(sql("schedule_record_run"), {"type": spec.type, "tick": tick, "idempotency_key": key})
    return _Advance(tick, previous, tick)
