"""The ``relay`` command line."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import signal
import sys
import threading
from collections.abc import Iterator
from datetime import datetime

import click

from . import admin, logs, monitor
from . import migrate as migrator
from .cli_input import FiniteFloatRange, JobIdType, load_app, parse_payload, queue_names
from .cli_users import UnusableSetting, command_dsn, connect, database_errors, user
from .client import Relay
from .errors import ConfigurationError, InvalidJobError, MigrationError, RelayError
from .settings import database_url_set
from .validation import new_job
from .worker import require_handlers
from .worker.config import MAX_CONCURRENCY
from .worker.shutdown import end_owned_process


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt for the block, as Ctrl-C does; the previous handler after it.

    For ``relay prove``: its default ended the process at once, leaving its
    workers serving the proof's queue, its unfinished jobs queued and an
    embedded server running. Left alone off the main thread, where no
    handler can be installed (a test calling the command in a thread).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _dsn_or_embedded() -> str:
    """DATABASE_URL when set, else an embedded PostgreSQL (stopped when this command exits)."""
    if database_url_set():
        return command_dsn()  # one that cannot be read is an error, not a reason to run elsewhere
    from .embedded import default_data_dir, start

    click.echo(f"no DATABASE_URL: starting an embedded PostgreSQL in {default_data_dir()}", err=True)
    return start()


class RelayCommands(click.Group):
    """The ``relay`` group: Relay's own configuration errors end any command with one line, not a traceback.

    A ``RELAY_*`` setting is read where it is used, often when a ``Relay`` is
    built, which for ``--app`` happens inside the user's module as it is
    imported; wherever that is, the message names the setting.

    Under ``--log-format json`` (or ``RELAY_LOG_FORMAT=json``) the line that
    ends a command, and the traceback of an application's module that failed
    to import, are log records like every other line on stderr: as plain
    text they broke the JSON a log pipeline parses. A usage error (a flag
    mistyped at a terminal) stays click's own text.
    """

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (ConfigurationError, MigrationError) as exc:
            ending = click.ClickException(str(exc))
        except (click.UsageError, click.exceptions.Exit, click.Abort):
            raise
        except click.ClickException as exc:
            ending = exc
        except Exception as exc:
            if not logs.json_configured():
                raise
            logs.logger.critical("%s: %s", type(exc).__name__, exc, exc_info=exc)
            ctx.exit(1)
        if logs.json_configured():
            logs.logger.error(ending.format_message())
            ctx.exit(ending.exit_code)
        raise ending from None


class RefusedInput(click.ClickException):
    """Input Relay's checks refused, or a setting it cannot use, nothing written: exit 2, as for a value
    click itself cannot read.

    A script then tells its own bad input or configuration (2) from a database
    that failed or refused (1), and does not retry what will never pass.
    """

    exit_code = 2


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``relay --version``: the release, and the newest migration it ships (what a database migrated by it records)."""
    if not value or ctx.resilient_parsing:
        return
    newest = migrator.available()[-1]
    try:
        release = importlib.metadata.version("relay-queue")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        release = "(not installed)"
    click.echo(f"relay {release} (migrations up to {newest.version:04d}_{newest.name})")
    ctx.exit()


@click.group(cls=RelayCommands)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_show_version,
    help="Show the release and the newest migration it ships, then exit.",
)
@click.option(
    "--log-level",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"], case_sensitive=False),  # as RELAY_LOG_FORMAT is read
    default=None,
    help="Log line format (default: RELAY_LOG_FORMAT or text).",
)
def main(log_level: str, log_format: str | None) -> None:
    """Relay: background jobs on PostgreSQL alone."""
    try:
        logs.configure(log_level, log_format)
    except ConfigurationError as exc:
        # RELAY_LOG_FORMAT mistyped: a setting refused before anything ran, as --log-format's own typo is.
        raise RefusedInput(str(exc)) from None


