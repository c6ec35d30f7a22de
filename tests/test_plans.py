"""Statements that find jobs by id read them through the primary key, whatever ANALYZE last saw.

An ANALYZE of relay.jobs while every job was queued (autovacuum's, or the
bench's before a drain) made the partial index of claimed jobs look like one
row, and the completion of a batch of jobs joined its ids against every entry
of that index: each statement took seconds, and a drain of 20,000 jobs ran at
a tenth of its speed. Checked on the plans themselves (EXPLAIN runs nothing).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Relay
from relay_core.migrate import migrate
from relay_core.queries import sql

#: The statements that find their jobs by id, and the alias their jobs go by in it.
FOUND_BY_ID = {
    "job_claim": "j",  # its UPDATE of the chosen ids (the candidates come from jobs_runnable_idx)
    "job_heartbeat_many": "j",
    "job_succeed_many": "j",
    "job_succeed_in_transaction": "j",
    "job_succeeded_with_tokens": "j",
    "job_fail_many": "j",
    "job_snooze_many": "j",
    "job_hand_back_many": "j",
    "job_requeue": "jobs",
    "job_cancel": "jobs",
    "job_request_cancel": "jobs",
    "job_cancel_running_many": "j",
    "job_set_progress": "jobs",
    "job_requeue_matching": "j",
    "job_cancel_matching": "j",
    "job_rescue_expired": "j",  # its UPDATE of the rows its subquery locked (those come from jobs_lease_idx)
}

IDS = list(range(1, 11))
#: A value for each parameter these statements take, by name.
PARAMS: dict[str, Any] = {
    "ids": IDS,
    "tokens": [1] * len(IDS),
    "results": ["null"] * len(IDS),
    "result": "null",
    "next_statuses": ["queued"] * len(IDS),
    "delays": [0.0] * len(IDS),
    "runs_on": [0.0] * len(IDS),
    "messages": ["failed"] * len(IDS),
    "errors": ["{}"] * len(IDS),
    "unstarted": [False] * len(IDS),
    "id": 5,
    "token": 1,
    "progress": "{}",
    "lease_seconds": 30,
    "queues": ["default"],
    "limit": 10,
    "worker_id": "plans",
    "locked": False,
    "last_attempt_room": 10,
    "idle_slots": 8,
    "status": None,
    "queue": None,
    "type": None,
    "q": None,
    "finished_by": None,
    "after": 0,
    "max_id": 100,
    "batch": 10,
    "held_ids": [],
    "held_tokens": [],
    "restart_grace": 0,
    "stall_seconds": 2,
}


@pytest.fixture(scope="module", params=["queued", "succeeded"])
def analyzed_dsn(database_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of its own with 20,000 jobs, analyzed while all were queued, or all had succeeded."""
    dsn = database_url  # the server's address; nothing is written to the session's database
    name = f"relay_plans_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    own = conninfo.make_conninfo(dsn, dbname=name)
    try:
        migrate(own)
        relay = Relay(own)
        try:
            relay.enqueue_many([{"type": "plans", "payload": {"n": n}, "max_attempts": 3} for n in range(20_000)])
        finally:
            relay.close()
        with psycopg.connect(own, autocommit=True) as conn:
            if request.param == "succeeded":
                conn.execute("UPDATE relay.jobs SET status = 'succeeded', attempts = 1, finished_at = now()")
            conn.execute("ANALYZE relay.jobs")
        yield own
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _scans(child)


@pytest.mark.parametrize(("name", "alias"), sorted(FOUND_BY_ID.items()))
def test_a_statement_finding_jobs_by_id_reads_them_through_the_primary_key(
    analyzed_dsn: str, name: str, alias: str
) -> None:
    text = sql(name)
    params = {key: PARAMS[key] for key in set(re.findall(r"%\((\w+)\)s", text))}
    with psycopg.connect(analyzed_dsn) as conn:
        statement = psycopg.ClientCursor(conn).mogrify(text, params)
        ((plan,),) = conn.execute(f"EXPLAIN (FORMAT JSON) {statement}").fetchall()
        conn.rollback()
    reads = [
        node
        for node in _scans(plan[0]["Plan"])
        if node.get("Relation Name") == "jobs"
        # A CTE's reads of the same alias are numbered (j_1, j_2).
        and re.fullmatch(rf"{alias}(_\d+)?", node.get("Alias", ""))
        and "Scan" in node["Node Type"]
    ]
    assert reads, f"{name}: no read of relay.jobs AS {alias} in the plan"
    assert {node.get("Index Name") for node in reads} == {"jobs_pkey"}, [
        (node["Node Type"], node.get("Index Name")) for node in reads
    ]
