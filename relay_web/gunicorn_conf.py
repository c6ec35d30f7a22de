"""gunicorn settings for Relay's web process: ``gunicorn -c python:relay_web.gunicorn_conf ...``.

gunicorn reads ``WEB_CONCURRENCY`` (its worker count) and the port in ``--bind``
without a bound or a clear word: ``WEB_CONCURRENCY=99999`` forked workers until
the machine ran out of memory, ``0`` listened and never answered, ``abc`` and
``PORT=99999`` stopped it with a traceback. They are checked here, where
gunicorn reads its settings, and a bad one stops it with one line that names it.

So are the app's own settings (a missing signing secret, an unreadable
DATABASE_URL): read first in each worker, a bad one printed a traceback per
worker and "Worker failed to boot". Only when the app reads them from the
environment alone (``relay_web:create_app()``): settings passed to the factory
(``relay_web:create_app({...})``) only the app itself can read.
"""

from __future__ import annotations

import os
import sys

from gunicorn.config import Config

from relay_core import ConfigurationError
from relay_web.config import load

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


def _app_takes_settings_from_the_environment_alone() -> bool:
    """Whether the app gunicorn serves was named without arguments to its factory.

    The command line is the one gunicorn itself parsed just before reading this file.
    """
    try:
        positional = Config().parser().parse_args().args
    except SystemExit:  # not gunicorn's command line: check what the environment holds
        return True
    factory_arguments = (positional[0] if positional else "").partition("(")[2].rpartition(")")[0]
    return not factory_arguments.strip()


web_concurrency = _whole("WEB_CONCURRENCY", 1, MAX_WEB_CONCURRENCY)
if web_concurrency is not None:
    workers = web_concurrency
_whole("PORT", 1, 65535)

if _app_takes_settings_from_the_environment_alone():
    try:
        load()
    except ConfigurationError as exc:
        _refuse(str(exc))
