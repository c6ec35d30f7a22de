"""Dashboard sessions: the same users and roles as the API, the JWT in a cookie.

The token lives in an HttpOnly cookie (Secure over HTTPS or in production,
SameSite=Lax unless ``JWT_COOKIE_SAMESITE`` says Strict) that page scripts
cannot read. Every state-changing request must also carry the token's CSRF
value, which the page holds in a meta tag and sends as the ``X-CSRF-TOKEN``
header (htmx) or a hidden ``csrf_token`` field (plain forms); a cross-site
form has the cookie withheld and cannot know the value.

Lax rather than Strict: an on-call engineer opens links pasted into chat,
and Strict would drop the cookie on that first navigation and show the login
page to someone already logged in. Lax still withholds it from cross-site
POSTs, and nothing here changes state over GET.

Tokens are short-lived like the API's access tokens, and slide: a request
made once a token is a minute old (a tenth of its life, if that is shorter)
gets a fresh cookie with the same CSRF value, until the refresh-token
lifetime since login runs out. So a session ends about an access token's
lifetime after its last request; renewed only past half its life, as it
once was, an idle session could end after half of it. Each request also
reads the user from the database, so a deleted user, a changed password or
a changed role takes effect at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import jwt
from flask import Response, after_this_request, current_app, g, redirect, request, url_for
from flask_jwt_extended import create_access_token, get_jwt, verify_jwt_in_request
from flask_jwt_extended.exceptions import CSRFError, JWTExtendedException

from relay_core import users

from .. import auth
from ..db import connection
from ..problems import Problem

F = TypeVar("F", bound=Callable[..., Any])

#: Claims only a dashboard session carries (an API token in the cookie is refused).
SESSION_CLAIMS = ("pwd", "auth_time")


@dataclass(frozen=True)
class Session:
    """Who is looking at the dashboard, with their current role and the page's CSRF value."""

    user: users.User
    csrf: str

    @property
    def is_admin(self) -> bool:
        """Admins see and may use the action buttons."""
        return self.user.is_admin


def _lifetimes() -> tuple[int, int]:
    config = current_app.config
    return int(config["RELAY_ACCESS_TOKEN_SECONDS"]), int(config["RELAY_REFRESH_TOKEN_SECONDS"])


def _token(user: users.User, *, csrf: str | None = None, auth_time: int | None = None) -> str:
    access, longest = _lifetimes()
    now = int(time.time())
    began = auth_time or now
    claims: dict[str, Any] = {
        "role": user.role,
        "username": user.username,
        "pwd": auth.session_mark(user),
        "auth_time": began,
    }
    if csrf:
        claims["csrf"] = csrf
    # A renewed token expires when the session must end, not a full access lifetime later.
    lifetime = timedelta(seconds=max(1, min(access, began + longest - now)))
    return create_access_token(identity=str(user.id), additional_claims=claims, expires_delta=lifetime)


def _set_cookie(response: Response, token: str) -> None:
    config = current_app.config
    access, _ = _lifetimes()
    response.set_cookie(
        config.get("JWT_ACCESS_COOKIE_NAME", "access_token_cookie"),
        token,
        max_age=access,
        path=config.get("JWT_ACCESS_COOKIE_PATH", "/"),
        secure=bool(config.get("JWT_COOKIE_SECURE")) or request.is_secure,
        httponly=True,
        samesite=config["JWT_COOKIE_SAMESITE"],
    )


def start(response: Response, user: users.User) -> None:
    """Log ``user`` in on ``response``."""
    _set_cookie(response, _token(user))


def end(response: Response) -> None:
    """Log out on ``response``: the session's tokens are refused from now on, and the cookie is removed.

    Removing the cookie alone would end the session only in this browser; a
    copy of the cookie would keep working until the session ran out.
    """
    claims = get_jwt()
    _, longest = _lifetimes()
    expires_at = datetime.fromtimestamp(float(claims["auth_time"]) + longest, UTC)
    with connection() as conn:
        users.end_session(conn, auth.session_id(str(claims["csrf"])), expires_at)
    g.relay_dashboard_ended = True
    config = current_app.config
    response.delete_cookie(
        config.get("JWT_ACCESS_COOKIE_NAME", "access_token_cookie"),
        path=config.get("JWT_ACCESS_COOKIE_PATH", "/"),
        secure=bool(config.get("JWT_COOKIE_SECURE")) or request.is_secure,
        httponly=True,
        samesite=config["JWT_COOKIE_SAMESITE"],
    )


def same_origin() -> bool:
    """Whether a POST came from a page of this host (browsers send Origin on every POST).

    Only the host is compared: behind a TLS-terminating proxy the scheme seen
    here may be http while the browser's is https.
    """
    origin = request.headers.get("Origin")
    if origin is None or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.host


