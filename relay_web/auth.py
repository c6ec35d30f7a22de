"""JWT authentication and roles, on flask-jwt-extended.

Access tokens are short-lived, refresh tokens longer lived; both carry a mark
of the password they were issued under and are checked against the database
on every use, so deleting a user or changing their password ends their
sessions at once, and a role lowered holds from the next request. Only HS256
is accepted, so ``alg: none`` and algorithm-confusion tokens are refused.
Every failure is a 401 or 403 problem.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import psycopg
from flask import Flask, Response, current_app, request
from flask_jwt_extended import (
    JWTManager,
    create_access_token,
    create_refresh_token,
    get_jwt,
    verify_jwt_in_request,
)

from relay_core import users
from relay_core.users import User
from relay_core.validation import finite_real, positive_number

from .db import connection
from .problems import Problem, unauthorized

ROLES = ("viewer", "admin")

#: How far ahead of this server's clock a session's login time may be (another web process's clock).
LOGIN_CLOCK_LEEWAY_SECONDS = 60


def _missing(reason: str) -> Response:
    return unauthorized(
        "Send 'Authorization: Bearer <access token>'; get one from POST /api/auth/login.",
        slug="token-missing",
    ).response()


def invalid_token() -> Problem:
    """The 401 of a token that is malformed, of the wrong kind, or not signed by this server."""
    return unauthorized(
        "The token is malformed, of the wrong kind, or not signed by this server; log in again.",
        slug="token-invalid",
        invalid_token=True,
    )


def _invalid(reason: str) -> Response:
    return invalid_token().response()


def _expired(header: dict[str, Any], payload: dict[str, Any]) -> Response:
    what = "refresh" if payload.get("type") == "refresh" else "access"
    hint = "log in again" if what == "refresh" else "get a new one from POST /api/auth/refresh or log in again"
    return unauthorized(f"The {what} token has expired; {hint}.", slug="token-expired", invalid_token=True).response()


def session_id(csrf: str) -> str:
    """The name a dashboard session is recorded under when it ends: a digest of its CSRF value.

    Every token of one session (login, then each renewal) carries the same
    CSRF value, and the value itself is a secret the page must present.
    """
    return hashlib.sha256(csrf.encode()).hexdigest()


def is_session_token(claims: dict[str, Any]) -> bool:
    """Whether verified claims are a dashboard session's (API tokens carry no login time)."""
    return isinstance(claims.get("csrf"), str) and "auth_time" in claims


def login_time(claims: dict[str, Any]) -> float | None:
    """A dashboard session token's login time, or None when it is no past moment Relay writes.

    A NaN, an infinity or a login in the future would make a session that never ends.
    """
    began = claims.get("auth_time")
    if not finite_real(began) or began > time.time() + LOGIN_CLOCK_LEEWAY_SECONDS:
        return None
    return float(began)


def session_outlived(began: float) -> bool:
    """Whether a dashboard session that began at ``began`` began longer ago than a session may
    last (a refresh token's lifetime).

    Its tokens are renewed while it is used, but never past that: after it
    the person logs in again, whether the token comes as a cookie or as a
    bearer token.
    """
    return time.time() - began > int(current_app.config["RELAY_REFRESH_TOKEN_SECONDS"])


def session_ended(conn: psycopg.Connection, claims: dict[str, Any]) -> bool:
    """Whether a dashboard session's token belongs to a session that was logged out."""
    return users.session_ended(conn, session_id(claims["csrf"]))


def init_app(app: Flask) -> JWTManager:
    """Attach flask-jwt-extended with problem-shaped failures."""
    jwt = JWTManager(app)
    jwt.unauthorized_loader(_missing)
    jwt.invalid_token_loader(_invalid)
    jwt.expired_token_loader(_expired)
    jwt.revoked_token_loader(lambda header, payload: _invalid("revoked"))
    jwt.user_lookup_error_loader(lambda header, payload: _invalid("unknown user"))
    jwt.token_verification_failed_loader(lambda header, payload: _invalid("claims"))
    jwt.needs_fresh_token_loader(lambda header, payload: _invalid("not fresh"))
    return jwt


#: The Bearer scheme, however it is capitalised, at the start of an Authorization header.
_BEARER = re.compile(r"^\s*bearer(?=\s)", re.IGNORECASE)


class AnyCaseBearer:
    """WSGI middleware: ``bearer <token>`` and ``BEARER <token>`` are ``Bearer <token>``.

    HTTP's authentication schemes are case-insensitive (RFC 9110, 11.1), but
    flask-jwt-extended compares the scheme as written, and answered a client
    that wrote it in lower case that it sent no token.
    """

    def __init__(self, wsgi_app: Any) -> None:
        self.wsgi_app = wsgi_app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        header = environ.get("HTTP_AUTHORIZATION")
        if header and not header.startswith("Bearer "):
            environ["HTTP_AUTHORIZATION"] = _BEARER.sub("Bearer", header, count=1)
        return self.wsgi_app(environ, start_response)


