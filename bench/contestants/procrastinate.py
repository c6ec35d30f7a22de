"""Procrastinate as its documentation shows it: an async App, tasks, ``run_worker_async``.

The worker runs with ``concurrency`` and otherwise default options (LISTEN/NOTIFY
on, finished jobs kept); the task is an ``async def`` because the worker is
asyncio-native (sync tasks would be sent to threads). Its connector's pool
holds ``concurrency + 1`` connections, as Procrastinate's docs ask for short
jobs ("Mind the size of your PostgreSQL pool"): every fetch and every finish
borrows one, and the pool's default of 4 would make the worker wait for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from common import Contestant, LoopThread, import_library, main

procrastinate = import_library("procrastinate")


class Procrastinate(Contestant):
    """One App on a PsycopgConnector; defer, batch_defer and one async worker."""

    name = "procrastinate"
    table = "procrastinate_jobs"
    finished_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
    history_overrides = {"status": "'succeeded'", "attempts": "1"}  # noqa: RUF012

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self.loop = LoopThread()
        connector = procrastinate.PsycopgConnector(conninfo=dsn, min_size=concurrency + 1, max_size=concurrency + 1)
        self.app = procrastinate.App(connector=connector)
        self._on_start: Callable[[int], None] = lambda seq: None
        self._worker = None

        @self.app.task(name="noop", queue="bench")
        async def noop(seq: int) -> None:
            self._on_start(seq)

        self.noop = noop
        self.loop.run(self._open())

    async def _open(self) -> None:
        await self.app.open_async()

    def setup(self) -> None:
        self.loop.run(self.app.schema_manager.apply_schema_async())

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        async def run() -> dict[int, float]:
            committed: dict[int, float] = {}
            for i, seq in enumerate(seqs):
                if pace:
                    await asyncio.to_thread(pace, i)
                await self.noop.defer_async(seq=seq)
                committed[seq] = time.perf_counter()
            return committed

        return self.loop.run(run())

    def enqueue_bulk(self, count: int) -> None:
        self.loop.run(self.noop.batch_defer_async(*({"seq": i} for i in range(count))))

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        self._on_start = on_start
        self._worker = self.loop.run(self._start())

    async def _start(self) -> asyncio.Task:
        options = {"queues": ["bench"], "concurrency": self.concurrency, "install_signal_handlers": False}
        return asyncio.create_task(self.app.run_worker_async(**options))

    def stop_worker(self) -> None:
        self.loop.run(self._stop(), timeout=60)

    async def _stop(self) -> None:
        # Cancelling run_worker_async is how an embedded worker is stopped gracefully.
        assert self._worker is not None
        self._worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker

    def close(self) -> None:
        self.loop.run(self.app.close_async())
        self.loop.close()


if __name__ == "__main__":
    main(Procrastinate)
