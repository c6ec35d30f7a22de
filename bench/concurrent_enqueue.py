"""Concurrent producers: one-job enqueues from several threads through one Relay, with and without NOTIFY.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python bench/concurrent_enqueue.py

Creates a scratch database (relay_bench_producers, or ``--database``: a name
the harness's ``databases`` module accepts) on the server of DATABASE_URL,
migrates Relay into it, and, with a session LISTENing on ``relay_jobs`` as a
worker's listener does, has 1 and then ``--threads`` threads each enqueue
``--jobs`` jobs one after another, each committed before the next, through
one ``Relay`` whose pool holds a connection per thread. Each shape runs with
Relay's wake-ups (``notify=True``, the default) and without them
(``notify=False``), in interleaved rounds; the table gives the median
enqueues per second and each one's ratio to the same threads without NOTIFY.

PostgreSQL lets one transaction that sent a NOTIFY commit at a time, so
producers that each notify cannot share a WAL flush; see
``relay_core/wakeups.py`` for how Relay's enqueues keep that from them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from enqueue_breakdown import positive
from harness import databases

from relay_core import Relay
from relay_core.settings import database_url

DATABASE = "relay_bench_producers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=positive, default=8, help="producer threads of the concurrent shape")
    parser.add_argument("--jobs", type=positive, default=400, help="enqueues per thread and round")
    parser.add_argument("--rounds", type=positive, default=5)
    parser.add_argument(
        "--database", default=DATABASE, help="the scratch database's name, starting relay_bench_ (dropped at the end)"
    )
    args = parser.parse_args()

    admin_dsn = database_url()
    dsn = databases.create(admin_dsn, args.database)
    try:
        Relay(dsn).migrate()
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute("LISTEN relay_jobs")
            stop = threading.Event()
            reader = threading.Thread(target=read_notifies, args=(listener, stop), daemon=True)
            reader.start()
            try:
                report(measure(dsn, args.threads, args.jobs, args.rounds), args.jobs)
            finally:
                stop.set()
                reader.join(5)
    finally:
        databases.drop(admin_dsn, args.database)


def read_notifies(listener: psycopg.Connection, stop: threading.Event) -> None:
    """Take the notifications as they come, as a worker's listener does."""
    while not stop.is_set():
        for _ in listener.notifies(timeout=0.2):
            pass


def measure(dsn: str, threads: int, jobs: int, rounds: int) -> dict[tuple[int, bool], list[float]]:
    """Enqueues per second for each (threads, notify), one value per round."""
    shapes = [(n, notify) for n in sorted({1, threads}) for notify in (True, False)]
    results: dict[tuple[int, bool], list[float]] = {shape: [] for shape in shapes}
    for _ in range(rounds):
        for shape in shapes:
            results[shape].append(enqueues_per_second(dsn, *shape, jobs))
    return results


def enqueues_per_second(dsn: str, threads: int, notify: bool, jobs: int) -> float:
    """``threads`` threads, started together, each enqueueing ``jobs`` jobs through one Relay."""
    relay = Relay(dsn, pool_size=threads, notify=notify)
    try:
        for _ in range(threads):
            relay.enqueue("noop")  # the pool connected, the insert prepared
        start = threading.Barrier(threads + 1)

        def produce() -> None:
            start.wait()
            for seq in range(jobs):
                relay.enqueue("noop", {"seq": seq})

        producers = [threading.Thread(target=produce) for _ in range(threads)]
        for producer in producers:
            producer.start()
        start.wait()
        began = time.perf_counter()
        for producer in producers:
            producer.join()
        return threads * jobs / (time.perf_counter() - began)
    finally:
        relay.close()


def report(results: dict[tuple[int, bool], list[float]], jobs: int) -> None:
    print(f"{jobs} one-job enqueues per thread and round, {len(next(iter(results.values())))} rounds, medians\n")
    print("| producers | NOTIFY | enqueues/s (min-max) | x without NOTIFY |")
    print("|---|---|---|---|")
    for (threads, notify), values in results.items():
        without = statistics.median(results[(threads, False)])
        median = statistics.median(values)
        print(
            f"| {threads} | {'yes' if notify else 'no'} | {median:,.0f} ({min(values):,.0f}-{max(values):,.0f}) "
            f"| {median / without:.2f}x |"
        )


if __name__ == "__main__":
    main()
