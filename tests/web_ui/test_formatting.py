"""The dashboard's pure helpers: ages, first lines, the chart's geometry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from relay_core.monitor import MinuteOutcomes
from relay_web.dashboard import chart, formatting
from relay_web.records.common import parse_moment

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (0.25, "250ms"),
        (42, "42s"),
        (60, "1m"),
        (185, "3m 5s"),
        (7800, "2h 10m"),
        (3 * 86400 + 3600, "3d 1h"),
    ],
)
def test_span(seconds: float | None, text: str) -> None:
    assert formatting.span(seconds) == text


def test_ago_reads_both_ways() -> None:
    assert formatting.ago(NOW - timedelta(minutes=3), NOW) == "3m ago"
    assert formatting.ago(NOW + timedelta(hours=2), NOW) == "in 2h"
    assert formatting.ago(NOW, NOW) == "now"
    assert formatting.ago(None, NOW) == "—"


def test_first_line_skips_blank_lines_and_cuts_long_ones() -> None:
    assert formatting.first_line("\n  ValueError: boom\nTraceback ...") == "ValueError: boom"
    assert formatting.first_line(None) == ""
    cut = formatting.first_line("x" * 500)
    assert len(cut) == formatting.FIRST_LINE_CHARS and cut.endswith("…")


def test_pretty_json_keeps_text_readable() -> None:
    assert formatting.pretty_json({"to": "zoë"}) == '{\n  "to": "zoë"\n}'


def test_stored_values_that_are_not_text_are_shown_as_json_not_python() -> None:
    assert formatting.as_text("boom") == "boom"
    assert formatting.as_text({"x": [1, True, None]}) == '{"x": [1, true, null]}'
    assert formatting.as_text(["zoë"]) == '["zoë"]'
    assert formatting.as_text(False) == "false"


def test_error_history_times_parse_or_are_dropped() -> None:
    assert parse_moment("2030-01-01T12:00:00+00:00") == NOW
    assert parse_moment("2030-01-01T12:00:00") == NOW
    assert parse_moment("2030-01-01T14:00:00+02:00") == NOW and parse_moment(NOW).tzinfo is UTC
    assert parse_moment("yesterday") is None
    assert parse_moment(42) is None
    assert parse_moment("9999-12-31T23:59:59-05:00") is None, "year 10000 in UTC"


@pytest.mark.parametrize(("value", "top"), [(0, 1), (1, 1), (3, 5), (7, 10), (11, 20), (480, 500), (501, 1000)])
def test_axis_tops_are_round(value: int, top: int) -> None:
    assert chart.nice_ceiling(value) == top


def test_chart_stacks_failures_under_successes_scaled_to_the_busiest_minute() -> None:
    minutes = [
        MinuteOutcomes(NOW + timedelta(minutes=i), succeeded=s, failed=f, dead=0)
        for i, (s, f) in enumerate([(0, 0), (8, 2), (3, 0)])
    ]
    drawn = chart.throughput(minutes)
    assert drawn.peak == 10 and not drawn.empty
    empty, busy, quiet = drawn.bars
    assert empty.succeeded_height == 0 and empty.failed_height == 0
    plot = chart.HEIGHT - chart.TOP - chart.BOTTOM
    assert busy.failed_height == pytest.approx(plot * 0.2, abs=0.01)
    assert busy.succeeded_height == pytest.approx(plot * 0.8, abs=0.01)
    assert busy.succeeded_y + busy.succeeded_height == pytest.approx(busy.failed_y, abs=0.02)
    assert busy.failed_y + busy.failed_height == pytest.approx(drawn.bottom_y, abs=0.02)
    assert busy.x > empty.x and quiet.x + quiet.width <= chart.WIDTH
    assert busy.label == "12:01 UTC: 8 succeeded, 2 failed"
    assert (drawn.first_label, drawn.last_label) == ("12:00", "12:02 UTC")


def test_the_middle_gridline_sits_at_the_height_of_its_label() -> None:
    """With an axis top of 5 the line was drawn halfway up, at 2.5, and labelled 2: a bar of 2 ended below it."""
    drawn = chart.throughput([MinuteOutcomes(NOW, succeeded=2, failed=1, dead=0)])
    assert (drawn.peak, drawn.mid) == (5, 2)
    plot = chart.HEIGHT - chart.TOP - chart.BOTTOM
    assert drawn.mid_y == pytest.approx(drawn.bottom_y - plot * 2 / 5, abs=0.01)
    (bar,) = drawn.bars
    assert bar.succeeded_y == pytest.approx(drawn.bottom_y - plot * 3 / 5, abs=0.02)  # a bar of 3, above the 2


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.001, "1ms"),
        (1.5, "1.5s"),
        (60, "1m"),
        (90.5, "1m 30.5s"),
        (3601, "1h 1s"),
        (2592000, "30d"),
        (59.9999, "1m"),
        (86399.9999, "1d"),
        (3600.0002, "1h"),
    ],
)
def test_a_rate_window_is_said_exactly(seconds: float, said: str) -> None:
    """'%g' wrote a 30-day window as 2.592e+06 s."""
    assert formatting.window(seconds) == said


def test_an_idle_hour_draws_no_bars() -> None:
    drawn = chart.throughput([MinuteOutcomes(NOW, 0, 0, 0)])
    assert drawn.empty and drawn.peak == 0
