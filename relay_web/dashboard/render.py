"""Full pages for browsers, partials for htmx.

Every page template includes its partial (``_name.html``); an htmx request
gets the partial alone, so polling and in-place actions reuse the markup of
the page instead of a second copy of it. A history restore asks for the full
page even though it comes from htmx.
"""

from __future__ import annotations

import json
from typing import Any

from flask import (
    Response,
    flash,
    get_flashed_messages,
    make_response,
    redirect,
    render_template,
    request,
    url_for,
)

from .session import current

#: htmx settings, read from a meta tag (no inline script needed). Indicator
#: styles would be an inline <style>, eval and script tags are never wanted,
#: and no snapshot of a page full of job data goes into localStorage. Error
#: answers carry a readable partial, so 4xx/5xx bodies are swapped in too.
HTMX_CONFIG = {
    "includeIndicatorStyles": False,
    "allowEval": False,
    "allowScriptTags": False,
    "historyCacheSize": 0,
    "selfRequestsOnly": True,
    "responseHandling": [
        {"code": "204", "swap": False},
        {"code": "[23]..", "swap": True},
        {"code": "[45]..", "swap": True, "error": True},
    ],
}


def is_htmx() -> bool:
    """Whether the request wants a fragment (htmx, and not restoring history)."""
    return bool(request.headers.get("HX-Request")) and not request.headers.get("HX-History-Restore-Request")


def page(
    template: str, *, partial: str | None = None, status: int = 200, whole: bool = False, **context: Any
) -> Response:
    """Render ``dashboard/<template>.html``, or for htmx its partial (``_<template>.html`` unless named).

    ``whole``: a page with no partial (the login form), rendered whole even for htmx.
    """
    name = f"dashboard/_{partial or template}.html" if is_htmx() and not whole else f"dashboard/{template}.html"
    session = current()
    body = render_template(
        name,
        me=session,
        csrf_token=session.csrf if session else "",
        csrf_headers=json.dumps({"X-CSRF-TOKEN": session.csrf}) if session else "{}",
        htmx_config=json.dumps(HTMX_CONFIG, separators=(",", ":")),
        **context,
    )
    return make_response(body, status)


def answer_plain_form(notice: str, endpoint: str, **values: Any) -> Response:
    """A plain form's POST (no htmx): keep ``notice`` for the page it is redirected to (303).

    The redirect keeps a reload from sending the action again; the message
    rides in Flask's session cookie until that page shows it (``kept_notice``).
    """
    flash(notice)
    return redirect(url_for(endpoint, **values), code=303)


def kept_notice() -> str | None:
    """The message a plain form's action left for this page, shown once; None for htmx requests."""
    if is_htmx():
        return None
    messages = get_flashed_messages()
    return messages[-1] if messages else None
