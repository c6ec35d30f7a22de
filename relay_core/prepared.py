"""Relay's statements prepared under names of its own on a connection's session, and the one-value ones run by them.

A worker's transactions sent as one message name statements prepared here
(``worker.one_message``). A one-job enqueue on Relay's own pool runs its
insert by name below psycopg's cursor (``first_value``): that statement,
committed on its own, is W2 of the benchmark. The cursor's own work
(converting and dumping the parameters, its prepared-statement bookkeeping,
building the result) was a third of the client's CPU for it: a one-row
insert on a held connection, 3,000 per round, nine rounds, medians, on the
2-core development machine, took 70-75 us through a kept cursor, 56 us sent
as here and 41-47 us through libpq's blocking call. The parameters go as
text, and the round trip is psycopg's own (``Connection.wait`` on its
``execute`` generator), not libpq's blocking one, so an interrupt still
cancels the statement on the server; errors are psycopg's exceptions.

``first_value`` runs a statement only where that is safe, and otherwise
leaves it to the cursor, having run nothing:

* an autocommit connection, not in a pipeline, with no transaction open: a
  psycopg connection outside autocommit would send its BEGIN first, which
  this path would skip;
* psycopg's own kind of cursor: a connection whose holder chose another (a
  tracing subclass) has Relay's statements go through it;
* a connection that prepares statements: behind a transaction pooler a
  named statement is missing on the next server connection;
* UTF-8 as the client encoding, and parameters that are str, int, bool or
  None, with no NUL character (the cursor refuses one with psycopg's error;
  a text parameter would end at it).

The statements run this way must let the server tell each parameter's type
from the statement alone, as Relay's inserts do: no type travels with a
parameter sent as text.

psycopg sends DEALLOCATE ALL whenever it empties its own cache of prepared
statements (after a ROLLBACK, a DROP or an ALTER it ran, say), and Relay's go
with its: a statement run by a name the session no longer has ran nothing, so it
is prepared again and run once more.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any

import psycopg
from psycopg import generators, pq
from psycopg.errors import error_from_result
from psycopg.pq.abc import PGresult

from .queries import sql

#: psycopg's named placeholder, ``%(name)s``.
PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@functools.cache
def positional(name: str) -> tuple[str, tuple[str, ...]]:
    """The statement ``name`` with its placeholders numbered ``$1``, ``$2``, ... and their names in that order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return PLACEHOLDER.sub(number, sql(name)), tuple(names)


def prepared_name(name: str) -> str:
    """The session's name for the statement called ``name`` (apart from psycopg's own ``_pg3_*``)."""
    return f"relay_{name}"


class PreparedHere:
    """What one connection's session has prepared of Relay's statements, and the loaders of their results."""

    __slots__ = ("loaders", "names")

    def __init__(self) -> None:
        #: The statements prepared, by Relay's name for them (``job_insert``).
        self.names: set[str] = set()
        #: psycopg's loader for each result type read so far, by oid.
        self.loaders: dict[int, Any] = {}


_PREPARED_ON: weakref.WeakKeyDictionary[psycopg.Connection, PreparedHere] = weakref.WeakKeyDictionary()
_PREPARED_ON_LOCK = threading.Lock()


def prepared_on(conn: psycopg.Connection) -> PreparedHere:
    """What ``conn``'s session has prepared of Relay's statements."""
    here = _PREPARED_ON.get(conn)
    if here is None:
        with _PREPARED_ON_LOCK:
            here = _PREPARED_ON.setdefault(conn, PreparedHere())
    return here


def forget_prepared(conn: psycopg.Connection) -> None:
    """Note that ``conn``'s session no longer holds Relay's statements (a DEALLOCATE ALL)."""
    prepared_on(conn).names.clear()


