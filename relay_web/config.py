"""The web app's settings: defaults, then the environment, then explicit config.

12-factor: a deployment sets environment variables (DATABASE_URL,
JWT_SECRET_KEY or SECRET_KEY, RELAY_*); tests and the demo pass a dict to
``create_app``. A missing or weak secret in production stops the app at
startup with a message saying what to set, never a silent default.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from flask import current_app

from relay_core import ConfigurationError, Relay, users
from relay_core.validation import MAX_PAYLOAD_BYTES_LIMIT

log = logging.getLogger("relay.web")

#: Shorter HMAC keys are guessable offline from any token (RFC 7518 3.2 asks for 256 bits).
MIN_SECRET_LENGTH = 32

YEAR_SECONDS = 365 * 86400
#: What PostgreSQL's integer settings (statement_timeout) and a C int hold.
INT32_MAX = 2**31 - 1

#: Integer settings: name -> (default, smallest allowed, largest allowed). The largest keep
#: every time computed from them inside what a datetime and PostgreSQL's timestamps hold:
#: past them a token's expiry, a login window or the workers' staleness failed every
#: login or /metrics with a 500 instead of stopping the app at start.
INT_SETTINGS: dict[str, tuple[int, int, int]] = {
    "RELAY_PROXY_HOPS": (0, 0, 64),
    "RELAY_ACCESS_TOKEN_SECONDS": (900, 30, YEAR_SECONDS),
    "RELAY_REFRESH_TOKEN_SECONDS": (12 * 3600, 60, 10 * YEAR_SECONDS),
    "RELAY_LOGIN_WINDOW_SECONDS": (900, 1, YEAR_SECONDS),
    "RELAY_LOGIN_MAX_FAILURES": (5, 1, INT32_MAX),
    "RELAY_LOGIN_MAX_FAILURES_PER_ADDRESS": (50, 1, INT32_MAX),
    "RELAY_ARGON2_TIME_COST": (0, 0, INT32_MAX),
    "RELAY_ARGON2_MEMORY_COST": (0, 0, INT32_MAX),
    "RELAY_ARGON2_PARALLELISM": (0, 0, INT32_MAX),
    "RELAY_WORKER_STALE_SECONDS": (60, 1, YEAR_SECONDS),
    "RELAY_WEB_POOL_SIZE": (4, 1, 1000),
    "RELAY_STATEMENT_TIMEOUT_MS": (5000, 0, INT32_MAX),
}

#: String settings read from the environment when not given explicitly.
STR_SETTINGS = ("RELAY_ENV", "RELAY_METRICS_TOKEN")

#: RELAY_ENV values where a missing secret is replaced by a random one.
NON_PRODUCTION = frozenset({"development", "test"})
#: Every RELAY_ENV value (read in any case; unset or blank is production).
ENVIRONMENTS = ("production", *sorted(NON_PRODUCTION))


#: What the dashboard's session cookie may say of cross-site requests (``JWT_COOKIE_SAMESITE``).
#: Not None: the cookie would then go with a cross-site form's POST.
COOKIE_SAMESITE = ("Lax", "Strict")

#: The smallest limit on a request's body: room for any job at the default payload limit.
MIN_REQUEST_BYTES = 1024 * 1024


#: How far the clock of the web process that stamped a token may be from this one's. Behind a
#: balancer a token signed by a process whose clock ran ahead was refused as not yet valid by one
#: that was behind (its issued-at in the future): 401 on the API, the login page on the dashboard.
#: It stretches a token's expiry by as much, far less than any lifetime Relay allows.
TOKEN_CLOCK_LEEWAY_SECONDS = 5


def max_request_bytes(max_payload_bytes: int) -> int:
    """The largest request body read: room for a job whose payload is at RELAY_MAX_PAYLOAD_BYTES.

    The limit counts the payload as Relay stores it; a client that escapes
    every non-ASCII character (``\\u00e9``, a surrogate pair for an emoji) sends
    up to three times as many bytes, and the rest of the job besides. Past
    it, a body is refused with 413 before it is read; below it, a payload
    over the limit gets the 422 that names it.
    """
    return max(MIN_REQUEST_BYTES, 3 * max_payload_bytes + 64 * 1024)


def _int(name: str, raw: Any, smallest: int, largest: int) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be an integer, got {raw!r}") from None
    if value < smallest:
        raise ConfigurationError(f"{name} must be at least {smallest}, got {value}")
    if value > largest:
        raise ConfigurationError(f"{name} must be at most {largest}, got {value}")
    return value


def _pick(name: str, given: Mapping[str, Any], *aliases: str) -> Any:
    """The first of ``name``/aliases set in ``given``, else in the environment."""
    for key in (name, *aliases):
        if given.get(key) not in (None, ""):
            return given[key]
    for key in (name, *aliases):
        if os.environ.get(key):
            return os.environ[key]
    return None


def signing_secret_given(given: Mapping[str, Any] | None = None) -> bool:
    """Whether JWT_SECRET_KEY or SECRET_KEY is set, in ``given`` or the environment.

    Without either, a development app signs with a random secret of its own
    (see ``load``): one per process.
    """
    return _pick("JWT_SECRET_KEY", given or {}, "SECRET_KEY") is not None


def _secret(given: Mapping[str, Any], production: bool) -> str:
    secret = _pick("JWT_SECRET_KEY", given, "SECRET_KEY")
    if secret is None:
        if production:
            raise ConfigurationError(
                "no signing secret: set JWT_SECRET_KEY (or SECRET_KEY) to a random string of at least "
                f"{MIN_SECRET_LENGTH} characters, e.g. python -c 'import secrets; print(secrets.token_urlsafe(48))'"
            )
        log.warning("no JWT_SECRET_KEY set: using a random one; tokens will not survive a restart")
        return secrets.token_urlsafe(48)
    secret = str(secret)
    _strong_enough("JWT_SECRET_KEY (or SECRET_KEY)", secret, production)
    return secret


def _strong_enough(name: str, secret: str, production: bool) -> None:
    """A signing secret: never blank, and in production at least MIN_SECRET_LENGTH characters."""
    if not secret.strip():
        raise ConfigurationError(f"{name} is blank: set it to a random string")
    if production and len(secret.strip()) < MIN_SECRET_LENGTH:
        raise ConfigurationError(f"{name} must be at least {MIN_SECRET_LENGTH} characters")


def _flask_secret(given: Mapping[str, Any], jwt_secret: str, production: bool) -> str:
    """SECRET_KEY when set beside JWT_SECRET_KEY (it signs the dashboard's session cookie), held to the same rule."""
    flask_secret = _pick("SECRET_KEY", given)
    if flask_secret is None:
        return jwt_secret
    _strong_enough("SECRET_KEY", str(flask_secret), production)
    return str(flask_secret)


def _metrics_token(token: str | None) -> str | None:
    """RELAY_METRICS_TOKEN as a scraper can send it: printable ASCII, no spaces at either end.

    An HTTP server strips a header's trailing spaces and reads it as ISO-8859-1, so a token
    with either could never match: every scrape was refused.
    """
    if token is None:
        return None
    if not token.strip():
        raise ConfigurationError("RELAY_METRICS_TOKEN is blank: set it to a random string, or unset it")
    if token != token.strip() or not all("\x21" <= c <= "\x7e" for c in token):
        raise ConfigurationError("RELAY_METRICS_TOKEN must be printable ASCII without spaces")
    return token


def _environment(value: str | None) -> str:
    """RELAY_ENV, lowercased; one Relay does not know stops the app rather than run as production unsaid
    (a misspelt ``development`` then asked for a secret with no word of why)."""
    environment = (value or "").strip().lower() or "production"
    if environment not in ENVIRONMENTS:
        raise ConfigurationError(
            f"RELAY_ENV must be {', '.join(ENVIRONMENTS[:-1])} or {ENVIRONMENTS[-1]}, got {value!r}"
        )
    return environment


def load(given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every setting the app needs, validated; raises ConfigurationError."""
    given = dict(given or {})
    settings: dict[str, Any] = {}
    for name in STR_SETTINGS:
        value = _pick(name, given)
        settings[name] = None if value is None else str(value)
    settings["RELAY_ENV"] = _environment(settings["RELAY_ENV"])
    production = settings["RELAY_ENV"] not in NON_PRODUCTION and not given.get("TESTING")
    for name, (default, smallest, largest) in INT_SETTINGS.items():
        raw = _pick(name, given)
        settings[name] = default if raw is None else _int(name, raw, smallest, largest)
    settings["RELAY_METRICS_TOKEN"] = _metrics_token(settings["RELAY_METRICS_TOKEN"])
    # Out-of-bounds Argon2 settings stop the app here, not at the first login.
    users.make_hasher(
        settings["RELAY_ARGON2_TIME_COST"] or None,
        settings["RELAY_ARGON2_MEMORY_COST"] or None,
        settings["RELAY_ARGON2_PARALLELISM"] or None,
    )
    # The DSN and the wait for a connection are resolved and checked as Relay() does them
    # (DSN: explicit, RELAY_DATABASE_URL, DATABASE_URL; the wait in seconds, fractions too):
    # one environment serves the application's Relay() and this app alike.
    wait = _pick("RELAY_DB_WAIT_SECONDS", given)
    try:
        wait = None if wait is None else float(wait)
    except (TypeError, ValueError):
        raise ConfigurationError(f"RELAY_DB_WAIT_SECONDS must be a number, got {wait!r}") from None
    # Given explicitly, the DSN is the caller's; from the environment, Relay reads it itself and
    # names the variable in what it says (a blank DATABASE_URL was called "the DSN passed to Relay").
    payload_bytes = given.get("RELAY_MAX_PAYLOAD_BYTES")
    if payload_bytes is not None:
        payload_bytes = _int("RELAY_MAX_PAYLOAD_BYTES", payload_bytes, 1, MAX_PAYLOAD_BYTES_LIMIT)
    relay = Relay(
        given.get("RELAY_DATABASE_URL") or given.get("DATABASE_URL") or None,
        db_wait=wait,
        max_payload_bytes=payload_bytes,
    )
    settings["RELAY_DATABASE_URL"] = relay.dsn
    settings["RELAY_DB_WAIT_SECONDS"] = relay.db_wait
    settings["RELAY_MAX_PAYLOAD_BYTES"] = relay.max_payload_bytes
    secret = _secret(given, production)
    flask_secret = _flask_secret(given, secret, production)
    # Said once every setting is known to work: an app that cannot start says only why.
    if production and settings["RELAY_METRICS_TOKEN"] is None:
        log.warning(
            "no RELAY_METRICS_TOKEN set: /metrics answers anyone who can reach the app "
            "(queue names, job types, counts); set one and give it to your scraper"
        )
    settings.update(
        JWT_SECRET_KEY=secret,
        SECRET_KEY=flask_secret,
        JWT_ALGORITHM="HS256",
        JWT_DECODE_ALGORITHMS=["HS256"],
        # The API reads tokens from the Authorization header only (views pass
        # locations=["headers"]); cookies are for a browser dashboard, with CSRF.
        JWT_TOKEN_LOCATION=["headers", "cookies"],
        JWT_ACCESS_TOKEN_EXPIRES=timedelta(seconds=settings["RELAY_ACCESS_TOKEN_SECONDS"]),
        JWT_REFRESH_TOKEN_EXPIRES=timedelta(seconds=settings["RELAY_REFRESH_TOKEN_SECONDS"]),
        JWT_ENCODE_ISSUER="relay",
        JWT_DECODE_ISSUER="relay",
        JWT_DECODE_LEEWAY=TOKEN_CLOCK_LEEWAY_SECONDS,
        JWT_COOKIE_SECURE=production,
        # Lax: see dashboard/session.py. Strict may be given instead (JWT_* overrides win).
        JWT_COOKIE_SAMESITE="Lax",
        JWT_COOKIE_CSRF_PROTECT=True,
        # Flask's own session cookie carries only a dashboard action's message from a
        # plain form's POST to the page it redirects to (see dashboard/render.py).
        SESSION_COOKIE_SECURE=production,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_HTTPONLY=True,
        MAX_CONTENT_LENGTH=max_request_bytes(relay.max_payload_bytes),
    )
    # Anything else given (TESTING, a dashboard's settings, JWT_* overrides) wins.
    for key, value in given.items():
        if key not in settings or (key.startswith("JWT_") and key != "JWT_SECRET_KEY"):
            settings[key] = value
    if settings["JWT_COOKIE_SAMESITE"] not in COOKIE_SAMESITE:
        raise ConfigurationError(
            f"JWT_COOKIE_SAMESITE must be one of {', '.join(COOKIE_SAMESITE)}, not "
            f"{settings['JWT_COOKIE_SAMESITE']!r}: the dashboard's session cookie must stay off cross-site POSTs"
        )
    return settings


def worker_stale_seconds() -> float:
    """How long a worker may stay silent before this app counts it gone (``RELAY_WORKER_STALE_SECONDS``)."""
    return float(current_app.config["RELAY_WORKER_STALE_SECONDS"])
