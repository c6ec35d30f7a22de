"""Migrations: idempotent, concurrent-safe, recorded."""

from __future__ import annotations

import subprocess
import uuid

import psycopg
from psycopg import conninfo

from relay_core import migrate as migrator


def fresh_database(server_dsn: str) -> str:
    name = f"relay_migrate_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return conninfo.make_conninfo(server_dsn, dbname=name)


def drop_database(dsn: str) -> None:
    name = conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(conninfo.make_conninfo(dsn, dbname="postgres"), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrate_twice_applies_once(database_url: str) -> None:
    dsn = fresh_database(database_url)
    try:
        assert migrator.migrate(dsn) == [f"{m.version:04d}_{m.name}" for m in migrator.available()]
        assert migrator.migrate(dsn) == []
        with psycopg.connect(dsn) as conn:
            assert migrator.is_current(conn)
    finally:
        drop_database(dsn)


def test_concurrent_migrate_commands_leave_one_schema(database_url: str, python: str, worker_env: dict) -> None:
    dsn = fresh_database(database_url)
    try:
        env = dict(worker_env, RELAY_DATABASE_URL=dsn)
        procs = [
            subprocess.Popen(
                [python, "-m", "relay_core", "migrate"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for _ in range(4)
        ]
        outputs = [p.communicate(timeout=60)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outputs
        assert sum("applied:" in out for out in outputs) == 1, outputs
        with psycopg.connect(dsn) as conn:
            versions = [r[0] for r in conn.execute("SELECT version FROM relay.schema_migrations ORDER BY 1")]
            assert versions == [m.version for m in migrator.available()]
    finally:
        drop_database(dsn)
