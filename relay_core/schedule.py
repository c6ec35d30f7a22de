"""Cron arithmetic for periodic jobs: pure functions over aware datetimes.

The database clock decides *when* (callers pass ``now()`` from PostgreSQL);
this module only answers which tick is due and which comes next.
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from croniter import CroniterBadDateError, croniter

from .validation import InvalidJobError

#: A tick older than this when first seen may have been missed; whether a worker
#: serving its queue was running then decides (worker.periodic.enqueue_due).
MISSED_AFTER_SECONDS = 120.0
#: Clocks move by at most this much at a daylight-saving change (cron's own bound).
DST_REACH = timedelta(hours=3)
#: How far the tick search walks. The sparsest real schedule, February 29th,
#: fires every 4 to 8 years; one whose every match falls in a skipped hour
#: (a wildcard job inside the spring-forward gap) never does.
SEARCH_REACH = timedelta(days=366 * 30)


#: Cron fields: minute, hour, day of month, month, day of week, and optionally seconds.
CRON_FIELDS = (5, 6)
#: croniter's random field (``R``, ``R(0-29)``): a new value each time an
#: expression is read, so every worker and every check would see other ticks.
_RANDOM_FIELD = re.compile(r"(?:^|,)\s*R(?:$|[(/,])", re.IGNORECASE)


#: Zone names that mean the zone the machine is set to, not one zone for every worker.
MACHINE_ZONES = frozenset({"localtime"})


@functools.cache
def _iana_zones() -> frozenset[str]:
    """The zone names this machine's zone database lists (read once: it scans a directory)."""
    return frozenset(available_timezones())


def check_cron(expression: str, timezone: str) -> None:
    """Refuse an invalid cron expression or an unknown time zone.

    croniter reads more than cron: a 7th field for the year, which stops
    matching once its years are past (and then fails every worker that reads
    it), and ``R`` for a random value, drawn again on every read (so a worker
    checking each second finds a new due tick each time). Neither is cron,
    so both are refused here, at registration.
    """
    if not isinstance(expression, str) or not croniter.is_valid(expression):
        raise InvalidJobError("cron", f"{expression!r} is not a valid cron expression")
    fields = expression.split()
    if not expression.lstrip().startswith("@") and len(fields) not in CRON_FIELDS:
        raise InvalidJobError(
            "cron", f"{expression!r} has {len(fields)} fields; cron has 5 (minute to day of week), or 6 with seconds"
        )
    if any(_RANDOM_FIELD.search(field) for field in fields):
        raise InvalidJobError("cron", f"{expression!r} has a random (R) field, which gives no fixed tick")
    # A name, not a tzinfo: it is stored in relay.schedules and read by every worker.
    if not isinstance(timezone, str):
        raise InvalidJobError("timezone", f"must be an IANA time zone name such as 'Europe/Berlin', got {timezone!r}")
    if timezone in MACHINE_ZONES:
        raise InvalidJobError(
            "timezone",
            f"{timezone!r} is whatever zone this machine is set to, which another worker's may not be: "
            "name the IANA zone itself, such as 'Europe/Berlin'",
        )
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a region's directory ("America"), a name too long
        raise InvalidJobError("timezone", f"{timezone!r} is not a known IANA time zone name") from None
    if timezone not in _iana_zones():
        # A file the zone database directory also holds (posixrules, right/UTC, posix/Europe/Berlin):
        # ZoneInfo reads it, but it is no zone name, and right/ ones count leap seconds.
        raise InvalidJobError("timezone", f"{timezone!r} is not an IANA time zone name")
    # Well-formed is not enough: "0 0 30 2 *" (February 30th) parses but never
    # fires, and would fail every worker at start instead of here.
    try:
        next_tick(expression, timezone, datetime.now(UTC))
    except CroniterBadDateError:
        raise InvalidJobError("cron", f"{expression!r} never fires: no date matches it") from None


def previous_tick(expression: str, timezone: str, now: datetime) -> datetime:
    """The latest tick at or before ``now``.

    The walk starts at now's own wall-clock time, where the answer almost
    always is. Only in the second pass of a repeated hour can a later wall
    time have an instant at or before now (its first pass); those instants
    all fall before the clocks went back, so a tick found after that moment
    stands, and otherwise the walk starts again from the latest wall time
    any instant at or before now can have.
    """
    zone, wild = ZoneInfo(timezone), _is_wild(expression)
    now = now.astimezone(UTC)
    own, earlier = _offset(now, zone), _offset(now - DST_REACH, zone)
    wall = _naive(now + own)
    went_back = _jump(now - DST_REACH, now, zone) if earlier > own and _is_ambiguous(wall, zone) else None
    smaller = min(own, earlier)
    found = _walk_back(expression, zone, wild, now, smaller, wall, went_back)
    if found is None:
        found = _walk_back(expression, zone, wild, now, smaller, _naive(now + earlier), None)
    return found.astimezone(zone)  # type: ignore[union-attr]


def next_tick(expression: str, timezone: str, after: datetime) -> datetime:
    """The first tick strictly after ``after``.

    As :func:`previous_tick`, mirrored: only in the first pass of a repeated
    hour can an earlier wall time have an instant after ``after`` (its second
    pass, from the moment the clocks go back).
    """
    zone, wild = ZoneInfo(timezone), _is_wild(expression)
    after = after.astimezone(UTC)
    own, later = _offset(after, zone), _offset(after + DST_REACH, zone)
    wall = _naive(after + own)
    goes_back = _jump(after, after + DST_REACH, zone) if later < own and _is_ambiguous(wall, zone) else None
    larger = max(own, later)
    found = _walk_forward(expression, zone, wild, after, larger, wall, goes_back)
    if found is None:
        found = _walk_forward(expression, zone, wild, after, larger, _naive(after + later), None)
    return found.astimezone(zone)  # type: ignore[union-attr]


