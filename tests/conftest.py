"""Fixtures: a real PostgreSQL for every test, never a mock.

The server is DATABASE_URL's when set, else an embedded one from the
``pgserver`` package. Each test session gets its own fresh database on it,
migrated once; each test starts from empty Relay tables.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from relay_core import Relay
from relay_core.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent

# Side effects of the test apps' handlers (tests/apps/worker_app.py).
TEST_SCHEMA = """
CREATE SCHEMA relay_test;
CREATE TABLE relay_test.executions (
    job_id bigint NOT NULL,
    pid integer NOT NULL,
    attempt integer NOT NULL,
    lease_token integer NOT NULL,
    phase text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def _server_dsn() -> str:
    dsn = os.environ.get("RELAY_TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if dsn:
        return dsn
    from relay_core.embedded import start

    return start(Path(tempfile.mkdtemp(prefix="relay-test-pg-")), cleanup="delete")


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh, migrated database for this test session; dropped afterwards."""
    server = _server_dsn()
    name = f"relay_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    dsn = conninfo.make_conninfo(server, dbname=name)
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TEST_SCHEMA)
    yield dsn
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def reset(dsn: str) -> None:
    """Empty every Relay table (and the test apps' tables) between tests."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables "
            "WHERE schemaname IN ('relay', 'relay_test', 'relay_proof') AND tablename <> 'schema_migrations'"
        ).fetchall()
        if tables:
            conn.execute("TRUNCATE " + ", ".join(t[0] for t in tables) + " RESTART IDENTITY CASCADE")


@pytest.fixture
def dsn(database_url: str) -> str:
    """The session database, emptied for this test."""
    reset(database_url)
    return database_url


@pytest.fixture
def unmigrated_dsn(dsn: str) -> Iterator[str]:
    """A database on the test server where `relay migrate` never ran; dropped afterwards."""
    name = f"relay_empty_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield conninfo.make_conninfo(dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def relay(dsn: str) -> Iterator[Relay]:
    """A Relay bound to the test database."""
    app = Relay(dsn)
    yield app
    app.close()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection for assertions."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def worker_env(dsn: str) -> dict[str, str]:
    """Environment for worker subprocesses: the test database and this checkout on the path."""
    env = dict(os.environ)
    env["RELAY_DATABASE_URL"] = dsn
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def python() -> str:
    """The interpreter running the tests, for subprocesses."""
    return sys.executable
