"""The overview's throughput chart, laid out on the server as SVG geometry.

A phone in an incident should not download and run a chart library to draw
sixty bars; the server computes rectangles and the template writes them as
inline SVG (presentation attributes only, so the page's CSP holds). Pure:
numbers in, coordinates out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

#: The drawing's coordinate box; the SVG scales to its container's width.
WIDTH = 360
HEIGHT = 150
LEFT = 34  # room for the y-axis labels
BOTTOM = 18  # room for the x-axis labels
TOP = 8


class Minute(Protocol):
    """What the chart reads of one minute (relay_core.monitor.MinuteOutcomes)."""

    minute: datetime
    succeeded: int
    failed: int


@dataclass(frozen=True)
class Bar:
    """One minute: failed attempts at the bottom, succeeded ones stacked on top."""

    x: float
    width: float
    failed_y: float
    failed_height: float
    succeeded_y: float
    succeeded_height: float
    label: str


@dataclass(frozen=True)
class Chart:
    """Everything the SVG template draws."""

    width: int
    height: int
    left: int
    top: int
    bottom_y: float
    bars: list[Bar]
    peak: int
    peak_y: float
    mid: int
    mid_y: float
    first_label: str
    last_label: str

    @property
    def empty(self) -> bool:
        """Nothing finished in the window."""
        return self.peak == 0


def nice_ceiling(value: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... at or above ``value`` (axis tops read cleanly)."""
    if value <= 1:
        return 1
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return step * factor
        step *= 10


def throughput(minutes: Sequence[Minute]) -> Chart:
    """Bars for each minute, scaled to the busiest one."""
    plot_width = WIDTH - LEFT - 2
    plot_height = HEIGHT - TOP - BOTTOM
    bottom = float(TOP + plot_height)
    busiest = max((m.succeeded + m.failed for m in minutes), default=0)
    peak = nice_ceiling(busiest) if busiest else 0
    scale = plot_height / peak if peak else 0.0
    slot = plot_width / max(1, len(minutes))
    gap = min(1.0, slot / 4)
    bars = []
    for index, m in enumerate(minutes):
        failed_h = m.failed * scale
        succeeded_h = m.succeeded * scale
        bars.append(
            Bar(
                x=round(LEFT + index * slot + gap / 2, 2),
                width=round(slot - gap, 2),
                failed_y=round(bottom - failed_h, 2),
                failed_height=round(failed_h, 2),
                succeeded_y=round(bottom - failed_h - succeeded_h, 2),
                succeeded_height=round(succeeded_h, 2),
                label=f"{m.minute:%H:%M} UTC: {m.succeeded} succeeded, {m.failed} failed",
            )
        )
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        left=LEFT,
        top=TOP,
        bottom_y=bottom,
        bars=bars,
        peak=peak,
        peak_y=float(TOP),
        # Drawn where its whole-number label is: with an axis top of 5 the line halfway up is 2.5.
        mid=peak // 2,
        mid_y=round(bottom - (peak // 2) * scale, 2),
        first_label=f"{minutes[0].minute:%H:%M}" if minutes else "",
        last_label=f"{minutes[-1].minute:%H:%M} UTC" if minutes else "",
    )