@main.command()
def migrate() -> None:
    """Apply pending migrations (safe to run concurrently)."""
    dsn = command_dsn()
    applied = Relay(dsn).migrate()  # a MigrationError is one line (RelayCommands)
    unknown = migrator.unknown_applied(dsn)
    if unknown:
        # Not an error: a rollback to this version must still deploy.
        click.echo(
            "warning: the database also has migrations this Relay does not ship, so a newer Relay "
            f"migrated it: {', '.join(unknown)}. They were left as they are.",
            err=True,
        )
    if applied:
        click.echo("applied: " + ", ".join(applied))
    else:
        click.echo("every migration this Relay ships is applied" if unknown else "schema is up to date")


@main.command()
@click.option("--app", "app_spec", required=True, help="MODULE:ATTR of your Relay object.")
@click.option(
    "--queues",
    default=None,
    callback=queue_names,
    help="Comma-separated queues to serve (default: RELAY_QUEUES, else default).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, MAX_CONCURRENCY),
    default=None,
    help="Jobs run at once (default: RELAY_CONCURRENCY, else 8).",
)
@click.option(
    "--lease",
    "lease_seconds",
    type=FiniteFloatRange(min=1),
    default=None,
    help="Lease seconds (default: RELAY_LEASE_SECONDS, else 30).",
)
@click.option(
    "--shutdown-timeout",
    type=FiniteFloatRange(min=0),
    default=None,
    help=(
        "Seconds in-flight jobs get to finish on SIGTERM before they are handed back"
        " (default: RELAY_SHUTDOWN_TIMEOUT, else 25)."
    ),
)
@click.option(
    "--no-listen", is_flag=True, help="Poll only, as RELAY_LISTEN=false does (for PgBouncer in transaction pooling)."
)
def worker(
    app_spec: str,
    queues: tuple[str, ...] | None,
    concurrency: int | None,
    lease_seconds: float | None,
    shutdown_timeout: float | None,
    no_listen: bool,
) -> None:
    """Run a worker until SIGTERM/SIGINT, then shut down gracefully.

    A flag wins over its variable. The other settings are variables only:
    RELAY_HEARTBEAT_INTERVAL, RELAY_POLL_INTERVAL, RELAY_SWEEP_INTERVAL,
    RELAY_RETENTION_*, RELAY_PRUNE, RELAY_MAX_STUCK_HANDLERS, RELAY_SELF_VACUUM, RELAY_TRANSACTION_POOLING
    (the README's "Workers" section says what each does).
    """
    app = load_app(app_spec)
    settings: dict[str, object] = {
        "concurrency": concurrency,
        "lease_seconds": lease_seconds,
        "shutdown_timeout": shutdown_timeout,
        "owns_process": True,
    }
    if queues is not None:
        settings["queues"] = queues
    if no_listen:
        settings["listen"] = False
    try:
        running = app.worker(**settings)
        require_handlers(running.handlers)
        # A statement the server refused as the worker starts (registering under a role that
        # may only read Relay's tables, say) as one line; the app's own code above is not wrapped.
        with database_errors(only_from_server=True):
            running.run()
    except ConfigurationError as exc:
        raise click.ClickException(str(exc)) from None
    end_owned_process(running)


