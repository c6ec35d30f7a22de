"""Log in and out of the dashboard, with the API's users, throttle and password hashing."""

from __future__ import annotations

import psycopg
from flask import Response, redirect, request, url_for

from relay_core import users

from .. import auth
from ..db import connection, get_database
from ..problems import Problem
from . import session
from .blueprint import bp
from .errors import RETRY_SECONDS, UNREACHABLE
from .render import page

#: What the login form says to someone sent to it by a button pressed after their session ended.
UNDONE = "Your session had ended, so what you pressed was not done. Log in, then press it again."

#: What the login form says when the database cannot be reached to check a password.
NO_DATABASE = "Relay cannot reach its database right now, so nobody can log in. Try again in a moment."
#: ... and when it refuses writes (a login records itself): read-only, as during a failover.
NO_WRITES = "Relay's database refuses writes right now (a failover?), so nobody can log in. Try again in a moment."


def _form(error: str | None = None, status: int = 200, username: str = "") -> Response:
    next_url = session.safe_next(request.values.get("next"))
    notice = UNDONE if request.method == "GET" and request.args.get("undone") else None
    return page("login", whole=True, status=status, error=error, notice=notice, username=username, next_url=next_url)


@bp.get("/login")
def login() -> Response:
    """The login form."""
    return _form()


@bp.post("/login")
def login_submit() -> Response:
    """Check the password (throttled like the API's login) and set the session cookie."""
    if not session.same_origin():
        raise Problem(403, "Forbidden", "This login form was not sent from this dashboard.", slug="csrf")
    username = request.form.get("username", "")[:200]
    password = request.form.get("password", "")
    if "\x00" in username + password:
        # As POST /api/auth/login refuses it: PostgreSQL text (the throttle's
        # key) cannot hold NUL, and no password can contain one.
        error = "Username and password must not contain NUL characters."
        return _form(error, 422, username.replace("\x00", ""))
    try:
        with connection() as conn:
            user = auth.log_in(conn, username, password)
    except UNREACHABLE as exc:
        # The form again, with the name typed kept: the error page's reload sent the form again.
        get_database().unavailable(request.path, exc)
        refusing_writes = isinstance(exc, psycopg.errors.ReadOnlySqlTransaction)
        response = _form(NO_WRITES if refusing_writes else NO_DATABASE, 503, username)
        response.headers["Retry-After"] = str(RETRY_SECONDS)
        return response
    except users.LoginThrottled as throttled:
        response = _form(f"Too many attempts; try again in {throttled.wait} seconds.", 429, username)
        response.headers["Retry-After"] = str(throttled.wait)
        return response
    if user is None:
        return _form("Wrong username or password.", 401, username)
    response = redirect(session.safe_next(request.form.get("next")) or url_for("dashboard.overview"), code=303)
    session.start(response, user)
    return response


@bp.post("/logout")
@session.require("viewer")
def logout() -> Response:
    """End the session (a POST with the CSRF token, so no other site can log you out)."""
    target = url_for("dashboard.login")
    response = redirect(target, code=303)
    if request.headers.get("HX-Request"):
        response = Response("", status=204)
        response.headers["HX-Redirect"] = target
    session.end(response)
    return response
