"""Settings of one worker process."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from ..backoff import MAX_DELAY_SECONDS
from ..errors import ConfigurationError
from ..finite import finite_real
from ..settings import env_bool, env_float, env_int, transaction_pooling
from ..validation import InvalidJobError, check_queue
from .retention import Retention

#: The most jobs one worker process runs at once (one thread each), as ``relay worker --concurrency``.
MAX_CONCURRENCY = 1000
#: The shortest lease a worker takes: heartbeats, the lease watch and the sweeper work in tenths of a second.
MIN_LEASE_SECONDS = 1.0
#: The shortest heartbeat interval: each renewal is a round trip for every lease the worker holds.
MIN_HEARTBEAT_SECONDS = 0.1
#: The shortest waits between an idle worker's claims and between sweeps: shorter, an idle
#: worker runs a query back to back (RELAY_POLL_INTERVAL=0.000001 kept a core of the
#: database busy answering empty claims); NOTIFY wakes a worker for new jobs sooner anyway.
MIN_INTERVAL_SECONDS = {"poll_interval": 0.01, "sweep_interval": 0.1}


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


#: The environment variable each numeric setting is read from (named in what a bad value says).
ENV_SETTINGS = {
    "concurrency": "RELAY_CONCURRENCY",
    "lease_seconds": "RELAY_LEASE_SECONDS",
    "heartbeat_interval": "RELAY_HEARTBEAT_INTERVAL",
    "poll_interval": "RELAY_POLL_INTERVAL",
    "sweep_interval": "RELAY_SWEEP_INTERVAL",
    "shutdown_timeout": "RELAY_SHUTDOWN_TIMEOUT",
    "max_stuck_handlers": "RELAY_MAX_STUCK_HANDLERS",
    "queues": "RELAY_QUEUES",
}


@dataclass
class WorkerConfig:
    """How a worker claims, leases and shuts down.

    The lease is how long a claimed job stays this worker's without a
    heartbeat; heartbeats renew it every ``heartbeat_interval``. A short lease
    recovers a dead worker's jobs sooner; a long one survives longer pauses
    (GC, a stalled VM) without a second run. Heartbeats make a long-running job
    safe under a short lease.
    """

    queues: tuple[str, ...] = ("default",)
    concurrency: int = 8
    lease_seconds: float = 30.0
    #: Default: a third of the lease.
    heartbeat_interval: float = None  # type: ignore[assignment]
    poll_interval: float = 0.5
    sweep_interval: float = 5.0
    shutdown_timeout: float = 25.0
    #: How many handlers may run on long after they were told to stop (past their timeouts)
    #: before the worker stops itself, for its process, their threads with it, to end and be
    #: started afresh (see ``Worker.check_stuck``). None: no limit, unless ``owns_process``.
    max_stuck_handlers: int | None = None
    #: Whether the worker's process is its own (``relay worker``, ``Relay.run_worker``), which
    #: ends when the worker stops: then ``max_stuck_handlers`` defaults to the concurrency. A
    #: worker run in a process of the application's has no such limit unless given one, since a
    #: stop it did not ask for would leave the process running without a worker.
    owns_process: bool = False
    #: Default: unless behind a transaction pooler (``RELAY_TRANSACTION_POOLING``), which delivers no
    #: notifications and would keep the LISTEN on a server connection other clients use next.
    listen: bool = None  # type: ignore[assignment]
    #: Empty: one is made for this process (host:pid:random), which no other process shares.
    worker_id: str = ""
    #: How long finished jobs are kept; None turns pruning off in this worker.
    retention: Retention | None = field(default_factory=Retention)
    #: Vacuum Relay's tables when the server's autovacuum is off (a no-op where it runs).
    self_vacuum: bool = True
    #: Whether ``worker_id`` was made for this process, so every job claimed under it is this
    #: process's (a given id may be shared, by a process starting while another drains).
    owns_worker_id: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = _worker_id()
            self.owns_worker_id = True
        if isinstance(self.queues, str):
            # tuple("emails") is six one-letter queues, none of them the one meant.
            raise ConfigurationError(f"queues must be a list of queue names, not one string: queues=[{self.queues!r}]")
        self.queues = tuple(dict.fromkeys(self.queues))  # each once, in the order given
        if not self.queues:
            raise ConfigurationError("queues must name at least one queue: a worker needs one")
        for queue in self.queues:
            try:
                check_queue(queue)
            except InvalidJobError as exc:
                raise ConfigurationError(f"queues must be queue names: {exc.message}") from None
        if self.listen is None:
            self.listen = not transaction_pooling()
        for name in ("listen", "self_vacuum", "owns_process"):
            # "false" is a true value: a string here would turn on what it means to turn off.
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.retention is not None and not isinstance(self.retention, Retention):
            raise ConfigurationError(
                f"retention must be a Retention(succeeded=..., cancelled=..., dead=...) or None, got {self.retention!r}"
            )
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int):
            raise ConfigurationError(f"concurrency must be a whole number of slots, got {self.concurrency!r}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"concurrency must be between 1 and {MAX_CONCURRENCY}, got {self.concurrency}")
        if self.max_stuck_handlers is None and self.owns_process:
            self.max_stuck_handlers = self.concurrency
        stuck = self.max_stuck_handlers
        if stuck is not None and (isinstance(stuck, bool) or not isinstance(stuck, int)):
            raise ConfigurationError(f"max_stuck_handlers must be a whole number of handlers, got {stuck!r}")
        if stuck is not None and not 0 <= stuck <= MAX_CONCURRENCY:
            raise ConfigurationError(f"max_stuck_handlers must be between 0 and {MAX_CONCURRENCY}, got {stuck}")
        # The lease first: the heartbeat's default is a third of it.
        for name in ("lease_seconds", "heartbeat_interval", "poll_interval", "sweep_interval"):
            if name == "heartbeat_interval" and self.heartbeat_interval is None:
                self.heartbeat_interval = self.lease_seconds / 3
            # NaN passes every comparison below, text or a bool is no number of seconds, and a thread
            # cannot wait an infinite time (nor longer than threading.TIMEOUT_MAX, about 292 years:
            # an OverflowError mid-run). A claimed job's claimed_until, now() + the lease, must
            # stay a timestamp PostgreSQL can store and Python can read.
            value = getattr(self, name)
            if not (finite_real(value) and 0 < value <= MAX_DELAY_SECONDS):
                raise ConfigurationError(
                    f"{name} must be a positive number of seconds, at most {MAX_DELAY_SECONDS:.0f}, got {value!r}"
                )
        for name, shortest in MIN_INTERVAL_SECONDS.items():
            if getattr(self, name) < shortest:
                raise ConfigurationError(f"{name} must be at least {shortest:g} s, got {getattr(self, name):g}")
        if self.lease_seconds < MIN_LEASE_SECONDS:
            raise ConfigurationError(
                f"lease_seconds must be at least {MIN_LEASE_SECONDS:.0f}: a pause of the worker any longer "
                "(a garbage collection, a busy machine) would let another worker run the job beside it"
            )
        if self.heartbeat_interval < MIN_HEARTBEAT_SECONDS:
            raise ConfigurationError(
                f"heartbeat_interval must be at least {MIN_HEARTBEAT_SECONDS:g} s, got {self.heartbeat_interval:g}"
            )
        if self.heartbeat_interval > self.lease_seconds / 2:
            # A renewal comes a round trip after it is due, and a late or failed one must
            # leave time for the next before the lease runs out.
            raise ConfigurationError(
                f"heartbeat_interval must be at most half of lease_seconds ({self.lease_seconds / 2:g} s), "
                f"got {self.heartbeat_interval:g}"
            )
        # NaN would skip the wait for in-flight jobs; an infinite wait outlasts every drain window.
        if not (finite_real(self.shutdown_timeout) and 0 <= self.shutdown_timeout <= MAX_DELAY_SECONDS):
            raise ConfigurationError(f"shutdown_timeout must be a number of seconds from 0 to {MAX_DELAY_SECONDS:.0f}")

    @classmethod
    def from_env(cls, **overrides: object) -> WorkerConfig:
        """Defaults, then RELAY_* environment settings, then explicit overrides.

        A setting given explicitly is not read from the environment at all, so
        a flag of ``relay worker`` wins over its variable even when the
        variable holds something that is no setting.
        """
        # None stands for "not given" (the CLI's unset options), except retention=None, which turns pruning off.
        given = {k: v for k, v in overrides.items() if v is not None or k == "retention"}
        default = {f.name: f.default for f in fields(cls)}
        named = ENV_SETTINGS
        readers: dict[str, Callable[[], object]] = {
            "concurrency": lambda: env_int(named["concurrency"], default["concurrency"]),
            "lease_seconds": lambda: env_float(named["lease_seconds"], default["lease_seconds"]),
            # None: a third of the lease, the one given here or in the environment.
            "heartbeat_interval": lambda: env_float(named["heartbeat_interval"], None),
            "poll_interval": lambda: env_float(named["poll_interval"], default["poll_interval"]),
            "sweep_interval": lambda: env_float(named["sweep_interval"], default["sweep_interval"]),
            "shutdown_timeout": lambda: env_float(named["shutdown_timeout"], default["shutdown_timeout"]),
            # None: as many as the worker has slots when it owns its process, else no limit.
            "max_stuck_handlers": lambda: env_int(named["max_stuck_handlers"], None),
            # None: the field's own default (polling behind a transaction pooler).
            "listen": lambda: env_bool("RELAY_LISTEN", default["listen"]),
            "retention": lambda: Retention.from_env() if env_bool("RELAY_PRUNE", True) else None,
            "self_vacuum": lambda: env_bool("RELAY_SELF_VACUUM", True),
        }
        values = {name: read() for name, read in readers.items() if name not in given}
        queues = os.environ.get("RELAY_QUEUES")
        if queues and "queues" not in given:
            values["queues"] = tuple(q.strip() for q in queues.split(",") if q.strip())
        values.update(given)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ConfigurationError as exc:
            # "poll_interval must be ..." says which field; set in the environment, name the variable too.
            field = str(exc).split(" ", 1)[0]
            variable = ENV_SETTINGS.get(field)
            if variable and field not in given and os.environ.get(variable) is not None:
                raise ConfigurationError(f"{variable}: {exc}") from None
            raise
