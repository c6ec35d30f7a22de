"""Structured log lines for job events (JSON when ``RELAY_LOG_FORMAT=json``)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

from .errors import ConfigurationError

logger = logging.getLogger("relay")

#: Values of RELAY_LOG_FORMAT (and ``relay --log-format``).
FORMATS = ("text", "json")

#: Libraries whose warnings land in a worker's log (psycopg and its pool say when a
#: connection broke or could not be opened). Without a handler of their own they
#: reach Python's last-resort handler as bare text, one line of JSON log broken
#: into several, so they share Relay's.
LIBRARY_LOGGERS = ("psycopg",)

#: The connection pool's warning for every failed try at connecting: in an outage, one
#: every couple of seconds per pool. For each of Relay's pools the first of each run gets
#: through, then one per REPEAT_SECONDS (a worker's own log says when the database stopped
#: and started answering).
POOL_CONNECT_WARNING = "error connecting in"
REPEAT_SECONDS = 30.0

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            # ISO 8601 with milliseconds and the UTC offset, as log shippers read it.
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class KeyValueFormatter(logging.Formatter):
    """Human-readable lines that still carry the structured fields as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = " ".join(
            f"{key}={_plain(value)}"
            for key, value in vars(record).items()
            if key not in _RESERVED and not key.startswith("_")
        )
        return f"{base} {fields}" if fields else base


#: A value that reads as one key=value item as it is: no spaces, quotes or control characters.
_BARE_VALUE = re.compile(r"[^\s\"'=\x00-\x1f\x7f]*")


def _plain(value: Any) -> str:
    """A field's value as one key=value item: quoted and escaped (as JSON) when it holds spaces or
    line breaks. Written as it was, a handler's error with a newline in it started a log line of
    its own, and "job succeeded" could be forged."""
    text = str(value)
    return text if _BARE_VALUE.fullmatch(text) else json.dumps(text)


class RepeatsFilter(logging.Filter):
    """Lets a record whose message starts with ``prefix`` through at most once per ``seconds`` for each pool.

    The pool is the record's first argument (psycopg_pool names it there);
    only Relay's own pools (named ``relay...``) are throttled, each on its own
    clock, so an application's pools in the same process keep every warning.
    """

    def __init__(self, prefix: str, seconds: float = REPEAT_SECONDS) -> None:
        super().__init__()
        self.prefix = prefix
        self.seconds = seconds
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a repeat of one of Relay's pools within the window."""
        if not str(record.msg).startswith(self.prefix):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        pool = str(args[0]) if args else ""
        if not pool.startswith("relay"):
            return True
        now = time.monotonic()
        if now - self._last.get(pool, -float("inf")) < self.seconds:
            return False
        self._last[pool] = now
        return True


def json_configured() -> bool:
    """Whether ``configure`` made Relay's log lines JSON."""
    return any(isinstance(handler.formatter, JsonFormatter) for handler in logger.handlers)


def configure(level: str | int = "INFO", fmt: str | None = None) -> None:
    """Send Relay's logs to stderr, as JSON or key=value lines; an unknown format is a ConfigurationError."""
    raw = fmt or os.environ.get("RELAY_LOG_FORMAT") or "text"
    fmt = raw.strip().lower()
    if fmt not in FORMATS:
        # A typo must not quietly turn the JSON a log pipeline parses into text.
        raise ConfigurationError(f"RELAY_LOG_FORMAT must be text or json, got {raw!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(level if isinstance(level, int) else level.upper())
    logger.propagate = False
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers[:] = [handler]
        # Their INFO is a line per pooled connection handed out: warnings and worse (errors under --log-level error).
        library.setLevel(max(logger.level, logging.WARNING))
        library.propagate = False
    root = logging.getLogger()
    if not root.handlers:
        # A process of Relay's own (``relay worker``): the application's loggers (a handler's
        # logging.getLogger(__name__)) and its warnings write the same lines to the same stream,
        # JSON a log pipeline can parse, and their INFO is kept rather than dropped by Python's fallback.
        root.addHandler(handler)
        root.setLevel(logger.level)
        logging.captureWarnings(True)
    throttle_pool_connect_warnings()


def throttle_pool_connect_warnings() -> None:
    """Let Relay's pools' warning for a failed try at connecting through once per REPEAT_SECONDS, per pool.

    Done by every Relay pool as it opens, not only by Relay's own processes:
    an application's enqueue during an outage, or with a misspelt database,
    printed one such line per try (seven in a five-second wait), and the
    admin web app one a second for as long as the outage lasted. The reason
    also reaches the caller in the checkout's PoolTimeout (``pools``).
    """
    pool = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, RepeatsFilter) for f in pool.filters):
        pool.addFilter(RepeatsFilter(POOL_CONNECT_WARNING))


def event(level: int, message: str, **fields: Any) -> None:
    """Log a job event with structured fields, skipping the work when the level is off."""
    if logger.isEnabledFor(level):
        logger.log(level, message, extra=fields)
