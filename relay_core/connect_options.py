"""How Relay connects: the options every one of its connections to the database gets.

Limits on a network path that went silent (libpq's defaults wait minutes to
hours), read around what the DSN, the environment and a service file already
set; prepared statements off behind a transaction pooler; a name for each
connection in ``pg_stat_activity``. Also lifting one of those limits while
other code's work runs on the connection, and telling a refused setting from
an outage.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .settings import transaction_pooling

#: libpq settings that bound how long a connection can hang on a network path
#: that went silent, where the DSN (or PGCONNECT_TIMEOUT) does not set them.
#: Seconds, but tcp_user_timeout, in milliseconds. See ``liveness_options``.
LIVENESS_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}


def liveness_options(dsn: str, *, user_timeout: bool = True) -> dict[str, int]:
    """Time limits on a dead network path, for the settings ``dsn`` leaves to libpq's defaults.

    A database that fails over to another address, or a proxy or NAT that
    forgets a connection, leaves the old path silent: nothing refuses,
    packets just vanish. libpq's defaults then wait on it for a very long
    time: a connection attempt 130 s (psycopg's default), a statement sent on
    an established connection until the kernel gives up retransmitting (about
    15 minutes on Linux), an idle LISTEN connection until the first keepalive
    (two hours). A worker meanwhile claims nothing. With these, a connection
    attempt gives up after 10 s, data unacknowledged for 15 s breaks the
    connection, and an idle connection is probed after 10 s; the worker's
    retry loops then reconnect on a path that works.

    ``tcp_user_timeout`` also breaks a connection whose server stops reading
    while the client still has data to send (a pipelined bulk insert queued
    behind a statement waiting on a lock), so it is left out with
    ``user_timeout=False``: for connections that carry other code's work.
    Relay's own statements are short and read as soon as they arrive.

    Settings the DSN names win, as do ``PGCONNECT_TIMEOUT`` and the service
    file section a ``service`` names; when that section cannot be found here,
    nothing is added. Unix-socket connections ignore the TCP settings.
    """
    given: dict[str, Any] = conninfo_to_dict(dsn)
    if os.environ.get("PGCONNECT_TIMEOUT"):
        given["connect_timeout"] = os.environ["PGCONNECT_TIMEOUT"]
    service = given.get("service") or os.environ.get("PGSERVICE")
    if service:
        section = service_settings(str(service))
        if section is None:
            _warn_service_unread(str(service))
            return {}
        given = {**section, **given}
    return {
        name: value
        for name, value in LIVENESS_DEFAULTS.items()
        if name not in given and (user_timeout or name != "tcp_user_timeout")
    }


#: Where libpq builds commonly look for the system-wide service file when
#: PGSYSCONFDIR is unset (Debian's packages and psycopg's bundled libpq use
#: the first); a section found in one that libpq does not read would only make
#: Relay add fewer defaults.
SYSCONF_DIRS = ("/etc/postgresql-common", "/etc/postgresql", "/usr/local/pgsql/etc")


def service_settings(service: str) -> dict[str, str] | None:
    """The settings of ``service`` in the connection service files, or None if no file has it.

    Read as libpq reads them: PGSERVICEFILE (else ~/.pg_service.conf), then
    the system-wide pg_service.conf; the first file with a ``[service]``
    section wins; lines are stripped, ``#`` lines and blank ones skipped,
    the section ends at the next ``[``, and each line in it is
    ``key=value``.
    """
    user_file = os.environ.get("PGSERVICEFILE")
    files = [Path(user_file) if user_file is not None else Path.home() / ".pg_service.conf"]
    sysconf = os.environ.get("PGSYSCONFDIR")
    files += [Path(folder) / "pg_service.conf" for folder in ([sysconf] if sysconf else SYSCONF_DIRS)]
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        section = _service_section(text, service)
        if section is not None:
            return section
    return None


def _service_section(text: str, service: str) -> dict[str, str] | None:
    """The ``key=value`` lines of section ``[service]`` in a service file's text, or None."""
    settings: dict[str, str] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            if settings is not None:
                break  # the next section: ours is over
            if line == f"[{service}]":
                settings = {}
        elif settings is not None:
            key, sep, value = line.partition("=")
            if sep:
                settings[key.strip()] = value.strip()
    return settings


@functools.cache
def _warn_service_unread(service: str) -> None:
    """Say once per process that a service's settings could not be read, so Relay added none of its own."""
    logging.getLogger("relay").warning(
        "connection service %r not found in the service files Relay reads; "
        "its connections get no connect_timeout, keepalives or tcp_user_timeout of Relay's",
        service,
    )


def connection_options(
    dsn: str, pooling: bool | None = None, *, user_timeout: bool = True, application_name: str | None = "relay"
) -> dict[str, Any]:
    """psycopg options for every connection Relay opens to ``dsn``.

    Time limits on a dead network path (``liveness_options``; without
    ``tcp_user_timeout`` unless ``user_timeout``). Behind a transaction pooler
    (``pooling``; RELAY_TRANSACTION_POOLING when None) nothing is prepared:
    ``prepare_threshold=None`` also overrides the ``prepare=True`` of Relay's
    hot statements. Elsewhere psycopg's defaults hold (those statements are
    prepared on first use).

    ``application_name`` names the connection in ``pg_stat_activity`` and a
    pooler's client list, so a session holding a lock or a server connection
    can be traced to its process. It is libpq's fallback: an
    ``application_name`` the DSN, ``PGAPPNAME`` or a service file gives wins.
    """
    pooling = transaction_pooling() if pooling is None else pooling
    options: dict[str, Any] = dict(liveness_options(dsn, user_timeout=user_timeout))
    if pooling:
        options["prepare_threshold"] = None
    if application_name:
        options["fallback_application_name"] = application_name[:APPLICATION_NAME_MAX]
    return options


#: The longest application_name PostgreSQL keeps (NAMEDATALEN - 1 bytes; Relay's names are ASCII).
APPLICATION_NAME_MAX = 63


def worker_application_name(worker_id: str) -> str:
    """What a worker's connections are called: its registry id, as ``relay.workers`` and its log show it.

    An id too long for the name keeps its start (the host) and its end (the
    process id and the random suffix that tell workers on one host apart).
    Behind a transaction pooler every worker shares one name: the pooler sets
    a client's ``application_name`` on the server connection it lends
    whenever it differs from the previous client's, a round trip each time.
    """
    prefix = "relay-worker"
    if transaction_pooling():
        return prefix
    room = APPLICATION_NAME_MAX - len(prefix) - 1
    if len(worker_id) > room:
        worker_id = f"{worker_id[: room - 21]}~{worker_id[-20:]}"
    return f"{prefix} {worker_id}"


@contextmanager
def without_user_timeout(conn: psycopg.Connection) -> Iterator[None]:
    """Lift the ``tcp_user_timeout`` Relay set on ``conn``'s socket while other code's work runs on it.

    A transactional handler gets a connection of the worker's pool, whose
    Relay statements want the limit (see ``liveness_options``); the
    handler's own work may queue more data than the socket holds behind a
    statement that waits on a lock. Restored afterwards; nothing to do on a
    Unix socket or where the platform has no such option.
    """
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock: socket.socket | None = None
    before = 0
    if option is not None:
        try:
            sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            before = sock.getsockopt(socket.IPPROTO_TCP, option)
            sock.setsockopt(socket.IPPROTO_TCP, option, 0)
        except (OSError, psycopg.Error):  # a Unix socket, or a connection already closed
            if sock is not None:
                sock.close()
            sock = None
    try:
        yield
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, before)
            sock.close()


def unusable_setting(exc: psycopg.Error) -> bool:
    """Whether a failed connection attempt was refused for a setting libpq cannot use, before any network.

    psycopg raises ProgrammingError for a connect_timeout that is no number,
    and "connection is bad" when libpq refuses the options outright (an
    unknown sslmode, a port out of range, a keepalives that is no integer),
    each saying what is "invalid", or a connection service (``service=``,
    ``PGSERVICE``) that no service file defines, or a service file
    (``PGSERVICEFILE``) that is not there. A server that cannot be reached over TCP
    fails later, as "connection failed"; over a Unix socket libpq may call
    that connection bad at once too ("No such file or directory" while the
    server is down), which is an outage to wait out, not a setting.
    """
    if isinstance(exc, psycopg.ProgrammingError):
        return True
    text = str(exc)
    return (
        isinstance(exc, psycopg.OperationalError)
        and text.startswith("connection is bad:")
        and ("invalid " in text or (" service " in f" {text}" and text.endswith(" not found")))
    )