@main.command()
@click.argument("job_type")
@click.argument("payload", default="{}")
@click.option("--run-at", default=None, help="ISO 8601 time with a UTC offset, e.g. 2030-01-01T09:00:00+00:00.")
@click.option("--queue", default="default", show_default=True)
@click.option("--priority", type=int, default=0, show_default=True, help="Lower runs first.")
@click.option(
    "--max-attempts",
    type=int,
    default=None,
    help="Default: the handler's max_attempts as workers published it for TYPE, else 20.",
)
@click.option("--idempotency-key", default=None)
def enqueue(
    job_type: str,
    payload: str,
    run_at: str | None,
    queue: str,
    priority: int,
    max_attempts: int | None,
    idempotency_key: str | None,
) -> None:
    """Enqueue one job; PAYLOAD is JSON, or - to read it from standard input. Prints the job id.

    Standard input takes payloads past what one command-line argument may hold
    (128 KiB on Linux, under the default payload limit) and JSON another
    command makes: jq -c . order.json | relay enqueue ship_order -
    """
    if payload == "-":
        payload = sys.stdin.read()
        if not payload.strip():
            raise click.BadParameter("standard input (-) held no JSON", param_hint="PAYLOAD")
    data = parse_payload(payload)
    when = None
    if run_at is not None:
        try:
            when = datetime.fromisoformat(run_at)
        except ValueError:
            raise click.BadParameter(f"{run_at!r} is not an ISO 8601 time", param_hint="--run-at") from None
    try:
        relay = Relay()  # the database's setting is read by connect(), once the input passed
    except ConfigurationError as exc:
        raise RefusedInput(str(exc)) from None
    try:
        # Checked before connecting: refused input exits 2 whether or not the database answers.
        new_job(
            job_type,
            data,
            queue=queue,
            priority=priority,
            run_at=when,
            max_attempts=relay.default_max_attempts if max_attempts is None else max_attempts,
            idempotency_key=idempotency_key,
            max_payload_bytes=relay.max_payload_bytes,
        )
    except InvalidJobError as exc:
        raise RefusedInput(f"refused: {exc}") from None
    # One plain connection, not the Relay's pool: a database that cannot be
    # reached is a one-line error at once, not a traceback after the pool's wait.
    try:
        conn = connect()
    except UnusableSetting as exc:
        raise RefusedInput(exc.message) from None
    with conn, database_errors():
        try:
            job_id = relay.enqueue(
                job_type,
                data,
                conn=conn,
                run_at=when,
                queue=queue,
                priority=priority,
                max_attempts=max_attempts,
                idempotency_key=idempotency_key,
            )
        except InvalidJobError as exc:
            raise RefusedInput(f"refused: {exc}") from None
    click.echo(job_id)


@main.command()
@click.option("--workers", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option("--jobs", type=click.IntRange(1, 10_000_000), default=5000, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option(
    "--timeout",
    type=FiniteFloatRange(1, 86400),
    default=300,
    show_default=True,
    help="Seconds to wait for the jobs; any still unfinished then are reported as such.",
)
def prove(workers: int, jobs: int, concurrency: int, timeout: float) -> None:
    """Drain JOBS jobs with WORKERS processes and audit for duplicates and losses."""
    from .prove import run_proof

    with _sigterm_as_ctrl_c():
        dsn = _dsn_or_embedded()
        Relay(dsn).migrate()
        with database_errors(only_from_server=True):
            result = run_proof(dsn, workers=workers, jobs=jobs, concurrency=concurrency, timeout=timeout)
    click.echo(result.report())
    if not result.ok:
        sys.exit(1)


@main.command()
@click.argument("job_id", type=JobIdType())
def requeue(job_id: int) -> None:
    """Requeue a dead or cancelled job."""
    with connect() as conn, database_errors():
        try:
            job = admin.requeue(conn, job_id)
        except RelayError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"job {job.id} is {job.status}")


@main.command()
def recount() -> None:
    """Rebuild the dashboard's and metrics' job counts from the jobs table.

    For counts left wrong by writes the counting triggers did not see
    (session_replication_role = replica, DISABLE TRIGGER, a data-only restore
    of both tables). It counts the whole table; enqueues and workers go on meanwhile.
    """
    with connect() as conn, database_errors():
        wrong = monitor.recount(conn)
    if not wrong:
        click.echo("the counts matched the jobs table")
    for row in wrong:
        click.echo(f"{row['queue']} {row['state']}: counted {row['was']}, now {row['now']}")


main.add_command(user)


@main.command()
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8000,
    envvar="PORT",
    show_default=True,
    help="Port of the dashboard on 127.0.0.1 (or PORT).",
)
@click.option("--fresh", is_flag=True, help="Delete the embedded database's data and start over.")
@click.option("--orders-per-minute", type=FiniteFloatRange(min=0.1, max=6000), default=30.0, show_default=True)
def demo(port: int, fresh: bool, orders_per_minute: float) -> None:
    """Run the whole product here: database, dashboard, two workers and a shop placing orders.

    On DATABASE_URL when set (refused if its default queue holds jobs the shop
    cannot run), else on an embedded PostgreSQL. Log in as the user `demo`.
    """
    from .demo import DemoError, run

    try:
        code = run(port=port, fresh=fresh, orders_per_minute=orders_per_minute)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)
