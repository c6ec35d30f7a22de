"""Retry delays: a pure function, so tests pin the numbers without sleeping."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


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
