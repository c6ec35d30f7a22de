"""Relay, through its public API only, with every guarantee on.

Leases, heartbeats, fencing tokens, the worker registry and error history are
all Relay's defaults; nothing here turns one off or reaches past
``Relay`` / ``Worker``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from common import Contestant, main

from relay_core import Relay, Worker


class RelayContestant(Contestant):
    """Relay as its README shows it: handlers on a ``Relay``, a ``Worker`` thread."""

    name = "relay"
    table = "relay.jobs"
    finished_sql = "SELECT count(*) FROM relay.jobs WHERE status = 'succeeded'"
    history_overrides = {  # noqa: RUF012
        "status": "'succeeded'",
        "attempts": "1",
        "lease_token": "1",
        "started_at": "now()",
        "finished_at": "now()",
    }

    def __init__(self, dsn: str, concurrency: int) -> None:
        super().__init__(dsn, concurrency)
        self.relay = Relay(dsn)
        self._on_start: Callable[[int], None] = lambda seq: None
        self._worker: Worker | None = None
        self._thread: threading.Thread | None = None

        @self.relay.handler("noop")
        def noop(job) -> None:  # type: ignore[no-untyped-def]
            self._on_start(job.payload["seq"])

    def setup(self) -> None:
        self.relay.migrate()

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        committed: dict[int, float] = {}
        for i, seq in enumerate(seqs):
            if pace:
                pace(i)
            self.relay.enqueue("noop", {"seq": seq})
            committed[seq] = time.perf_counter()
        return committed

    def enqueue_bulk(self, count: int) -> None:
        self.relay.enqueue_many([{"type": "noop", "payload": {"seq": i}} for i in range(count)])

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        self._on_start = on_start
        self._worker = self.relay.worker(concurrency=self.concurrency)
        self._thread = threading.Thread(target=self._worker.run, kwargs={"install_signals": False}, daemon=True)
        self._thread.start()

    def stop_worker(self) -> None:
        assert self._worker is not None and self._thread is not None
        self._worker.stop()
        self._thread.join(60)
        self._thread = None  # stopped as asked, not gone on its own (worker_gone)

    def worker_gone(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def close(self) -> None:
        self.relay.close()


if __name__ == "__main__":
    main(RelayContestant)
