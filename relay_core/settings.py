"""Relay's settings from the environment (12-factor)."""

from __future__ import annotations

import os
import re

import psycopg
from psycopg import conninfo, pq

from .errors import ConfigurationError

#: What a database URL looks like, for messages about one that is not.
EXAMPLE_URL = "postgresql://user:password@host:5432/dbname"

#: A URL's scheme and its "://" (RFC 3986's letters, with "+" for SQLAlchemy's driver names).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

#: Quoted text in libpq's parse errors: a token it could not read, often the password itself.
_QUOTED = re.compile(r'"([^"]*)"')


def database_url_set() -> bool:
    """Whether RELAY_DATABASE_URL or DATABASE_URL is set, to anything (a database, or an empty or
    unreadable value that ``database_url`` refuses).

    Set to nothing (``DATABASE_URL=`` in an env file) counted as unset: ``relay prove`` and
    ``relay demo`` then ran on an embedded PostgreSQL, and the proof passed on a database the
    operator never named, where ``relay migrate`` said the setting was empty.
    """
    return "RELAY_DATABASE_URL" in os.environ or "DATABASE_URL" in os.environ


def check_dsn_type(dsn: object) -> None:
    """Refuse a DSN that is no string (bytes, a port number): it failed later, on first use, with a
    bare TypeError or AttributeError from deep in the parsing."""
    if dsn is not None and not isinstance(dsn, str):
        raise ConfigurationError(
            f"the DSN must be a string (a database URL or key=value settings), got {type(dsn).__name__}"
        )


