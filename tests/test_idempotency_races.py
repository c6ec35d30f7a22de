"""An idempotency key whose holder is deleted while an enqueue resolves it.

The enqueue inserts with ON CONFLICT DO NOTHING, then looks the holder up. A
retention pass (or an admin) can delete the holder between the two
statements; a trigger installed for the test deletes it inside the insert's
own statement, so the race happens every time. The key is then free: the
enqueue inserts its job after all, and never hands out another job's id.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from relay_core import Relay

VANISH = """
CREATE FUNCTION relay.test_vanish_holder() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM relay.jobs WHERE id = {holder};
    RETURN NULL;
END $$;
CREATE TRIGGER test_vanish_holder AFTER INSERT ON relay.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION relay.test_vanish_holder();
"""


@pytest.fixture
def vanishing_holder(relay: Relay, db: psycopg.Connection) -> Iterator[int]:
    holder = relay.enqueue("charge", {"n": 0}, idempotency_key="vanishing")
    db.execute(VANISH.format(holder=int(holder)))
    try:
        yield holder
    finally:
        db.execute("DROP TRIGGER test_vanish_holder ON relay.jobs; DROP FUNCTION relay.test_vanish_holder()")


def keyed(db: psycopg.Connection, key: str) -> list[tuple]:
    return db.execute(
        "SELECT id, type, payload FROM relay.jobs WHERE idempotency_key = %s ORDER BY id", (key,)
    ).fetchall()


def test_single_enqueue_inserts_when_the_holder_vanished(
    relay: Relay, db: psycopg.Connection, vanishing_holder: int
) -> None:
    job_id = relay.enqueue("charge", {"n": 1}, idempotency_key="vanishing")
    assert job_id != vanishing_holder
    assert keyed(db, "vanishing") == [(job_id, "charge", {"n": 1})]


def test_bulk_enqueue_gives_each_job_its_own_id_when_a_holder_vanished(
    relay: Relay, db: psycopg.Connection, vanishing_holder: int
) -> None:
    ids = relay.enqueue_many(
        [
            {"type": "charge", "payload": {"n": 1}, "idempotency_key": "vanishing"},
            {"type": "other", "payload": {"n": 2}, "idempotency_key": "fresh-1"},
            {"type": "other", "payload": {"n": 3}},
            {"type": "charge", "payload": {"n": 4}, "idempotency_key": "vanishing"},
        ]
    )
    assert vanishing_holder not in ids and ids[0] == ids[3] and len(set(ids)) == 3
    rows = {
        row[0]: (row[1], row[2])
        for row in db.execute("SELECT id, type, payload FROM relay.jobs WHERE id = ANY(%s)", (ids,)).fetchall()
    }
    assert [rows[i] for i in ids] == [
        ("charge", {"n": 1}),
        ("other", {"n": 2}),
        ("other", {"n": 3}),
        ("charge", {"n": 1}),
    ]


def test_two_batches_whose_keys_overlap_in_opposite_orders_never_deadlock(relay: Relay, db: psycopg.Connection) -> None:
    """Each batch takes its keys' locks as it inserts them; in input order, one batch
    waiting for a key the other holds while the other waits for one it holds
    was a deadlock, and PostgreSQL aborted one of them."""
    rounds, size = 8, 400
    barrier = threading.Barrier(2)
    failures: list[BaseException] = []
    results: dict[tuple[int, bool], list[int]] = {}

    def enqueue(reverse: bool) -> None:
        for r in range(rounds):
            keys = [f"r{r}-k{n:04d}" for n in range(size)]
            batch = [{"type": "charge", "payload": {"n": n}, "idempotency_key": k} for n, k in enumerate(keys)]
            barrier.wait(timeout=30)
            try:
                ids = relay.enqueue_many(batch[::-1] if reverse else batch)
            except psycopg.Error as exc:
                failures.append(exc)
                continue
            results[(r, reverse)] = ids[::-1] if reverse else ids

    threads = [threading.Thread(target=enqueue, args=(reverse,)) for reverse in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    for r in range(rounds):
        # Both batches name the same jobs, key by key, and each key has one job.
        assert results[(r, False)] == results[(r, True)]
        stored = db.execute(
            "SELECT id FROM relay.jobs WHERE idempotency_key LIKE %s ORDER BY idempotency_key", (f"r{r}-%",)
        ).fetchall()
        assert [row[0] for row in stored] == results[(r, False)]
