"""Vacuum Relay's own tables where the server's autovacuum will not.

A queue table is rewritten all day: every claim and every completion leaves a
dead row version behind, every pruned job another. Autovacuum makes that space
reusable; on a server where it is switched off (for the whole server, or for
one table) retention can delete all it likes and the table and its indexes
still grow without bound. There the worker does autovacuum's job for Relay's
tables, with autovacuum's own trigger rule, and analyzes them as it goes
(autovacuum off is autoanalyze off too, and a planner left with the table's
first statistics misjudges a backlog). Where autovacuum runs, this does
nothing but one cheap catalog read.

``VACUUM (SKIP_LOCKED)`` lets two workers that decide at once skip each other
instead of queueing; VACUUM takes no lock that blocks claims or completions.
"""

from __future__ import annotations

import logging

import psycopg
from psycopg import sql as pgsql

from ..logs import event
from ..queries import sql
from ..sessions import in_autocommit

#: Dead row versions a table may hold before it is vacuumed ...
VACUUM_THRESHOLD = 1000
#: ... plus this fraction of its live rows (the jobs table's own autovacuum settings).
VACUUM_SCALE_FACTOR = 0.05
#: A table vacuumed (by anyone) less than this long ago waits, as autovacuum waits its
#: naptime between passes: while an old snapshot held dead rows back, every worker vacuumed
#: again each check, removing nothing.
VACUUM_NAPTIME_SECONDS = 60


#: Tables this process already warned it may not vacuum (the check repeats every few seconds).
_warned_not_allowed: set[str] = set()


def vacuum_if_needed(conn: psycopg.Connection, *, untimed: bool = True) -> list[str]:
    """Vacuum every Relay table autovacuum should vacuum but will not; name those vacuumed.

    A table this session's role may not vacuum (it does not own it: migrations
    ran as another role) is not vacuumed but named in a warning, once per
    process: VACUUM itself would only warn on the server and skip it.

    ``untimed``: with no statement timeout, as autovacuum runs. Under the
    role's or the database's (meant for the application's statements), a
    vacuum of a table grown past a few seconds' work was cancelled every
    time, and the table it was there to keep in bounds grew for good. Not
    behind a transaction pooler, where a session setting would stay on a
    server connection other clients use next.
    """
    rows = conn.execute(
        sql("tables_needing_vacuum"),
        {"threshold": VACUUM_THRESHOLD, "scale_factor": VACUUM_SCALE_FACTOR, "naptime": VACUUM_NAPTIME_SECONDS},
    ).fetchall()
    conn.commit()
    tables = [name for name, may_vacuum in rows if may_vacuum]
    not_allowed = sorted(name for name, may_vacuum in rows if not may_vacuum and name not in _warned_not_allowed)
    if not_allowed:
        _warned_not_allowed.update(not_allowed)
        event(
            logging.WARNING,
            "cannot vacuum tables autovacuum does not reach: this role does not own them; "
            "turn autovacuum on for them, or run the workers as their owner",
            tables=",".join(not_allowed),
        )
    if not tables:
        return []
    with in_autocommit(conn):  # VACUUM cannot run inside a transaction, so neither can a SET LOCAL before it
        if untimed:
            conn.execute("SET statement_timeout = 0")
        try:
            for table in tables:
                conn.execute(pgsql.SQL("VACUUM (SKIP_LOCKED, ANALYZE) {}").format(pgsql.Identifier("relay", table)))
        finally:
            if untimed and not conn.broken:
                conn.execute("RESET statement_timeout")
    event(logging.INFO, "vacuumed tables autovacuum does not reach", tables=",".join(tables))
    return tables
