"""The ceiling: only the SQL that no PostgreSQL queue can avoid, in a raw psycopg loop.

Insert a row; claim a batch with ``FOR UPDATE SKIP LOCKED`` in one UPDATE;
mark the batch done in one UPDATE. No leases, no retries, no error history, no
registry, no logging. Its batches are the issue's fixed 10 jobs per thread, so
in W1 a queue that claims more per statement (Relay, up to 136 at concurrency
8) can drain faster than it; in W2-W4 it is the floor of what any queue pays.
Enqueues from a paced producer (W4, W6) also NOTIFY, since an idle worker must
be woken somehow; the unpaced ones (W2) do not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
from common import Contestant, main
from psycopg.types.json import Jsonb

BATCH = 10

SCHEMA = """
CREATE TABLE bench_jobs (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status   smallint NOT NULL DEFAULT 0,  -- 0 queued, 1 running, 2 done
    payload  jsonb NOT NULL,
    run_at   timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0
);
CREATE INDEX bench_jobs_runnable ON bench_jobs (run_at, id) WHERE status = 0;
"""

INSERT = "INSERT INTO bench_jobs (payload) VALUES (%s) RETURNING id"
INSERT_NOTIFY = (
    "WITH i AS (INSERT INTO bench_jobs (payload) VALUES (%s) RETURNING id) "
    "SELECT id, pg_notify('bench_jobs', '') FROM i"
)
INSERT_MANY = "INSERT INTO bench_jobs (payload) SELECT * FROM unnest(%s::jsonb[])"
CLAIM = """
UPDATE bench_jobs SET status = 1, attempts = attempts + 1
WHERE id IN (
    SELECT id FROM bench_jobs WHERE status = 0 AND run_at <= now()
    ORDER BY run_at, id LIMIT %s FOR UPDATE SKIP LOCKED
)
RETURNING id, payload
"""
COMPLETE = "UPDATE bench_jobs SET status = 2 WHERE id = ANY(%s)"


class Ceiling(Contestant):
    """``concurrency`` threads, each claiming 10 jobs at a time on its own connection."""

    name = "ceiling"
    table = "bench_jobs"
    finished_sql = "SELECT count(*) FROM bench_jobs WHERE status = 2"
    history_overrides = {"status": "2", "attempts": "1"}  # noqa: RUF012

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self._conn: psycopg.Connection | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    def _connection(self) -> psycopg.Connection:
        if self._conn is None:
            self._conn = psycopg.connect(self.dsn, autocommit=True)
        return self._conn

    def setup(self) -> None:
        self._connection().execute(SCHEMA)

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        conn = self._connection()
        statement = INSERT_NOTIFY if pace else INSERT
        committed: dict[int, float] = {}
        for i, seq in enumerate(seqs):
            if pace:
                pace(i)
            conn.execute(statement, (Jsonb({"seq": seq}),), prepare=True).fetchone()
            committed[seq] = time.perf_counter()
        return committed

    def enqueue_bulk(self, count: int) -> None:
        self._connection().execute(INSERT_MANY, ([Jsonb({"seq": i}) for i in range(count)],))

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._listen, daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, args=(on_start,), daemon=True) for _ in range(self.concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def _listen(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("LISTEN bench_jobs")
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=0.5, stop_after=1):
                    self._wake.set()

    def _work(self, on_start: Callable[[int], None]) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(CLAIM, (BATCH,), prepare=True).fetchall()
                if not rows:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for _id, payload in rows:
                    on_start(payload["seq"])
                conn.execute(COMPLETE, ([r[0] for r in rows],), prepare=True)

    def stop_worker(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(10)

    def worker_gone(self) -> bool:
        workers = self._threads[1:]  # the first listens for wake-ups, and lives on while its workers crash
        return bool(workers) and not self._stop.is_set() and not any(t.is_alive() for t in workers)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


if __name__ == "__main__":
    main(Ceiling)
