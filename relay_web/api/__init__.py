"""The JSON API under ``/api``: auth, jobs, queues/workers/stats, and its OpenAPI document."""

from __future__ import annotations

from flask import Blueprint

from . import auth, jobs, monitor, spec


def blueprint() -> Blueprint:
    """A fresh ``/api`` blueprint with its children (one per app, so tests can build many apps)."""
    api = Blueprint("api", __name__, url_prefix="/api")
    api.register_blueprint(auth.bp)
    api.register_blueprint(jobs.bp)
    api.register_blueprint(monitor.bp)
    api.register_blueprint(spec.bp)
    return api
