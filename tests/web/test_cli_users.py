"""``relay user ...``: the only way users come to exist; no default password ships."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from click.testing import CliRunner

from relay_core.cli import main


@pytest.fixture
def run(dsn: str):
    env = {
        "RELAY_DATABASE_URL": dsn,
        "RELAY_ARGON2_TIME_COST": "1",
        "RELAY_ARGON2_MEMORY_COST": "1024",
        "RELAY_ARGON2_PARALLELISM": "1",
    }

    def invoke(*args: str, stdin: str | None = None):
        return CliRunner().invoke(main, list(args), input=stdin, env=env, catch_exceptions=False)

    return invoke


def _hash(db: psycopg.Connection, name: str) -> tuple[str, str]:
    return db.execute("SELECT role, password_hash FROM relay.users WHERE username = %s", (name,)).fetchone()


def test_create_with_password_from_stdin(run, db, client) -> None:
    result = run("user", "create", "Ops", "--role", "admin", "--password-stdin", stdin="s3cret-enough\n")
    assert result.exit_code == 0, result.output
    assert "created admin ops" in result.output
    role, digest = _hash(db, "ops")
    assert role == "admin" and digest.startswith("$argon2id$") and "s3cret" not in digest
    login = client.post("/api/auth/login", json={"username": "ops", "password": "s3cret-enough"})
    assert login.status_code == 200 and login.get_json()["role"] == "admin"


def test_create_prompts_twice_and_hides_the_password(run, db) -> None:
    result = run("user", "create", "watcher", "--role", "viewer", stdin="first-password\nfirst-password\n")
    assert result.exit_code == 0, result.output
    assert "first-password" not in result.output
    assert result.output.count("assword") >= 2
    assert _hash(db, "watcher")[0] == "viewer"


def test_mismatched_prompts_are_asked_again(run, db) -> None:
    result = run(
        "user", "create", "w2", "--role", "viewer", stdin="one-password\ntwo-password\nok-password\nok-password\n"
    )
    assert result.exit_code == 0, result.output
    assert _hash(db, "w2") is not None


def test_a_short_password_is_refused_at_the_first_prompt_and_asked_again(run, db) -> None:
    """It was asked for twice, then refused, and the command ended."""
    result = run("user", "create", "w3", "--role", "viewer", stdin="short\nlong-enough-now\nlong-enough-now\n")
    assert result.exit_code == 0, result.output
    assert "at least 8 characters" in result.output
    assert result.output.index("at least 8 characters") < result.output.index("Repeat the password")
    assert _hash(db, "w3") is not None


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (("user", "create", "a", "--role", "admin", "--password-stdin"), "short\n", "at least 8"),
        (("user", "create", "bad name", "--role", "admin", "--password-stdin"), "long-enough\n", "USERNAME"),
        (("user", "create", "ops\n", "--role", "admin", "--password-stdin"), "long-enough\n", "USERNAME"),
        (("user", "create", "a", "--role", "root", "--password-stdin"), "long-enough\n", "root"),
        (("user", "create", "a", "--password-stdin"), "long-enough\n", "--role"),
    ],
)
def test_refusals_create_nothing(run, db, args, stdin, message) -> None:
    result = run(*args, stdin=stdin)
    assert result.exit_code != 0
    assert message in result.output
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 0


def test_a_password_with_nul_is_refused_as_no_login_could_send_it(run, db, client) -> None:
    result = run("user", "create", "nul", "--role", "admin", "--password-stdin", stdin="long\x00enough\n")
    assert result.exit_code == 2 and "NUL" in result.output, result.output
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 0


@pytest.mark.parametrize("command", [("create", "bytes", "--role", "admin"), ("set-password", "bytes")])
def test_a_password_that_is_not_utf8_is_refused_without_a_traceback(run, db, dsn: str, command) -> None:
    """Standard input is read with surrogateescape: bytes that are not UTF-8 reach the hasher as lone surrogates."""
    run("user", "create", "bytes", "--role", "viewer", "--password-stdin", stdin="long-enough\n")
    before = _hash(db, "bytes")
    env = {**os.environ, "RELAY_DATABASE_URL": dsn, "RELAY_ARGON2_TIME_COST": "1", "RELAY_ARGON2_MEMORY_COST": "1024"}
    result = subprocess.run(
        [sys.executable, "-m", "relay_core", "user", *command, "--password-stdin"],
        input=b"\xff\xfe-long-enough\n",
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert b"UTF-8" in result.stderr and b"Traceback" not in result.stderr, result.stderr
    assert _hash(db, "bytes") == before
    assert db.execute("SELECT count(*) FROM relay.users").fetchone()[0] == 1


def test_duplicate_user_is_refused(run) -> None:
    assert run("user", "create", "dup", "--role", "admin", "--password-stdin", stdin="long-enough\n").exit_code == 0
    result = run("user", "create", "DUP", "--role", "viewer", "--password-stdin", stdin="long-enough\n")
    assert result.exit_code == 1 and "already exists" in result.output


def test_list_set_role_set_password_delete(run, db) -> None:
    run("user", "create", "eve", "--role", "viewer", "--password-stdin", stdin="long-enough\n")
    before = _hash(db, "eve")[1]
    assert run("user", "set-role", "eve", "admin").exit_code == 0
    assert run("user", "set-password", "eve", "--password-stdin", stdin="another-long-one\n").exit_code == 0
    role, after = _hash(db, "eve")
    assert role == "admin" and after != before
    listing = run("user", "list")
    assert "eve\tadmin\tlast login: never" in listing.output
    assert run("user", "delete", "eve").exit_code == 0
    assert _hash(db, "eve") is None
    assert run("user", "delete", "eve").exit_code == 1


def test_an_empty_user_list_says_how_to_make_the_first_admin(run, db) -> None:
    result = run("user", "list")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # a script reading the list reads none
    assert "no users yet; make the first admin with: relay user create NAME --role admin" in result.stderr


@pytest.mark.parametrize("action", [("delete", "boss"), ("set-role", "boss", "viewer")])
def test_removing_the_last_admin_is_done_and_warned_of(run, db, action: tuple[str, ...]) -> None:
    """Nobody can act from the dashboard or the API after it; only the shell can make another."""
    assert run("user", "create", "boss", "--role", "admin", "--password-stdin", stdin="long-enough-1\n").exit_code == 0
    assert run("user", "create", "other", "--role", "admin", "--password-stdin", stdin="long-enough-2\n").exit_code == 0
    assert "warning" not in run("user", *action).output  # another admin is left
    run("user", "delete", "other")
    run("user", "create", "boss", "--role", "admin", "--password-stdin", stdin="long-enough-1\n")
    last = run("user", *action)
    assert last.exit_code == 0, last.output
    assert "warning: no admin is left; make one with: relay user create NAME --role admin" in last.stderr
