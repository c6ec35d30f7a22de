"""What every contestant script shares: the command line, the clocks and the workloads.

A contestant script describes one queue library in a small class (how to
install its schema, enqueue one job, enqueue many, and run and stop a worker
whose handler calls ``on_start(seq)``); this module turns that class into the
same command-line contract for all of them, so the harness can run Relay, the
ceiling and every peer alike and compare their numbers. It needs only the
standard library and psycopg (for the harness's own bookkeeping queries), so it
runs in every contestant's virtualenv.

Every time here is ``time.perf_counter()``: on Linux it reads CLOCK_MONOTONIC,
one clock for the whole machine, so a producer process and a worker process
can compare their stamps (W4).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

WORKLOADS = ("setup", "W1", "W2", "W3", "W4", "W4-producer", "W5", "W6")


def import_library(name: str) -> Any:
    """Import the installed library ``name``, which this script's own file name shadows."""
    here = os.path.dirname(os.path.abspath(sys.argv[0]))
    saved = sys.path[:]
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        return importlib.import_module(name)
    finally:
        sys.path = saved


class Recorder:
    """Counts handler starts and stamps them; tells a waiter when ``target`` is reached.

    Handlers of threaded and asyncio workers both call :meth:`hit`; a plain
    lock keeps it correct for the threaded ones and costs nothing noticeable
    for the others.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        self.starts: dict[int, float] = {}
        self.done = threading.Event()
        self._lock = threading.Lock()

    def hit(self, seq: int | None = None) -> None:
        """A handler started (``seq`` identifies the job when latency is measured)."""
        now = time.perf_counter()
        with self._lock:
            self.count += 1
            if self.first is None:
                self.first = now
            if seq is not None:
                self.starts[seq] = now
            if self.count == self.target:
                self.last = now
                self.done.set()


class Contestant:
    """One queue library as the harness sees it; scripts subclass it.

    ``table`` is the library's jobs table; ``history_overrides`` and
    ``runnable_overrides`` give SQL expressions for columns that a cloned row
    needs changed (W5 builds big tables by cloning one job enqueued through
    the library's own API); ``finished_sql`` counts jobs whose outcome is
    recorded; ``keeps_history`` is False for libraries that delete finished
    jobs from their queue table.
    """

    name = "?"
    table = "?"
    finished_sql = "?"
    history_overrides: dict[str, str] = {}  # noqa: RUF012 (overridden per class, never mutated)
    runnable_overrides: dict[str, str] = {}  # noqa: RUF012
    keeps_history = True

    def __init__(self, dsn: str, concurrency: int) -> None:
        self.dsn = dsn
        self.concurrency = concurrency

    # The methods below are what each library implements.

    def setup(self) -> None:
        """Install the library's schema in an empty database."""
        raise NotImplementedError

    def enqueue_each(self, seqs: list[int], pace: Callable[[int], None] | None = None) -> dict[int, float]:
        """Enqueue one job per seq, each in its own transaction; return seq -> time committed.

        ``pace(i)`` (W4) sleeps until the i-th job is due.
        """
        raise NotImplementedError

    def enqueue_bulk(self, count: int) -> None:
        """Enqueue ``count`` jobs the way the library recommends for bulk."""
        raise NotImplementedError

    def start_worker(self, on_start: Callable[[int], None]) -> None:
        """Start a worker at ``self.concurrency`` whose handler calls ``on_start(seq)``."""
        raise NotImplementedError

    def stop_worker(self) -> None:
        """Stop the worker gracefully and wait for it."""
        raise NotImplementedError

    def worker_gone(self) -> bool:
        """Whether the worker started by :meth:`start_worker` has stopped on its own (crashed).

        Those that cannot tell say False, and a waiter waits out its time limit.
        """
        return False

    def close(self) -> None:
        """Release whatever the contestant holds (pools, event loops)."""


class LoopThread:
    """An asyncio event loop in a background thread, for asyncio-only libraries.

    The harness drives contestants synchronously; an asyncio library runs its
    worker on this loop and the harness submits coroutines to it.
    """

    def __init__(self) -> None:
        import asyncio

        self._asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and return its result."""
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Any) -> Any:
        """Start ``coro`` on the loop without waiting; returns its concurrent future."""
        return self._asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def pacer(rate: float) -> Callable[[int], None]:
    """A function that sleeps until the i-th event of a steady ``rate``/s schedule."""
    start = time.perf_counter()

    def pace(i: int) -> None:
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    return pace


# -- bookkeeping queries the harness makes itself --------------------------


def scalar(dsn: str, query: str, params: Any = None) -> Any:
    """One value from a fresh autocommit connection."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
        return row[0] if row else None


def wait_finished(dsn: str, finished_sql: str, target: int, timeout: float) -> float:
    """Poll until ``finished_sql`` counts ``target`` jobs; return when that was seen."""
    deadline = time.perf_counter() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            count = conn.execute(finished_sql).fetchone()[0]
            now = time.perf_counter()
            if count >= target:
                return now
            if now > deadline:
                raise TimeoutError(f"only {count} of {target} jobs finished in {timeout}s")
            time.sleep(0.005)


def clone_rows(dsn: str, table: str, template_key: str, count: int, overrides: dict[str, str]) -> None:
    """Insert ``count`` copies of one row, with some columns replaced by SQL expressions.

    Identity and serial columns are left to their defaults, so each copy is a
    new job exactly as the library would have written it.
    """
    schema, _, name = table.rpartition(".")
    schema = schema or "public"
    with psycopg.connect(dsn, autocommit=True) as conn:
        columns = [
            row[0]
            for row in conn.execute(
                """
                SELECT column_name FROM information_schema.columns
                WHERE table_schema = %s AND table_name = %s
                  AND is_identity = 'NO' AND is_generated = 'NEVER'
                  AND coalesce(column_default, '') NOT LIKE 'nextval(%%'
                ORDER BY ordinal_position
                """,
                (schema, name),
            )
        ]
        target = ", ".join(f'"{c}"' for c in columns)
        source = ", ".join(overrides.get(c, f't."{c}"') for c in columns)
        conn.execute(
            f"INSERT INTO {table} ({target}) SELECT {source} "
            f"FROM {table} AS t, generate_series(1, %s) WHERE t.id::text = %s",
            (count, template_key),
        )


def table_bytes(dsn: str, table: str) -> int:
    """Heap, indexes and TOAST of the jobs table."""
    return int(scalar(dsn, "SELECT pg_total_relation_size(%s::regclass)", (table,)))


def latest_key(dsn: str, table: str) -> str:
    """The key of the most recently inserted job (the clone template of W5)."""
    order = "created_at DESC" if table.endswith("chancy_jobs") else "id DESC"
    return str(scalar(dsn, f"SELECT id::text FROM {table} ORDER BY {order} LIMIT 1"))


# -- the workloads ------------------------------------------------------------


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def wait_for_starts(contestant: Contestant, recorder: Recorder, timeout: float) -> None:
    """Wait until every handler ``recorder`` expects has started: TimeoutError past ``timeout``, and
    RuntimeError as soon as the worker is gone, rather than the whole time limit (14 minutes in W1)."""
    deadline = time.monotonic() + timeout
    while not recorder.done.wait(min(1.0, max(deadline - time.monotonic(), 0.0))):
        if contestant.worker_gone():
            raise RuntimeError(f"the worker stopped after {recorder.count} of {recorder.target} handlers started")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{recorder.count} of {recorder.target} handlers started in {timeout}s")


def drain(contestant: Contestant, jobs: int, timeout: float) -> dict[str, Any]:
    """W1: enqueue ``jobs`` (untimed), then time a worker draining them all.

    The clock starts when the first handler starts (worker start-up is not
    the queue's throughput) and stops when the database shows every job's
    outcome recorded, so a library cannot look fast by deferring its writes.

    The bulk-loaded table is vacuumed and analyzed before the clock starts,
    as autovacuum would have done by then on a server that runs it: without
    statistics, a planner that sees a table of 20,000 fresh rows may pick a
    poor plan for a library's claim (the bench server may run with
    autovacuum off, and only Relay vacuums its own tables).
    """
    contestant.enqueue_bulk(jobs)
    with psycopg.connect(contestant.dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {contestant.table}")
    recorder = Recorder(jobs)
    contestant.start_worker(recorder.hit)
    try:
        wait_for_starts(contestant, recorder, timeout)
        finished = wait_finished(contestant.dsn, contestant.finished_sql, jobs, timeout)
    finally:
        contestant.stop_worker()
    assert recorder.first is not None
    seconds = finished - recorder.first
    return {"jobs": jobs, "seconds": seconds, "value": jobs / seconds, "unit": "jobs/s"}


def enqueue_each(contestant: Contestant, jobs: int) -> dict[str, Any]:
    """W2: ``jobs`` enqueues, each in its own transaction, one after another."""
    started = time.perf_counter()
    contestant.enqueue_each(list(range(jobs)))
    seconds = time.perf_counter() - started
    return {"jobs": jobs, "seconds": seconds, "value": jobs / seconds, "unit": "jobs/s"}


def enqueue_bulk(contestant: Contestant, jobs: int) -> dict[str, Any]:
    """W3: one bulk enqueue of ``jobs``."""
    started = time.perf_counter()
    contestant.enqueue_bulk(jobs)
    seconds = time.perf_counter() - started
    return {"jobs": jobs, "seconds": seconds, "value": jobs / seconds, "unit": "jobs/s"}


def latency(contestant: Contestant, args: argparse.Namespace) -> dict[str, Any]:
    """W4: jobs enqueued at a steady rate by another process into idle workers.

    The producer is a separate process (like a web process) and stamps each
    job after its enqueue returned, i.e. after commit; the handler stamps its
    start. The difference is the enqueue-to-start latency.
    """
    recorder = Recorder(args.jobs)
    contestant.start_worker(recorder.hit)
    try:
        time.sleep(1.0)  # let the worker settle into its idle wait
        command = [sys.executable, os.path.abspath(sys.argv[0]), "--dsn", args.dsn, "--workload", "W4-producer"]
        command += ["--jobs", str(args.jobs), "--rate", str(args.rate), "--concurrency", str(args.concurrency)]
        produced = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False)
        if produced.returncode != 0:
            raise RuntimeError(f"producer failed: {produced.stderr.strip()[-2000:]}")
        committed = {int(k): v for k, v in json.loads(produced.stdout.strip().splitlines()[-1]).items()}
        wait_for_starts(contestant, recorder, args.timeout)
    finally:
        contestant.stop_worker()
    waits = [(recorder.starts[seq] - committed[seq]) * 1000 for seq in committed if seq in recorder.starts]
    return {
        "jobs": args.jobs,
        "value": statistics.median(waits),
        "unit": "ms",
        "p50_ms": percentile(waits, 50),
        "p95_ms": percentile(waits, 95),
        "p99_ms": percentile(waits, 99),
        "max_ms": max(waits),
    }


def produce(contestant: Contestant, args: argparse.Namespace) -> None:
    """The W4 producer process: enqueue at ``rate``/s, print seq -> commit time."""
    committed = contestant.enqueue_each(list(range(args.jobs)), pace=pacer(args.rate))
    print(json.dumps(committed))


def claim_cost(contestant: Contestant, args: argparse.Namespace) -> dict[str, Any]:
    """W5: time per job while draining ``jobs`` jobs from tables of growing size.

    For each size the table is grown by cloning one freshly enqueued job:
    half the new rows as finished history, half runnable (a library that
    deletes finished jobs keeps no history, so all its new rows are runnable:
    the harder case for its claim). Then ``reps`` times a
    worker drains ``jobs`` jobs and the time between the first and the last
    handler start is divided by the jobs between them.
    """
    sizes = [int(s) for s in args.sizes.split(",")]
    levels = []
    for size in sizes:
        existing = int(scalar(contestant.dsn, f"SELECT count(*) FROM {contestant.table}"))
        missing = max(0, size - existing)
        contestant.enqueue_each([0])
        template = latest_key(contestant.dsn, contestant.table)
        history = missing // 2 if contestant.keeps_history else 0
        if history:
            clone_rows(contestant.dsn, contestant.table, template, history, contestant.history_overrides)
        clone_rows(contestant.dsn, contestant.table, template, missing - history, contestant.runnable_overrides)
        with psycopg.connect(contestant.dsn, autocommit=True) as conn:
            conn.execute(f"VACUUM ANALYZE {contestant.table}")
        per_job = []
        for _ in range(args.reps):
            recorder = Recorder(args.jobs)
            contestant.start_worker(recorder.hit)
            try:
                wait_for_starts(contestant, recorder, args.timeout)
            finally:
                contestant.stop_worker()
            assert recorder.first is not None and recorder.last is not None
            per_job.append((recorder.last - recorder.first) / (args.jobs - 1) * 1000)
        rows = int(scalar(contestant.dsn, f"SELECT count(*) FROM {contestant.table}"))
        levels.append({"size": size, "rows": rows, "ms_per_job": statistics.median(per_job), "reps": per_job})
    flat = levels[-1]["ms_per_job"] / levels[0]["ms_per_job"]
    return {"jobs": args.jobs, "levels": levels, "value": flat, "unit": "x (largest / smallest)"}


def soak(contestant: Contestant, args: argparse.Namespace) -> dict[str, Any]:
    """W6: a steady enqueue rate for ``duration`` s; throughput and table size per window."""
    recorder = Recorder(10**12)
    # Count only: stamping every job would grow this process by ~100 bytes a job and
    # hide the worker's own memory behaviour, which the soak is there to show.
    contestant.start_worker(lambda seq: recorder.hit())
    windows = []
    stop = threading.Event()

    def producer() -> None:
        pace = pacer(args.rate)
        seq = 0
        while not stop.is_set():
            batch = list(range(seq, seq + 10))
            contestant.enqueue_each(batch)
            seq += 10
            pace(seq)

    thread = threading.Thread(target=producer, daemon=True)
    started = time.perf_counter()
    thread.start()
    try:
        previous = 0
        while time.perf_counter() - started < args.duration:
            time.sleep(args.window)
            count = recorder.count
            windows.append(
                {
                    "t": round(time.perf_counter() - started, 1),
                    "jobs_per_s": (count - previous) / args.window,
                    "table_bytes": table_bytes(contestant.dsn, contestant.table),
                    "rss_mb": _rss_mb(),
                }
            )
            previous = count
    finally:
        stop.set()
        thread.join(10)
        contestant.stop_worker()
    # Drift runs from the second window to the last: the first is the worker's warm-up. Without two
    # such windows, or with none of the jobs run in the second, there is none to give, and 0% read as met.
    rates = [w["jobs_per_s"] for w in windows[1:]]
    if len(rates) < 2 or not rates[0]:
        raise SystemExit(
            f"W6 cannot tell a drift from jobs/s per window {[w['jobs_per_s'] for w in windows]}: it needs two "
            "windows after the first (--duration at least 3 x --window), and jobs run in the second"
        )
    drift = (rates[-1] - rates[0]) / rates[0]
    return {"windows": windows, "value": drift, "unit": "throughput drift", "rate": args.rate}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(factory: Callable[[str, int], Contestant]) -> None:
    """Parse the shared command line, run one workload, print one JSON line."""
    parser = argparse.ArgumentParser(description="Run one benchmark workload against one queue library.")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--workload", required=True, choices=WORKLOADS)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=100.0, help="W4/W6: jobs per second")
    parser.add_argument("--sizes", default="10000,100000,1000000", help="W5: table sizes")
    parser.add_argument("--reps", type=int, default=3, help="W5: drains per size")
    parser.add_argument("--duration", type=float, default=600.0, help="W6: seconds")
    parser.add_argument("--window", type=float, default=30.0, help="W6: seconds per reported window")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    contestant = factory(args.dsn, args.concurrency)
    try:
        if args.workload == "setup":
            contestant.setup()
            result: dict[str, Any] = {}
        elif args.workload == "W1":
            result = drain(contestant, args.jobs, args.timeout)
        elif args.workload == "W2":
            result = enqueue_each(contestant, args.jobs)
        elif args.workload == "W3":
            result = enqueue_bulk(contestant, args.jobs)
        elif args.workload == "W4":
            result = latency(contestant, args)
        elif args.workload == "W4-producer":
            produce(contestant, args)
            return
        elif args.workload == "W5":
            result = claim_cost(contestant, args)
        else:
            result = soak(contestant, args)
    finally:
        contestant.close()
    result.update({"contestant": contestant.name, "workload": args.workload, "concurrency": args.concurrency})
    print(json.dumps(result))
