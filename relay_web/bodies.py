"""Request bodies read whole, or refused as too large: never cut short."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge


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


def repeated_keys(raw: bytes) -> tuple[list[str], list[str]]:
    """The keys a JSON document repeats within one object: (in the top-level object, in nested ones).

    The JSON parser keeps the last of two equal keys, so ``{"action": "requeue",
    "action": "cancel"}`` cancels, while a proxy or audit log in between may
    read the first. Call it on a body already parsed once: what it cannot read
    again counts as nothing repeated.
    """
    seen: list[list[str]] = []  # per object, innermost first; the top level comes last

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        counts = Counter(key for key, _ in items)
        seen.append(sorted(key for key, n in counts.items() if n > 1) if len(counts) < len(items) else [])
        return dict(items)

    try:
        top = json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return [], []
    if not seen:
        return [], []
    top_level = seen.pop() if isinstance(top, dict) else []
    return top_level, sorted({key for keys in seen for key in keys})
