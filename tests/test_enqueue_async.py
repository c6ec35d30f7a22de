"""Enqueue from asyncio code: ``enqueue_async`` joins the caller's async transaction.

The same checks, statement and idempotency as ``enqueue``, on a psycopg
``AsyncConnection`` or a SQLAlchemy ``AsyncConnection`` / ``AsyncSession``,
read back from the real database.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from relay_core import InvalidJobError, Job, Relay, client
from relay_core.connections import ASYNC_KINDS

from .helpers import job_status, publish_handlers, running_worker, wait_for


def jobs(db: psycopg.Connection) -> list[tuple[str, Any, int]]:
    return db.execute("SELECT type, payload, max_attempts FROM relay.jobs ORDER BY id").fetchall()


@asynccontextmanager
async def psycopg_transaction(dsn: str) -> AsyncIterator[psycopg.AsyncConnection]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        yield conn


@asynccontextmanager
async def sqlalchemy_connection(dsn: str) -> AsyncIterator[Any]:
    engine = create_async_engine("postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn))
    try:
        async with engine.begin() as conn:
            yield conn
    finally:
        await engine.dispose()


@asynccontextmanager
async def sqlalchemy_session(dsn: str, session_class: type[AsyncSession] = AsyncSession) -> AsyncIterator[Any]:
    engine = create_async_engine("postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn))
    try:
        async with session_class(engine) as session, session.begin():
            yield session
    finally:
        await engine.dispose()


def test_a_sqlalchemy_async_connection_set_to_stream_results_still_enqueues(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """SQLAlchemy ran Relay's INSERT through a server-side cursor (``DECLARE ... CURSOR FOR INSERT``)."""

    async def enqueue() -> None:
        engine = create_async_engine(
            "postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn)
        ).execution_options(stream_results=True)
        try:
            async with engine.begin() as conn:
                await relay.enqueue_async("send_email", {"n": 1}, conn=conn)
                await relay.enqueue_many_async([{"type": "send_email"}], conn=conn)
        finally:
            await engine.dispose()

    asyncio.run(enqueue())
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 2


class AppSession(AsyncSession):
    """An application's own session class (``async_sessionmaker(class_=AppSession)``): still a session."""


TRANSACTIONS = {
    "psycopg": psycopg_transaction,
    "sqlalchemy": sqlalchemy_connection,
    "session": sqlalchemy_session,
    "subclassed_session": functools.partial(sqlalchemy_session, session_class=AppSession),
}


@pytest.mark.parametrize("kind", TRANSACTIONS)
def test_enqueue_async_commits_with_the_callers_transaction(
    relay: Relay, dsn: str, db: psycopg.Connection, kind: str
) -> None:
    async def place_order() -> int:
        async with TRANSACTIONS[kind](dsn) as conn:
            job_id = await relay.enqueue_async("send_email", {"to": "a@b.c"}, conn=conn, priority=-1)
            assert jobs(db) == [], "visible before the caller's commit"
            return job_id

    job_id = asyncio.run(place_order())
    row = db.execute("SELECT type, payload, priority, status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("send_email", {"to": "a@b.c"}, -1, "queued")


@pytest.mark.parametrize(
    "options",
    [{"row_factory": psycopg.rows.dict_row}, {"cursor_factory": psycopg.AsyncRawCursor}],
    ids=["dict_row", "AsyncRawCursor"],
)
def test_a_callers_async_connection_makes_rows_and_cursors_its_own_way(
    relay: Relay, dsn: str, db: psycopg.Connection, options: dict[str, Any]
) -> None:
    async def enqueue() -> tuple[int, int, int]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, **options) as conn:
            plain = await relay.enqueue_async("send_email", {"n": 1}, conn=conn)
            keyed = await relay.enqueue_async("send_email", {"n": 2}, conn=conn, idempotency_key="order-7")
            again = await relay.enqueue_async("send_email", {"n": 3}, conn=conn, idempotency_key="order-7")
            return plain, keyed, again

    plain, keyed, again = asyncio.run(enqueue())
    assert again == keyed
    assert db.execute("SELECT id, payload->>'n' FROM relay.jobs ORDER BY id").fetchall() == [(plain, "1"), (keyed, "2")]


@pytest.mark.parametrize("kind", TRANSACTIONS)
def test_enqueue_async_rolls_back_with_the_callers_transaction(
    relay: Relay, dsn: str, db: psycopg.Connection, kind: str
) -> None:
    async def place_order() -> None:
        async with TRANSACTIONS[kind](dsn) as conn:
            await relay.enqueue_async("send_email", {"to": "a@b.c"}, conn=conn)
            await relay.enqueue_many_async([{"type": "resize"}, {"type": "resize"}], conn=conn)
            raise RuntimeError("order failed")

    with pytest.raises(RuntimeError, match="order failed"):
        asyncio.run(place_order())
    assert jobs(db) == []


