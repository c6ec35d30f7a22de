"""``/api/auth``: log in, refresh an access token, and say who the token belongs to.

Every login attempt is counted in PostgreSQL against its username and its
client address before the password is checked (so parallel guesses cannot
slip past the limit, and every web process sees the same counts); a success
forgives its own attempt. Over the limit, the answer is 429 with Retry-After.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from relay_core import users

from .. import auth
from ..db import connection
from ..endpoint import endpoint
from ..problems import Problem, unauthorized
from ..records.ops import LoginBody, TokenRecord

bp = Blueprint("auth", __name__, url_prefix="/auth")


@bp.post("/login")
@endpoint(
    tag="auth",
    body=LoginBody,
    responses={200: TokenRecord},
    problems=(401, 429),
    response_headers={429: {"Retry-After": "Seconds until another attempt is allowed."}},
)
def login(body: LoginBody) -> TokenRecord:
    """Trade a username and password for an access token and a refresh token."""
    try:
        with connection() as conn:
            user = auth.log_in(conn, body.username, body.password)
    except users.LoginThrottled as throttled:
        wait = throttled.wait
        raise Problem(
            429,
            "Too many login attempts",
            f"Too many attempts for this username or from this address; try again in {wait} seconds.",
            slug="login-throttled",
            headers={"Retry-After": str(wait)},
            retry_after=wait,
        ) from None
    if user is None:
        raise unauthorized("Wrong username or password.", slug="login-failed")
    access, expires_in = auth.access_token(user)
    refresh, refresh_expires_in = auth.refresh_token(user)
    return TokenRecord(
        access_token=access,
        expires_in=expires_in,
        refresh_token=refresh,
        refresh_expires_in=refresh_expires_in,
        username=user.username,
        role=user.role,  # type: ignore[arg-type]
    )


@bp.post("/refresh")
@endpoint(tag="auth", refresh=True, responses={200: TokenRecord}, ignores_body=True)
def refresh(claims: dict[str, Any]) -> TokenRecord:
    """Trade a refresh token for a new access token, with the user's current role.

    Send the refresh token as ``Authorization: Bearer <refresh token>``. A
    user removed, or whose password changed, since login must log in again.
    """
    user = auth.token_holder(claims)
    access, expires_in = auth.access_token(user)
    return TokenRecord(access_token=access, expires_in=expires_in, username=user.username, role=user.role)  # type: ignore[arg-type]
