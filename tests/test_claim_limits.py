"""The claim when job types have limits: held-back jobs are not read, and a nearly full type crowds out nothing."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from relay_core.queries import sql

HELD_BACK = 50_000


def claim(db: psycopg.Connection, limit: int = 8, explain: bool = False) -> Any:
    """One limited claim as a worker sends it (the limits lock, then the claim), rolled back."""
    params = {"queues": ["default"], "locked": True, "limit": limit, "worker_id": "w", "lease_seconds": 30.0}
    statement = sql("job_claim")
    if explain:
        statement = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement
    with db.transaction() as tx:
        db.execute(sql("claim_limits_lock"))
        with db.cursor(row_factory=dict_row) as cur:
            result = cur.execute(statement, params).fetchall()
        raise psycopg.Rollback(tx)
    return result


def enqueue_sql(db: psycopg.Connection, job_type: str, count: int) -> None:
    db.execute(
        "INSERT INTO relay.jobs (type, queue, run_at) SELECT %s, 'default', now() - interval '1 minute' "
        "FROM generate_series(1, %s)",
        (job_type, count),
    )


@pytest.fixture
def db_no_jit(db: psycopg.Connection) -> psycopg.Connection:
    db.execute("SET jit = off")  # as on Relay's own connections
    return db


def test_a_backlog_held_back_by_its_rate_limit_is_not_read_by_every_claim(db_no_jit: psycopg.Connection) -> None:
    db = db_no_jit
    db.execute("INSERT INTO relay.type_limits (type, rate_limit, rate_period_seconds) VALUES ('newsletter', 1, 3600)")
    db.execute("INSERT INTO relay.rate_starts (type) VALUES ('newsletter')")  # its window is used up
    enqueue_sql(db, "newsletter", HELD_BACK)
    db.execute("INSERT INTO relay.jobs (type, queue) SELECT 'receipt', 'default' FROM generate_series(1, 10)")
    db.execute("ANALYZE relay.jobs")

    assert [row["type"] for row in claim(db)] == ["receipt"] * 8
    plan = claim(db, explain=True)[0]
    plan = plan["QUERY PLAN"] if isinstance(plan["QUERY PLAN"], list) else json.loads(plan["QUERY PLAN"])
    top = plan[0]["Plan"]
    buffers = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    # Reading past the held-back jobs in claim order touched every one of their pages (over a thousand
    # blocks here); skipping their type costs a few index probes.
    assert buffers < 300, buffers


def test_a_type_with_room_for_one_does_not_crowd_the_others_out_of_a_claim(db_no_jit: psycopg.Connection) -> None:
    db = db_no_jit
    db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('report', 1)")
    enqueue_sql(db, "report", 50)  # older: first in claim order
    db.execute("INSERT INTO relay.jobs (type, queue) SELECT 'receipt', 'default' FROM generate_series(1, 10)")

    claimed = sorted(row["type"] for row in claim(db))
    assert claimed == ["receipt"] * 7 + ["report"]


def test_limits_are_still_held_across_queues_and_types(db_no_jit: psycopg.Connection) -> None:
    """A type offered by two queues takes no more than its room; unlimited types fill the rest in claim order."""
    db = db_no_jit
    db.execute("INSERT INTO relay.type_limits (type, max_running) VALUES ('report', 2)")
    for queue in ("default", "mail"):
        db.execute(
            "INSERT INTO relay.jobs (type, queue, run_at) "
            "SELECT 'report', %s, now() - interval '1 minute' FROM generate_series(1, 5)",
            (queue,),
        )
    db.execute("INSERT INTO relay.jobs (type, queue, priority) SELECT 'urgent', 'mail', -1 FROM generate_series(1, 3)")
    db.execute("INSERT INTO relay.jobs (type, queue) SELECT 'receipt', 'default' FROM generate_series(1, 10)")
    params = {"queues": ["default", "mail"], "locked": True, "limit": 8, "worker_id": "w", "lease_seconds": 30.0}
    with db.transaction():
        db.execute(sql("claim_limits_lock"))
        rows = db.execute(sql("job_claim"), params).fetchall()
    types = sorted(row[1] for row in rows)
    assert types == ["receipt"] * 3 + ["report"] * 2 + ["urgent"] * 3
    # The next claim finds the limited type full.
    with db.transaction():
        db.execute(sql("claim_limits_lock"))
        rows = db.execute(sql("job_claim"), params).fetchall()
    assert sorted(row[1] for row in rows) == ["receipt"] * 7
