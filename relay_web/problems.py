"""RFC 9457 problem details: the one shape of every error the app sends.

Views raise :class:`Problem`; error handlers turn everything else into one.
A problem carries only what the client should read: no stack trace, no SQL,
no Python class name. ``type`` is a URN naming the kind of problem (documented
in docs/api.md); ``about:blank`` means "nothing more than the HTTP status".
"""

from __future__ import annotations

from typing import Any

from flask import Response, json, request

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:relay:problem:"


def problem_type(slug: str) -> str:
    """The ``type`` URI of a Relay problem kind."""
    return TYPE_PREFIX + slug


class Problem(Exception):
    """An error response waiting to be sent."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        slug: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.type = problem_type(slug) if slug else "about:blank"
        self.errors = errors
        self.headers = headers or {}
        self.extensions = extensions

    def body(self) -> dict[str, Any]:
        """The JSON members, in the order RFC 9457 lists them."""
        body: dict[str, Any] = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": request.path if request else None,
        }
        if self.errors is not None:
            body["errors"] = self.errors
        body.update(self.extensions)
        return body

    def response(self) -> Response:
        """The Flask response of this problem."""
        response = Response(json.dumps(self.body()), status=self.status, mimetype=MEDIA_TYPE)
        for name, value in self.headers.items():
            response.headers[name] = value
        return response


def validation_problem(errors: list[dict[str, Any]]) -> Problem:
    """422 with one entry per bad field."""
    names = ", ".join(sorted({str(e["field"]) for e in errors})) or "the request"
    return Problem(
        422,
        "Invalid request",
        f"Fix these fields and try again: {names}.",
        slug="validation",
        errors=errors,
    )


def unauthorized(detail: str, *, slug: str = "unauthorized", invalid_token: bool = False) -> Problem:
    """401 with the WWW-Authenticate challenge RFC 6750 asks for."""
    challenge = 'Bearer realm="relay"'
    if invalid_token:
        challenge += ', error="invalid_token"'
    return Problem(401, "Unauthorized", detail, slug=slug, headers={"WWW-Authenticate": challenge})
