"""Oban for Python as its README shows it: a ``@worker`` class, ``Oban(pool=..., queues=...)``.

A client-mode instance (no queues) enqueues, as a web process would; the
worker is an embedded server-mode instance with one queue at ``concurrency``.
Everything else (stager, pruner, lifeline, leadership) keeps its defaults.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common import Contestant, LoopThread, import_library, main

oban = import_library("oban")
Oban, worker = oban.Oban, oban.worker
from oban import schema  # noqa: E402

QUEUE = "bench"


def _ignore(seq: int) -> None:
    """What a job does before the harness starts a worker: nothing."""


_on_start: Callable[[int], None] = _ignore


@worker(queue=QUEUE)
class Noop:
    """The job: tell the harness it started."""

    async def process(self, job) -> None:  # type: ignore[no-untyped-def]
        _on_start(job.args["seq"])


class ObanContestant(Contestant):
    """A pool, a client-mode Oban for enqueues and a server-mode one for work."""

    name = "oban"
    table = "oban_jobs"
    finished_sql = "SELECT count(*) FROM oban_jobs WHERE state = 'completed'"
    history_overrides = {  # noqa: RUF012
        "state": "'completed'",
        "attempt": "1",
        "attempted_at": "timezone('UTC', now())",
        "completed_at": "timezone('UTC', now())",
    }

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self.loop = LoopThread()
        self.pool = self.loop.run(Oban.create_pool(dsn))
        self.client = Oban(pool=self.pool)
        self._server: Oban | None = None

    def setup(self) -> None:
        self.loop.run(schema.install(self.pool))

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        async def run() -> dict[int, float]:
            committed: dict[int, float] = {}
            for i, seq in enumerate(seqs):
                if pace:
                    await asyncio.to_thread(pace, i)
                await self.client.enqueue(Noop.new({"seq": seq}))
                committed[seq] = time.perf_counter()
            return committed

        return self.loop.run(run())

    def enqueue_bulk(self, count: int) -> None:
        self.loop.run(self.client.enqueue_many([Noop.new({"seq": i}) for i in range(count)]))

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        global _on_start
        _on_start = on_start

        async def start() -> Oban:
            server = Oban(pool=self.pool, queues={QUEUE: self.concurrency}, name="bench-worker")
            return await server.start()

        self._server = self.loop.run(start())

    def stop_worker(self) -> None:
        assert self._server is not None
        self.loop.run(self._server.stop(), timeout=60)

    def close(self) -> None:
        self.loop.run(self.pool.close())
        self.loop.close()


if __name__ == "__main__":
    main(ObanContestant)
