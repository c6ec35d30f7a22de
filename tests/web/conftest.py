"""Fixtures of the web tests: apps on the test database, clients, users and tokens.

Built on tests/conftest.py: ``dsn`` is a real, migrated PostgreSQL database
emptied for each test. Apps get their settings explicitly, never from the
environment, and cheap Argon2 parameters so logins stay fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient

from relay_core import users
from relay_web import create_app

SECRET = "relay-test-signing-key-" + "k" * 32
FAST_HASH = {"RELAY_ARGON2_TIME_COST": 1, "RELAY_ARGON2_MEMORY_COST": 1024, "RELAY_ARGON2_PARALLELISM": 1}
PASSWORD = "correct horse battery"


@pytest.fixture
def make_app(dsn: str) -> Iterator[Callable[..., Flask]]:
    """Build apps on the test database; each is closed after the test."""
    built: list[Flask] = []

    def build(**overrides: Any) -> Flask:
        config = {"TESTING": True, "RELAY_DATABASE_URL": dsn, "JWT_SECRET_KEY": SECRET, **FAST_HASH, **overrides}
        app = create_app(config)
        built.append(app)
        return app

    yield build
    for app in built:
        app.extensions["relay.close"]()


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    """The app with default settings."""
    return make_app()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """A test client of ``app``."""
    return app.test_client()


class AuthActions:
    """Create users and log in through the API, as the Flask tutorial's helper does."""

    def __init__(self, client: FlaskClient, dsn: str) -> None:
        self.client = client
        self.dsn = dsn
        self._tokens: dict[str, dict[str, Any]] = {}

    def create_user(self, username: str, role: str, password: str = PASSWORD) -> users.User:
        """A user straight in the database (the CLI's path)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return users.create_user(conn, username, password, role, hasher=users.make_hasher(1, 1024, 1))

    def login(self, username: str, password: str = PASSWORD, **kwargs: Any) -> Any:
        """POST /api/auth/login."""
        return self.client.post("/api/auth/login", json={"username": username, "password": password}, **kwargs)

    def tokens(self, role: str) -> dict[str, Any]:
        """Login answer of a user with ``role`` (made on first use)."""
        if role not in self._tokens:
            self.create_user(role, role)
            response = self.login(role)
            assert response.status_code == 200, response.get_json()
            self._tokens[role] = response.get_json()
        return self._tokens[role]

    def headers(self, role: str = "admin") -> dict[str, str]:
        """An Authorization header of a user with ``role``."""
        return {"Authorization": f"Bearer {self.tokens(role)['access_token']}"}


@pytest.fixture
def auth(client: FlaskClient, dsn: str) -> AuthActions:
    """User and token helpers."""
    return AuthActions(client, dsn)


@pytest.fixture
def admin(auth: AuthActions) -> dict[str, str]:
    """Headers of an admin."""
    return auth.headers("admin")


@pytest.fixture
def viewer(auth: AuthActions) -> dict[str, str]:
    """Headers of a viewer."""
    return auth.headers("viewer")
