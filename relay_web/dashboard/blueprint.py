"""The dashboard's blueprint and the headers every dashboard answer carries.

Pages show job payloads and errors written by anyone who can enqueue a job,
so the Content-Security-Policy allows scripts and styles from this server's
``/static`` only: no inline script, no inline style, no other origin. htmx
needs none of those once its indicator styles are turned off (see the
``htmx-config`` meta tag in ``base.html``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, request
from flask.blueprints import BlueprintSetupState
from werkzeug.routing import BaseConverter

from relay_core import RelayError

from ..bodies import read_body
from ..records.common import BIGINT_MAX

bp = Blueprint("dashboard", __name__)


class JobNumber(BaseConverter):
    """A job id in a dashboard URL, spelled as the dashboard writes it; no other URL names a job.

    werkzeug's ``int`` converter also reads "022" and non-ASCII digits such as
    "٢٢", so a mistyped link would show, or act on, a real job.
    """

    regex = r"[1-9][0-9]*"

    def to_python(self, value: str) -> int:
        """The job id; one too long for a bigint reads as 0, which names no job, so the view answers 404."""
        return int(value) if len(value) <= len(str(BIGINT_MAX)) else 0

    def to_url(self, value: Any) -> str:
        """The id as digits."""
        return str(int(value))


bp.record_once(lambda state: state.app.url_map.converters.setdefault("job_number", JobNumber))

#: script-src 'self' forbids inline scripts and eval; style-src 'self' forbids
#: inline styles too, so markup injected into a page could not even restyle it.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ]
)


@bp.record_once
def _accept_form_csrf(state: BlueprintSetupState) -> None:
    # Forms carry the CSRF token as a hidden field, so they work before htmx
    # loads (and without it); htmx requests send the X-CSRF-TOKEN header too.
    # flask-jwt-extended has already set its default (False) by now. The API
    # reads tokens from headers only, so this changes nothing there.
    state.app.config["JWT_CSRF_CHECK_FORM"] = True


@bp.before_request
def _whole_form() -> None:
    # werkzeug parses a url-encoded form sent without Content-Length (chunked)
    # from as much as the size limit lets it read, and says nothing of the
    # rest; read it whole first, or refuse it with 413, so the form that is
    # acted on is the one that was sent. (Multipart forms already get a 413.)
    if request.content_length is None and request.mimetype == "application/x-www-form-urlencoded":
        read_body()


@bp.before_request
def _each_field_once() -> None:
    # Every dashboard form sends each field once; a repeated one (Requeue all with two
    # types) was acted on by its first value, and the answer named that one alone.
    if request.method == "POST":
        for name, values in request.form.lists():
            if len(values) > 1:
                raise RelayError(f"the form field {name[:40]!r} is given more than once; give it once")


@bp.after_request
def page_headers(response: Response) -> Response:
    """CSP, no framing, no caching of job data, and partials kept apart from pages in caches."""
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    response.vary.add("HX-Request")
    return response