def require(role: str) -> dict[str, Any]:
    """The claims of the request's access token, if its role is at least ``role``.

    Raises a 401 problem without a valid token and a 403 problem for a
    viewer where an admin is needed.
    """
    verify_jwt_in_request(locations=["headers"])
    claims = get_jwt()
    # A dashboard cookie's token sent as a bearer token is checked as the dashboard checks it, so a
    # logout, a deleted user, a changed password or role takes effect at once. An API access token
    # too: a user removed, demoted or whose password changed lost what the token says at once, not
    # one token lifetime (up to a year) later.
    user = session_holder(claims) if is_session_token(claims) else token_holder(claims)
    held = user.role
    if held not in ROLES:
        raise unauthorized("The token carries no role Relay knows; log in again.", slug="token-invalid")
    if ROLES.index(held) < ROLES.index(role):
        raise Problem(
            403,
            "Forbidden",
            f"This needs the {role} role; you are a {held}. Ask an admin to act, or to change your role.",
            slug="forbidden",
        )
    return claims


def session_user(claims: dict[str, Any]) -> User | None:
    """The user of a dashboard session's token as stored now; None once the session no longer holds
    (see :func:`session_holder`)."""
    try:
        return session_holder(claims)
    except Problem as refused:
        if refused.status != 401:
            raise
        return None


def session_holder(claims: dict[str, Any]) -> User:
    """The user of a dashboard session's token as stored now, while the session holds.

    It no longer holds after a logout, past its longest lifetime, once the
    user is deleted, or once their password changed: a 401 problem saying the
    session ended (one saying the token is invalid for a token that names no
    user or login time Relay writes). The dashboard reads it on every request,
    and so does the API for such a token sent as a bearer token, so both act
    with the current role.
    """
    account, began = user_id(claims), login_time(claims)
    if account is None or began is None:
        raise invalid_token()
    if session_outlived(began):
        raise ended_session("it began longer ago than a session may last")
    with connection() as conn:
        # The logout check shares the user's read: one pooled connection per request.
        if session_ended(conn, claims):
            raise ended_session("logged out")
        user = users.get_user(conn, account)
    if user is None or claims.get("pwd") != session_mark(user):
        raise ended_session("the user was removed or changed password")
    return user


def ended_session(why: str) -> Problem:
    """The 401 of a token whose session ended (``why``): valid, but no longer honoured."""
    return unauthorized(f"This session has ended ({why}); log in again.", slug="session-ended", invalid_token=True)


def token_holder(claims: dict[str, Any]) -> User:
    """The user an API token (access or refresh) names, as stored now, while the password it was issued under holds.

    Raises a 401 problem for a subject that is no user id Relay writes, and
    one saying the session ended once the user was removed or their password
    changed (a token issued before access tokens carried the mark ends too).
    """
    account = user_id(claims)
    if account is None:
        raise invalid_token()
    with connection() as conn:
        user = users.get_user(conn, account)
    if user is None or claims.get("pwd") != session_mark(user):
        raise ended_session("the user was removed or changed password")
    return user


def refresh_claims() -> dict[str, Any]:
    """The claims of the request's refresh token (401 problem without a valid one)."""
    verify_jwt_in_request(refresh=True, locations=["headers"])
    return get_jwt()


def user_id(claims: dict[str, Any]) -> int | None:
    """The user id a verified token names, or None when its subject is not an id Relay writes."""
    subject = claims.get("sub")
    return positive_number(subject) if isinstance(subject, str) else None


def session_mark(user: User) -> str:
    """What a refresh token remembers of the password it was issued under."""
    return user.password_changed_at.isoformat()


def access_token(user: User) -> tuple[str, int]:
    """A new access token for ``user`` and its lifetime in seconds."""
    claims = {"role": user.role, "username": user.username, "pwd": session_mark(user)}
    token = create_access_token(identity=str(user.id), additional_claims=claims)
    return token, int(current_app.config["JWT_ACCESS_TOKEN_EXPIRES"].total_seconds())


def refresh_token(user: User) -> tuple[str, int]:
    """A new refresh token for ``user`` and its lifetime in seconds."""
    token = create_refresh_token(identity=str(user.id), additional_claims={"pwd": session_mark(user)})
    return token, int(current_app.config["JWT_REFRESH_TOKEN_EXPIRES"].total_seconds())


def login_policy() -> users.ThrottlePolicy:
    """The failed-login throttle the API and the dashboard share, from the app's settings."""
    config = current_app.config
    return users.ThrottlePolicy(
        window_seconds=config["RELAY_LOGIN_WINDOW_SECONDS"],
        max_per_user=config["RELAY_LOGIN_MAX_FAILURES"],
        max_per_address=config["RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS"],
    )


def password_hasher() -> Any:
    """The Argon2id hasher the API and the dashboard share (None settings use Relay's defaults)."""
    config = current_app.config
    return users.make_hasher(
        config["RELAY_ARGON2_TIME_COST"] or None,
        config["RELAY_ARGON2_MEMORY_COST"] or None,
        config["RELAY_ARGON2_PARALLELISM"] or None,
    )


def log_in(conn: psycopg.Connection, username: str, password: str) -> User | None:
    """``users.log_in`` with this app's throttle and hasher, for the client ``request.remote_addr`` names."""
    return users.log_in(conn, login_policy(), username, password, request.remote_addr, hasher=password_hasher())