def test_enqueue_async_without_conn_commits_at_once(relay: Relay, db: psycopg.Connection) -> None:
    job_id = asyncio.run(relay.enqueue_async("send_email", {"to": "a@b.c"}))
    ids = asyncio.run(relay.enqueue_many_async([{"type": "resize", "payload": {"n": n}} for n in range(3)]))
    assert [r[0] for r in db.execute("SELECT id FROM relay.jobs ORDER BY id")] == [job_id, *ids]


def test_an_idempotency_key_returns_the_first_job_across_sync_and_async(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    first = relay.enqueue("receipt", idempotency_key="order-42:receipt")

    async def again() -> list[int]:
        async with psycopg_transaction(dsn) as conn:
            one = await relay.enqueue_async("receipt", conn=conn, idempotency_key="order-42:receipt")
            many = await relay.enqueue_many_async(
                [{"type": "receipt", "idempotency_key": "order-42:receipt"}, {"type": "receipt"}], conn=conn
            )
            return [one, *many]

    one, many_first, fresh = asyncio.run(again())
    assert one == many_first == first and fresh != first
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 2


def test_enqueue_async_takes_the_max_attempts_workers_published(dsn: str, db: psycopg.Connection) -> None:
    publish_handlers(dsn, send_email=3)
    bare = Relay(dsn)  # a service that only enqueues

    async def enqueue() -> None:
        async with sqlalchemy_session(dsn) as session:
            await bare.enqueue_async("send_email", conn=session)
            await bare.enqueue_async("send_email", conn=session, max_attempts=7)
            await bare.enqueue_async("resize_image", conn=session)

    try:
        asyncio.run(enqueue())
    finally:
        bare.close()
    assert [r[2] for r in jobs(db)] == [3, 7, 20]


def test_bad_input_to_enqueue_async_raises_and_writes_nothing(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    async def attempt(enqueue: Callable[[Any], Awaitable[Any]]) -> None:
        async with psycopg_transaction(dsn) as conn:
            await enqueue(conn)

    with pytest.raises(InvalidJobError) as refused:
        asyncio.run(attempt(lambda conn: relay.enqueue_async("t", {"x": float("nan")}, conn=conn)))
    assert refused.value.field == "payload"
    with pytest.raises(InvalidJobError) as refused:
        asyncio.run(attempt(lambda conn: relay.enqueue_many_async([{"type": "t"}, {"type": "t", "queue": "Bad"}])))
    assert refused.value.field == "jobs[1].queue"
    with pytest.raises(InvalidJobError):
        asyncio.run(relay.enqueue_async("", {}))
    assert jobs(db) == []


@pytest.mark.parametrize("kind", TRANSACTIONS)
def test_enqueue_given_an_async_connection_says_to_use_enqueue_async(
    relay: Relay, dsn: str, db: psycopg.Connection, kind: str
) -> None:
    async def attempt() -> None:
        async with TRANSACTIONS[kind](dsn) as conn:
            relay.enqueue("send_email", conn=conn)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no coroutine left unawaited on the way
        with pytest.raises(TypeError, match=r"enqueue_async\(\.\.\., conn=conn\)"):
            asyncio.run(attempt())
    assert jobs(db) == []


def test_enqueue_async_given_a_sync_connection_says_to_use_enqueue(relay: Relay, dsn: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(TypeError, match=r"relay\.enqueue\(\.\.\., conn=conn\)"):
        asyncio.run(relay.enqueue_async("send_email", conn=conn))
    engine = sqlalchemy.create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    try:
        with engine.connect() as conn, pytest.raises(TypeError, match=r"relay\.enqueue\(\.\.\., conn=conn\)"):
            asyncio.run(relay.enqueue_async("send_email", conn=conn))
    finally:
        engine.dispose()
    with pytest.raises(TypeError, match="AsyncConnection"):
        asyncio.run(relay.enqueue_async("send_email", conn=object()))


def test_an_async_engine_or_session_factory_is_refused_as_no_transaction(relay: Relay, dsn: str) -> None:
    """Neither is a transaction to join: each is refused with the kinds that are, by either call."""
    engine = create_async_engine("postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn))
    try:
        for given in (engine, async_sessionmaker(engine)):
            with pytest.raises(TypeError, match=f"conn must be {ASYNC_KINDS}, not"):
                asyncio.run(relay.enqueue_async("send_email", conn=given))
            with pytest.raises(TypeError, match=r"conn must be .* \(or, with enqueue_async, "):
                relay.enqueue("send_email", conn=given)
    finally:
        asyncio.run(engine.dispose())


def test_a_sqlalchemy_engine_on_asyncpg_is_refused_before_anything_is_sent(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """asyncpg takes $1 parameters: Relay's %(name)s statement failed with a syntax error at "%"
    and left the caller's transaction aborted. Now a clear TypeError, and the transaction goes on."""
    import asyncpg

    params = psycopg.conninfo.conninfo_to_dict(dsn)
    server = {name: params[name] for name in ("host", "port", "user", "password") if name in params}

    async def attempt() -> None:
        engine = create_async_engine(
            "postgresql+asyncpg://", async_creator=lambda: asyncpg.connect(database=params["dbname"], **server)
        )
        try:
            async with AsyncSession(engine) as session, session.begin():
                for enqueue in (
                    relay.enqueue_async("send_email", conn=session),
                    relay.enqueue_many_async([{"type": "send_email"}], conn=session),
                ):
                    with pytest.raises(TypeError, match="asyncpg driver, whose statements take numeric_dollar"):
                        await enqueue
                assert (await session.execute(sqlalchemy.text("SELECT 1"))).scalar() == 1
        finally:
            await engine.dispose()

    asyncio.run(attempt())
    assert jobs(db) == []


def test_a_job_enqueued_from_asyncio_runs_on_an_async_handler(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    @relay.handler("welcome")
    async def welcome(job: Job) -> str:
        await asyncio.sleep(0)
        return f"welcomed {job.payload['user']}"

    async def sign_up() -> int:
        async with psycopg_transaction(dsn) as conn:
            return await relay.enqueue_async("welcome", {"user": "ada"}, conn=conn)

    job_id = asyncio.run(sign_up())
    with running_worker(relay):
        wait_for(lambda: job_status(db, job_id) == "succeeded")
    assert relay.get_job(job_id).result == "welcomed ada"


@pytest.mark.parametrize(("batch", "field"), [(None, "jobs"), ({"type": "a"}, "jobs"), ([5], "jobs[0]")])
def test_enqueue_many_async_refuses_a_batch_that_is_not_a_list_of_mappings(
    relay: Relay, db: psycopg.Connection, batch: Any, field: str
) -> None:
    with pytest.raises(InvalidJobError) as caught:
        asyncio.run(relay.enqueue_many_async(batch))
    assert caught.value.field == field
    assert jobs(db) == []


def test_the_callers_own_failed_statement_in_an_async_pipeline_is_raised_as_it_is(
    relay: Relay, dsn: str, db: psycopg.Connection
) -> None:
    """The async twin: a caller's failed statement, queued before the enqueue, was called Relay's
    schema being missing."""

    async def enqueue() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
            await conn.execute("SELECT no_such_function()")
            await relay.enqueue_async("t", conn=conn)

    with pytest.raises(psycopg.errors.UndefinedFunction, match="no_such_function"):
        asyncio.run(enqueue())
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


def test_enqueue_async_in_a_pipeline_returns_the_ids(relay: Relay, dsn: str, db: psycopg.Connection) -> None:
    """In ``conn.pipeline()`` a cursor has no description until its rows are fetched: the jobs were
    inserted while enqueue_many_async raised IndexError, enqueue_async returned None and a repeated
    idempotency key raised "conflicted but its job vanished"."""

    async def enqueue() -> tuple[list[int], int, int, int]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn, conn.pipeline():
            jobs = [{"type": "resize", "payload": {"n": n}} for n in range(3)]
            many = await relay.enqueue_many_async(jobs, conn=conn)
            one = await relay.enqueue_async("send_email", {"n": 3}, conn=conn)
            keyed = await relay.enqueue_async("send_email", {"n": 4}, conn=conn, idempotency_key="order-8")
            again = await relay.enqueue_async("send_email", {"n": 5}, conn=conn, idempotency_key="order-8")
            return many, one, keyed, again

    many, one, keyed, again = asyncio.run(enqueue())
    assert again == keyed
    stored = db.execute("SELECT id, payload->>'n' FROM relay.jobs ORDER BY id").fetchall()
    assert stored == [(many[0], "0"), (many[1], "1"), (many[2], "2"), (one, "3"), (keyed, "4")]


def test_an_enqueue_held_up_by_a_key_no_one_commits_ends_and_frees_its_connection(
    dsn: str, db: psycopg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key held by the caller's own open transaction on another connection: the enqueue waited for
    good (a deadlock the server cannot see), and each cancelled ``enqueue_async`` kept a pooled
    connection waiting, until every enqueue failed with PoolTimeout."""
    monkeypatch.setattr(client, "LOCK_WAIT_SECONDS", 0.5)
    relay = Relay(dsn, pool_size=2, db_wait=5)
    try:
        with psycopg.connect(dsn) as holder:
            held = relay.enqueue("charge", {}, idempotency_key="held", conn=holder)  # not committed
            with pytest.raises(psycopg.errors.LockNotAvailable) as waited:
                relay.enqueue("charge", {}, idempotency_key="held")
            assert any("Nothing was enqueued" in note for note in waited.value.__notes__)

            async def cancelled() -> None:
                for _ in range(2):
                    with pytest.raises(TimeoutError):
                        await asyncio.wait_for(relay.enqueue_async("charge", idempotency_key="held"), 0.1)

            asyncio.run(cancelled())
            wait_for(lambda: relay.pool.checked_out == 0, 5, what="the cancelled enqueues' connections back")
            other = relay.enqueue("charge", {}, idempotency_key="other")
            holder.commit()
        assert relay.enqueue("charge", {}, idempotency_key="held") == held
    finally:
        relay.close()
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 2
    assert other != held
