"""One state machine: every statement that writes ``status`` is a legal transition.

Statically, each statement in relay_core/sql/*.sql that writes ``status``
declares its transitions, each declared transition is in
``relay_core.states.TRANSITIONS``, and an UPDATE guards on the state it
leaves. Dynamically, a trigger records every status change while real
workers and admin actions run, and every change seen must be legal.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psycopg
import pytest

from relay_core import Backoff, PermanentFailure, Relay, Snooze
from relay_core.queries import QUERIES, sql
from relay_core.states import NEW, TRANSITIONS, is_legal
from relay_core.worker.maintenance import sweep_once

from .helpers import claim_params, running_worker, wait_for

ROOT = Path(__file__).resolve().parent.parent
WRITES_STATUS = re.compile(r"\bSET\s+status\s*=|\bUPDATE\s+relay\.jobs\b[\s\S]*?\bstatus\s*=", re.IGNORECASE)
INSERTS_JOB = re.compile(r"\bINSERT\s+INTO\s+relay\.jobs\b", re.IGNORECASE)


def writes_status(sql: str) -> bool:
    """Whether a statement sets the status column or creates a job."""
    updates = [m for m in re.finditer(r"\bUPDATE\s+relay\.jobs\b", sql, re.IGNORECASE)]
    for match in updates:
        set_clause = re.search(r"\bSET\b([\s\S]*?)\b(FROM|WHERE|RETURNING)\b", sql[match.end() :], re.IGNORECASE)
        if set_clause and re.search(r"(^|[\s,])status\s*=", set_clause.group(1)):
            return True
    return bool(INSERTS_JOB.search(sql))


def test_every_status_writer_declares_legal_guarded_transitions() -> None:
    writers = {name: q for name, q in QUERIES.items() if writes_status(q.sql)}
    assert {
        "job_insert",
        "job_insert_keyed",
        "job_insert_many",
        "job_claim",
        "job_succeed_many",
        "job_fail_many",
        "job_rescue_expired",
        "job_requeue",
        "job_cancel",
    } <= set(writers)
    for name, query in writers.items():
        assert query.transitions, f"{name} writes status but declares no transition"
        for frm, to in query.transitions:
            assert is_legal(frm, to), f"{name}: {frm} -> {to} is not in the state machine"
            assert f"'{to}'" in query.sql, f"{name}: target state {to!r} does not appear in its SQL"
            if frm != NEW:
                # status::text: statements that find jobs by id compare it as text (see queries.sql).
                column = r"status(?:::text)?"
                guard = re.search(rf"{column}\s*=\s*'{frm}'|{column}\s+IN\s*\([^)]*'{frm}'", query.sql)
                assert guard, f"{name}: UPDATE from {frm!r} is not guarded by status"


def test_statements_that_declare_transitions_really_write_status() -> None:
    for name, query in QUERIES.items():
        if query.transitions:
            assert writes_status(query.sql), f"{name} declares transitions but writes no status"


def test_no_python_module_writes_job_status() -> None:
    offenders = []
    for folder in ("relay_core", "relay_web"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if re.search(r"UPDATE\s+relay\.jobs|INSERT\s+INTO\s+relay\.jobs", text, re.IGNORECASE):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"job writes outside relay_core/sql: {offenders}"


AUDIT = """
CREATE TABLE relay_test.transitions (from_status text, to_status text);
CREATE FUNCTION relay_test.record_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO relay_test.transitions VALUES ('(new)', NEW.status::text);
    ELSIF NEW.status IS DISTINCT FROM OLD.status THEN
        INSERT INTO relay_test.transitions VALUES (OLD.status::text, NEW.status::text);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER relay_test_audit AFTER INSERT OR UPDATE ON relay.jobs
    FOR EACH ROW EXECUTE FUNCTION relay_test.record_transition();
"""

UNDO_AUDIT = """
DROP TRIGGER IF EXISTS relay_test_audit ON relay.jobs;
DROP TABLE IF EXISTS relay_test.transitions;
DROP FUNCTION IF EXISTS relay_test.record_transition();
"""


@pytest.fixture
def audited(db: psycopg.Connection):  # type: ignore[no-untyped-def]
    db.execute(AUDIT)
    yield db
    db.execute(UNDO_AUDIT)


def test_every_transition_seen_under_real_work_is_legal(relay: Relay, audited: psycopg.Connection) -> None:
    snoozed: set[int] = set()

    @relay.handler("ok")
    def ok(job):  # type: ignore[no-untyped-def]
        return None

    @relay.handler("flaky", max_attempts=2, backoff=Backoff(base=0.05, jitter=0))
    def flaky(job):  # type: ignore[no-untyped-def]
        raise RuntimeError("still broken")

    @relay.handler("hopeless")
    def hopeless(job):  # type: ignore[no-untyped-def]
        raise PermanentFailure("bad address")

    @relay.handler("sleepy")
    def sleepy(job):  # type: ignore[no-untyped-def]
        if job.id not in snoozed:
            snoozed.add(job.id)
            raise Snooze(0.1)

    @relay.handler("stoppable")
    def stoppable(job):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            job.raise_if_cancelled()
            time.sleep(0.05)

    ids = {name: relay.enqueue(name) for name in ("ok", "flaky", "hopeless", "sleepy", "stoppable")}
    cancelled = relay.enqueue("ok", run_at=None, queue="parked")
    relay.cancel(cancelled)
    with running_worker(relay, concurrency=3, heartbeat_interval=0.3):
        wait_for(lambda: relay.get_job(ids["stoppable"]).status == "claimed", what="stoppable job running")
        relay.cancel(ids["stoppable"])
        wait_for(lambda: relay.get_job(ids["stoppable"]).status == "cancelled", what="running job cancelled")
        wait_for(lambda: relay.get_job(ids["flaky"]).status == "dead", what="flaky job dead")
        wait_for(lambda: relay.get_job(ids["sleepy"]).status == "succeeded", what="snoozed job done")
        wait_for(lambda: relay.get_job(ids["hopeless"]).status == "dead", what="permanent failure dead")
        relay.requeue(ids["hopeless"])
        relay.requeue(cancelled)
        wait_for(lambda: relay.get_job(ids["hopeless"]).status == "dead", what="requeued job dead again")
    # Lease expiry and hand-back, driven through the same statements the worker uses.
    expiring = relay.enqueue("ok", queue="sweep")
    audited.execute(
        sql("job_claim"),
        claim_params(queues=["sweep"], limit=5, worker_id="gone", lease_seconds=0, locked=False),
    )
    assert sweep_once(audited)["queued"] == 1
    token = audited.execute(
        sql("job_claim"),
        claim_params(queues=["sweep"], limit=5, worker_id="w", lease_seconds=30, locked=False),
    ).fetchone()[7]
    handed = audited.execute(
        sql("job_hand_back_many"), {"ids": [expiring], "tokens": [token], "delays": [0.0]}
    ).fetchall()
    assert handed == [(expiring,)]

    seen = set(audited.execute("SELECT from_status, to_status FROM relay_test.transitions").fetchall())
    illegal = {t for t in seen if not is_legal(*t)}
    assert illegal == set()
    assert seen == set(TRANSITIONS), f"not exercised: {set(TRANSITIONS) - seen}"
