"""PGQueuer as its README shows it: asyncpg, ``PgQueuer`` with one entrypoint,
``Queries.enqueue``.

The worker runs as PGQueuer's performance guide asks for short jobs, with a
batch larger than its default of 10 ("increase batch_size when jobs are
short-lived"): ``max_concurrent_tasks`` at 136, what a Relay worker at
concurrency 8 holds claimed at most (8 running, 16 prefetched per slot), and
``batch_size`` at 68, the most PGQueuer accepts for that cap (it asks for at
least twice the batch). That cap counts jobs fetched and not yet finished, as
Relay's slots and prefetch do. With the default batch and its least cap (10
and 20), W1 drained 4,752-5,035 jobs/s where a batch of 100 drained
15,295-15,844, on one machine. A per-entrypoint ``concurrency_limit`` was tried
and is not used: it stalls on picked jobs whose completion is still buffered.
PGQueuer deletes finished jobs from its queue table (their history goes to
``pgqueuer_log``), so in W5 every row it is given is runnable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common import Contestant, LoopThread, import_library, main

PgQueuer = import_library("pgqueuer").PgQueuer
asyncpg = import_library("asyncpg")
from pgqueuer.db import AsyncpgDriver  # noqa: E402
from pgqueuer.models import Job  # noqa: E402
from pgqueuer.queries import Queries  # noqa: E402

#: Jobs fetched and not yet finished per unit of concurrency: what a Relay worker holds claimed
#: per slot at most, the one it runs and 16 prefetched (136 at concurrency 8).
HELD_PER_SLOT = 17


class PgQueuerContestant(Contestant):
    """A PgQueuer app on one asyncpg connection; producers on another."""

    name = "pgqueuer"
    table = "pgqueuer"
    # A finished job leaves the queue table (its outcome goes to pgqueuer_log,
    # which PGQueuer folds into statistics now and then): finished = ever enqueued - left.
    finished_sql = "SELECT (SELECT last_value FROM pgqueuer_id_seq) - (SELECT count(*) FROM pgqueuer)"
    keeps_history = False

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self.loop = LoopThread()
        self._producer_conn = None
        self._queries: Queries | None = None
        self._pgq = None
        self._worker = None
        self._worker_conn = None

    async def _queries_async(self) -> Queries:
        if self._queries is None:
            self._producer_conn = await asyncpg.connect(self.dsn)
            self._queries = Queries(AsyncpgDriver(self._producer_conn))
        return self._queries

    def setup(self) -> None:
        async def install() -> None:
            await (await self._queries_async()).install()

        self.loop.run(install())

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        async def run() -> dict[int, float]:
            queries = await self._queries_async()
            committed: dict[int, float] = {}
            for i, seq in enumerate(seqs):
                if pace:
                    await asyncio.to_thread(pace, i)
                await queries.enqueue("noop", str(seq).encode())
                committed[seq] = time.perf_counter()
            return committed

        return self.loop.run(run())

    def enqueue_bulk(self, count: int) -> None:
        async def run() -> None:
            queries = await self._queries_async()
            await queries.enqueue(["noop"] * count, [str(i).encode() for i in range(count)], [0] * count)

        self.loop.run(run())

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        async def start() -> asyncio.Task:
            connection = await asyncpg.connect(self.dsn)
            pgq = PgQueuer(AsyncpgDriver(connection))

            @pgq.entrypoint("noop")
            async def noop(job: Job) -> None:
                on_start(int(job.payload or b"0"))

            self._pgq = pgq
            self._worker_conn = connection
            cap = HELD_PER_SLOT * self.concurrency
            # The largest batch PGQueuer accepts under that cap: it asks for at least twice the batch.
            run = pgq.run(batch_size=cap // 2, max_concurrent_tasks=cap)
            return asyncio.create_task(run)

        self._worker = self.loop.run(start())

    def stop_worker(self) -> None:
        async def stop() -> None:
            assert self._pgq is not None and self._worker is not None
            self._pgq.shutdown.set()
            await self._worker
            if self._worker_conn is not None:
                # run() leaves its connection open (and LISTENing): W5 starts a worker three times per size.
                await self._worker_conn.close()
                self._worker_conn = None

        self.loop.run(stop(), timeout=60)

    def close(self) -> None:
        if self._producer_conn is not None:
            self.loop.run(self._producer_conn.close())
        self.loop.close()


if __name__ == "__main__":
    main(PgQueuerContestant)
