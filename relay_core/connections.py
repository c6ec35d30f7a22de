"""Running Relay's statements on a connection the caller already holds.

``enqueue(..., conn=...)`` must join the caller's transaction whether the caller
holds a psycopg 3 connection, a SQLAlchemy 2 ``Connection`` or a SQLAlchemy
``Session``; ``enqueue_async`` the same for their asyncio counterparts (a
psycopg ``AsyncConnection``, a SQLAlchemy ``AsyncConnection`` or
``AsyncSession``). The same ``%(name)s`` SQL runs on all six: psycopg
directly, SQLAlchemy through ``exec_driver_sql`` (the statement goes to the
DBAPI untouched, so no SQL is rewritten for it). ``run`` and ``run_async``
send the statements an enqueue's steps (``relay_core.inserts``) ask for.
"""

from __future__ import annotations

from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row, tuple_row

from . import prepared
from .inserts import Statement, Steps
from .migrate import SchemaNeeded
from .pools import RelayConnection

T = TypeVar("T")

SYNC_KINDS = "a psycopg Connection or a SQLAlchemy Connection or Session"
ASYNC_KINDS = "a psycopg AsyncConnection or a SQLAlchemy AsyncConnection or AsyncSession"


def _made_by(conn: Any, package: str) -> bool:
    """Whether ``conn``'s class or one it derives from belongs to ``package``.

    By the classes' modules, so SQLAlchemy (an optional dependency) is never
    imported; through the whole MRO, so an application's own subclass of a
    Session or an AsyncSession (``sessionmaker(class_=...)``) is one too.
    """
    return any(c.__module__ == package or c.__module__.startswith(package + ".") for c in type(conn).__mro__)


def is_async_connection(conn: Any) -> bool:
    """Whether ``conn`` is an asyncio connection (psycopg or SQLAlchemy): its calls must be awaited.

    Of SQLAlchemy's asyncio objects only an AsyncConnection and an AsyncSession
    are in a transaction; an AsyncEngine or a session factory is not one.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return True
    return _made_by(conn, "sqlalchemy.ext.asyncio") and (
        hasattr(conn, "exec_driver_sql") or (hasattr(conn, "connection") and hasattr(conn, "flush"))
    )


def _sqlalchemy_connection(conn: Any) -> Any | None:
    """The SQLAlchemy Connection behind ``conn``, or None if it is not SQLAlchemy."""
    if not _made_by(conn, "sqlalchemy"):
        return None
    if hasattr(conn, "exec_driver_sql"):
        return conn
    if hasattr(conn, "connection") and hasattr(conn, "flush"):  # an ORM Session
        return conn.connection()
    return None


def _check_driver(sa_conn: Any) -> None:
    """Refuse a SQLAlchemy connection whose driver does not take ``%(name)s`` parameters (asyncpg, pg8000).

    ``exec_driver_sql`` hands Relay's statements to the driver untouched: such
    a driver failed with a syntax error at the first ``%`` and left the
    caller's transaction aborted. Refused before anything is sent, it is not.
    """
    dialect = sa_conn.dialect
    if dialect.paramstyle != "pyformat":
        raise TypeError(
            f"conn runs on SQLAlchemy's {dialect.driver} driver, whose statements take {dialect.paramstyle} "
            "parameters; Relay's take %(name)s ones: use an engine on psycopg 3 (postgresql+psycopg://, "
            "which Relay installs) or psycopg2 (postgresql+psycopg2://, sync only)"
        )


def _cursor(conn: Any, row_factory: Any) -> Any:
    """A cursor on the caller's psycopg connection that makes the rows Relay reads.

    The connection's own kind of cursor, so what the caller built into it (a
    tracing or logging subclass) sees Relay's statements too; its row factory
    is the caller's choice (dict_row is common), so Relay names its own. A
    raw cursor takes $1 placeholders, not Relay's %(name)s: a plain one then.
    """
    if issubclass(conn.cursor_factory, (psycopg.RawCursor, psycopg.AsyncRawCursor)):
        plain = psycopg.AsyncCursor if isinstance(conn, psycopg.AsyncConnection) else psycopg.Cursor
        return plain(conn, row_factory=row_factory)
    return conn.cursor(row_factory=row_factory)


def _prepare(conn: Any) -> bool | None:
    """Whether to prepare Relay's statement on ``conn``: always on Relay's own connections (whose
    ``prepare_threshold`` Relay sets, None behind a transaction pooler); on a caller's, as the
    caller's own statements are. Forced there, it was prepared behind PgBouncer in transaction
    mode too, and the next transaction, on another server connection, failed to find it."""
    return True if isinstance(conn, RelayConnection) else None


#: SQLAlchemy execution options for Relay's statements on a caller's connection: a connection set to
#: ``stream_results`` ran them through a server-side cursor, ``DECLARE ... CURSOR FOR INSERT``, which
#: PostgreSQL refuses (aborting the caller's transaction); they return a row or a few.
ONE_RESULT = {"stream_results": False}


def fetch_all(conn: Any, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``sql`` on a caller's connection and return its rows as dicts."""
    if isinstance(conn, psycopg.Connection):
        with _cursor(conn, dict_row) as cur:
            cur.execute(sql, params, prepare=_prepare(conn))
            # Every statement of Relay's returns rows. Not ``if cur.description``: in a
            # pipeline (``conn.pipeline()``) that is None until the rows are fetched.
            return cur.fetchall()
    if is_async_connection(conn):
        raise TypeError(
            f"conn is an asyncio connection ({type(conn).__name__}), which enqueue cannot use: "
            "`await relay.enqueue_async(..., conn=conn)` joins its transaction"
        )
    sa_conn = _sqlalchemy_connection(conn)
    if sa_conn is not None:
        _check_driver(sa_conn)
        result = sa_conn.exec_driver_sql(sql, params, execution_options=ONE_RESULT)
        if not result.returns_rows:
            return []
        return [dict(row) for row in result.mappings()]
    raise TypeError(f"conn must be {SYNC_KINDS} (or, with enqueue_async, {ASYNC_KINDS}), not {type(conn).__name__}")


