"""Request bodies read whole, or refused as too large: never cut short."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge

from relay_core.jsonb import float_changes


def read_body() -> bytes:
    """The request's body, cached for ``request.form``; RequestEntityTooLarge past MAX_CONTENT_LENGTH."""
    raw = request.get_data(cache=True)
    limit = request.max_content_length
    # A body without Content-Length (chunked) is read only up to the limit, and
    # werkzeug returns what it read without a word: one more byte means the
    # body was longer, a 413, not a document cut short (and maybe still valid).
    if request.content_length is None and limit is not None and len(raw) >= limit and request.input_stream.read(1):
        raise RequestEntityTooLarge()
    return raw


@dataclass(frozen=True)
class BodyScan:
    """What a second reading of a JSON body finds that the records cannot see."""

    #: Keys the top-level object gives twice.
    repeated: list[str] = field(default_factory=list)
    #: Keys some nested object gives twice.
    repeated_nested: list[str] = field(default_factory=list)
    #: Numbers, as written, that a float does not hold: read as one, they would change.
    inexact: list[str] = field(default_factory=list)


def scan_body(raw: bytes) -> BodyScan:
    """Read a JSON body again for what parsing into records hides.

    Repeated keys: the JSON parser keeps the last of two equal keys, so
    ``{"action": "requeue", "action": "cancel"}`` cancels, while a proxy or
    audit log in between may read the first.

    Inexact numbers: a fraction or exponent is read as a float, so ``1e-400``
    was stored as 0.0 and ``12345678901234567.5`` as ``12345678901234568``,
    though jsonb holds both exactly. A number whose value a float keeps (``0.1``
    and ``2.50`` do: written back, they are the same number) passes.

    Call it on a body already parsed once: what it cannot read again counts as
    nothing found.
    """
    seen: list[list[str]] = []  # per object, innermost first; the top level comes last
    inexact: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        counts = Counter(key for key, _ in items)
        seen.append(sorted(key for key, n in counts.items() if n > 1) if len(counts) < len(items) else [])
        return dict(items)

    def number(text: str) -> float:
        value = float(text)
        if math.isfinite(value) and float_changes(text, value):
            inexact.append(text)
        return value

    try:
        top = json.loads(raw, object_pairs_hook=pairs, parse_float=number)
    except (ValueError, RecursionError):
        return BodyScan()
    top_level = seen.pop() if seen and isinstance(top, dict) else []
    return BodyScan(top_level, sorted({key for keys in seen for key in keys}), inexact)
