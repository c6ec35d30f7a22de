"""Running Relay's statements on a connection the caller already holds.

``enqueue(..., conn=...)`` must join the caller's transaction whether the caller
holds a psycopg 3 connection, a SQLAlchemy 2 ``Connection`` or a SQLAlchemy
``Session``. The same ``%(name)s`` SQL runs on all three: psycopg directly,
SQLAlchemy through ``exec_driver_sql`` (the statement goes to the DBAPI
untouched, so no SQL is rewritten for it).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row


def _sqlalchemy_connection(conn: Any) -> Any | None:
    """The SQLAlchemy Connection behind ``conn``, or None if it is not SQLAlchemy."""
    module = type(conn).__module__
    if not module.startswith("sqlalchemy"):
        return None
    if hasattr(conn, "exec_driver_sql"):
        return conn
    if hasattr(conn, "connection") and hasattr(conn, "flush"):  # an ORM Session
        return conn.connection()
    return None


def fetch_all(conn: Any, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``sql`` on a caller's connection and return its rows as dicts."""
    if isinstance(conn, psycopg.Connection):
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(sql, params, prepare=True)
            return cur.fetchall() if cur.description else []
    sa_conn = _sqlalchemy_connection(conn)
    if sa_conn is not None:
        result = sa_conn.exec_driver_sql(sql, params)
        if not result.returns_rows:
            return []
        return [dict(row) for row in result.mappings()]
    raise TypeError(
        f"conn must be a psycopg Connection or a SQLAlchemy Connection or Session, not {type(conn).__name__}"
    )


def fetch_first_value(conn: Any, sql: str, params: dict[str, Any]) -> Any:
    """The first column of the first row ``sql`` returns, or None when it returns no row.

    The one-job enqueue's path: on psycopg it skips building a dict per row.
    """
    if isinstance(conn, psycopg.Connection):
        row = conn.execute(sql, params, prepare=True).fetchone()
        return None if row is None else row[0]
    rows = fetch_all(conn, sql, params)
    return next(iter(rows[0].values())) if rows else None
