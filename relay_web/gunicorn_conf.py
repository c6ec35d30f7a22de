"""gunicorn settings for Relay's web process: ``gunicorn -c python:relay_web.gunicorn_conf ...``.

gunicorn reads ``WEB_CONCURRENCY`` (its worker count) and the port in ``--bind``
without a bound or a clear word: ``WEB_CONCURRENCY=99999`` forked workers until
the machine ran out of memory, ``0`` listened and never answered, and
``PORT=99999`` stopped it with a traceback. They are checked here, where
gunicorn reads its settings, and a bad one stops it with one line that names it.
(A ``WEB_CONCURRENCY`` that is no number at all, ``abc`` or empty, still ends in
gunicorn's own traceback: gunicorn reads it as it loads, before this file.)

Outside production, an app without a signing secret makes a random one as it
starts, and each gunicorn worker starts its own: a token one worker signed was
refused by the others, so a session failed at random with two workers or more.
The secret is made here, once, in the process the workers are forked from.

Relay's log lines (the app's "database unavailable", its warnings at start)
are written as a worker's are, key=value or, under ``RELAY_LOG_FORMAT=json``,
JSON: without it they reached Python's fallback, message alone, the error's
libpq text over three lines. gunicorn's own lines are its own.

So are the app's own settings (a missing signing secret, an unreadable
DATABASE_URL): read first in each worker, a bad one printed a traceback per
worker and "Worker failed to boot". They are read as the factory will read
them: the environment, and the settings ``relay_web:create_app({...})`` passes,
parsed as gunicorn parses them. An app of another module (a factory of the
application's own that calls ``create_app``) knows its settings alone, and is
left to report them.
"""

from __future__ import annotations

import ast
import os
import secrets
import sys
from collections.abc import Mapping
from typing import Any

from gunicorn.config import Config

from relay_core import ConfigurationError, logs
from relay_web.config import load, signing_secret_given

#: More worker processes than this is a typo, not a plan (each holds its own database pool).
MAX_WEB_CONCURRENCY = 64


def _refuse(message: str) -> None:
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(1)  # gunicorn catches exceptions from its config file and prints a traceback; not an exit


def _whole(name: str, smallest: int, largest: int) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or not smallest <= int(text) <= largest:
        _refuse(f"{name} must be a whole number from {smallest} to {largest}, got {raw!r}")
    return int(text)


#: How gunicorn's command line may name Relay's app factory.
RELAY_APP_MODULES = ("relay_web", "relay_web.app")


def _relay_app_settings() -> Mapping[str, Any] | None:
    """What gunicorn's app argument passes to Relay's ``create_app``; None for another app.

    The command line is the one gunicorn itself parsed just before reading this
    file; the factory's arguments are read as literals, as gunicorn reads them.
    """
    try:
        positional = Config().parser().parse_args().args
    except SystemExit:  # not gunicorn's command line
        return None
    module, _, call = (positional[0] if positional else "").partition(":")
    if module not in RELAY_APP_MODULES:
        return None
    try:
        expression = ast.parse(call, mode="eval").body
        if not (isinstance(expression, ast.Call) and getattr(expression.func, "id", None) == "create_app"):
            return None
        args = [ast.literal_eval(arg) for arg in expression.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in expression.keywords}
    except (SyntaxError, ValueError, TypeError):  # gunicorn says what it cannot read as it loads the app
        return None
    given = args[0] if args else kwargs.get("config_overrides")
    if given is None:
        return {}
    return given if isinstance(given, Mapping) else None  # the factory itself refuses it


# RELAY_PROXY_HOPS alone decides whose X-Forwarded-Proto the app believes (its
# ProxyFix). gunicorn believes the header from 127.0.0.1 too unless told
# otherwise, so with hops 0, which ignores it, a proxy on the same host that
# passed a client's header through made plain HTTP look like HTTPS. An
# operator's own FORWARDED_ALLOW_IPS still wins.
if "FORWARDED_ALLOW_IPS" not in os.environ:
    forwarded_allow_ips = ""

web_concurrency = _whole("WEB_CONCURRENCY", 1, MAX_WEB_CONCURRENCY)
if web_concurrency is not None:
    workers = web_concurrency
_port = _whole("PORT", 1, 65535)

# Without --bind, gunicorn listens on every interface once PORT is set (as
# platforms set it). RELAY_WEB_HOST names the interface instead, an IPv6 one in
# brackets as gunicorn reads it (the Procfile passes no --bind, which would
# have to spell that itself); a --bind on the command line still wins over this file.
_web_host = os.environ.get("RELAY_WEB_HOST", "").strip()
if _web_host:
    _interface = f"[{_web_host}]" if ":" in _web_host and not _web_host.startswith("[") else _web_host
    bind = [f"{_interface}:{_port if _port is not None else 8000}"]

try:
    logs.configure()
except ConfigurationError as exc:
    _refuse(str(exc))

_app_settings = _relay_app_settings()
if _app_settings is not None:
    try:
        load(_app_settings)
    except ConfigurationError as exc:
        _refuse(str(exc))
    if not signing_secret_given(_app_settings):  # not production, or load() would have refused
        os.environ["JWT_SECRET_KEY"] = secrets.token_urlsafe(48)
