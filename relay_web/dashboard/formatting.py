"""Template filters: ages, durations, first lines, pretty JSON.

Pure functions of their arguments (the current time is passed in or read
once per call) so they are tested without an app. Display only: no decision
about what runs is made with the app's clock.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup

#: Characters of a first line shown in a listing row (CSS clips it further on phones).
FIRST_LINE_CHARS = 160


def now() -> datetime:
    """The time pages are rendered at."""
    return datetime.now(UTC)


def span(seconds: float | None) -> str:
    """A short human duration: ``42s``, ``3m 5s``, ``2h 10m``, ``4d 3h``."""
    if seconds is None:
        return "—"
    seconds = max(0.0, float(seconds))
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h" if hours else f"{days}d"


def window(seconds: float) -> str:
    """A rate limit's window, exactly: ``1.5s``, ``1h 1s``, ``30d`` (``span`` rounds, and a limit's window is exact)."""
    rest = round(float(seconds) * 1000)  # to the millisecond, a window's finest grain
    if rest < 1000:
        return f"{rest}ms"
    parts = []
    for size, unit in ((86_400_000, "d"), (3_600_000, "h"), (60_000, "m")):
        whole, rest = divmod(rest, size)
        if whole:
            parts.append(f"{whole}{unit}")
    if rest:
        parts.append(f"{rest / 1000:g}s")
    return " ".join(parts)


def ago(moment: datetime | None, at: datetime | None = None) -> str:
    """``3m ago``, or ``in 3m`` for a moment still to come."""
    if moment is None:
        return "—"
    delta = ((at or now()) - moment).total_seconds()
    if -1 < delta < 1:
        return "now"
    return f"{span(delta)} ago" if delta > 0 else f"in {span(-delta)}"


def between(start: datetime | None, end: datetime | None) -> str:
    """The duration from ``start`` to ``end``, when both are known."""
    if start is None or end is None:
        return "—"
    return span((end - start).total_seconds())


def stamp(moment: datetime | None) -> str:
    """A full UTC timestamp, for the title of an age."""
    if moment is None:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(moment: datetime | None) -> str:
    """The ISO 8601 form, for <time datetime>."""
    return moment.isoformat() if moment else ""


def first_line(text: str | None, limit: int = FIRST_LINE_CHARS) -> str:
    """The first non-empty line of an error, cut to ``limit`` characters."""
    if not text:
        return ""
    for line in text.splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


def pretty_json(value: Any) -> str:
    """Indented JSON, non-ASCII kept readable; escaping is the template's job."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def as_text(value: Any) -> str:
    """Text as it is; any other JSON value (a program writing with SQL may store one) as compact JSON.

    ``str()`` showed Python's spelling of it: ``{'x': [1]}``, ``True``, ``None``.
    """
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def number(value: int | float | None) -> str:
    """``12,345``."""
    if value is None:
        return "—"
    return f"{value:,}"


def percent(value: float | None) -> str:
    """A rate as ``2.5%``; ``—`` when undefined."""
    if value is None:
        return "—"
    return f"{value * 100:.1f}%"


def progress_percent(value: int | float) -> float:
    """A handler's reported percent, between 0 and 100.

    Job.progress() clamps what it sends, but a program writing with SQL can
    store any JSON number: one too large for a float failed the job's page.
    """
    try:
        number = float(value)
    except OverflowError:
        number = 100.0 if value > 0 else 0.0
    return max(0.0, min(100.0, number))


#: Unicode's explicit direction controls (embeddings, overrides, isolates), each shown as its code point.
DIRECTION_CONTROLS = {code: f"[U+{code:04X}]" for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


class Verbatim(str):
    """Text a page sends back as it is (a form's value): ``direction_controls_shown`` leaves it alone."""


def verbatim(value: Any) -> Verbatim:
    """The ``verbatim`` filter: ``value="{{ g.type|verbatim }}"`` for a value the server must get back unchanged.

    Written out, a job type holding a direction control came back from the
    dead page's "Requeue all" as another type, and requeued nothing.
    """
    return Verbatim("" if value is None else value)


def direction_controls_shown(value: Any) -> Any:
    """``value`` with every direction control written out, for every ``{{ ... }}`` of the dashboard.

    Escaping makes a job's text inert but leaves the order it is drawn in to
    the text: a right-to-left override in an error showed "gnp.exe" as
    "exe.png" and reordered the payload's punctuation around it. Jinja calls
    this on each expression's value before escaping it (``finalize``); text
    already marked safe stays safe, as what replaces a control is plain text,
    and a form's value marked ``verbatim`` is sent back as it came.
    """
    if not isinstance(value, str) or isinstance(value, Verbatim) or value.isascii():
        return value
    shown = value.translate(DIRECTION_CONTROLS)
    return Markup(shown) if isinstance(value, Markup) else shown


FILTERS = {
    "span": span,
    "window": window,
    "ago": ago,
    "between": between,
    "stamp": stamp,
    "iso": iso,
    "first_line": first_line,
    "pretty_json": pretty_json,
    "as_text": as_text,
    "number": number,
    "percent": percent,
    "progress_percent": progress_percent,
    "verbatim": verbatim,
}
