"""``relay user ...``: manage who may use the admin surface.

Relay ships no default account and no default password: the first admin is
made here. Passwords are prompted for twice (never echoed), or read from
standard input with ``--password-stdin`` so scripts never put one on a
command line, where ``ps`` and shell history would show it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click
import psycopg

from . import users
from .connect_options import connection_options, unusable_setting
from .errors import ConfigurationError, RelayError
from .jsonb import read_any_number
from .migrate import MISSING_SCHEMA_ERRORS, MISSING_TABLES
from .settings import EXAMPLE_URL, database_url, env_int

#: The command that makes an admin, for the messages that say none is there.
FIRST_ADMIN = "relay user create NAME --role admin"


class UnusableSetting(click.ClickException):
    """The database's setting cannot be used (none, blank, or a parameter libpq cannot read): one line, exit 1.

    A command whose exit codes tell a caller what to retry (``relay enqueue``)
    turns it into its own refusal: a setting does not fix itself on a retry.
    """


def command_dsn() -> str:
    """The configured database's DSN, or one line saying what is wrong with its setting."""
    if not any(name in os.environ for name in ("RELAY_DATABASE_URL", "DATABASE_URL")):
        # database_url's own words ("pass a DSN to Relay(...)") are for code; at a shell only the variable serves.
        raise UnusableSetting(f"no database configured: set DATABASE_URL (or RELAY_DATABASE_URL) to {EXAMPLE_URL}")
    try:
        return database_url()
    except ConfigurationError as exc:
        raise UnusableSetting(str(exc)) from None


def connect() -> psycopg.Connection:
    """An autocommit connection to the configured database, its transactions READ COMMITTED;
    a clear usage error when there is none."""
    dsn = command_dsn()
    try:
        options = connection_options(dsn)
    except ConfigurationError as exc:
        raise UnusableSetting(str(exc)) from None
    try:
        conn = psycopg.connect(dsn, autocommit=True, **options)
    except (psycopg.OperationalError, psycopg.ProgrammingError) as exc:
        # A setting libpq cannot use (connect_timeout=abc, sslmode=bogus) is no outage to retry.
        unusable = UnusableSetting if unusable_setting(exc) else click.ClickException
        raise unusable(f"cannot connect to the database: {exc}") from None
    # READ COMMITTED whatever the database's default, as every Relay connection: under a
    # stricter level a requeue that waited for a worker's row lock failed with a
    # serialization error. Asked for in each BEGIN (nothing stays behind a pooler).
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    # A requeue reads the job back: a payload with an integer of over 4,300 digits, or
    # nested past Python's recursion limit, must read as on Relay's own connections.
    read_any_number(conn)
    return conn


@contextmanager
def database_errors(only_from_server: bool = False) -> Iterator[None]:
    """A statement the database refused as one line, not a traceback.

    A read-only replica behind DATABASE_URL, a statement timeout or a lost
    connection is the operator's to fix, not a bug of the command.
    ``only_from_server``: errors psycopg raised itself (a lost connection, a
    query its caller got wrong) keep their traceback.
    """
    try:
        yield
    except psycopg.Error as exc:
        if only_from_server and exc.sqlstate is None:
            raise
        if isinstance(exc, MISSING_SCHEMA_ERRORS):
            # What a later migration adds is missing: the schema is behind this release.
            raise click.ClickException(MISSING_TABLES) from None
        lines = str(exc).strip().splitlines()
        detail = lines[0] if lines else type(exc).__name__
        raise click.ClickException(f"the database refused: {detail}") from None


def _hasher() -> users.PasswordHasher:
    """The same Argon2id parameters the web app uses (RELAY_ARGON2_* settings)."""
    try:
        return users.make_hasher(
            env_int("RELAY_ARGON2_TIME_COST", 0) or None,
            env_int("RELAY_ARGON2_MEMORY_COST", 0) or None,
            env_int("RELAY_ARGON2_PARALLELISM", 0) or None,
        )
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        # One line; the newline a pipe or heredoc adds is not part of the password.
        return sys.stdin.readline().rstrip("\r\n")
    # Checked as typed, before the repeat: a short one was refused only after both prompts.
    return click.prompt(
        "Password", hide_input=True, confirmation_prompt="Repeat the password", value_proc=_acceptable_password
    )


def _acceptable_password(password: str) -> str:
    """``password`` if Relay would store it; else the prompt says why and asks again."""
    try:
        return users.check_password(password)
    except users.InvalidUserError as exc:
        raise click.BadParameter(exc.message, param_hint="password") from None


def _run(action: str, func: object, *args: object) -> bool:
    """Run ``func(conn, *args)``; answers whether an admin is left afterwards."""
    with connect() as conn, database_errors():
        try:
            func(conn, *args)  # type: ignore[operator]
        except users.InvalidUserError as exc:
            raise click.BadParameter(exc.message, param_hint=exc.field) from None
        except RelayError as exc:
            raise click.ClickException(f"{action} failed: {exc}") from None
        return any(u.role == "admin" for u in users.list_users(conn))


def _say_if_no_admin_is_left(admin_left: bool) -> None:
    """Done, but nobody can act from the dashboard or the API any more: the shell is the way back."""
    if not admin_left:
        click.echo(f"warning: no admin is left; make one with: {FIRST_ADMIN}", err=True)


@click.group()
def user() -> None:
    """Manage admin-surface users (admin: read and act; viewer: read)."""


@user.command("create")
@click.argument("username")
@click.option("--role", type=click.Choice(users.ROLES), required=True, help="admin acts on jobs; viewer only reads.")
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input instead of prompting.")
def create(username: str, role: str, password_stdin: bool) -> None:
    """Create a user; prompts for the password twice."""
    try:
        name = users.normalize_username(username)
    except users.InvalidUserError as exc:
        raise click.BadParameter(exc.message, param_hint="USERNAME") from None
    password = _read_password(password_stdin)
    _run("create", lambda conn: users.create_user(conn, name, password, role, hasher=_hasher()))
    click.echo(f"created {role} {name}")


@user.command("set-password")
@click.argument("username")
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input instead of prompting.")
def set_password(username: str, password_stdin: bool) -> None:
    """Give a user a new password (their refresh tokens stop working)."""
    password = _read_password(password_stdin)
    _run("set-password", lambda conn: users.set_password(conn, username, password, hasher=_hasher()))
    click.echo(f"password of {username.lower()} changed")


@user.command("set-role")
@click.argument("username")
@click.argument("role", type=click.Choice(users.ROLES))
def set_role(username: str, role: str) -> None:
    """Make a user an admin or a viewer."""
    admin_left = _run("set-role", users.set_role, username, role)
    click.echo(f"{username.lower()} is now {role}")
    _say_if_no_admin_is_left(admin_left)


@user.command("delete")
@click.argument("username")
def delete(username: str) -> None:
    """Remove a user."""
    admin_left = _run("delete", users.delete_user, username)
    click.echo(f"deleted {username.lower()}")
    _say_if_no_admin_is_left(admin_left)


@user.command("list")
def list_() -> None:
    """Show every user and their role."""
    with connect() as conn, database_errors():
        found = users.list_users(conn)
    if not found:
        click.echo(f"no users yet; make the first admin with: {FIRST_ADMIN}", err=True)
    for u in found:
        seen = u.last_login_at.isoformat(timespec="seconds") if u.last_login_at else "never"
        click.echo(f"{u.username}\t{u.role}\tlast login: {seen}")