def database_url(explicit: str | None = None) -> str:
    """The DSN to use: an explicit one, else RELAY_DATABASE_URL, else DATABASE_URL."""
    check_dsn_type(explicit)
    # An explicit "" is the caller's blank DSN, not a request for the environment's.
    dsn = explicit if explicit is not None else os.environ.get("RELAY_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if dsn is None or (explicit is None and not dsn):
        empty = [name for name in ("RELAY_DATABASE_URL", "DATABASE_URL") if os.environ.get(name) == ""]
        if explicit is None and empty:
            # Set to nothing (``DATABASE_URL=`` in an env file): say so, not that none is configured.
            raise ConfigurationError(f"{empty[0]} is empty: set it to a database URL (or unset it)")
        raise ConfigurationError(
            "no database configured: pass a DSN to Relay(...) or set DATABASE_URL (or RELAY_DATABASE_URL)"
        )
    if not dsn.strip():
        # libpq reads a blank string as "every default": a database nobody named.
        source = (
            "the DSN passed to Relay"
            if explicit is not None
            else ("RELAY_DATABASE_URL" if os.environ.get("RELAY_DATABASE_URL") else "DATABASE_URL")
        )
        raise ConfigurationError(f"{source} is blank: set it to a database URL (or unset it)")
    _refuse_wrapping(dsn)
    dsn = _libpq_scheme(dsn)
    try:
        parsed = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # Here, not at the first connection: a pool would log libpq's message,
        # quoted password and all, on every attempt, and the worker would run on.
        hint = "" if "://" in dsn else f" (expected {EXAMPLE_URL} or key=value settings)"
        raise ConfigurationError(
            f"the database URL (DATABASE_URL or RELAY_DATABASE_URL) cannot be read: {_redact(exc, dsn)}{hint}"
        ) from None
    if not all(_is_port(port.strip()) for port in str(parsed.get("port") or "").split(",")):
        # Each connection failed to resolve its host ("Servname not supported"), an outage retried
        # for good. A '/' in a URL's password ends its host there: the rest reads as a port.
        if _slash_in_userinfo(dsn):
            raise ConfigurationError(
                "the database URL (DATABASE_URL or RELAY_DATABASE_URL) has a '/' in its user or password: "
                "write it as %2F"
            )
        raise ConfigurationError(
            "the database URL (DATABASE_URL or RELAY_DATABASE_URL) has a port that is not a number"
        )
    if dsn.startswith("postgresql://") and any("@" in host[1:] for host in str(parsed.get("host", "")).split(",")):
        # libpq ends the password at its first "@": the rest of it became the host name, which
        # every failed connection then logged. (A host starting with "@" is an abstract socket.)
        raise ConfigurationError(
            "the database URL (DATABASE_URL or RELAY_DATABASE_URL) has an '@' in its user or password: write it as %40"
        )
    return dsn


def _refuse_wrapping(dsn: str) -> None:
    """Refuse a DSN with the quotes or the line break of where it was written still around it.

    Quoted (an env file or a dashboard field that kept the quotes), libpq read
    it as one key=value token and quoted it back, and its quotation marks
    paired with the message's own: the password was shown. A URL's line break
    (a file read whole) or a space at either end became part of the database's
    name. Key=value settings are libpq's to read: it takes whitespace between
    them, and a quote around them is a token it refuses in its own words.
    """
    if "://" not in dsn:
        return  # key=value settings: libpq reads spaces and line breaks between them, and refuses stray quotes
    edges = dsn[:1] + dsn[-1:]
    if len(dsn) >= 2 and dsn[0] == dsn[-1] and dsn[0] in "\"'":
        raise ConfigurationError(
            "the database URL (DATABASE_URL or RELAY_DATABASE_URL) is wrapped in quotes: remove them"
        )
    if edges != edges.strip():
        raise ConfigurationError(
            "the database URL (DATABASE_URL or RELAY_DATABASE_URL) has spaces or a line break at its start or end: "
            "remove them"
        )


def _is_port(text: str) -> bool:
    """Whether ``text`` is a port number, or nothing (the default). One out of range libpq refuses itself,
    before any network (``connect_options.unusable_setting``); one that is no number it tried as a
    service name, in a host name's lookup that failed as a network's would."""
    return text == "" or (text.isascii() and text.isdigit())


def _after_scheme(dsn: str) -> str:
    """What a URL carries after its "://" (nothing for key=value settings)."""
    return dsn.split("://", 1)[1] if "://" in dsn else ""


def _slash_in_userinfo(dsn: str) -> bool:
    """Whether a URL's user or password holds a '/', which ended its authority early: no '@' before
    the first '/', one after it."""
    authority, slash, path = _after_scheme(dsn).partition("/")
    return bool(slash) and "@" not in authority and "@" in path


def _userinfo(dsn: str) -> str:
    """What a URL carries before its last '@' (its user and password, as written), or nothing."""
    rest = _after_scheme(dsn)
    return rest.rsplit("@", 1)[0] if "@" in rest else ""


def _password_in(dsn: str) -> str:
    """The password ``dsn`` carries as written, found without libpq, which could not read ``dsn``."""
    if "://" in dsn:
        userinfo = _userinfo(dsn)
        return userinfo.split(":", 1)[1] if ":" in userinfo else ""
    found = re.search(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn)
    return found.group(1) if found else ""


def _libpq_scheme(dsn: str) -> str:
    """``dsn`` with a URL scheme libpq reads, or a ConfigurationError naming the scheme it has.

    Heroku-style URLs say ``postgres://``, which libpq accepts; it is written
    ``postgresql://`` for SQLAlchemy users too. SQLAlchemy's own spelling names
    a driver (``postgresql+psycopg://``), which an application sharing one
    DATABASE_URL with Relay has; libpq read it as key=value settings and
    answered 'missing "=" after "..."'. Any other scheme is not PostgreSQL.
    """
    scheme = _SCHEME.match(dsn)
    if scheme is None:
        return dsn  # key=value settings, or text libpq will refuse in its own words
    name = scheme.group(1).lower()
    if name in {"postgres", "postgresql"} or name.startswith(("postgres+", "postgresql+")):
        return "postgresql://" + dsn[scheme.end() :]
    raise ConfigurationError(
        f"the database URL (DATABASE_URL or RELAY_DATABASE_URL) is a {name}:// URL: "
        f"Relay needs PostgreSQL, {EXAMPLE_URL}"
    )


def _redact(exc: Exception, dsn: str) -> str:
    """libpq's parse error with ``dsn``'s password elided (whole, and each part of it between quotes
    or spaces, which libpq may quote alone), then every quoted token but option names ("port") and "="."""
    keep = {option.keyword.decode() for option in pq.Conninfo.get_defaults()} | {"="}
    text = str(exc).strip()
    password = _password_in(dsn)
    for secret in sorted({password, *re.split(r"[\"'\s]+", password)}, key=len, reverse=True):
        if len(secret) >= 3:
            text = text.replace(secret, "...")
    text = _QUOTED.sub(lambda m: m.group(0) if m.group(1) in keep else '"..."', text)
    if "percent-encoded" in text:
        text += "; write a % in the user or password as %25"
    return text


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


def transaction_pooling() -> bool:
    """Whether Relay's connections go through a pooler in transaction mode (``RELAY_TRANSACTION_POOLING``).

    PgBouncer in transaction pooling (and poolers like it) hands each
    transaction whichever server connection is free. State a session leaves
    behind then belongs to no one: a statement prepared in one transaction is
    missing, or its name already taken, in the next ("prepared statement
    "_pg3_0" already exists"), and a session setting lands on a server
    connection that other clients, the application's own included, use next.
    """
    return env_bool("RELAY_TRANSACTION_POOLING", False)