def _usable(conn: psycopg.Connection) -> bool:
    """Whether ``first_value`` may run a statement on ``conn`` (see the module's docstring); asked
    holding the connection's lock, so no other thread opens a transaction or a pipeline meanwhile."""
    pgconn = conn.pgconn
    return (
        conn.autocommit
        and conn.prepare_threshold is not None
        and conn.cursor_factory is psycopg.Cursor
        and pgconn.transaction_status == pq.TransactionStatus.IDLE
        and pgconn.pipeline_status == pq.PipelineStatus.OFF
        and conn.info.encoding == "utf-8"
    )


def _as_text(names: tuple[str, ...], params: dict[str, Any]) -> list[bytes | None] | None:
    """The parameters ``names`` of ``params`` as text, in that order; None if one is of a kind only the cursor sends."""
    values: list[bytes | None] = []
    for name in names:
        value = params[name]
        if value is None:
            values.append(None)
        elif value is True or value is False:
            values.append(b"t" if value else b"f")
        elif type(value) is int:
            values.append(str(value).encode())
        elif type(value) is str and "\x00" not in value:
            values.append(value.encode())
        else:
            return None
    return values


def first_value(conn: psycopg.Connection, name: str, params: dict[str, Any]) -> tuple[bool, Any]:
    """Run the statement ``name`` by its prepared name on ``conn``, where that is safe.

    (True, the first column of its first row, or None without a row), or
    (False, None) where the statement is left to the cursor; nothing has run then.
    """
    text, names = positional(name)
    values = _as_text(names, params)
    if values is None:
        return False, None
    here = prepared_on(conn)
    with conn.lock:
        if not _usable(conn):
            return False, None
        for _ in range(2):
            if name not in here.names:
                _prepare(conn, name, text)
                here.names.add(name)
            result = _run(conn, prepared_name(name).encode(), values)
            if result is not None:
                break
            here.names.clear()  # gone from the session with the rest: prepared again and run once more
        else:
            raise psycopg.errors.InvalidSqlStatementName(f"prepared statement {prepared_name(name)} vanished twice")
    if result.ntuples == 0 or (data := result.get_value(0, 0)) is None:
        return True, None
    oid = result.ftype(0)
    loader = here.loaders.get(oid)
    if loader is None:
        # psycopg's own fallback for a type it has no loader for: the one registered under oid 0.
        loader_class = conn.adapters.get_loader(oid, pq.Format.TEXT) or conn.adapters.get_loader(0, pq.Format.TEXT)
        loader = here.loaders[oid] = loader_class(oid, conn)
    return True, loader.load(data)


def _prepare(conn: psycopg.Connection, name: str, text: str) -> None:
    """Prepare ``name`` on ``conn``'s session."""
    pgconn = conn.pgconn
    (result,) = conn.wait(_exchange(pgconn, pgconn.send_prepare, prepared_name(name).encode(), text.encode()))
    if result.status != pq.ExecStatus.COMMAND_OK:
        error = error_from_result(result, encoding=conn.info.encoding)
        if not isinstance(error, psycopg.errors.DuplicatePreparedStatement):  # else prepared by a worker's message
            raise error


def _run(conn: psycopg.Connection, statement: bytes, values: list[bytes | None]) -> PGresult | None:
    """Run the prepared ``statement``: its last result, or None if the session no longer has it."""
    pgconn = conn.pgconn
    results = conn.wait(_exchange(pgconn, pgconn.send_query_prepared, statement, values))
    for result in results:
        if result.status != pq.ExecStatus.TUPLES_OK:
            error = error_from_result(result, encoding=conn.info.encoding)
            if isinstance(error, psycopg.errors.InvalidSqlStatementName):
                return None
            raise error
    return results[-1]


def _exchange(pgconn: Any, send: Callable[..., None], *args: Any) -> Generator[Any, Any, list[PGresult]]:
    """Send with ``send(*args)``, then read the results: one generator for ``Connection.wait``, as
    psycopg's cursor does it, so an interrupt once the query is sent still finds ``wait`` there to
    cancel it on the server and read what is left; sent outside, the connection stayed busy."""
    send(*args)
    return (yield from generators.execute(pgconn))
