"""Where a one-job enqueue's time goes, next to the ceiling's bare insert (W2's gap, part by part).

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python bench/enqueue_breakdown.py

Creates a scratch database (relay_bench_enqueue, or ``--database``: a name
the harness's ``databases`` module accepts) on the server of DATABASE_URL,
migrates Relay into it, and times one-job transactions, each committed
before the next as in W2, in interleaved rounds (each in a shuffled order):

- ``ceiling``: the ceiling contestant's insert into its own five-column table;
- ``jobs, no count``: a plain one-job INSERT of Relay's columns, which
  counts nothing itself (as before migration 0027), into a copy of
  ``relay.jobs`` with the same columns, defaults and indexes but no triggers;
- ``jobs, statement trigger``: that insert into a copy with the statement
  trigger that counted every insert until 0027
  (``relay.jobs_counted_insert``: the table's rules and the admin counters'
  delta, through a transition table);
- ``jobs, counted by the insert``: Relay's insert statement (``job_insert``),
  which checks and counts its job itself, into the copy without triggers;
- ``relay.jobs, NOTIFY``: that statement on ``relay.jobs`` itself, with the
  NOTIFY that wakes an idle worker;
- ``Relay.enqueue``: the public call (validation, the pool's checkout and
  return, then that statement, by a name prepared on the session).

The first five run on one held connection, prepared by psycopg. For each it prints the
median wall time per transaction, the server process's CPU time per
transaction (from /proc, so PostgreSQL must run on this machine; Relay's
pool may spread the last one over two server processes, and all of them are
read), and the WAL each writes. Nothing listens on the channel, as in W2.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import databases

from relay_core import Relay
from relay_core.queries import sql
from relay_core.settings import database_url

DATABASE = "relay_bench_enqueue"

TABLES = """
CREATE TABLE bench_jobs (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status   smallint NOT NULL DEFAULT 0,
    payload  jsonb NOT NULL,
    run_at   timestamptz NOT NULL DEFAULT now(),
    attempts integer NOT NULL DEFAULT 0
);
CREATE INDEX bench_jobs_runnable ON bench_jobs (run_at, id) WHERE status = 0;
CREATE TABLE public.jobs_plain (LIKE relay.jobs INCLUDING ALL) WITH (fillfactor = 80);
CREATE TABLE public.jobs_counted (LIKE relay.jobs INCLUDING ALL) WITH (fillfactor = 80);
CREATE TRIGGER jobs_counted_insert AFTER INSERT ON public.jobs_counted
    REFERENCING NEW TABLE AS inserted_jobs FOR EACH STATEMENT EXECUTE FUNCTION relay.jobs_counted_insert();
"""

CEILING_INSERT = "INSERT INTO bench_jobs (payload) VALUES (%s) RETURNING id"

#: A plain one-job insert with Relay's columns, which counts nothing itself (as before migration 0027).
INSERT_UNCOUNTED = (
    "INSERT INTO {table} (status, type, payload, queue, priority, run_at, max_attempts)"
    " VALUES ('queued', %(type)s, %(payload)s::jsonb, %(queue)s, %(priority)s, now(), %(max_attempts)s) RETURNING id"
)


def server_cpu_seconds(pids: list[int]) -> float:
    """CPU time the server processes ``pids`` have used, from /proc (nanoseconds there)."""
    return sum(int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) for pid in pids) / 1e9


def positive(text: str) -> int:
    """A command-line count of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=positive, default=2000, help="transactions per variant and round")
    parser.add_argument("--rounds", type=positive, default=7)
    parser.add_argument(
        "--database", default=DATABASE, help="the scratch database's name, starting relay_bench_ (dropped at the end)"
    )
    args = parser.parse_args()

    admin_dsn = database_url()
    dsn = databases.create(admin_dsn, args.database)
    relay = Relay(dsn)
    try:
        relay.migrate()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(TABLES)
            conn.execute("SET TimeZone = 'UTC'; SET jit = off")
            report(measure(relay, conn, args.jobs, args.rounds), args.jobs)
    finally:
        relay.close()
        databases.drop(admin_dsn, args.database)  # with FORCE: a run that failed part way may leave a session


def measure(
    relay: Relay, conn: psycopg.Connection, jobs: int, rounds: int
) -> dict[str, list[tuple[float, float, float]]]:
    """Each variant's (wall s, server CPU s, WAL bytes) per round, for ``jobs`` transactions."""
    insert = sql("job_insert")

    def params(seq: int, notify: bool) -> dict:
        return {
            "type": "noop",
            "payload": json.dumps({"seq": seq}),
            "queue": "default",
            "priority": 0,
            "run_at": None,
            "max_attempts": 20,
            "notify": notify,
            "published": False,
        }

    def statement(query: str, notify: bool) -> Callable[[int], object]:
        return lambda seq: conn.execute(query, params(seq, notify), prepare=True).fetchone()

    variants: dict[str, Callable[[int], object]] = {
        "ceiling": lambda seq: conn.execute(CEILING_INSERT, (Jsonb({"seq": seq}),), prepare=True).fetchone(),
        "jobs, no count": statement(INSERT_UNCOUNTED.format(table="public.jobs_plain"), notify=False),
        "jobs, statement trigger": statement(INSERT_UNCOUNTED.format(table="public.jobs_counted"), notify=False),
        "jobs, counted by the insert": statement(insert.replace("relay.jobs ", "public.jobs_plain "), notify=False),
        "relay.jobs, NOTIFY": statement(insert, notify=True),
        "Relay.enqueue": lambda seq: relay.enqueue("noop", {"seq": seq}),
    }
    for run in variants.values():  # warm: plans prepared, the pool's connections open
        for seq in range(200):
            run(seq)
    pool_pids = [
        row[0]
        for row in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"  # not an autovacuum worker, which may be gone when read
        )
    ]
    own_pid = [conn.info.backend_pid]
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(6).shuffle
    for _ in range(rounds):
        shuffle(order)  # each round in another order, so no variant always runs after the same one
        for name in order:
            run = variants[name]
            pids = pool_pids if name == "Relay.enqueue" else own_pid
            wal_before = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
            cpu_before, started = server_cpu_seconds(pids), time.perf_counter()
            for seq in range(jobs):
                run(seq)
            wall = time.perf_counter() - started
            cpu = server_cpu_seconds(pids) - cpu_before
            wal = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s)", (wal_before,)).fetchone()[0]
            results[name].append((wall, cpu, float(wal)))
    return results


def report(results: dict[str, list[tuple[float, float, float]]], jobs: int) -> None:
    """Medians per transaction, and each wall time as a ratio of the ceiling's."""
    ceiling = statistics.median(wall for wall, _, _ in results["ceiling"])
    print("| variant | wall us (min-max) | x ceiling | server CPU us | WAL bytes |")
    print("|---|---|---|---|---|")
    for name, rounds in results.items():
        walls = [wall / jobs * 1e6 for wall, _, _ in rounds]
        wall = statistics.median(walls)
        cpu = statistics.median(cpu for _, cpu, _ in rounds) / jobs * 1e6
        wal = statistics.median(wal for _, _, wal in rounds) / jobs
        ratio = ceiling / (wall * jobs / 1e6)
        print(f"| {name} | {wall:.0f} ({min(walls):.0f}-{max(walls):.0f}) | {ratio:.2f}x | {cpu:.0f} | {wal:.0f} |")


if __name__ == "__main__":
    main()
