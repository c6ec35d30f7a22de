"""Cron arithmetic for periodic jobs: pure functions over aware datetimes.

The database clock decides *when* (callers pass ``now()`` from PostgreSQL);
this module only answers which tick is due and which comes next.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from .validation import InvalidJobError

#: A tick older than this when first seen was missed (every worker was down).
MISSED_AFTER_SECONDS = 120.0


def check_cron(expression: str, timezone: str) -> None:
    """Refuse an invalid cron expression or an unknown time zone."""
    if not isinstance(expression, str) or not croniter.is_valid(expression):
        raise InvalidJobError("cron", f"{expression!r} is not a valid cron expression")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidJobError("timezone", f"{timezone!r} is not a known time zone") from None
    # Well-formed is not enough: "0 0 30 2 *" (February 30th) parses but never
    # fires, and would fail every worker at start instead of here.
    try:
        next_tick(expression, timezone, datetime.now(UTC))
    except CroniterBadDateError:
        raise InvalidJobError("cron", f"{expression!r} never fires: no date matches it") from None


def previous_tick(expression: str, timezone: str, now: datetime) -> datetime:
    """The latest tick at or before ``now``."""
    local = now.astimezone(ZoneInfo(timezone))
    itr = croniter(expression, local)
    if croniter.match(expression, local.replace(microsecond=0)) and local.second == 0 and local.microsecond == 0:
        return local
    return itr.get_prev(datetime)


def next_tick(expression: str, timezone: str, after: datetime) -> datetime:
    """The first tick strictly after ``after``."""
    return croniter(expression, after.astimezone(ZoneInfo(timezone))).get_next(datetime)


def is_missed(tick: datetime, now: datetime) -> bool:
    """Whether a due tick is too old to have been seen on time."""
    return (now - tick).total_seconds() > MISSED_AFTER_SECONDS
