"""Transactional enqueue (R1), bulk enqueue, idempotency keys and bad input."""

from __future__ import annotations

import os
import select
import subprocess
import time
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any, ClassVar

import psycopg
import pytest
import sqlalchemy
from psycopg import conninfo
from psycopg_pool import PoolTimeout
from sqlalchemy.orm import Session

from relay_core import ConfigurationError, IllegalTransition, InvalidJobError, Relay

from .helpers import job_status, publish_handlers, wait_for


def job_count(db: psycopg.Connection) -> int:
    return db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0]


def sa_engine(dsn: str) -> sqlalchemy.Engine:
    """A SQLAlchemy engine on the test database (TCP or a Unix socket alike)."""
    return sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))


def test_psycopg_transaction_that_raises_leaves_no_job(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    with pytest.raises(RuntimeError), psycopg.connect(dsn) as conn, conn.transaction():
        relay.enqueue("send_email", {"to": "a@b.c"}, conn=conn)
        raise RuntimeError("order failed")
    assert job_count(db) == 0


def test_psycopg_transaction_that_commits_leaves_one_job(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        job_id = relay.enqueue("send_email", {"to": "a@b.c"}, conn=conn)
        # Not visible to anyone else until the caller commits.
        assert job_count(db) == 0
    assert job_count(db) == 1
    assert relay.get_job(job_id).payload == {"to": "a@b.c"}


@pytest.mark.parametrize(
    "options",
    [
        {"row_factory": psycopg.rows.dict_row},
        {"row_factory": psycopg.rows.scalar_row},
        {"cursor_factory": psycopg.RawCursor},
    ],
    ids=["dict_row", "scalar_row", "RawCursor"],
)
def test_a_callers_connection_makes_rows_and_cursors_its_own_way(
    relay: Relay, dsn: str, db: psycopg.Connection, options: dict[str, Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True, **options) as conn:
        plain = relay.enqueue("send_email", {"n": 1}, conn=conn)
        keyed = relay.enqueue("send_email", {"n": 2}, conn=conn, idempotency_key="order-7")
        again = relay.enqueue("send_email", {"n": 3}, conn=conn, idempotency_key="order-7")
        many = relay.enqueue_many([{"type": "send_email", "payload": {"n": 4}}], conn=conn)
    assert again == keyed
    rows = db.execute("SELECT id, payload->>'n' FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [(plain, "1"), (keyed, "2"), (many[0], "4")]


def test_relays_own_connections_read_their_rows_whatever_their_holder_set(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Relay.connect() and its pools' connections (a transactional handler's ``conn``) are Relay's.

    A holder's ``dict_row`` made the read of the new id fail (KeyError: 0)
    after the insert ran: the caller got an error and the job committed with
    its transaction all the same. A pooled connection given back that way
    broke every later enqueue on it, and the worker's own statements.
    """
    with relay.connect() as conn:
        conn.row_factory = psycopg.rows.dict_row
        conn.cursor_factory = psycopg.RawCursor
        job_id = relay.enqueue("send_email", {"n": 1}, conn=conn)
        conn.commit()
    small = Relay(dsn, pool_size=1)
    try:
        with small.pool.connection() as conn:  # the pool's only connection, changed by its holder
            conn.row_factory = psycopg.rows.dict_row
            conn.cursor_factory = psycopg.RawCursor
        more = [small.enqueue("send_email", {"n": n}) for n in (2, 3)]
        with small.pool.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        small.close()
    rows = db.execute("SELECT id, payload->>'n' FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [(job_id, "1"), (more[0], "2"), (more[1], "3")]


class Tracing(psycopg.Cursor):
    """An application's cursor class that sees every statement (as a tracing library's does)."""

    seen: ClassVar[list[str]] = []

    def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def, override]
        self.seen.append(str(query))
        return super().execute(query, params, **kwargs)


@pytest.mark.parametrize("autocommit", [False, True])
def test_relays_own_connections_run_the_enqueue_on_their_holders_kind_of_cursor(relay: Relay, autocommit: bool) -> None:
    """In a transaction or in autocommit (where the insert could run by a prepared name below the
    cursor), a tracing cursor the holder chose sees the enqueue's statement."""
    Tracing.seen.clear()
    with relay.connect() as conn:
        conn.autocommit = autocommit
        conn.cursor_factory = Tracing
        relay.enqueue("send_email", {"n": 1}, conn=conn)
        if not autocommit:
            conn.commit()
    assert any("INSERT INTO relay.jobs" in statement for statement in Tracing.seen)


def test_a_transactional_handler_may_choose_its_connections_rows(relay: Relay, db: psycopg.Connection) -> None:
    """A handler's ``dict_row`` stays its own: its enqueue joins its transaction, and the worker's
    statements on that connection afterwards still read the rows they expect."""
    from .helpers import running_worker

    @relay.handler("parent")
    def parent(job, conn) -> None:  # type: ignore[no-untyped-def]
        conn.row_factory = psycopg.rows.dict_row
        relay.enqueue("child", {"of": job.id}, conn=conn)

    @relay.handler("child")
    def child(job) -> None:  # type: ignore[no-untyped-def]
        pass

    with running_worker(relay, concurrency=1) as worker:
        parents = [relay.enqueue("parent") for _ in range(3)]
        wait_for(lambda: job_status(db, parents[-1]) == "succeeded", what="the parents")
        wait_for(lambda: worker.counters.succeeded == 6, what="the children")
    statuses = db.execute("SELECT type, status::text, count(*) FROM relay.jobs GROUP BY 1, 2 ORDER BY 1").fetchall()
    assert statuses == [("child", "succeeded", 3), ("parent", "succeeded", 3)]


def test_sqlalchemy_connection_joins_the_transaction(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    engine = sa_engine(dsn)
    try:
        with pytest.raises(RuntimeError), engine.begin() as conn:
            relay.enqueue("send_email", {"n": 1}, conn=conn)
            raise RuntimeError("rolled back")
        assert job_count(db) == 0
        with engine.begin() as conn:
            relay.enqueue("send_email", {"n": 2}, conn=conn)
        assert job_count(db) == 1
    finally:
        engine.dispose()


def test_a_sqlalchemy_connection_set_to_stream_results_still_enqueues(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """``stream_results=True`` (SQLAlchemy's way to stream a large SELECT) made SQLAlchemy run Relay's
    INSERT through a server-side cursor, "DECLARE ... CURSOR FOR INSERT": a syntax error that also
    aborted the caller's transaction."""
    engine = sa_engine(dsn)
    try:
        with engine.connect() as plain:
            conn = plain.execution_options(stream_results=True)
            with conn.begin():
                one = relay.enqueue("send_email", {"n": 1}, conn=conn)
                many = relay.enqueue_many([{"type": "send_email", "payload": {"n": 2}}], conn=conn)
                keyed = [relay.enqueue("send_email", conn=conn, idempotency_key="k") for _ in range(2)]
                assert conn.exec_driver_sql("SELECT 1").scalar() == 1  # the caller's transaction goes on
        with Session(engine.execution_options(stream_results=True)) as session:
            relay.enqueue("send_email", {"n": 3}, conn=session)
            session.commit()
        assert job_count(db) == 4 and keyed[0] == keyed[1] and len({one, *many, keyed[0]}) == 3
    finally:
        engine.dispose()


class AppSession(Session):
    """An application's own session class: refused as "not a SQLAlchemy Session" before."""


@pytest.mark.parametrize("session_class", [Session, AppSession], ids=["Session", "subclass"])
def test_sqlalchemy_session_joins_the_transaction(
    relay: Relay, dsn: str, db: psycopg.Connection, session_class: type[Session]
) -> None:
    engine = sa_engine(dsn)
    try:
        with session_class(engine) as session:
            relay.enqueue("send_email", {"n": 1}, conn=session)
            session.rollback()
        assert job_count(db) == 0
        with session_class(engine) as session:
            relay.enqueue("send_email", {"n": 2}, conn=session)
            ids = relay.enqueue_many([{"type": "send_email", "payload": {"n": 3}}], conn=session)
            assert len(ids) == 1
            session.commit()
        assert job_count(db) == 2
    finally:
        engine.dispose()


def test_enqueue_without_conn_commits_at_once(relay: Relay, db: psycopg.Connection) -> None:
    job_id = relay.enqueue("report", {"month": "2026-11"}, queue="reports", priority=-5)
    row = db.execute(
        "SELECT status::text, queue, priority, attempts FROM relay.jobs WHERE id = %s", (job_id,)
    ).fetchone()
    assert row == ("queued", "reports", -5, 0)


def test_notify_fires_only_on_commit(relay: Relay, dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN relay_jobs")
        with psycopg.connect(dsn) as conn:
            relay.enqueue("a", conn=conn)
            assert select.select([listener.fileno()], [], [], 0.3)[0] == []  # nothing before commit
            conn.commit()
        notes = list(listener.notifies(timeout=2.0, stop_after=1))
        assert [n.payload for n in notes] == ["default"]


class CountingCursor(psycopg.Cursor):
    """Counts the statements sent through it."""

    executed: ClassVar[list[str]] = []

    def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def, override]
        CountingCursor.executed.append(str(query))
        return super().execute(query, params, **kwargs)


def test_enqueue_many_inserts_thousands_in_one_statement(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    relay.handler("bulk")(lambda job: None)  # its max_attempts is known here: nothing to look up
    jobs = [{"type": "bulk", "payload": {"n": n}} for n in range(5000)]
    CountingCursor.executed = []
    with psycopg.connect(dsn, cursor_factory=CountingCursor) as conn:
        ids = relay.enqueue_many(jobs, conn=conn)
        conn.commit()
    assert len(CountingCursor.executed) == 1, CountingCursor.executed
    assert len(ids) == 5000 and len(set(ids)) == 5000
    payloads = dict(db.execute("SELECT id, (payload->>'n')::int FROM relay.jobs").fetchall())
    assert [payloads[i] for i in ids] == list(range(5000)), "ids come back in input order"


def test_a_bulk_enqueue_jsonb_would_overflow_as_one_document_is_written(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """240 payloads of 200 kB, each under the limit, went as one 48 MB JSON document, which takes six
    times that as jsonb: the database refused it, and the caller's transaction was aborted."""
    numbers = [0] * 100_000  # [0,0,...]: 2 bytes of JSON, 12 of jsonb, per element
    with psycopg.connect(dsn) as conn:
        ids = relay.enqueue_many([{"type": "import_rows", "payload": numbers} for _ in range(240)], conn=conn)
        conn.execute("SELECT 1")  # the caller's transaction goes on
        conn.commit()
    assert len(set(ids)) == 240
    lengths = db.execute("SELECT min(jsonb_array_length(payload)), max(jsonb_array_length(payload)) FROM relay.jobs")
    assert lengths.fetchone() == (100_000, 100_000)


def test_a_bulk_enqueue_past_what_one_statement_carries_is_refused_before_anything_is_sent(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """Its payloads go as an array parameter of one message, which PostgreSQL holds in at most 1 GB."""
    text = "x" * 262_000  # each payload just under the default 256 KiB
    with psycopg.connect(dsn) as conn:
        with pytest.raises(InvalidJobError) as caught:
            relay.enqueue_many([{"type": "import_rows", "payload": text} for _ in range(520)], conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # nothing was sent
    assert caught.value.field == "jobs"
    sent = 520 * (len('"' + text + '"') + len("import_rows") + len("default") + 64)
    assert caught.value.message == (
        f"the batch would send {sent} characters (payloads, types, queues, keys), more than the 134217728 "
        "one enqueue_many sends; enqueue them in smaller batches"
    )
    assert job_count(db) == 0


def test_idempotency_key_returns_the_existing_job(relay: Relay, db: psycopg.Connection) -> None:
    first = relay.enqueue("charge", {"order": 1}, idempotency_key="order-1-charge")
    second = relay.enqueue("charge", {"order": 1}, idempotency_key="order-1-charge")
    assert first == second
    assert job_count(db) == 1
    many = relay.enqueue_many(
        [
            {"type": "charge", "idempotency_key": "order-1-charge"},
            {"type": "charge", "idempotency_key": "order-2-charge"},
            {"type": "charge", "idempotency_key": "order-2-charge"},
            {"type": "charge"},
        ]
    )
    assert many[0] == first
    assert many[1] == many[2] != first
    assert len(set(many)) == 3
    assert job_count(db) == 3


def nested(depth: int) -> list:
    """A list inside a list, ``depth`` deep: deeper than the JSON encoder can recurse."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


BAD_INPUTS = [
    ({"job_type": "x", "payload": {"when": datetime.now(UTC)}}, "payload"),
    ({"job_type": "x", "payload": {"f": float("nan")}}, "payload"),
    ({"job_type": "x", "payload": {"s": "a\x00b"}}, "payload"),
    ({"job_type": "x", "payload": {"s": "C:\\\x00"}}, "payload"),  # a backslash, then a NUL
    ({"job_type": "x", "payload": {"a\x00": 1}}, "payload"),
    ({"job_type": "x", "payload": {"s": "\ud800"}}, "payload"),
    ({"job_type": "x", "payload": {"\ud800": 1}}, "payload"),
    ({"job_type": "x", "payload": {"blob": "x" * 300_000}}, "payload"),
    ({"job_type": "x", "payload": nested(100_000)}, "payload"),
    # 101 levels: the encoder manages it, but every worker that claimed it could fail to read it.
    ({"job_type": "x", "payload": nested(100)}, "payload"),
    # JSON's keys are strings: the encoder made these "1", "true" and "null", and
    # {1: "a", "1": "b"} was stored as {"1": "b"}.
    ({"job_type": "x", "payload": {1: "a", "1": "b"}}, "payload"),
    ({"job_type": "x", "payload": {"rows": [{"id": 1}, {True: "yes"}]}}, "payload"),
    ({"job_type": "x", "payload": {"by_day": {f"d{n}": n for n in range(40)} | {None: 0}}}, "payload"),
    ({"job_type": "x", "run_at": datetime(2030, 1, 1)}, "run_at"),
    ({"job_type": "x", "run_at": "2030-01-01T00:00:00Z"}, "run_at"),
    # Year 0 and year 10000 in UTC: PostgreSQL stores them, but no datetime can read them back.
    ({"job_type": "x", "run_at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14)))}, "run_at"),
    ({"job_type": "x", "run_at": datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-14)))}, "run_at"),
    ({"job_type": ""}, "type"),
    ({"job_type": "   "}, "type"),
    ({"job_type": "t" * 201}, "type"),
    ({"job_type": None}, "type"),
    ({"job_type": "send\nemail"}, "type"),  # no job type holds a control character on purpose
    ({"job_type": "send_email\x7f"}, "type"),
    ({"job_type": "send\x9b31memail"}, "type"),  # a C1 control character: CSI, the terminal escape
    ({"job_type": "send\x85email"}, "type"),  # NEL, a line break to str.splitlines()
    ({"job_type": " send_email"}, "type"),  # no handler's type: it would fail every attempt
    ({"job_type": "send_email\u00a0"}, "type"),
    ({"job_type": "x", "queue": "Has Spaces"}, "queue"),
    ({"job_type": "x", "queue": "'; DROP TABLE relay.jobs; --"}, "queue"),
    ({"job_type": "x", "queue": ""}, "queue"),
    ({"job_type": "x", "queue": "emails\n"}, "queue"),  # a regular expression's $ would let the newline through
    ({"job_type": "x", "priority": 10**6}, "priority"),
    ({"job_type": "x", "priority": "high"}, "priority"),
    ({"job_type": "x", "max_attempts": 0}, "max_attempts"),
    ({"job_type": "x", "idempotency_key": ""}, "idempotency_key"),
]


def test_a_nul_in_an_idempotency_key_is_named_as_such(relay: Relay, db: psycopg.Connection) -> None:
    """A 9-character key was refused as if it were empty or over 200 characters."""
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue("charge", idempotency_key="order-42\x00")
    assert (caught.value.field, caught.value.message) == (
        "idempotency_key",
        "must not contain a NUL character ('\\x00')",
    )
    assert job_count(db) == 0


def test_a_payload_key_that_is_not_a_string_is_named(relay: Relay, db: psycopg.Connection) -> None:
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue("x", {"totals": {"2026-12": 3, 2026: 40}})
    assert (caught.value.field, caught.value.message) == ("payload", "has a key that is not a string: 2026 (int)")
    assert job_count(db) == 0


def test_a_backslash_before_u0000_is_text_not_a_nul(relay: Relay, db: psycopg.Connection) -> None:
    """JSON writes the text ``C:\\u0000dir`` as ``"C:\\\\u0000dir"``; jsonb stores it. The NUL check
    looked for ``\\u0000`` anywhere in the JSON, and refused it as a NUL character."""
    payload = {"path": "C:\\u0000dir", "odd": "\\\\\\u0000"}
    job_id = relay.enqueue("x", payload)
    assert db.execute("SELECT payload FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()[0] == payload


@pytest.mark.parametrize(("kwargs", "field"), BAD_INPUTS)
def test_bad_input_is_refused_and_writes_nothing(
    relay: Relay, db: psycopg.Connection, kwargs: dict, field: str
) -> None:
    kwargs = dict(kwargs)  # the parameters are shared with the batch test
    job_type = kwargs.pop("job_type")
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue(job_type, kwargs.pop("payload", {}), **kwargs)
    assert caught.value.field == field
    assert job_count(db) == 0


@pytest.mark.parametrize(("kwargs", "field"), BAD_INPUTS)
def test_bad_input_in_a_batch_is_refused_by_position_and_writes_nothing(
    relay: Relay, db: psycopg.Connection, kwargs: dict, field: str
) -> None:
    item = {("type" if key == "job_type" else key): value for key, value in kwargs.items()}
    # Good items of the same type and queue first: the bad one is found wherever it stands.
    batch = [{"type": "x", "payload": {"n": n}} for n in range(3)] + [item]
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue_many(batch)
    assert caught.value.field == f"jobs[3].{field}"
    assert job_count(db) == 0


class OffsetOnlyBeforeFold(tzinfo):
    """A zone whose second pass of a repeated hour (fold=1) has no known offset."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None if dt is not None and dt.fold else timedelta(hours=1)

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None


def test_a_batch_checks_a_run_at_equal_to_a_good_one_but_without_an_offset(
    relay: Relay, db: psycopg.Connection
) -> None:
    zone = OffsetOnlyBeforeFold()
    good = datetime(2030, 1, 1, 12, tzinfo=zone)
    unknown = good.replace(fold=1)
    assert good == unknown  # Python compares them equal: same wall time, same tzinfo
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue_many([{"type": "x", "run_at": good}, {"type": "x", "run_at": unknown}])
    assert caught.value.field == "jobs[1].run_at"
    assert job_count(db) == 0


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [("priority", 1, True), ("priority", 0, False), ("max_attempts", 3, 3.0), ("max_attempts", 1, True)],
)
def test_a_batch_tells_a_good_value_from_an_equal_one_of_another_kind(
    relay: Relay, db: psycopg.Connection, field: str, good: object, bad: object
) -> None:
    # A batch checks each combination of type, queue, priority, run_at and max_attempts
    # once; True == 1 and 3.0 == 3 in Python, but they are not what these fields take.
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue_many([{"type": "x", field: good}, {"type": "x", field: good}, {"type": "x", field: bad}])
    assert caught.value.field == f"jobs[2].{field}"
    assert job_count(db) == 0


def test_a_mixed_batch_keeps_every_field_and_the_input_order(relay: Relay, db: psycopg.Connection) -> None:
    later = datetime(2030, 1, 1, tzinfo=UTC)
    batch = [
        {"type": "a", "payload": {"n": 0}},
        {"type": "b", "payload": {"n": 1}, "queue": "emails", "priority": -5},
        {"type": "a", "payload": {"n": 2}, "run_at": later, "max_attempts": 3},
        {"type": "a", "payload": {"n": 3}, "idempotency_key": "k3"},
    ]
    ids = relay.enqueue_many(batch)
    rows = {
        row[0]: row[1:]
        for row in db.execute(
            "SELECT id, type, (payload->>'n')::int, queue, priority, run_at = %s, max_attempts, idempotency_key "
            "FROM relay.jobs",
            (later,),
        )
    }
    assert [rows[i] for i in ids] == [
        ("a", 0, "default", 0, False, 20, None),
        ("b", 1, "emails", -5, False, 20, None),
        ("a", 2, "default", 0, True, 3, None),
        ("a", 3, "default", 0, False, 20, "k3"),
    ]


def test_a_batch_of_alike_jobs_keeps_run_at_priority_and_queue(relay: Relay, db: psycopg.Connection) -> None:
    later = datetime(2030, 1, 1, tzinfo=UTC)
    ids = relay.enqueue_many(
        [{"type": "a", "payload": {"n": n}, "queue": "q1", "priority": 7, "run_at": later} for n in range(50)]
    )
    rows = db.execute(
        "SELECT id, (payload->>'n')::int, queue, priority, run_at, max_attempts, status::text "
        "FROM relay.jobs ORDER BY id"
    ).fetchall()
    assert [r[0] for r in rows] == ids
    assert [r[1] for r in rows] == list(range(50))
    assert {r[2:] for r in rows} == {("q1", 7, later, 20, "queued")}


def test_a_none_payload_is_stored_as_empty_object_one_job_or_many(relay: Relay, db: psycopg.Connection) -> None:
    one = relay.enqueue("a", None)
    alike = relay.enqueue_many([{"type": "a", "payload": None}, {"type": "a"}])
    mixed = relay.enqueue_many([{"type": "a", "payload": None, "idempotency_key": "k"}, {"type": "b"}])
    payloads = dict(db.execute("SELECT id, payload FROM relay.jobs").fetchall())
    assert [payloads[i] for i in [one, *alike, *mixed]] == [{}] * 5


def test_one_bad_item_refuses_the_whole_batch(relay: Relay, db: psycopg.Connection) -> None:
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue_many([{"type": "ok"}, {"type": "ok", "run_at": datetime(2030, 1, 1)}])
    assert caught.value.field == "jobs[1].run_at"
    with pytest.raises(InvalidJobError, match="unknown fields"):
        relay.enqueue_many([{"type": "ok", "colour": "red"}])
    assert job_count(db) == 0


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        (
            "max_payload_bytes",
            0,
            "max_payload_bytes (RELAY_MAX_PAYLOAD_BYTES) must be from 1 to 33554432 (32 MiB), got 0",
        ),
        # A limit jsonb cannot hold: the database refused a payload under it, aborting the caller's transaction.
        (
            "max_payload_bytes",
            400 * 1024 * 1024,
            "max_payload_bytes (RELAY_MAX_PAYLOAD_BYTES) must be from 1 to 33554432 (32 MiB), got 419430400",
        ),
        ("default_max_attempts", 0, "default_max_attempts must be an integer between 1 and 1000, got 0"),
        ("default_max_attempts", True, "default_max_attempts must be an integer between 1 and 1000, got True"),
        ("pool_size", 0, "pool_size must be a whole number of connections, at least 1, got 0"),
    ],
)
def test_a_setting_no_enqueue_could_work_with_is_refused_when_the_relay_is_made(
    dsn: str, setting: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Relay(dsn, **{setting: value})
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("jobs", "field", "message"),
    [
        ({"type": "a"}, "jobs", "must be a list of mappings (one per job), got dict"),
        (None, "jobs", "must be a list of mappings (one per job), got NoneType"),
        ("a", "jobs", "must be a list of mappings (one per job), got str"),
        ([{"type": "a"}, 5], "jobs[1]", "must be a mapping with a type, got int"),
        ([None], "jobs[0]", "must be a mapping with a type, got NoneType"),
    ],
)
def test_a_batch_that_is_not_a_list_of_mappings_is_refused(
    relay: Relay, db: psycopg.Connection, jobs: Any, field: str, message: str
) -> None:
    with pytest.raises(InvalidJobError) as caught:
        relay.enqueue_many(jobs)
    assert (caught.value.field, caught.value.message) == (field, message)
    assert job_count(db) == 0


def test_payload_limit_is_configurable(dsn: str, db: psycopg.Connection) -> None:
    small = Relay(dsn, max_payload_bytes=100)
    try:
        with pytest.raises(InvalidJobError, match="over the limit of 100"):
            small.enqueue("x", {"blob": "y" * 200})
        assert job_count(db) == 0
    finally:
        small.close()


def test_run_at_at_the_very_edges_of_the_utc_calendar_is_kept(relay: Relay) -> None:
    first = datetime(1, 1, 1, 14, tzinfo=timezone(timedelta(hours=14)))
    last = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    for run_at in (first, last):
        assert relay.get_job(relay.enqueue("x", {}, run_at=run_at)).run_at == run_at


def test_run_at_is_stored_as_given_and_now_comes_from_the_database(relay: Relay, db: psycopg.Connection) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    scheduled = relay.enqueue("x", run_at=later)
    immediate = relay.enqueue("x")
    rows = dict(db.execute("SELECT id, run_at FROM relay.jobs").fetchall())
    assert rows[scheduled] == later
    db_now = db.execute("SELECT now()").fetchone()[0]
    assert abs((rows[immediate] - db_now).total_seconds()) < 5


def test_a_pooled_connection_that_died_while_idle_is_replaced(relay: Relay, db: psycopg.Connection) -> None:
    relay.enqueue("warm_up")
    killed = db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
    ).fetchall()
    assert killed
    time.sleep(1.2)  # idle past IDLE_CHECK_SECONDS: the pool checks it and reconnects
    relay.enqueue("after_restart")
    assert job_count(db) == 2


def test_the_pool_stamps_returns_so_only_idle_connections_are_checked(relay: Relay) -> None:
    relay.enqueue("stamp")
    pool = relay.pool
    assert pool.returned_at, "a returned connection carries its return time"
    assert all(time.monotonic() - t < 5 for t in pool.returned_at.values())


@pytest.mark.parametrize("queue", ["Has Spaces", "", ".hidden", "-dash", "q" * 64, "Default"])
def test_the_table_itself_refuses_a_bad_queue_name_written_by_hand(db: psycopg.Connection, queue: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        db.execute("INSERT INTO relay.jobs (type, queue) VALUES ('x', %s)", (queue,))
    assert job_count(db) == 0


def test_the_table_accepts_the_default_queue_and_named_ones_written_by_hand(db: psycopg.Connection) -> None:
    for queue in ("default", "emails", "a.b-c_9", "q" * 63):
        db.execute("INSERT INTO relay.jobs (type, queue) VALUES ('x', %s)", (queue,))
    assert job_count(db) == 4


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("type", "", "jobs_type_check"),
        ("type", "t" * 201, "jobs_type_check"),
        ("max_attempts", 0, "jobs_max_attempts_check"),
        ("queue", "Has Spaces", "jobs_queue_format"),
        ("status", "claimed", "jobs_claim_has_lease"),
    ],
)
def test_the_table_refuses_a_bad_value_written_by_hand_in_an_insert_or_an_update(
    db: psycopg.Connection, column: str, value: object, constraint: str
) -> None:
    """Written by hand, a bad value is refused by the table's checks, by name, whether a job is
    inserted with it or updated to it."""
    (job_id,) = db.execute("INSERT INTO relay.jobs (type) VALUES ('x') RETURNING id").fetchone()
    columns, values = ("type", "%s") if column == "type" else (f"type, {column}", "'x', %s")
    with pytest.raises(psycopg.errors.CheckViolation, match=constraint):
        db.execute(f"INSERT INTO relay.jobs ({columns}) VALUES ({values})", (value,))
    with pytest.raises(psycopg.errors.CheckViolation, match=constraint):
        db.execute(f"UPDATE relay.jobs SET {column} = %s WHERE id = %s", (value, job_id))
    row = db.execute("SELECT type, queue, max_attempts FROM relay.jobs").fetchall()
    assert row == [("x", "default", 20)]


def test_jobs_copied_whole_are_counted_and_checked_as_any_insert_by_hand(relay: Relay, db: psycopg.Connection) -> None:
    """A row Relay inserted carries the transaction that counted it. Copied back whole (an
    archive's INSERT ... SELECT *, a COPY round trip), it comes from another transaction, so the
    trigger counts it and checks its rules as it does any row inserted by hand."""
    relay.enqueue_many([{"type": "t", "queue": "emails"}, {"type": "t", "queue": "emails"}])
    db.execute("CREATE TEMP TABLE kept AS SELECT * FROM relay.jobs")
    db.execute("DELETE FROM relay.jobs")
    assert counted(db) == {}
    db.execute("INSERT INTO relay.jobs OVERRIDING SYSTEM VALUE SELECT * FROM kept")
    assert counted(db) == {("emails", "queued"): 2}
    db.execute("DELETE FROM relay.jobs")
    db.execute("UPDATE kept SET max_attempts = 0")
    with pytest.raises(psycopg.errors.CheckViolation, match="jobs_max_attempts_check"):
        db.execute("INSERT INTO relay.jobs OVERRIDING SYSTEM VALUE SELECT * FROM kept")
    assert counted(db) == {}
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone() == (0,)


def counted(conn: psycopg.Connection) -> dict[tuple[str, str], int]:
    """What the admin counters say each (queue, state) holds."""
    rows = conn.execute(
        "SELECT queue, state::text, sum(n) FROM relay.job_counts GROUP BY 1, 2 HAVING sum(n) <> 0"
    ).fetchall()
    return {(queue, state): n for queue, state, n in rows}


def test_one_bad_row_among_many_refuses_the_whole_statement_and_counts_nothing(db: psycopg.Connection) -> None:
    """The rules are checked for every row of a statement, not only the first, whether its rows
    share a queue or not; the refused statement leaves neither a job nor a count behind."""
    db.execute("INSERT INTO relay.jobs (type, queue) VALUES ('a', 'emails'), ('b', 'emails')")
    before = counted(db)
    for queues in (("emails", "emails", "emails"), ("emails", "default", "reports")):
        with pytest.raises(psycopg.errors.CheckViolation, match="jobs_max_attempts_check") as refused:
            db.execute(
                "INSERT INTO relay.jobs (type, queue, max_attempts) VALUES ('x', %s, 5), ('y', %s, 0), ('z', %s, 5)",
                queues,
            )
        assert refused.value.diag.constraint_name == "jobs_max_attempts_check"
        assert refused.value.diag.table_name == "jobs"
    with pytest.raises(psycopg.errors.CheckViolation, match="jobs_claim_has_lease"):
        # Two rows, only the second of which breaks a rule once claimed.
        db.execute(
            "UPDATE relay.jobs SET status = 'claimed', claimed_until = now() + interval '1 minute',"
            " claimed_by = CASE WHEN type = 'a' THEN 'w' END"
        )
    assert db.execute("SELECT type, status::text FROM relay.jobs ORDER BY type").fetchall() == [
        ("a", "queued"),
        ("b", "queued"),
    ]
    assert counted(db) == before == {("emails", "queued"): 2}


def test_the_rules_name_the_constraint_postgres_would_and_ignore_the_sessions_search_path(
    db: psycopg.Connection,
) -> None:
    """A row breaking every rule is refused under the name PostgreSQL's own CHECKs gave first
    (in name order); a session whose search_path puts its own length() first cannot switch off
    the type's rule, as it could not switch off a CHECK's."""
    with pytest.raises(psycopg.errors.CheckViolation, match="jobs_claim_has_lease"):
        db.execute("INSERT INTO relay.jobs (type, queue, max_attempts, status) VALUES ('', 'Bad', 0, 'claimed')")
    with pytest.raises(psycopg.errors.CheckViolation, match="jobs_max_attempts_check"):
        db.execute("INSERT INTO relay.jobs (type, queue, max_attempts) VALUES ('', 'Bad', 0)")
    with db.transaction(force_rollback=True):
        db.execute("CREATE SCHEMA relay_test_lengths")
        db.execute("CREATE FUNCTION relay_test_lengths.length(text) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT 5'")
        db.execute("SET LOCAL search_path = relay_test_lengths, pg_catalog, public")
        with pytest.raises(psycopg.errors.CheckViolation, match="jobs_type_check"), db.transaction():
            db.execute("INSERT INTO relay.jobs (type) VALUES ('')")
    assert job_count(db) == 0
    assert db.execute("SELECT to_regnamespace('relay_test_lengths')").fetchone() == (None,)


def test_the_client_pool_hands_out_autocommit_connections_and_admin_actions_still_work(
    relay: Relay, db: psycopg.Connection
) -> None:
    with relay.pool.connection() as conn:
        assert conn.autocommit, "an enqueue without conn is one statement: its own transaction"
    job_id = relay.enqueue("t")
    relay.cancel(job_id)
    with pytest.raises(IllegalTransition):
        relay.cancel(job_id)  # refused, and the refusal changes nothing
    assert job_status(db, job_id) == "cancelled"


def test_an_enqueue_the_database_refuses_hands_its_connection_back(relay: Relay, db: psycopg.Connection) -> None:
    relay.enqueue("warm_up")
    db.execute("ALTER TABLE relay.jobs ADD CONSTRAINT test_refuses_forbidden CHECK (type <> 'forbidden')")
    try:
        for _ in range(relay._pool_size + 1):  # more refusals than the pool holds connections
            with pytest.raises(psycopg.errors.CheckViolation):
                relay.enqueue("forbidden")
        # Not the pool's own pool_available: it lags while a connection the pool grew by is still connecting.
        assert relay.pool.checked_out == 0
        relay.enqueue("allowed")
    finally:
        db.execute("ALTER TABLE relay.jobs DROP CONSTRAINT test_refuses_forbidden")
    assert job_count(db) == 2


def notes_within(listener: psycopg.Connection, seconds: float) -> list[str]:
    """The payloads of the notifications ``listener`` receives within ``seconds``."""
    return [n.payload for n in listener.notifies(timeout=seconds)]


def test_a_relay_with_notify_off_enqueues_without_waking_anyone(dsn: str, db: psycopg.Connection) -> None:
    quiet = Relay(dsn, notify=False)
    loud = Relay(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute("LISTEN relay_jobs")
            quiet.enqueue("a")
            quiet.enqueue("b", idempotency_key="b-1")
            quiet.enqueue_many([{"type": "c"}, {"type": "c"}])  # alike
            quiet.enqueue_many([{"type": "d"}, {"type": "e", "queue": "other"}])  # mixed
            assert notes_within(listener, 0.5) == []
            assert job_count(db) == 6, "every job was written"
            loud.enqueue("f")
            assert notes_within(listener, 2.0) == ["default"], "the default still notifies"
    finally:
        quiet.close()
        loud.close()


@pytest.mark.parametrize(
    ("raw", "expected"), [("false", False), ("0", False), ("off", False), ("true", True), ("", True)]
)
def test_relay_notify_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("RELAY_NOTIFY", raw)
    assert Relay("postgresql://unused").notify is expected
    assert Relay("postgresql://unused", notify=not expected).notify is (not expected), "the argument wins"


def test_a_malformed_relay_notify_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_NOTIFY", "sometimes")
    with pytest.raises(ConfigurationError, match="RELAY_NOTIFY must be true or false, got 'sometimes'"):
        Relay("postgresql://unused")


@pytest.mark.parametrize("bad", [0, 1, "false", "maybe"])
def test_a_notify_that_is_no_bool_is_refused_when_the_relay_is_made(bad: object, db: psycopg.Connection) -> None:
    """It went into every insert as a boolean: 0 or 1 failed each enqueue (a caller's transaction
    left aborted, its own writes lost with it), and "false" was a true value."""
    with pytest.raises(ConfigurationError, match=r"notify must be True or False, got "):
        Relay("postgresql://unused", notify=bad)  # type: ignore[arg-type]
    assert job_count(db) == 0


@pytest.mark.parametrize("bad", [b"postgresql://localhost/db", 5432])
def test_a_dsn_that_is_no_string_is_refused_when_the_relay_is_made(bad: object) -> None:
    """It was taken, and the first enqueue raised a bare TypeError (bytes) or AttributeError (a number)."""
    with pytest.raises(ConfigurationError, match=r"the DSN must be a string .*, got (bytes|int)"):
        Relay(bad)  # type: ignore[arg-type]


def test_the_wait_for_a_connection_comes_from_the_environment_and_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAY_DB_WAIT_SECONDS", raising=False)
    assert Relay("postgresql://unused").db_wait == 5.0
    monkeypatch.setenv("RELAY_DB_WAIT_SECONDS", "1.5")
    assert Relay("postgresql://unused").db_wait == 1.5
    assert Relay("postgresql://unused", db_wait=2).db_wait == 2, "the argument wins"
    for bad in ("0", "-1", "nan", "inf", "soon", "1e10"):  # 1e10: past what a thread's wait takes
        monkeypatch.setenv("RELAY_DB_WAIT_SECONDS", bad)
        with pytest.raises(ConfigurationError, match="RELAY_DB_WAIT_SECONDS"):
            Relay("postgresql://unused")
    monkeypatch.delenv("RELAY_DB_WAIT_SECONDS")
    for given in (0, True, "5", [5], 10**400):
        with pytest.raises(ConfigurationError, match="db_wait"):
            Relay("postgresql://unused", db_wait=given)  # type: ignore[arg-type]


def test_a_blank_dsn_passed_to_relay_is_refused_not_replaced_by_the_environments(
    monkeypatch: pytest.MonkeyPatch, dsn: str
) -> None:
    """``Relay("")`` connected to DATABASE_URL's database, though ``Relay("  ")`` was refused."""
    monkeypatch.setenv("DATABASE_URL", dsn)
    for blank in ("", "  "):
        with pytest.raises(ConfigurationError, match="the DSN passed to Relay is blank"):
            Relay(blank).dsn  # noqa: B018 - reading it resolves it


@pytest.mark.parametrize("job_id", [True, "1", 1.0, [1], 0, -5, 2**63])
def test_a_job_action_given_what_is_no_job_id_is_refused_clearly(relay: Relay, job_id: Any) -> None:
    """``get_job("abc")`` raised the database's InvalidTextRepresentation; ``cancel(1219.0)`` acted on job 1219."""
    real = relay.enqueue("t")
    for action in (relay.get_job, relay.cancel, relay.requeue):
        with pytest.raises(InvalidJobError, match=r"^job_id: must be an int from 1 to 9223372036854775807"):
            action(job_id)
    assert relay.get_job(real).status == "queued"


def test_enqueue_on_a_callers_connection_prepares_only_as_its_own_statements_are(relay: Relay, dsn: str) -> None:
    """Relay forced preparation on the caller's connection: behind PgBouncer in transaction mode the
    next transaction, on another server connection, failed with 'prepared statement does not exist'."""
    with psycopg.connect(dsn) as conn:  # psycopg's default: a statement is prepared on its fifth use
        relay.enqueue("t", conn=conn)
        relay.enqueue_many([{"type": "t"}, {"type": "u"}], conn=conn)
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 0


@pytest.mark.parametrize("hours", [15, 16, 23])
def test_a_batch_takes_a_run_at_with_any_offset_python_allows(relay: Relay, db: psycopg.Connection, hours: int) -> None:
    """Sent as text in an array with its own offset, +16:00 and more failed in PostgreSQL (and left the
    caller's transaction aborted), though one job with it was stored."""
    when = datetime(2030, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=hours, minutes=59, microseconds=5)))
    ids = relay.enqueue_many([{"type": "a", "run_at": when}, {"type": "b", "run_at": when}])
    stored = db.execute("SELECT run_at FROM relay.jobs WHERE id = ANY(%s)", (ids,)).fetchall()
    assert stored == [(when,), (when,)]


@pytest.mark.parametrize("offset", [timedelta(hours=-17), timedelta(hours=1, microseconds=500_000)])
def test_alike_jobs_in_a_batch_take_a_run_at_postgresql_cannot_read_with_its_offset(
    relay: Relay, db: psycopg.Connection, dsn: str, offset: timedelta
) -> None:
    """A job alike an earlier one in the batch skipped the check that turns run_at into UTC: with a
    key (sent row by row) its offset reached PostgreSQL as text, which refused it with a raw psycopg
    error and left the caller's transaction aborted, though each job alone was stored."""
    when = datetime(2030, 1, 1, 12, 0, tzinfo=timezone(offset))
    with psycopg.connect(dsn) as conn:
        ids = relay.enqueue_many(
            [{"type": "t", "run_at": when}, {"type": "t", "run_at": when, "idempotency_key": f"odd-{offset}"}],
            conn=conn,
        )
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    stored = db.execute("SELECT run_at FROM relay.jobs WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()
    assert stored == [(when,), (when,)]


def test_a_payload_nested_to_the_limit_is_kept(relay: Relay, db: psycopg.Connection) -> None:
    job_id = relay.enqueue("deep", nested(99))  # 100 levels
    assert relay.get_job(job_id).payload == nested(99)


def test_times_read_back_whatever_the_servers_time_zone(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """9999-12-31 20:00 UTC is year 10000 in Tokyo: a session in that zone could not read the job back."""
    monkeypatch.setenv("PGOPTIONS", "-c TimeZone=Asia/Tokyo")
    tokyo = Relay(dsn)
    try:
        late = datetime(9999, 12, 31, 20, 0, tzinfo=UTC)
        job_id = tokyo.enqueue("far_future", run_at=late)
        assert tokyo.get_job(job_id).run_at == late
    finally:
        tokyo.close()


# -- max_attempts of types the enqueuing Relay has no handler for -------------------------------


def stored_attempts(db: psycopg.Connection, ids: list[int]) -> list[int]:
    rows = dict(db.execute("SELECT id, max_attempts FROM relay.jobs WHERE id = ANY(%s)", (ids,)).fetchall())
    return [rows[i] for i in ids]


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The types of every read of published max_attempts an enqueue sends: a lookup statement of
    its own, or an insert asked to read it (the statements still run on PostgreSQL)."""
    from relay_core import connections
    from relay_core.queries import sql

    seen: list[str] = []
    real_all, real_first = connections.fetch_all, connections.fetch_first_value

    def note(text: str, params: Any) -> None:
        if text == sql("job_type_max_attempts_many"):
            seen.append(",".join(params["types"]))
        elif isinstance(params, dict) and params.get("published"):
            seen.append(params["type"])

    inside_first: list[bool] = []  # fetch_first_value reads SQLAlchemy connections through fetch_all

    def counting_all(conn, text, params):  # type: ignore[no-untyped-def]
        if not inside_first:
            note(text, params)
        return real_all(conn, text, params)

    def counting_first(conn, text, params, name=None):  # type: ignore[no-untyped-def]
        note(text, params)
        inside_first.append(True)
        try:
            return real_first(conn, text, params, name)
        finally:
            inside_first.pop()

    monkeypatch.setattr(connections, "fetch_all", counting_all)
    monkeypatch.setattr(connections, "fetch_first_value", counting_first)
    return seen


def test_a_relay_without_the_handler_takes_the_max_attempts_workers_published(
    dsn: str, db: psycopg.Connection, lookups: list[str]
) -> None:
    publish_handlers(dsn, send_email=3)
    bare = Relay(dsn)  # like a web process or script that only enqueues: no handlers registered
    try:
        own = bare.enqueue("send_email", {"to": "a@b.c"})
        CountingCursor.executed = []
        with psycopg.connect(dsn, cursor_factory=CountingCursor) as conn, conn.transaction():
            joined = bare.enqueue("send_email", conn=conn)
        # The insert reads what was published: one statement, no lookup round trip of its own.
        assert len(CountingCursor.executed) == 1, CountingCursor.executed
        assert "INSERT INTO relay.jobs" in CountingCursor.executed[0], CountingCursor.executed
        with Session(sa_engine(dsn)) as session, session.begin():
            via_sqlalchemy = bare.enqueue("send_email", conn=session)
        keyed = bare.enqueue("send_email", idempotency_key="k1")
        explicit = bare.enqueue("send_email", max_attempts=7)
        nothing_published = bare.enqueue("resize_image")
        assert stored_attempts(db, [own, joined, via_sqlalchemy, keyed, explicit, nothing_published]) == [
            3,
            3,
            3,
            3,
            7,
            20,
        ]
        assert lookups == ["send_email"] * 4 + ["resize_image"]
    finally:
        bare.close()
    other_default = Relay(dsn, default_max_attempts=9)
    try:
        ids = [other_default.enqueue("send_email"), other_default.enqueue("resize_image")]
        assert stored_attempts(db, ids) == [3, 9]
    finally:
        other_default.close()


def test_a_local_handler_or_an_explicit_value_never_looks_up_what_workers_published(
    dsn: str, db: psycopg.Connection, lookups: list[str]
) -> None:
    publish_handlers(dsn, send_email=3, resize_image=4)
    local = Relay(dsn)
    local.handler("send_email", max_attempts=5)(lambda job: None)
    try:
        with psycopg.connect(dsn, autocommit=True) as locker, locker.transaction():
            # No statement that reads relay.job_types can run while this lock is held.
            locker.execute("LOCK TABLE relay.job_types IN ACCESS EXCLUSIVE MODE")
            with psycopg.connect(dsn) as conn:
                conn.execute("SET lock_timeout = '500ms'")
                ids = [
                    local.enqueue("send_email", conn=conn),
                    local.enqueue("resize_image", conn=conn, max_attempts=2),
                    *local.enqueue_many(
                        [{"type": "send_email"}, {"type": "resize_image", "max_attempts": 6}], conn=conn
                    ),
                ]
                conn.commit()
                with pytest.raises(psycopg.errors.LockNotAvailable):
                    local.enqueue("resize_image", conn=conn)  # the lookup runs on the caller's connection
        assert lookups == ["resize_image"]
        assert stored_attempts(db, ids) == [5, 2, 5, 6]
        assert job_count(db) == 4
    finally:
        local.close()


def test_enqueue_many_looks_up_every_unknown_type_in_one_statement(
    dsn: str, db: psycopg.Connection, lookups: list[str]
) -> None:
    publish_handlers(dsn, send_email=3, resize_image=4)
    local = Relay(dsn)
    local.handler("charge_card", max_attempts=5)(lambda job: None)
    try:
        CountingCursor.executed = []
        with psycopg.connect(dsn, cursor_factory=CountingCursor) as conn:
            ids = local.enqueue_many(
                [
                    {"type": "charge_card"},
                    {"type": "send_email"},
                    {"type": "resize_image", "idempotency_key": "r1"},
                    {"type": "send_email", "max_attempts": 8},
                    {"type": "never_published"},
                    {"type": "never_published", "max_attempts": 2},
                    {"type": "send_email"},
                ],
                conn=conn,
            )
            conn.commit()
        # The lookup, then the insert: on the caller's connection, in its transaction.
        assert [q.split()[0] for q in CountingCursor.executed] == ["SELECT", "WITH"], CountingCursor.executed
        assert stored_attempts(db, ids) == [5, 3, 4, 8, 20, 2, 3]
        assert lookups == ["never_published,resize_image,send_email"]
        with psycopg.connect(dsn) as conn, conn.transaction():
            alike = local.enqueue_many([{"type": "resize_image", "payload": {"n": n}} for n in range(3)], conn=conn)
        assert stored_attempts(db, alike) == [4, 4, 4]
        assert local.enqueue_many([{"type": "charge_card"}, {"type": "send_email", "max_attempts": 1}]) != []
        assert len(lookups) == 2
    finally:
        local.close()


def test_a_worker_registering_another_max_attempts_replaces_the_published_one(
    dsn: str, db: psycopg.Connection, relay: Relay
) -> None:
    publish_handlers(dsn, send_email=3)
    publish_handlers(dsn, send_email=6)
    assert stored_attempts(db, [relay.enqueue("send_email")]) == [6]


def test_a_relay_used_before_a_fork_enqueues_from_both_processes(
    python: str, worker_env: dict[str, str], db: psycopg.Connection
) -> None:
    """The child used the parent's pooled connections: statements from both processes
    mixed on one session, and one of them hung (2 runs in 3)."""
    script = Path(__file__).parent / "apps" / "fork_after_enqueue.py"
    result = subprocess.run([python, str(script)], env=worker_env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "0"), result.stderr
    rows = db.execute(
        "SELECT payload->>'who', count(*), min((payload->>'n')::int), max((payload->>'n')::int)"
        " FROM relay.jobs WHERE type = 'forked' GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert rows == [("child", 200, 0, 199), ("parent", 202, -1, 200)]


def test_a_handler_that_names_no_max_attempts_takes_its_relays_default(dsn: str, db: psycopg.Connection) -> None:
    """Relay(default_max_attempts=3) reached only types without a local handler: every type with one got 20."""
    relay = Relay(dsn, default_max_attempts=3)
    try:
        relay.handler("digest")(lambda job: None)
        relay.handler("invoice", max_attempts=7)(lambda job: None)
        assert (relay.handlers["digest"].max_attempts, relay.handlers["invoice"].max_attempts) == (3, 7)
        ids = [relay.enqueue("digest"), relay.enqueue("invoice")]
    finally:
        relay.close()
    rows = db.execute("SELECT max_attempts FROM relay.jobs WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()
    assert rows == [(3,), (7,)]


@pytest.mark.parametrize("many", [False, True], ids=["enqueue", "enqueue_many"])
def test_the_callers_own_failed_statement_in_a_pipeline_is_raised_as_it_is_not_as_a_schema_to_migrate(
    relay: Relay, dsn: str, db: psycopg.Connection, many: bool
) -> None:
    """In a pipeline the server's error for the caller's earlier statement (a mistyped table) comes
    back at Relay's fetch, and Relay called it its own schema being missing: "run `relay migrate`"."""
    with psycopg.connect(dsn) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable, match='relation "ordrs" does not exist'), conn.pipeline():
            conn.execute("INSERT INTO ordrs VALUES (1)")
            if many:
                relay.enqueue_many([{"type": "t"}], conn=conn)
            else:
                relay.enqueue("t", conn=conn)
        conn.rollback()
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transaction"])
def test_enqueue_many_in_a_pipeline_returns_the_ids(
    relay: Relay, dsn: str, db: psycopg.Connection, autocommit: bool
) -> None:
    """In ``conn.pipeline()`` a cursor has no description until its rows are fetched: the jobs were
    inserted and enqueue_many raised IndexError, so a caller that retried made every job twice."""
    publish_handlers(dsn, report=2)  # the published max_attempts is read in the pipeline too
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        with conn.pipeline():
            ids = relay.enqueue_many([{"type": "report", "payload": {"n": n}} for n in range(3)], conn=conn)
            keyed = relay.enqueue_many([{"type": "t", "idempotency_key": "k"}, {"type": "t"}], conn=conn)
            again = relay.enqueue_many([{"type": "t", "idempotency_key": "k"}], conn=conn)
        if not autocommit:
            conn.commit()
    assert again == keyed[:1]
    rows = db.execute("SELECT id, type, max_attempts FROM relay.jobs ORDER BY id").fetchall()
    assert [r[0] for r in rows] == sorted([*ids, *keyed]) and len(rows) == 5
    assert [r[2] for r in rows if r[1] == "report"] == [2, 2, 2]


def test_a_bulk_enqueue_retried_after_a_schema_change_inserts_each_job_once(dsn: str, db: psycopg.Connection) -> None:
    """A bulk enqueue whose insert committed and whose next statement (the lookup of a key already
    held) met a plan the schema change had outdated ran again on a fresh connection: the
    first insert stayed, and every job without a key was there twice, one copy nobody knew of."""
    relay = Relay(dsn, pool_size=1)
    try:
        relay.enqueue("t", {}, idempotency_key="k1")
        # Both statements prepared on the pool's one connection.
        relay.enqueue_many([{"type": "t", "payload": {"warm": 1}}, {"type": "t", "idempotency_key": "k1"}])
        db.execute("ALTER TABLE relay.jobs ALTER COLUMN idempotency_key TYPE varchar(200)")
        try:
            later = datetime.now(UTC) + timedelta(hours=1)  # a run_at: the insert is prepared afresh
            ids = relay.enqueue_many(
                [{"type": "t", "payload": {"n": "once"}, "run_at": later}, {"type": "t", "idempotency_key": "k1"}]
            )
        finally:
            db.execute("ALTER TABLE relay.jobs ALTER COLUMN idempotency_key TYPE text")
    finally:
        relay.close()
    rows = db.execute("SELECT id FROM relay.jobs WHERE payload->>'n' = 'once'").fetchall()
    assert [row[0] for row in rows] == [ids[0]]


def test_an_enqueue_that_cannot_connect_says_why(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A misspelt database name: the enqueue waited, then raised "couldn't get a connection after
    1.00 sec" with no cause, while the pool printed the cause once per try."""
    missing = f"relay_missing_{os.getpid()}"
    relay = Relay(conninfo.make_conninfo(dsn, dbname=missing), db_wait=1.0)
    caplog.set_level("WARNING", logger="psycopg.pool")
    try:
        with pytest.raises(PoolTimeout) as raised:
            relay.enqueue("echo", {})
    finally:
        relay.close()
    assert f'database "{missing}" does not exist' in str(raised.value)
    tries = [r for r in caplog.records if r.getMessage().startswith("error connecting in 'relay-client'")]
    assert len(tries) <= 1, [r.getMessage() for r in tries]


def test_calls_on_a_database_never_migrated_say_to_migrate(unmigrated_dsn: str) -> None:
    """The CLI, the worker and the web app said to run `relay migrate`; an application's own calls
    raised the server's `relation "relay.jobs" does not exist` as it came."""
    relay = Relay(unmigrated_dsn)
    calls = {
        "enqueue": lambda: relay.enqueue("echo", {}),
        "enqueue_many": lambda: relay.enqueue_many([{"type": "echo"}]),
        "cancel": lambda: relay.cancel(1),
        "schedules": relay.schedules,
        "pause_queue": lambda: relay.pause_queue("emails"),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(ConfigurationError, match=r"run `relay migrate`") as raised:
                call()
            assert isinstance(raised.value.__cause__, psycopg.errors.UndefinedTable), name
        with psycopg.connect(unmigrated_dsn) as conn:
            with pytest.raises(ConfigurationError, match=r"run `relay migrate`") as raised:
                relay.enqueue("echo", {}, conn=conn)
            assert 'relation "relay.jobs" does not exist' in str(raised.value.__cause__)
            conn.rollback()
            # In a pipeline too: the error names Relay's table, so it is Relay's to explain.
            with pytest.raises(ConfigurationError, match=r"run `relay migrate`"), conn.pipeline():
                relay.enqueue("echo", {}, conn=conn)
            conn.rollback()
        engine = sa_engine(unmigrated_dsn)
        try:
            with engine.begin() as conn, pytest.raises(ConfigurationError, match=r"run `relay migrate`"):
                relay.enqueue("echo", {}, conn=conn)
        finally:
            engine.dispose()
    finally:
        relay.close()


def prepared_here(conn: psycopg.Connection) -> list[str]:
    """The statements prepared on ``conn``'s session under Relay's own names."""
    rows = conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'relay%%' ORDER BY 1")
    return [name for (name,) in rows]


def test_an_enqueue_runs_its_insert_by_a_prepared_name_and_prepares_it_again_after_a_deallocate(
    dsn: str, db: psycopg.Connection
) -> None:
    """The one-job enqueue on Relay's own pool runs its insert by a name prepared on the session
    (below psycopg's cursor). psycopg sends DEALLOCATE ALL when it empties its own cache, and takes
    Relay's names with it: the next enqueue, told the name is gone, prepares it again and inserts
    its job once."""
    # One connection: a pool that grew to two at its first checkout (the first still connecting)
    # could send the enqueues on either, their statements prepared on both.
    relay = Relay(dsn, pool_size=1)
    try:
        first = relay.enqueue("t", {"n": 1})
        keyed = relay.enqueue("t", {"n": 2}, idempotency_key="k")
        assert relay.enqueue("t", {"n": 3}, idempotency_key="k") == keyed
        with relay.pool.connection() as conn:
            assert prepared_here(conn) == [
                "relay_job_id_by_idempotency_key",
                "relay_job_insert",
                "relay_job_insert_keyed",
            ]
            conn.execute("DEALLOCATE ALL")
            assert prepared_here(conn) == []
        second = relay.enqueue("t", {"n": 4})
        with relay.pool.connection() as conn:
            assert prepared_here(conn) == ["relay_job_insert"]
    finally:
        relay.close()
    rows = db.execute("SELECT id, payload->>'n' FROM relay.jobs ORDER BY id").fetchall()
    assert rows == [(first, "1"), (keyed, "2"), (second, "4")]
    assert db.execute("SELECT sum(n)::int FROM relay.job_counts").fetchone() == (3,)


def test_an_enqueue_the_prepared_path_cannot_send_goes_through_the_cursor(relay: Relay, db: psycopg.Connection) -> None:
    """A run_at (a datetime, which only the cursor sends) or a connection in a pipeline takes the
    cursor: the job is the same, and nothing of Relay's is prepared by name."""
    at = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    scheduled = relay.enqueue("t", run_at=at)
    with relay.pool.connection() as conn:
        assert prepared_here(conn) == []
        with conn.pipeline():
            piped = relay.enqueue("t", {"n": 1}, conn=conn)
        assert prepared_here(conn) == []
    rows = db.execute("SELECT id, run_at FROM relay.jobs ORDER BY id").fetchall()
    assert [row[0] for row in rows] == [scheduled, piped]
    assert rows[0][1] == at
