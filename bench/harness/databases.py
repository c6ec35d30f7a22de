"""Fresh databases for every run, cloned from a per-contestant template.

Each contestant's schema is installed once into ``relay_bench_<pid>_<name>_tpl``;
every run gets ``relay_bench_<pid>_<name>``, dropped and re-created from that
template, so no run sees another's rows or bloat, and two harnesses on one
server (the pid of the harness is in every name) never touch each other's
databases. Only databases whose names start with ``relay_bench_`` are ever
created or dropped.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PREFIX = "relay_bench_"


def dsn_for(admin_dsn: str, database: str) -> str:
    """The admin DSN pointed at another database, kept a URL when it is one (asyncpg needs URLs)."""
    parts = urlsplit(admin_dsn)
    if parts.scheme in ("postgres", "postgresql"):
        return urlunsplit(parts._replace(path="/" + database))
    return make_conninfo(admin_dsn, dbname=database)


def _checked(name: str) -> sql.Identifier:
    if not name.startswith(PREFIX):
        raise ValueError(f"refusing to touch database {name!r}: not a bench database")
    return sql.Identifier(name)


def drop(admin_dsn: str, name: str) -> None:
    """Drop a bench database if it exists, ending its sessions."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(_checked(name)))


def create(admin_dsn: str, name: str, template: str | None = None) -> str:
    """(Re)create a bench database, empty or as a copy of ``template``; return its DSN."""
    drop(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        if template:
            query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(_checked(name), _checked(template))
        else:
            query = sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(_checked(name))
        conn.execute(query)
    return dsn_for(admin_dsn, name)


def server_version(admin_dsn: str) -> str:
    """The server's version string, for the results file."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])


def describe(admin_dsn: str) -> str:
    """Host and port of the server, without credentials."""
    parts = conninfo_to_dict(admin_dsn)
    return f"{parts.get('host', 'local socket')}:{parts.get('port', 5432)}"
