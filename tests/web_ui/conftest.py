"""Fixtures of the dashboard tests: apps on the test database, logged-in clients, jobs in every state.

Built on tests/conftest.py: ``dsn`` is a real, migrated PostgreSQL database
emptied for each test. Jobs are enqueued through Relay; putting one in a
given state (dead with a traceback, claimed by a worker) is setup SQL, never
the thing under test. DashboardClient fixtures live in ``browser.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from relay_core import Relay, users
from relay_web import create_app

from .browser import browser, live_server, phone  # noqa: F401 (fixtures)
from .support import PASSWORD, base_config

#: A traceback as a worker stores it.
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/app/jobs.py", line 12, in send_email\n'
    "    smtp.connect(host, port)\n"
    "ConnectionError: SMTP server mail.example.com:587 refused the connection"
)


@pytest.fixture
def make_app(dsn: str) -> Iterator[Callable[..., Flask]]:
    """Build apps on the test database; each is closed after the test."""
    built: list[Flask] = []

    def build(**overrides: Any) -> Flask:
        app = create_app(base_config(dsn, **overrides))
        built.append(app)
        return app

    yield build
    for app in built:
        app.extensions["relay.close"]()


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    """The app with default settings."""
    return make_app()


def make_user(dsn: str, username: str, role: str, password: str = PASSWORD) -> users.User:
    """A user straight in the database (the CLI's path)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return users.create_user(conn, username, password, role, hasher=users.make_hasher(1, 1024, 1))


class DashboardClient:
    """A test client that logs in through the dashboard's form and sends its CSRF token."""

    def __init__(self, client: FlaskClient, dsn: str) -> None:
        self.client = client
        self.dsn = dsn
        self.csrf = ""

    def login(self, username: str, password: str = PASSWORD, **form: str) -> TestResponse:
        """POST the login form; remember the page's CSRF token on success."""
        response = self.client.post("/login", data={"username": username, "password": password, **form})
        if response.status_code == 303:
            self.csrf = page_csrf(self.client.get("/jobs").get_data(as_text=True))
        return response

    def get(self, url: str, *, htmx: bool = False, **kwargs: Any) -> TestResponse:
        """GET, as htmx when asked."""
        headers = {"HX-Request": "true"} if htmx else {}
        return self.client.get(url, headers=headers, **kwargs)

    def post(
        self, url: str, data: dict[str, str] | None = None, *, htmx: bool = True, csrf: bool = True
    ) -> TestResponse:
        """POST as the page would: htmx with the X-CSRF-TOKEN header (or a plain form with the field)."""
        headers: dict[str, str] = {}
        body = dict(data or {})
        if htmx:
            headers["HX-Request"] = "true"
            if csrf:
                headers["X-CSRF-TOKEN"] = self.csrf
        elif csrf:
            body["csrf_token"] = self.csrf
        return self.client.post(url, data=body, headers=headers)


def page_csrf(html: str) -> str:
    """The CSRF token a page carries in its meta tag."""
    found = re.search(r'<meta name="csrf-token" content="([^"]*)">', html)
    assert found, "no csrf-token meta tag"
    return found.group(1)


@pytest.fixture
def anonymous(app: Flask, dsn: str) -> DashboardClient:
    """A client that has not logged in."""
    return DashboardClient(app.test_client(), dsn)


def _logged_in(app: Flask, dsn: str, role: str) -> DashboardClient:
    make_user(dsn, role, role)
    client = DashboardClient(app.test_client(), dsn)
    assert client.login(role).status_code == 303
    return client


@pytest.fixture
def admin(app: Flask, dsn: str) -> DashboardClient:
    """A client logged in as an admin."""
    return _logged_in(app, dsn, "admin")


@pytest.fixture
def viewer(app: Flask, dsn: str) -> DashboardClient:
    """A client logged in as a viewer."""
    return _logged_in(app, dsn, "viewer")


class Jobs:
    """Jobs for a test: enqueued through Relay, moved into a state by setup SQL."""

    def __init__(self, relay: Relay, db: psycopg.Connection) -> None:
        self.relay = relay
        self.db = db

    def add(self, job_type: str = "send_email", payload: Any = None, **options: Any) -> int:
        """Enqueue one job."""
        return self.relay.enqueue(job_type, {"to": "a@example.com"} if payload is None else payload, **options)

    def claimed(self, job_id: int, worker: str = "web-1:4242:abc123") -> int:
        """A worker holds the job's lease."""
        self.db.execute(
            "UPDATE relay.jobs SET status = 'claimed', claimed_by = %s, claimed_until = now() + interval '30 seconds', "
            "attempts = attempts + 1, lease_token = lease_token + 1, started_at = now() WHERE id = %s",
            (worker, job_id),
        )
        return job_id

    def dead(self, job_id: int, message: str = "ConnectionError: refused", traceback: str = TRACEBACK) -> int:
        """The job's one attempt failed and it is dead, with its error history."""
        self.claimed(job_id)
        history = [
            {
                "attempt": 1,
                "at": "2030-01-01T00:00:00+00:00",
                "worker": "web-1:4242:abc123",
                "type": "ConnectionError",
                "message": message,
                "traceback": traceback,
            }
        ]
        self.db.execute(
            "UPDATE relay.jobs SET status = 'dead', claimed_until = NULL, finished_at = now(), last_error = %s, "
            "errors = %s::jsonb WHERE id = %s",
            (message, json.dumps(history), job_id),
        )
        return job_id

    def succeeded(self, job_id: int, result: Any = None) -> int:
        """The job ran and succeeded."""
        self.claimed(job_id)
        self.db.execute(
            "UPDATE relay.jobs SET status = 'succeeded', claimed_until = NULL, finished_at = now(), "
            "result = %s::jsonb WHERE id = %s",
            (json.dumps(result), job_id),
        )
        return job_id

    def status(self, job_id: int) -> str:
        """The job's status now."""
        row = self.db.execute("SELECT status::text FROM relay.jobs WHERE id = %s", (job_id,)).fetchone()
        assert row is not None
        return row[0]


@pytest.fixture
def jobs(relay: Relay, db: psycopg.Connection) -> Jobs:
    """Job factories on the test database."""
    return Jobs(relay, db)