def _walk_back(
    expression: str,
    zone: ZoneInfo,
    wild: bool,
    now: datetime,
    smaller: timedelta,
    start: datetime,
    at_least: datetime | None,
) -> datetime | None:
    """The latest tick at or before ``now`` among wall times up to ``start``; None if it is before ``at_least``.

    The walk ends at a due tick of an unambiguous wall time (every earlier
    wall time is an earlier instant), or once no earlier wall time can be
    later than the best tick found: within DST_REACH of now a wall time's
    instants are at most the wall time less ``smaller``, the smaller of the
    offsets at now and DST_REACH before it.
    """
    walls = croniter(expression, start + timedelta(microseconds=1))
    best: datetime | None = None
    while True:
        wall = walls.get_prev(datetime)
        _within_reach(wall, now)
        due = [tick for tick in _instants(wall, zone, wild) if tick <= now]
        if due and (best is None or max(due) > best):
            best = max(due)
        if best is None:
            continue
        nothing_later = best >= now - DST_REACH and best >= (wall - smaller).replace(tzinfo=UTC)
        if nothing_later or (due and not _is_ambiguous(wall, zone)):
            return None if at_least is not None and best < at_least else best


def _walk_forward(
    expression: str,
    zone: ZoneInfo,
    wild: bool,
    after: datetime,
    larger: timedelta,
    start: datetime,
    at_most: datetime | None,
) -> datetime | None:
    """The first tick after ``after`` among wall times past ``start``; None if it is past ``at_most``.

    Mirrors :func:`_walk_back`: within DST_REACH of ``after`` a wall time's
    instants are at least the wall time less ``larger``, the larger of the
    offsets at ``after`` and DST_REACH past it.
    """
    walls = croniter(expression, start)
    best: datetime | None = None
    while True:
        wall = walls.get_next(datetime)
        _within_reach(wall, after)
        due = [tick for tick in _instants(wall, zone, wild) if tick > after]
        if due and (best is None or min(due) < best):
            best = min(due)
        if best is None:
            continue
        nothing_earlier = best <= after + DST_REACH and best <= (wall - larger).replace(tzinfo=UTC)
        if nothing_earlier or (due and not _is_ambiguous(wall, zone)):
            return None if at_most is not None and best > at_most else best


def _within_reach(wall: datetime, start: datetime) -> None:
    """Stop a search that found no tick within SEARCH_REACH of where it started."""
    if abs(wall - _naive(start)) > SEARCH_REACH:
        raise CroniterBadDateError(f"no tick within {SEARCH_REACH.days // 366} years")


def _naive(instant: datetime) -> datetime:
    return instant.astimezone(UTC).replace(tzinfo=None)


def _offset(instant: datetime, zone: ZoneInfo) -> timedelta:
    return instant.astimezone(zone).utcoffset()  # type: ignore[return-value]


def _is_wild(expression: str) -> bool:
    """Whether the minute or the hour field starts with ``*`` (cron's "wildcard job")."""
    fields = croniter(expression).expressions
    return fields[0].startswith("*") or fields[1].startswith("*")


def _is_ambiguous(wall: datetime, zone: ZoneInfo) -> bool:
    """Whether a wall-clock time happens twice (the clocks went back across it)."""
    return wall.replace(tzinfo=zone, fold=0).utcoffset() > wall.replace(tzinfo=zone, fold=1).utcoffset()  # type: ignore[operator]


def _instants(wall: datetime, zone: ZoneInfo, wild: bool) -> list[datetime]:
    """The instants (UTC) at which a matching wall-clock time is a tick.

    Cron's rule for daylight-saving changes: when the clocks go back, a
    wildcard job (every N minutes, hourly) runs in both passes of the repeated
    hour, as elapsed time demands, and a job at fixed times runs once; when
    they jump forward, a fixed time that never happened runs at the jump, and
    a wildcard job just goes on from the new time.
    """
    first = wall.replace(tzinfo=zone, fold=0)
    second = wall.replace(tzinfo=zone, fold=1)
    if first.utcoffset() == second.utcoffset():
        return [first.astimezone(UTC)]
    if _is_ambiguous(wall, zone):
        return [first.astimezone(UTC), second.astimezone(UTC)] if wild else [first.astimezone(UTC)]
    return [] if wild else [_jump(second.astimezone(UTC), first.astimezone(UTC), zone)]


def _jump(before: datetime, after: datetime, zone: ZoneInfo) -> datetime:
    """The instant the clocks jumped forward, between ``before`` and ``after`` (whole seconds)."""
    low, high = before, after  # low is in the old offset, high in the new one
    while high - low > timedelta(seconds=1):
        middle = low + (high - low) / 2
        if _offset(middle, zone) == _offset(low, zone):
            low = middle
        else:
            high = middle
    return high.replace(microsecond=0)


def ticks_between(expression: str, timezone: str, after: datetime, before: datetime, most: int) -> int:
    """How many ticks fall strictly between ``after`` and ``before``, counting no further than ``most``."""
    count, tick = 0, after
    while count < most:
        tick = next_tick(expression, timezone, tick)
        if tick >= before:
            break
        count += 1
    return count


def is_missed(tick: datetime, now: datetime) -> bool:
    """Whether a due tick is too old to have been seen on time."""
    return (now - tick).total_seconds() > MISSED_AFTER_SECONDS
