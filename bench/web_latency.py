"""Latency of the admin API with 1,000,000 jobs in the table.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python bench/web_latency.py

Creates a scratch database (relay_bench_web) on the server of DATABASE_URL,
fills it with a realistic million jobs (mostly succeeded, a backlog of queued
ones across queues and priorities, dead jobs with error histories, a few
claimed and cancelled), registers workers, then calls each admin endpoint
through the real Flask app (in process, WSGI) and prints p50/p95/max per
endpoint. For comparison it also times the full-table count the counters of
migration 0003 replace. ``--keep`` keeps the filled database for another run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg import conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay_core import Relay, users
from relay_core.migrate import migrate
from relay_core.settings import database_url
from relay_web import create_app

DATABASE = "relay_bench_web"
SECRET = "bench-" + "s" * 40

FILL = """
INSERT INTO relay.jobs (type, queue, priority, payload, run_at)
SELECT (ARRAY['send_email', 'resize_image', 'sync_crm', 'charge_card', 'build_report'])[1 + i %% 5],
       (ARRAY['default', 'mail', 'media', 'billing'])[1 + i %% 4],
       (i %% 3) - 1,
       jsonb_build_object('n', i, 'to', 'user' || i || '@example.com'),
       now() - make_interval(secs => (%(rows)s - i) * 0.5)
FROM generate_series(1, %(rows)s) AS i
"""

# Moves the jobs through legal transitions so the counters see them as workers would.
LIFECYCLE = [
    # 96% were claimed by some worker...
    "UPDATE relay.jobs SET status = 'claimed', attempts = 1, lease_token = 1, started_at = now(), "
    "claimed_by = 'bench-' || (id %% 16), claimed_until = now() + interval '5 minutes' "
    "WHERE status = 'queued' AND id <= %(rows)s * 0.96",
    # ...93% succeeded...
    "UPDATE relay.jobs SET status = 'succeeded', finished_at = now(), claimed_until = NULL "
    "WHERE status = 'claimed' AND id <= %(rows)s * 0.93",
    # ...2% died, with an error history...
    "UPDATE relay.jobs SET status = 'dead', finished_at = now(), claimed_until = NULL, "
    "last_error = 'TimeoutError: SMTP server did not answer within 30s', "
    "errors = jsonb_build_array(jsonb_build_object('attempt', 1, 'at', now(), 'worker', claimed_by, "
    "'type', 'TimeoutError', 'message', 'SMTP server did not answer within 30s', "
    "'traceback', 'Traceback (most recent call last): ...')) "
    "WHERE status = 'claimed' AND id <= %(rows)s * 0.95",
    # ...1% are running now; of the 4% still queued, an eighth is cancelled.
    "UPDATE relay.jobs SET status = 'cancelled', finished_at = now() WHERE status = 'queued' AND id %% 8 = 0",
]

WORKERS = """
INSERT INTO relay.workers (id, host, pid, queues, concurrency, last_seen_at, stopped_at)
SELECT 'bench-' || i, 'host-' || (i % 4), 1000 + i, '{default,mail,media,billing}', 8,
       CASE WHEN i < 18 THEN now() ELSE now() - interval '1 hour' END,
       CASE WHEN i IN (16, 17) THEN now() - interval '1 hour' END
