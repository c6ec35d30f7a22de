"""Retry delays: a pure function, so tests pin the numbers without sleeping."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, fields

from .finite import finite_real
from .names import shown, type_name

#: The longest delay before a job runs again (about a century). PostgreSQL
#: stores now() + 1e12 s (year 33715), but no Python datetime can hold it, so
#: the job's page and every listing that shows it would fail from then on.
MAX_DELAY_SECONDS = 36500 * 86400.0


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with a cap and proportional jitter.

    The delay before attempt ``n + 1`` (after ``n`` failed attempts) is
    ``min(cap, base * factor ** (n - 1))``, then moved by up to ``jitter`` of
    itself in either direction so that jobs which failed together do not all
    retry in the same instant.
    """

    base: float = 2.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        # A delay is at most cap * (1 + jitter): bounding both keeps every run_at readable.
        for field in fields(self):
            value = getattr(self, field.name)
            if not finite_real(value):
                raise ValueError(f"backoff {field.name} must be a finite number, got {value!r}")
            if value < 0:  # a negative base gave every retry at once; a negative factor, delays of either sign
                raise ValueError(f"backoff {field.name} must not be negative, got {value!r}")
        if not 0 <= self.cap <= MAX_DELAY_SECONDS / 2:
            raise ValueError(f"backoff cap must be between 0 and {MAX_DELAY_SECONDS / 2:.0f} seconds")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter must be between 0 and 1")

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based).

        ``rand`` returns a float in [0, 1); tests pass a constant.
        """
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        exponent = min(attempt - 1, 64)
        try:
            raw = min(self.cap, self.base * self.factor**exponent)
        except OverflowError:  # a large factor: the cap is reached long before
            raw = self.cap
        spread = raw * self.jitter * (2.0 * rand() - 1.0)
        return max(0.0, raw + spread)


DEFAULT_BACKOFF = Backoff()


def usable_delay(seconds: object) -> bool:
    """Whether ``seconds`` can put a job's next run that far ahead (a real number, 0 to MAX_DELAY_SECONDS)."""
    return finite_real(seconds) and 0 <= seconds <= MAX_DELAY_SECONDS  # type: ignore[operator]


def as_delay(value: object) -> float | None:
    """``value`` as a delay in seconds if it is a usable one (``usable_delay``) as a float too, else None.

    A handler's number may be of its own class: one that passed the check
    could still read as NaN through its ``__float__``, and the database then
    refused the failure, which was lost.
    """
    if not usable_delay(value):
        return None
    seconds = float(value)  # type: ignore[arg-type]
    return seconds if usable_delay(seconds) else None


def retry_delay(backoff: Backoff, attempt: int) -> tuple[float, str | None]:
    """The delay ``backoff`` gives after failed attempt ``attempt``, and None; or, when it raises or gives
    what no run_at can hold (NaN, negative, past a century), the default backoff's delay and why.

    A handler's own backoff is its code: raising there killed the slot thread with its job held
    forever, and a NaN delay had the database refuse the failure, which was then lost. Whatever
    it raises: a KeyboardInterrupt from it ended the lease watch's thread, and every timeout after.
    """
    try:
        # What it gives is its code too: telling whether it is a usable number, reading it as one
        # and showing it all run that code, and raising there stopped every timeout of the worker.
        given = backoff.delay(attempt)
        seconds = as_delay(given)
        if seconds is not None:
            return seconds, None
        problem = f"its backoff gave a delay of {shown(given)}, not 0 to {MAX_DELAY_SECONDS:.0f} seconds"
    except BaseException as exc:
        problem = f"its backoff raised {type_name(exc)}"  # its text is the backoff's code too: not read
    return DEFAULT_BACKOFF.delay(attempt), f"{problem}; the default backoff was used"
