"""Cron arithmetic across daylight-saving changes, checked against every instant.

The oracle walks time itself, second by second (or minute by minute), and
asks of each instant what cron's rule asks: does the wall clock match, and
is this the pass of a repeated hour that runs it; at a jump forward, does a
fixed time the clocks skipped run here. previous_tick and next_tick must
agree with it at every point sampled around the changes, including inside
the repeated hour and the hours on either side, where their search starts
from a different wall time than the one the clock shows.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from relay_core import schedule
from relay_core.schedule import _is_wild


def previous_tick(expression: str, timezone: str, now: datetime) -> datetime:
    """The previous tick in UTC: an aware time inside a repeated hour never equals one of another zone."""
    return schedule.previous_tick(expression, timezone, now).astimezone(UTC)


def next_tick(expression: str, timezone: str, after: datetime) -> datetime:
    """The next tick in UTC (see previous_tick)."""
    return schedule.next_tick(expression, timezone, after).astimezone(UTC)


def wall_matcher(expression: str) -> Callable[[datetime], bool]:
    """Whether a wall-clock time matches, read off the expression's fields (any day: these tests need no more)."""
    minutes, hours, days, months, weekdays, *seconds = croniter(expression).expanded
    assert days == months == weekdays == ["*"], "the oracle reads times of day only"

    def allowed(values: list, value: int) -> bool:
        return values == ["*"] or value in values

    def matches(wall: datetime) -> bool:
        second_ok = allowed(seconds[0], wall.second) if seconds else wall.second == 0
        return second_ok and allowed(minutes, wall.minute) and allowed(hours, wall.hour)

    return matches


def oracle_ticks(expression: str, timezone: str, start: datetime, end: datetime, step: timedelta) -> list[datetime]:
    """Every tick in [start, end], found by looking at each instant a step apart."""
    zone, wild, matches = ZoneInfo(timezone), _is_wild(expression), wall_matcher(expression)
    ticks, instant = [], start
    while instant <= end:
        local = instant.astimezone(zone)
        wall = local.replace(tzinfo=None)
        runs = matches(wall) and (wild or local.fold == 0)
        before = (instant - step).astimezone(zone)
        if not runs and not wild and local.utcoffset() > before.utcoffset():  # type: ignore[operator]
            # The clocks jumped forward onto this instant: a fixed time they skipped runs now.
            skipped = before.replace(tzinfo=None) + step
            while skipped < wall and not runs:
                runs = matches(skipped)
                skipped += step
        if runs:
            ticks.append(instant)
        instant += step
    return ticks


#: Berlin: the clocks go back at 03:00 (02:00-03:00 happens twice) and jump forward at 02:00.
BERLIN_BACK = ("Europe/Berlin", datetime(2026, 10, 25, 1, tzinfo=UTC))
BERLIN_FORWARD = ("Europe/Berlin", datetime(2026, 3, 29, 1, tzinfo=UTC))
#: Lord Howe: a half-hour change, back at 02:00.
LORD_HOWE_BACK = ("Australia/Lord_Howe", datetime(2026, 4, 4, 15, tzinfo=UTC))

SECOND_EXPRESSIONS = [
    "* * * * * *",  # every second: a wildcard job
    "10,40 2 * * * 30",  # second 30 of 2:10 and 2:40: fixed, so once in a repeated hour, at the jump when skipped
]
MINUTE_EXPRESSIONS = [
    "*/20 * * * *",
    "30 2 * * *",
    "15,45 1-3 * * *",
    "0 * * * *",  # hourly: a wildcard job
    "*/10 2 * * *",  # a wildcard minute: both passes of a repeated 2 a.m., nothing at the jump
]

CASES = [
    *[
        (expression, timedelta(seconds=1), *change)
        for expression in SECOND_EXPRESSIONS
        for change in (BERLIN_BACK, BERLIN_FORWARD)
    ],
    *[
        (expression, timedelta(minutes=1), *change)
        for expression in MINUTE_EXPRESSIONS
        for change in (BERLIN_BACK, BERLIN_FORWARD, LORD_HOWE_BACK)
    ],
]


@pytest.mark.parametrize(("expression", "step", "timezone", "change"), CASES, ids=str)
def test_ticks_around_a_daylight_saving_change_are_the_ones_each_instant_shows(
    expression: str, step: timedelta, timezone: str, change: datetime
) -> None:
    # Wider than DST_REACH (3 h) on both sides: where the search starts from another wall time than the clock's.
    reach = timedelta(hours=4) if step.total_seconds() == 1 else timedelta(hours=30)
    ticks = oracle_ticks(expression, timezone, change - reach, change + reach, step)
    assert ticks, "the window holds ticks to compare"
    sample = timedelta(seconds=7.5) if step.total_seconds() == 1 else timedelta(seconds=131)
    point, checked = change - reach, 0
    while point <= change + reach:
        latest = bisect_right(ticks, point) - 1
        if latest >= 0:
            assert previous_tick(expression, timezone, point) == ticks[latest], f"previous_tick at {point}"
            checked += 1
        following = bisect_right(ticks, point)
        if following < len(ticks):
            assert next_tick(expression, timezone, point) == ticks[following], f"next_tick at {point}"
            checked += 1
        point += sample
    assert checked > 100
    # Exactly on a tick: it is the previous tick, and the next is a later one.
    for index, tick in enumerate(ticks[:-1]):
        if index % 50 == 0 or tick - ticks[index - 1] > step:
            assert previous_tick(expression, timezone, tick) == tick
            assert next_tick(expression, timezone, tick) == ticks[index + 1]
