"""Posting an event to a partner's webhook with a real HTTP client (``urllib``).

A partner's endpoint is the classic flaky dependency: it times out, answers
503 while it deploys, rate-limits. Those are worth retrying, with growing
gaps so a struggling partner is not hammered. A 4xx other than 408 and 429
means the request itself is wrong and will never succeed, so it is reported
as permanent and the job goes straight to dead.

Every delivery carries an ``Idempotency-Key`` header that is the same on every
attempt: Relay delivers at least once, so the receiver must be able to
recognise a repeat.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

RETRYABLE_CLIENT_ERRORS = {408, 429}


class DeliveryFailed(Exception):
    """The endpoint did not take the event this time; worth another attempt."""


class DeliveryRefused(Exception):
    """The endpoint refused the event for good (a 4xx): retrying cannot help."""


def post_event(url: str, event: dict[str, Any], *, idempotency_key: str, timeout: float = 5.0) -> int:
    """POST ``event`` as JSON to ``url``; return the HTTP status of a 2xx answer."""
    request = urllib.request.Request(
        url,
        data=json.dumps(event).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": idempotency_key,
            "User-Agent": "relay-shop/1.0",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        detail = exc.read(200).decode("utf-8", "replace").strip()
        message = f"POST {url} answered {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
        if 400 <= exc.code < 500 and exc.code not in RETRYABLE_CLIENT_ERRORS:
            raise DeliveryRefused(message) from None
        raise DeliveryFailed(message) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DeliveryFailed(f"POST {url} failed: {reason}") from None