FROM generate_series(0, 19) AS i
ON CONFLICT (id) DO NOTHING
"""


def prepare(server: str, rows: int, keep: bool) -> str:
    """A database holding ``rows`` jobs (reused when a kept one already has them)."""
    dsn = conninfo.make_conninfo(server, dbname=DATABASE)
    with psycopg.connect(server, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
    if exists and keep:
        with psycopg.connect(dsn) as conn:
            if conn.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] >= rows:
                print(f"reusing {DATABASE}")
                return dsn
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{DATABASE}"')
    migrate(dsn)
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FILL, {"rows": rows})
        for statement in LIFECYCLE:
            conn.execute(statement, {"rows": rows})
        conn.execute(WORKERS)
        conn.execute("VACUUM ANALYZE relay.jobs")
    print(f"filled {rows:,} jobs in {time.perf_counter() - started:.0f}s")
    return dsn


def full_count_ms(dsn: str, runs: int = 5) -> float:
    """The median time of the count the counters replace."""
    times = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(runs):
            started = time.perf_counter()
            conn.execute("SELECT queue, status, count(*) FROM relay.jobs GROUP BY 1, 2").fetchall()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(client, path: str, headers: dict[str, str], n: int) -> list[float]:
    """Milliseconds of ``n`` GETs of ``path`` (after two warm-up calls)."""
    for _ in range(2):
        assert client.get(path, headers=headers).status_code == 200, path
    times = []
    for _ in range(n):
        started = time.perf_counter()
        response = client.get(path, headers=headers)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.get_data(as_text=True))
    return times


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def main() -> None:
    """Fill, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200, help="requests per endpoint")
    parser.add_argument("--pending-deltas", type=int, default=2000, help="single enqueues left unfolded")
    parser.add_argument("--keep", action="store_true", help="keep (and reuse) the filled database")
    args = parser.parse_args()

    server = database_url()
    dsn = prepare(server, args.rows, args.keep)
    relay = Relay(dsn)
    for i in range(args.pending_deltas):  # one counter delta each, as a web app's enqueues leave them
        relay.enqueue("send_email", {"n": i}, queue="mail")
    relay.close()

    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET})
    client = app.test_client()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with contextlib.suppress(users.UserExists):
            users.create_user(conn, "bench", "bench-password", "admin", hasher=users.make_hasher(1, 1024, 1))
        total = conn.execute("SELECT count(*) FROM relay.jobs").fetchone()[0]
        dead_id = conn.execute("SELECT max(id) FROM relay.jobs WHERE status = 'dead'").fetchone()[0]
        deltas = conn.execute("SELECT count(*) FROM relay.job_counts").fetchone()[0]
    token = client.post("/api/auth/login", json={"username": "bench", "password": "bench-password"}).get_json()
    headers = {"Authorization": f"Bearer {token['access_token']}"}

    started = time.perf_counter()
    client.get("/api/admin/queues", headers=headers)
    first_fold_ms = (time.perf_counter() - started) * 1000
    cursor = client.get("/api/admin/jobs?status=dead&limit=50", headers=headers).get_json()["next_cursor"]
    endpoints = [
        "/api/admin/queues",
        "/api/admin/workers",
        "/api/admin/stats",
        "/metrics",
        "/api/admin/jobs",
        "/api/admin/jobs?status=dead",
        f"/api/admin/jobs?status=dead&cursor={cursor}",
        "/api/admin/jobs?status=queued",
        "/api/admin/jobs?status=queued&queue=mail",
        "/api/admin/jobs?status=claimed",
        "/api/admin/jobs?status=succeeded",
        "/api/admin/jobs?status=cancelled",
        "/api/admin/jobs?type=charge_card",
        "/api/admin/jobs?status=dead&q=smtp",
        "/api/admin/jobs?q=timeout",
        f"/api/admin/jobs/{dead_id}",
        "/readyz",
    ]
    print(f"\n{total:,} jobs; {deltas:,} unfolded counter rows before the first read, folded in {first_fold_ms:.0f} ms")
    print(f"full-table count by (queue, status), which the counters replace: {full_count_ms(dsn):.0f} ms (median)\n")
    print(f"{'endpoint':<48} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    # Filters no index serves and nothing matches: the listing reads the whole table
    # (bounded by RELAY_STATEMENT_TIMEOUT_MS, 503 past it). Fewer requests: they are slow.
    worst = ["/api/admin/jobs?type=no_such_type", "/api/admin/jobs?q=no-such-text"]
    for path in endpoints + worst:
        times = measure(client, path, headers, args.requests if path not in worst else max(5, args.requests // 10))
        print(
            f"{path:<48} {len(times):>4} {percentile(times, 50):>8.1f} {percentile(times, 95):>8.1f} {max(times):>8.1f}"
        )
    app.extensions["relay.close"]()


if __name__ == "__main__":
    main()
