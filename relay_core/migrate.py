"""Applies the numbered SQL files in ``migrations/`` under an advisory lock.

Two ``relay migrate`` runs at once are safe: the second waits on the lock,
then finds every migration recorded and applies nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from .errors import MigrationError
from .pools import connection_options

#: Advisory-lock key shared by every migrator ("relay" as digits, arbitrary but fixed).
MIGRATION_LOCK_KEY = 7_265_108_721

_FILENAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

_CREATE_TABLE = """
CREATE SCHEMA IF NOT EXISTS relay;
CREATE TABLE IF NOT EXISTS relay.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    """Every migration shipped in the package, in order."""
    found = []
    folder = resources.files("relay_core").joinpath("migrations")
    for entry in folder.iterdir():
        match = _FILENAME.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migrations share a version number: {versions}")
    return found


def applied(conn: psycopg.Connection) -> dict[int, str]:
    """Migrations recorded as applied, version -> name (empty if Relay was never migrated here)."""
    exists = conn.execute("SELECT to_regclass('relay.schema_migrations') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return {}
    return dict(conn.execute("SELECT version, name FROM relay.schema_migrations").fetchall())


def applied_versions(conn: psycopg.Connection) -> set[int]:
    """Versions recorded as applied (empty if Relay was never migrated here)."""
    return set(applied(conn))


def pending(conn: psycopg.Connection) -> list[Migration]:
    """Migrations not yet applied on this database."""
    done = applied_versions(conn)
    return [m for m in available() if m.version not in done]


def migrate(dsn: str) -> list[str]:
    """Bring the schema up to date; return the names of the migrations applied.

    Everything happens in one transaction holding a transaction-level advisory
    lock, so a failure leaves the schema as it was and concurrent migrators
    serialise instead of racing on CREATE statements.
    """
    applied: list[str] = []
    try:
        with psycopg.connect(dsn, **connection_options(dsn)) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            conn.execute(_CREATE_TABLE)
            for migration in pending(conn):
                conn.execute(migration.sql)
                conn.execute(
                    "INSERT INTO relay.schema_migrations (version, name) VALUES (%s, %s)",
                    (migration.version, migration.name),
                )
                applied.append(f"{migration.version:04d}_{migration.name}")
    except psycopg.Error as exc:
        raise MigrationError(f"migration failed: {exc}") from exc
    return applied


def unknown_applied(dsn: str) -> list[str]:
    """Migrations recorded on the database that this Relay does not ship (a newer Relay applied them)."""
    shipped = {m.version for m in available()}
    try:
        with psycopg.connect(dsn, **connection_options(dsn)) as conn:
            recorded = applied(conn)
    except psycopg.Error as exc:
        raise MigrationError(f"cannot read the applied migrations: {exc}") from exc
    return [f"{version:04d}_{name}" for version, name in sorted(recorded.items()) if version not in shipped]


def is_current(conn: psycopg.Connection) -> bool:
    """True when every shipped migration is applied (the readiness check)."""
    return not pending(conn)
