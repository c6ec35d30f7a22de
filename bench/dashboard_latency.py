"""Render time of every dashboard page with 1,000,000 jobs in the table.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python bench/dashboard_latency.py

Creates a scratch database (relay_bench_dashboard) on the server of
DATABASE_URL and fills it the way bench/web_latency.py does (a realistic
million: mostly succeeded, a queued backlog across queues and priorities,
20,000 dead jobs with error histories, some running and cancelled, twenty
registered workers) plus a few cron schedules. It logs in through the
dashboard's form, then GETs each page through the real Flask app (in
process, WSGI, template rendering included) and prints p50/p95/max per page.
The target is p95 under 200 ms. ``--keep`` keeps the filled database.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from pathlib import Path

import psycopg
from psycopg import conninfo

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import web_latency  # noqa: E402 - the same million jobs as the API's benchmark

from relay_core import Relay, users  # noqa: E402
from relay_core.migrate import migrate  # noqa: E402
from relay_core.settings import database_url  # noqa: E402
from relay_web import create_app  # noqa: E402

DATABASE = "relay_bench_dashboard"
SECRET = "bench-" + "s" * 40
TARGET_MS = 200.0

SCHEDULES = """
INSERT INTO relay.schedules (type, cron, timezone, queue, last_tick, next_tick, updated_at)
VALUES ('nightly_report', '0 3 * * *', 'UTC', 'default',
        now() - interval '21 hours', now() + interval '3 hours', now()),
       ('sync_crm', '*/5 * * * *', 'UTC', 'billing',
        now() - interval '2 minutes', now() + interval '3 minutes', now())
ON CONFLICT (type) DO NOTHING
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
        conn.execute(web_latency.FILL, {"rows": rows})
        for statement in web_latency.LIFECYCLE:
            conn.execute(statement, {"rows": rows})
        conn.execute(web_latency.WORKERS)
        conn.execute(SCHEDULES)
        conn.execute("VACUUM ANALYZE relay.jobs")
    print(f"filled {rows:,} jobs in {time.perf_counter() - started:.0f}s")
    return dsn


def measure(client, path: str, headers: dict[str, str], n: int) -> list[float]:
    """Milliseconds of ``n`` GETs of ``path`` (after two warm-up calls)."""
    for _ in range(2):
        assert client.get(path, headers=headers).status_code == 200, path
    times = []
    for _ in range(n):
        started = time.perf_counter()
        response = client.get(path, headers=headers)
        response.get_data()
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code)
    return times


def main() -> None:
    """Fill, log in, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200, help="requests per page")
    parser.add_argument("--pending-deltas", type=int, default=2000, help="single enqueues left unfolded")
    parser.add_argument("--keep", action="store_true", help="keep (and reuse) the filled database")
    args = parser.parse_args()

    dsn = prepare(database_url(), args.rows, args.keep)
    relay = Relay(dsn)
    for i in range(args.pending_deltas):  # one counter delta each, as a web app's enqueues leave them
        relay.enqueue("send_email", {"n": i}, queue="mail")
    relay.close()

    app = create_app({"RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, "RELAY_ENV": "development"})
    client = app.test_client()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with contextlib.suppress(users.UserExists):
            users.create_user(conn, "bench", "bench-password", "admin", hasher=users.make_hasher(1, 1024, 1))
        total = conn.execute("SELECT count(*) FROM relay.jobs").fetchone()[0]
        dead_id = conn.execute("SELECT max(id) FROM relay.jobs WHERE status = 'dead'").fetchone()[0]
        running_id = conn.execute("SELECT max(id) FROM relay.jobs WHERE status = 'claimed'").fetchone()[0]
    login = client.post("/login", data={"username": "bench", "password": "bench-password"})
    assert login.status_code == 303, login.get_data(as_text=True)

    started = time.perf_counter()
    client.get("/")
    first_ms = (time.perf_counter() - started) * 1000
    older = re.search(r'href="(/jobs\?before=\d+)"', client.get("/jobs").get_data(as_text=True))
    assert older, "no second page of jobs"
    htmx = {"HX-Request": "true"}
    pages: list[tuple[str, dict[str, str]]] = [
        ("/", {}),
        ("/", htmx),
        ("/dead", {}),
        ("/jobs", {}),
        (older.group(1), {}),
        ("/jobs?state=dead", {}),
        ("/jobs?state=dead&type=send_email", {}),
        ("/jobs?state=queued&queue=mail", {}),
        ("/jobs?type=charge_card", {}),
        ("/jobs?state=dead&q=smtp", {}),
        ("/jobs?q=timeout", {}),
        (f"/jobs/{dead_id}", {}),
        (f"/jobs/{running_id}?part=status&seen=claimed", htmx),
        ("/queues", {}),
        ("/workers", {}),
        ("/schedules", {}),
        ("/login", {}),
    ]
    print(f"\n{total:,} jobs; first overview (folding {args.pending_deltas:,} counter deltas) {first_ms:.0f} ms\n")
    print(f"{'page':<48} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    worst_p95 = 0.0
    for path, headers in pages:
        times = measure(client, path, headers, args.requests)
        p95 = web_latency.percentile(times, 95)
        worst_p95 = max(worst_p95, p95)
        label = path + (" (htmx)" if headers else "")
        print(f"{label:<48} {len(times):>4} {web_latency.percentile(times, 50):>8.1f} {p95:>8.1f} {max(times):>8.1f}")
    # Filters no index serves and nothing matches read the whole table (bounded by
    # RELAY_STATEMENT_TIMEOUT_MS, a 503 page past it); shown apart, fewer requests.
    print("\nfilters no index serves, matching nothing (a full scan):")
    for path in ("/jobs?type=no_such_type", "/jobs?q=no-such-text"):
        times = measure(client, path, {}, max(5, args.requests // 20))
        print(
            f"{path:<48} {len(times):>4} {web_latency.percentile(times, 50):>8.1f} "
            f"{web_latency.percentile(times, 95):>8.1f} {max(times):>8.1f}"
        )
    verdict = "within" if worst_p95 < TARGET_MS else "OVER"
    print(f"\nslowest p95 of the pages above the line: {worst_p95:.1f} ms ({verdict} the {TARGET_MS:.0f} ms target)")
    app.extensions["relay.close"]()


if __name__ == "__main__":
    main()
