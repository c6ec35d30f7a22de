"""Chancy as its documentation shows it: ``async with Chancy(dsn)``, a declared Queue, a Worker.

The queue runs the asyncio executor (the job is an ``async def`` no-op; the
default process-pool executor is meant for CPU-bound jobs) at ``concurrency``
with ``eager_polling`` on, the documented setting for queues that always have
work (without it a worker sleeps the 5 s polling interval after every fetch).
Its logger is set to WARNING so that, as for every contestant, no line is
written per job. Notifications and default plugins are left as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common import Contestant, LoopThread, import_library, main

chancy = import_library("chancy")
Chancy, Queue, Worker, job = chancy.Chancy, chancy.Queue, chancy.Worker, chancy.job

QUEUE = "bench"


def _ignore(seq: int) -> None:
    """What a job does before the harness starts a worker: nothing."""


_on_start: Callable[[int], None] = _ignore


@job(queue=QUEUE)
async def noop(seq: int) -> None:
    """The job: tell the harness it started."""
    _on_start(seq)


class ChancyContestant(Contestant):
    """One Chancy app for producers and the worker, on a background event loop."""

    name = "chancy"
    table = "chancy_jobs"
    finished_sql = "SELECT count(*) FROM chancy_jobs WHERE state = 'succeeded'"
    history_overrides = {  # noqa: RUF012
        "id": "gen_random_uuid()",
        "state": "'succeeded'",
        "attempts": "1",
        "started_at": "now()",
        "completed_at": "now()",
    }
    runnable_overrides = {"id": "gen_random_uuid()"}  # noqa: RUF012

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self.loop = LoopThread()
        quiet = logging.getLogger("bench.chancy")
        quiet.setLevel(logging.WARNING)
        self.app = Chancy(dsn, log=quiet)
        self.loop.run(self.app.__aenter__())
        self._worker = None

    def setup(self) -> None:
        async def install() -> None:
            await self.app.migrate()
            await self.app.declare(
                Queue(QUEUE, concurrency=self.concurrency, executor=Chancy.Executor.Async, eager_polling=True),
                upsert=True,
            )

        self.loop.run(install())

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        async def run() -> dict[int, float]:
            committed: dict[int, float] = {}
            for i, seq in enumerate(seqs):
                if pace:
                    await asyncio.to_thread(pace, i)
                await self.app.push(noop.job.with_kwargs(seq=seq))
                committed[seq] = time.perf_counter()
            return committed

        return self.loop.run(run())

    def enqueue_bulk(self, count: int) -> None:
        async def run() -> None:
            async for _refs in self.app.push_many([noop.job.with_kwargs(seq=i) for i in range(count)]):
                pass

        self.loop.run(run())

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        global _on_start
        _on_start = on_start

        async def start() -> Worker:
            worker = Worker(self.app, register_signal_handlers=False)
            await worker.start()
            return worker

        self._worker = self.loop.run(start())

    def stop_worker(self) -> None:
        assert self._worker is not None
        self.loop.run(self._worker.stop(), timeout=60)

    def close(self) -> None:
        self.loop.run(self.app.__aexit__(None, None, None))
        self.loop.close()


if __name__ == "__main__":
    main(ChancyContestant)
