"""Backoff is a pure function: its delays are pinned here, nothing sleeps."""

from __future__ import annotations

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
