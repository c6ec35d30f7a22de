"""``/healthz`` (the process answers) and ``/readyz`` (the database answers, schema current).

Platforms restart a process whose liveness check fails and stop routing to
one whose readiness check fails, so liveness never touches the database: a
database outage must not make every web process restart in a loop.
"""

from __future__ import annotations

import logging

import psycopg
from flask import Blueprint
from psycopg_pool import PoolTimeout

from relay_core import monitor

from .db import connection
from .endpoint import endpoint
from .problems import Problem
from .records.ops import HealthRecord, ReadyRecord

bp = Blueprint("health", __name__)
log = logging.getLogger("relay.web")


@bp.get("/healthz")
@endpoint(tag="health", responses={200: HealthRecord}, ignores_query=True)
def healthz() -> HealthRecord:
    """Liveness: the process is up. Never touches the database."""
    return HealthRecord()


@bp.get("/readyz")
@endpoint(tag="health", responses={200: ReadyRecord}, ignores_query=True)
def readyz() -> ReadyRecord:
    """Readiness: the database answers and every migration is applied; 503 otherwise."""
    with connection() as conn:
        monitor.ping(conn)
        problem = monitor.schema_problem(conn)
    if problem is not None:
        raise migrations_pending(problem)
    return ReadyRecord()


def migrations_pending(problem: str) -> Problem:
    """503 while the database's schema is not this release's: behind it (a deploy whose migrations have
    not run), or migrated by another build; ``problem`` (``monitor.schema_problem``) says which, and what to do."""
    return Problem(
        503,
        "Not ready",
        problem[0].upper() + problem[1:] + ".",
        slug="migrations-pending",
        headers={"Retry-After": "10"},
    )


def missing_schema_problem(exc: Exception) -> Problem | None:
    """``migrations-pending`` when a query met something missing because the schema is behind; else None.

    Asked only after such an error: on a current schema (or when the
    question itself cannot be answered) the same error is a defect, and
    stays a logged 500.
    """
    try:
        with connection() as conn:
            problem = monitor.schema_problem(conn)
    except (psycopg.Error, PoolTimeout):
        return None
    if problem is None:
        return None
    log.warning("%s: %s", problem, exc)
    return migrations_pending(problem)
