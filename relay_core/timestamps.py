"""How Relay's admin reads load timestamps: every value PostgreSQL can store.

timestamptz holds ``infinity``, ``-infinity`` and years from 4713 BC to
294276; a Python datetime holds years 1 to 9999, and psycopg's loader raised
DataError on anything else. So one job a program wrote with SQL (a run_at of
``'-infinity'``, a finished_at in a year BC) made every admin API answer and
dashboard page that read it a 500: the job lists (every page holding it),
its own page, the queues, ``/metrics``. The claim clamps such times in SQL
(``job_claim``); these reads take the nearest time a datetime can hold
instead, a day inside its range so that showing it in any time zone cannot
overflow.

This loader is Python where psycopg's own is C, so it serves the admin's
reads only, never the worker's claims.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.datetime import TimestamptzLoader

#: What a time before year 1 (or ``-infinity``) is read as.
EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
#: What a time after year 9999 (or ``infinity``) is read as.
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


class ClampedTimestamptzLoader(TimestamptzLoader):
    """psycopg's timestamptz loader, with EARLIEST and LATEST for times a datetime cannot hold."""

    def load(self, data: Any) -> datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            text = bytes(data).decode("ascii", "replace").strip()
            return EARLIEST if text.startswith("-") or text.endswith("BC") else LATEST


def read_any_timestamp(target: psycopg.Connection[Any] | psycopg.Cursor[Any]) -> None:
    """Make ``target`` (a connection, or only one cursor) read timestamptz values with the clamped loader."""
    target.adapters.register_loader("timestamptz", ClampedTimestamptzLoader)
