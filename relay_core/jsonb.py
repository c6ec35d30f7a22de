"""How Relay reads jsonb: every number PostgreSQL can store, however long.

Python refuses to read an integer of more than 4,300 digits from text
(``sys.get_int_max_str_digits``, a guard against slow conversions), and
jsonb writes a number such as ``1e5000`` out in full. psycopg's default
loader then raised ValueError on the row: a worker whose claim returned such
a job (one inserted with SQL, by another program) lost its producer thread,
and every worker that claimed the job after it went the same way. Relay's
connections read such an integer as a ``decimal.Decimal`` instead: exact,
and nothing else changes, since only a document that fails is read again.

jsonb holds fractions past a float's range too: read as floats, ``1e400``
with a fraction became ``inf`` (which the admin API then wrote as the bare
token ``Infinity``, which no strict JSON parser reads) and ``1e-400`` became
0.0. Such a number is read as a Decimal too. A fraction within the range is
read as the nearest float, as JSON parsers do: ``avg()`` in SQL writes 16 or
more digits, and handlers do float arithmetic with what it gives them.

PostgreSQL also stores documents nested deeper than Python's parser reads (it
recurses once per level, up to the interpreter's recursion limit): reading
one raised RecursionError out of the claim, after it had committed, and the
worker stopped with that job and every job claimed beside it held. Such a
document is read as an :class:`UnreadableJson` that says why; a worker fails
that job alone, as dead, and the admin surface shows the reason.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import psycopg
from psycopg.types.json import set_json_loads

#: The longest integer text Python reads by default (sys.get_int_max_str_digits()).
INT_MAX_STR_DIGITS = 4300


@dataclass(frozen=True, slots=True)
class UnreadableJson:
    """A json or jsonb value Python cannot read; ``reason`` says why."""

    reason: str

    def __str__(self) -> str:
        return f"(unreadable JSON: {self.reason})"


def _too_deep(data: str | bytes) -> UnreadableJson:
    return UnreadableJson(
        f"{len(data):,} characters nested deeper than Python reads (its recursion limit is {sys.getrecursionlimit()})"
    )


def _itself(unreadable: UnreadableJson) -> UnreadableJson:
    return unreadable


def _integer(digits: str, exact: Callable[[str], Any]) -> Any:
    return int(digits) if len(digits.lstrip("-")) <= INT_MAX_STR_DIGITS else exact(digits)


def _fraction(text: str, exact: Callable[[str], Any]) -> Any:
    value = float(text)
    if 0.0 < abs(value) < math.inf:
        return value
    # 0.0 is exact unless a digit other than 0 was read as it (underflow); inf never is.
    if value == 0.0 and not text.lstrip("-0.")[:1].isdigit():
        return value
    try:
        return exact(text)
    except InvalidOperation:  # an exponent past Decimal's (only json, not jsonb, holds one)
        return value


@functools.cache
def _decoders(exact: Callable[[str], Any]) -> tuple[json.JSONDecoder, json.JSONDecoder]:
    """Decoders reading fractions past a float's range with ``exact``; the second
    reads integers too long for ``int`` with it as well (see ``loads``)."""
    fraction = functools.partial(_fraction, exact=exact)
    return (
        json.JSONDecoder(parse_float=fraction),
        json.JSONDecoder(parse_float=fraction, parse_int=functools.partial(_integer, exact=exact)),
    )


def loads(
    data: str | bytes,
    exact: Callable[[str], Any] = Decimal,
    too_deep: Callable[[UnreadableJson], Any] = _itself,
) -> Any:
    """``json.loads``, reading a number that ``int`` refuses or that is past a float's range with
    ``exact`` (as Decimal, by default), and a document nested too deeply as ``too_deep`` of its
    :class:`UnreadableJson` (that itself, by default).

    Integers are read by ``int`` unless one is too long: only a document
    that fails so is read again, with the slower check on every integer.
    """
    # PostgreSQL sends UTF-8 (json.loads also guesses UTF-16 and UTF-32, which it never sends).
    text = data if isinstance(data, str) else bytes(data).decode("utf-8", "surrogatepass")
    plain, long_integers = _decoders(exact)
    try:
        try:
            return plain.decode(text)
        except ValueError as exc:
            if "integer string conversion" not in str(exc):
                raise
            return long_integers.decode(text)
    except RecursionError:
        return too_deep(_too_deep(data))


def float_changes(text: str, value: float) -> bool:
    """Whether the JSON number ``text``, read as the finite float ``value``, is a different number.

    Read as a float, ``1e-400`` is 0.0 and ``12345678901234567.5`` is
    ``12345678901234568``, though jsonb holds both exactly; ``0.1`` and ``2.50``
    are the number they say (written back, the float reads the same). An
    exponent past what Decimal reads (``0e99999999999999999999``) leaves a
    float of 0.0, exact only when every digit before it is zero.
    """
    try:
        return Decimal(repr(value)) != Decimal(text)
    except InvalidOperation:
        mantissa = text.lower().partition("e")[0]
        return value != 0.0 or any(digit in "123456789" for digit in mantissa)


def read_any_number(conn: psycopg.Connection[Any], *, as_text: bool = False) -> None:
    """Make ``conn`` read json and jsonb with :func:`loads`.

    ``as_text``: such a number is read as its digits in a string, and a
    document nested too deeply as a string saying so, for display (the admin
    API's records and the dashboard hold only JSON's own types), instead of
    as a Decimal and an :class:`UnreadableJson`.
    """
    set_json_loads(functools.partial(loads, exact=str, too_deep=str) if as_text else loads, conn)
