"""Relay's settings from the environment (12-factor)."""

from __future__ import annotations

import os

from .errors import ConfigurationError


def database_url(explicit: str | None = None) -> str:
    """The DSN to use: an explicit one, else RELAY_DATABASE_URL, else DATABASE_URL."""
    dsn = explicit or os.environ.get("RELAY_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not dsn:
        raise ConfigurationError(
            "no database configured: pass a DSN to Relay(...) or set DATABASE_URL (or RELAY_DATABASE_URL)"
        )
    # Heroku-style URLs say postgres://, which libpq accepts; normalise for SQLAlchemy users too.
    if dsn.startswith("postgres://"):
        dsn = "postgresql://" + dsn[len("postgres://") :]
    return dsn


def env_float(name: str, default: float) -> float:
    """A float setting from the environment, with a clear error when malformed."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None


def env_int(name: str, default: int) -> int:
    """An integer setting from the environment, with a clear error when malformed."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, got {raw!r}") from None


def env_bool(name: str, default: bool) -> bool:
    """A boolean setting from the environment (1/0, true/false, yes/no, on/off)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ConfigurationError(f"{name} must be true or false, got {raw!r}")