def _csrf_tokens_sent() -> list[str]:
    """The CSRF tokens a request flask-jwt-extended checks carries, in the header and the form field it reads."""
    config = current_app.config
    if request.method not in config["JWT_CSRF_METHODS"]:
        return []
    sent = [request.headers.get(config["JWT_ACCESS_CSRF_HEADER_NAME"])]
    if config["JWT_CSRF_CHECK_FORM"]:
        sent.append(request.form.get(config["JWT_ACCESS_CSRF_FIELD_NAME"]))
    return [token for token in sent if token is not None]


def _lacks_token() -> Problem:
    """The 403 for a request without this page's CSRF token, or with another one."""
    return Problem(
        403, "Forbidden", "The request lacked this page's security token; reload the page and try again.", slug="csrf"
    )


def _load() -> Session | None:
    """The request's session, None when there is none; raises a 403 problem for a CSRF failure."""
    if request.method == "POST" and not same_origin():
        raise Problem(403, "Forbidden", "This request did not come from a page of this dashboard.", slug="csrf")
    if not all(token.isascii() for token in _csrf_tokens_sent()):
        # flask-jwt-extended compares the token with hmac.compare_digest, which raises TypeError for
        # non-ASCII text: the page's token is ASCII, so such a value is simply not it.
        raise _lacks_token()
    try:
        verify_jwt_in_request(locations=["cookies"])
    except CSRFError:
        raise _lacks_token() from None
    except (JWTExtendedException, jwt.PyJWTError):
        return None
    claims = get_jwt()
    if any(name not in claims for name in SESSION_CLAIMS) or claims.get("type") != "access":
        return None
    user = auth.session_user(claims)  # None too once the session outlived its longest lifetime
    if user is None:
        return None
    return Session(user=user, csrf=str(claims["csrf"]))


#: Seconds after which a request renews a session's token (a tenth of its lifetime, if that is shorter).
RENEW_AFTER_SECONDS = 60


def _slide(session: Session, claims: dict[str, Any]) -> None:
    access, _ = _lifetimes()
    if time.time() - float(claims.get("iat", 0)) < min(RENEW_AFTER_SECONDS, access / 10):
        return
    token = _token(session.user, csrf=session.csrf, auth_time=int(claims["auth_time"]))

    @after_this_request
    def renew(response: Response) -> Response:
        if not g.get("relay_dashboard_ended"):
            _set_cookie(response, token)
        return response


def return_path() -> str | None:
    """The page to show again after login: the one the person was on, on this host only.

    An htmx request names that page in HX-Current-URL (a poll's own URL is only
    a fragment of it); a plain form POST in its Referer. Without either, a GET
    returns to itself and a POST to the overview: a POST is never replayed.
    """
    source = request.headers.get("HX-Current-URL") if request.headers.get("HX-Request") else None
    if source is None and request.method != "GET":
        source = request.referrer
    if source:
        parts = urlsplit(source)
        if parts.netloc == request.host:
            return safe_next(parts.path + (f"?{parts.query}" if parts.query else ""))
    return request.full_path.rstrip("?") if request.method == "GET" else None


def _to_login() -> Response:
    # A button pressed after the session ended did nothing: the login form says so (``undone``).
    undone = 1 if request.method != "GET" and request.endpoint != "dashboard.logout" else None
    target = url_for("dashboard.login", next=return_path(), undone=undone)
    if request.headers.get("HX-Request"):
        response = Response("", status=401)
        response.headers["HX-Redirect"] = target
        return response
    return redirect(target, code=303)


def current() -> Session | None:
    """The session of the request being served, if a view required one."""
    return g.get("relay_dashboard_session")


def require(role: str) -> Callable[[F], F]:
    """Let only users holding ``role`` (or more) through; others go to login or get 403."""

    def decorate(view: F) -> F:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            session = _load()
            if session is None:
                return _to_login()
            g.relay_dashboard_session = session
            _slide(session, get_jwt())
            held = session.user.role
            if auth.ROLES.index(held) < auth.ROLES.index(role):
                raise Problem(
                    403,
                    "Forbidden",
                    f"This needs the {role} role; you are a {held}. Ask an admin to act, or to change your role.",
                    slug="forbidden",
                )
            return view(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def safe_next(target: str | None) -> str | None:
    """A post-login destination on this site, or None (never another host).

    Spaces and control characters are refused outright: URL parsing drops
    tabs and newlines, so "/<TAB>/evil.example" would reach the Location
    header as "//evil.example", another host.
    """
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return None
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in target):
        return None
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None
    return target
