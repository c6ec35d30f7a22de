"""A PostgreSQL server of a test's own, which the test may stop, crash and restart.

The shared test server must never be restarted (other test runs use it), so
tests of database outages start their own cluster from the binaries the
``pgserver`` package ships (in the ``test`` extra, through ``demo``, so present
wherever the tests run). PostgreSQL refuses to run as root; as root the cluster
runs as the ``pgserver`` system user, the one the embedded server uses too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg
from pgserver._commands import POSTGRES_BIN_PATH

from .helpers import free_port

SYSTEM_USER = "pgserver"


class Cluster:
    """One initdb'd data directory and the server on it, listening on 127.0.0.1:<port>."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="relay-outage-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            from pgserver.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

            entry = ensure_user_exists(SYSTEM_USER)
            ensure_prefix_permissions(self.root)
            ensure_prefix_permissions(POSTGRES_BIN_PATH)
            ensure_folder_permissions(POSTGRES_BIN_PATH, 0o555)
            ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", 0o444)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self.user = SYSTEM_USER
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "utf8")
        self.start()

    @property
    def url(self) -> str:
        """The DSN of the server's ``postgres`` database."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, exe: str, *args: str) -> None:
        # Output to a file, never a pipe: the server inherits pg_ctl's descriptors and would hold a pipe open.
        with open(self.root / "commands.log", "ab") as out:
            subprocess.run(
                [str(POSTGRES_BIN_PATH / exe), *args], check=True, stdout=out, stderr=subprocess.STDOUT, user=self.user
            )

    def _pg_ctl(self, *args: str) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, *args)

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._pg_ctl("start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends sessions cleanly, ``immediate`` is a crash (recovery on start)."""
        self._pg_ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        """Stop (``fast`` or ``immediate``) and start again."""
        self._pg_ctl("restart", "-m", mode)

    def create_database(self, name: str) -> str:
        """Create a database and return its DSN."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def destroy(self) -> None:
        """Stop the server if it runs and delete its files."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self._pg_ctl("stop", "-m", "immediate")
        shutil.rmtree(self.root, ignore_errors=True)