def fetch_first_value(conn: Any, sql: str, params: dict[str, Any], name: str | None = None) -> Any:
    """The first column of the first row ``sql`` returns, or None when it returns no row.

    The one-job enqueue's path: on psycopg it skips building a dict per row,
    and on a connection of Relay's pools it skips building a cursor, or,
    given the statement's ``name``, runs it by its prepared name below the
    cursor (``prepared.first_value``).
    """
    if isinstance(conn, RelayConnection):
        if name is not None:
            ran, value = prepared.first_value(conn, name, params)
            if ran:
                return value
        cur = conn.kept_cursor()
        cur.execute(sql, params, prepare=True)
        row = cur.fetchone()
        return None if row is None else row[0]
    if isinstance(conn, psycopg.Connection):
        # The insert has run by the time its row is read: reading it must not fail.
        with _cursor(conn, tuple_row) as cur:
            cur.execute(sql, params, prepare=_prepare(conn))
            row = cur.fetchone()
        return None if row is None else row[0]
    rows = fetch_all(conn, sql, params)
    return next(iter(rows[0].values())) if rows else None


def run(conn: Any, steps: Steps[T]) -> T:
    """Send each statement ``steps`` asks for on ``conn``; return what the steps return.

    A statement refused because Relay's schema is missing or behind this
    release raises ConfigurationError saying to migrate (``migrate.SchemaNeeded``).
    """
    with SchemaNeeded(conn):
        try:
            statement = next(steps)
            while True:
                if statement.first_value:
                    answer = fetch_first_value(conn, statement.sql, statement.params, statement.name)
                else:
                    answer = fetch_all(conn, statement.sql, statement.params)
                statement = steps.send(answer)
        except StopIteration as done:
            return done.value


async def run_async(conn: Any, steps: Steps[T]) -> T:
    """Send each statement ``steps`` asks for on the asyncio connection ``conn``; return what the steps return."""
    if not is_async_connection(conn):
        raise TypeError(
            f"conn must be {ASYNC_KINDS}, not {type(conn).__name__}"
            + (": `relay.enqueue(..., conn=conn)` joins its transaction" if _is_sync_connection(conn) else "")
        )
    if _made_by(conn, "sqlalchemy"):
        if not hasattr(conn, "exec_driver_sql"):
            conn = await conn.connection()  # an AsyncSession: its connection, in its transaction
        _check_driver(conn)
    with SchemaNeeded(conn):
        try:
            statement = next(steps)
            while True:
                rows = await _fetch_all_async(conn, statement)
                answer: Any = rows
                if statement.first_value:
                    answer = next(iter(rows[0].values())) if rows else None
                statement = steps.send(answer)
        except StopIteration as done:
            return done.value


async def _fetch_all_async(conn: Any, statement: Statement) -> list[dict[str, Any]]:
    if isinstance(conn, psycopg.AsyncConnection):
        async with _cursor(conn, dict_row) as cur:
            await cur.execute(statement.sql, statement.params, prepare=None)  # the caller's policy, as _prepare
            return await cur.fetchall()  # rows even in a pipeline (see fetch_all)
    result = await conn.exec_driver_sql(statement.sql, statement.params, execution_options=ONE_RESULT)
    if not result.returns_rows:
        return []
    return [dict(row) for row in result.mappings()]


def _is_sync_connection(conn: Any) -> bool:
    """Whether ``conn`` is one that ``enqueue`` takes (checked without opening anything on it)."""
    if isinstance(conn, psycopg.Connection):
        return True
    return (
        _made_by(conn, "sqlalchemy")
        and not is_async_connection(conn)
        and (hasattr(conn, "exec_driver_sql") or (hasattr(conn, "connection") and hasattr(conn, "flush")))
    )
