"""Whether a value is a number Relay can compute with: real, finite, and not a bool."""

from __future__ import annotations

import math
import numbers


def finite_real(value: object) -> bool:
    """A real number (int, float, or another ``numbers.Real``) that a float holds finitely.

    A bool is an int to Python but never a number a caller meant; NaN and
    infinity compare as no bound expects; and ``math.isfinite(10**400)``
    raises OverflowError rather than answering, so such an int is no number here.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
