"""Request bodies read whole, or refused as too large: never cut short."""

from __future__ import annotations

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
