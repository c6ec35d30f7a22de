"""Backoff is a pure function: its delays are pinned here, nothing sleeps."""

from __future__ import annotations

import math

import pytest

from relay_core import Backoff


def test_default_delays_double_from_two_seconds_without_jitter() -> None:
    backoff = Backoff()
    assert [backoff.delay(n, rand=lambda: 0.5) for n in range(1, 7)] == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0]


def test_delay_is_capped() -> None:
    backoff = Backoff(base=1, factor=10, cap=300, jitter=0)
    assert [backoff.delay(n) for n in (1, 2, 3, 4, 5, 200)] == [1, 10, 100, 300, 300, 300]


def test_jitter_spreads_within_its_fraction() -> None:
    backoff = Backoff(base=10, factor=2, cap=1000, jitter=0.1)
    assert backoff.delay(1, rand=lambda: 0.0) == pytest.approx(9.0)
    assert backoff.delay(1, rand=lambda: 0.999999) == pytest.approx(11.0, rel=1e-5)
    assert backoff.delay(3, rand=lambda: 0.25) == pytest.approx(40 - 2.0)


def test_attempt_must_be_positive() -> None:
    with pytest.raises(ValueError, match="attempt must be >= 1"):
        Backoff().delay(0)


def test_huge_attempt_numbers_stay_finite() -> None:
    assert Backoff(cap=60, jitter=0).delay(10_000) == 60


class NaNWhenRead(float):
    """A number of a handler's own class: finite as stored, NaN through its ``__float__``."""

    def __float__(self) -> float:
        return float("nan")


class GivesNaNWhenRead(Backoff):
    def delay(self, attempt: int, rand: object = None) -> float:  # type: ignore[override]
        return NaNWhenRead(5.0)


def test_a_delay_that_reads_as_nan_is_refused_and_the_default_backoff_used() -> None:
    """It passed the check as stored, then was read through its __float__: a NaN run_at made the database
    refuse the failure, and the failure was lost."""
    from relay_core.backoff import DEFAULT_BACKOFF, as_delay, retry_delay

    assert as_delay(NaNWhenRead(5.0)) is None
    assert as_delay(5) == 5.0
    delay, problem = retry_delay(GivesNaNWhenRead(jitter=0), 1)
    assert math.isfinite(delay) and 0 <= delay <= DEFAULT_BACKOFF.cap
    assert problem is not None and "the default backoff was used" in problem
