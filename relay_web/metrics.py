"""``/metrics``: Relay's state in Prometheus text format.

Every series is read from PostgreSQL at scrape time (the counters of
migration 0003, the worker registry), not kept in process memory: under
gunicorn each scrape lands on a different process, and all of them must tell
the same story. Set RELAY_METRICS_TOKEN to require ``Authorization: Bearer``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator

from flask import Blueprint, Response, current_app, request
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from relay_core import monitor

from .config import worker_stale_seconds
from .db import counters_read
from .endpoint import endpoint
from .health import migrations_pending
from .problems import unauthorized

bp = Blueprint("metrics", __name__)


class RelayCollector:
    """Collects every Relay series in one short database visit per scrape."""

    def __init__(self, stale_seconds: float) -> None:
        self.stale_seconds = stale_seconds

    def collect(self) -> Iterator[Metric]:
        """The series of one scrape (503 while the schema is behind this release, as /readyz says)."""
        with counters_read() as conn:
            problem = monitor.schema_problem(conn)
            if problem is not None:
                raise migrations_pending(problem)
            depths = monitor.queue_depths(conn, stale_seconds=self.stale_seconds)
            totals = monitor.outcome_totals(conn)
            recent = monitor.stats(conn)
            workers = monitor.worker_counts(conn, stale_seconds=self.stale_seconds)

        jobs = GaugeMetricFamily("relay_jobs", "Jobs in each queue and state.", labels=["queue", "state"])
        age = GaugeMetricFamily(
            "relay_queue_oldest_job_age_seconds",
            "How long the oldest job that is due to run has waited (0 when none is due).",
            labels=["queue"],
        )
        serving = GaugeMetricFamily(
            "relay_queue_live_workers",
            "Live workers that serve the queue (0 with jobs queued: nothing will run them).",
            labels=["queue"],
        )
        paused = GaugeMetricFamily(
            "relay_queue_paused",
            "1 while the queue is paused (its jobs wait on purpose, however old), else 0.",
            labels=["queue"],
        )
        lapsed = GaugeMetricFamily(
            "relay_queue_lapsed_leases",
            "Claimed jobs whose lease ran out (their worker stopped heartbeating) that no sweeper has put back yet.",
            labels=["queue"],
        )
        for depth in depths:
            for state, n in depth.counts.items():
                jobs.add_metric([depth.queue, state], n)
            age.add_metric([depth.queue], depth.oldest_runnable_age_seconds or 0.0)
            serving.add_metric([depth.queue], depth.live_workers)
            paused.add_metric([depth.queue], 1.0 if depth.paused else 0.0)
            lapsed.add_metric([depth.queue], depth.lapsed_leases)
        yield jobs
        yield age
        yield serving
        yield paused
        yield lapsed

        succeeded = CounterMetricFamily("relay_jobs_succeeded", "Attempts that succeeded.", labels=["queue", "type"])
        failed = CounterMetricFamily(
            "relay_jobs_failed",
            "Attempts that raised or lost their lease (retried, dead or cancelled).",
            labels=["queue", "type"],
        )
        dead = CounterMetricFamily(
            "relay_jobs_dead", "Jobs that ran out of attempts or failed permanently.", labels=["queue", "type"]
        )
        for total in totals:
            succeeded.add_metric([total.queue, total.type], total.succeeded)
            failed.add_metric([total.queue, total.type], total.failed)
            dead.add_metric([total.queue, total.type], total.dead)
        yield succeeded
        yield failed
        yield dead

        rate = GaugeMetricFamily(
            "relay_jobs_failure_ratio", "Failed over finished attempts in the last hour (0 when idle)."
        )
        rate.add_metric([], recent.failure_rate or 0.0)
        yield rate

        states = GaugeMetricFamily("relay_workers", "Registered workers by state.", labels=["state"])
        for state in ("alive", "stopped", "gone"):
            states.add_metric([state], getattr(workers, state))
        yield states
        alive = GaugeMetricFamily("relay_workers_alive", "Workers heartbeating now.")
        alive.add_metric([], workers.alive)
        yield alive


def _check_token() -> None:
    expected = current_app.config.get("RELAY_METRICS_TOKEN")
    if not expected:
        return
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise unauthorized("Send 'Authorization: Bearer <RELAY_METRICS_TOKEN>'.", slug="metrics-token")


@bp.get("/metrics")
@endpoint(
    tag="metrics",
    responses={200: None},
    media_type="text/plain",
    security="metricsToken",
    problems=(401,),
    ignores_query=True,
)
def metrics() -> Response:
    """Prometheus text format: queue depths, oldest waits, lapsed leases, outcomes by type, failure ratio, workers."""
    _check_token()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RelayCollector(worker_stale_seconds()))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_PLAIN_0_0_4)
