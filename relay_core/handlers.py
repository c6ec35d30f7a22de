"""Handler registrations: what a worker runs for each job type, and how."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backoff import DEFAULT_BACKOFF, Backoff
from .schedule import check_cron
from .validation import InvalidJobError, check_max_attempts, check_queue, check_seconds, check_type

DEFAULT_MAX_ATTEMPTS = 20
#: Limits are integer columns of relay.type_limits.
MAX_LIMIT = 2**31 - 1
#: The longest rate window. Every worker's claim reads every type's limit, so
#: a window PostgreSQL cannot subtract from now() would fail every claim of
#: the whole fleet, not just this type's; each start is also kept this long.
MAX_RATE_PERIOD_SECONDS = 31 * 86400.0
#: The shortest rate window. PostgreSQL's clock counts microseconds: a window
#: shorter than one is no time at all, and no start ever fell inside it.
MIN_RATE_PERIOD_SECONDS = 0.001


@dataclass(frozen=True)
class HandlerSpec:
    """A registered handler and its per-type policy.

    ``transactional`` handlers take ``(job, conn)``: ``conn`` is in the
    transaction that also marks the job succeeded, so what the handler writes
    there commits together with the success or not at all.
    """

    type: str
    func: Callable[..., Any]
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff: Backoff = DEFAULT_BACKOFF
    timeout: float | None = None
    transactional: bool = False
    #: At most this many jobs of the type run at once across all workers.
    concurrency: int | None = None
    #: (starts, seconds): at most ``starts`` jobs of the type start per sliding ``seconds``.
    rate_limit: tuple[int, float] | None = None
    #: A periodic schedule: a 5-field cron expression or @daily, @monthly, ...
    cron: str | None = None
    #: Time zone the cron expression is read in.
    timezone: str = "UTC"
    #: Enqueue the latest tick missed while every worker was down (else skip it).
    catch_up: bool = False
    #: Queue periodic jobs go to.
    queue: str = "default"

    @property
    def has_limits(self) -> bool:
        """Whether the claim must respect a limit for this type."""
        return self.concurrency is not None or self.rate_limit is not None


def is_async(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` returns a coroutine: an ``async def``, a partial of one, an async ``__call__``.

    What registration can see; a sync function that returns an awaitable
    anyway is caught when it runs (the worker awaits whatever is awaitable).
    """
    return any(inspect.iscoroutinefunction(f) for f in _call_targets(func))


def is_generator(func: Callable[..., Any]) -> bool:
    """Whether ``func`` is a generator function, sync or async (or a partial or ``__call__`` of one)."""
    return any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in _call_targets(func))


def _call_targets(func: Callable[..., Any]) -> list[Callable[..., Any]]:
    """``func``, and the ``__call__`` method of a callable object (inspect looks only at the object)."""
    return [func] if inspect.isroutine(func) else [func, func.__call__]


def _is_limit(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LIMIT


def make_spec(
    job_type: str,
    func: Callable[..., Any],
    *,
    max_attempts: int,
    backoff: Backoff | None,
    timeout: float | None,
    transactional: bool | None,
    concurrency: int | None = None,
    rate_limit: tuple[int, float] | None = None,
    cron: str | None = None,
    timezone: str = "UTC",
    catch_up: bool = False,
    queue: str = "default",
) -> HandlerSpec:
    """Validate a registration; ``transactional`` defaults to "the handler takes a conn"."""
    check_type(job_type)
    check_max_attempts(max_attempts)
    check_queue(queue)
    if isinstance(backoff, type):
        raise InvalidJobError("backoff", f"must be an instance, such as {backoff.__name__}(), not the class itself")
    if backoff is not None and not callable(getattr(backoff, "delay", None)):
        raise InvalidJobError(
            "backoff", f"must be a relay_core.Backoff (or have a delay(attempt) method), got {type(backoff).__name__}"
        )
    if timeout is not None:
        check_seconds("timeout", timeout)
    if concurrency is not None and not _is_limit(concurrency):
        raise InvalidJobError("concurrency", f"must be an integer between 1 and {MAX_LIMIT}")
    if rate_limit is not None:
        if not (isinstance(rate_limit, tuple) and len(rate_limit) == 2):
            raise InvalidJobError("rate_limit", "must be (starts, seconds), e.g. (100, 60)")
        if not _is_limit(rate_limit[0]):
            raise InvalidJobError("rate_limit", f"starts must be an integer between 1 and {MAX_LIMIT}")
        period = check_seconds(
            "rate_limit",
            rate_limit[1],
            most=MAX_RATE_PERIOD_SECONDS,
            too_long=f"the window must be at most {MAX_RATE_PERIOD_SECONDS:.0f} s (31 days)",
        )
        if period < MIN_RATE_PERIOD_SECONDS:
            raise InvalidJobError("rate_limit", f"the window must be at least {MIN_RATE_PERIOD_SECONDS:g} s (1 ms)")
        rate_limit = (rate_limit[0], period)
    # A string such as "no" would count as true: a flag must be one.
    if not isinstance(catch_up, bool):
        raise InvalidJobError("catch_up", f"must be True or False, not {catch_up!r}")
    if transactional is not None and not isinstance(transactional, bool):
        raise InvalidJobError("transactional", f"must be True, False or None, not {transactional!r}")
    if cron is not None:
        check_cron(cron, timezone)
    elif timezone != "UTC" or catch_up or queue != "default":
        # Without a schedule none of them means anything (enqueue names its own
        # queue), and a mistyped zone or queue would go unnoticed.
        raise InvalidJobError("cron", "timezone, catch_up and queue apply to a schedule: give cron too")
    if not callable(func):
        raise InvalidJobError("handler", f"must be a function (or other callable), got {type(func).__name__}")
    if is_generator(func):
        raise InvalidJobError(
            "handler",
            "a generator function cannot be a handler: calling it runs none of its body "
            "(it only makes a generator); use def or async def, and return the result",
        )
    signature = _signature(func)
    if transactional is None:
        # The worker passes (job, conn) by position: a keyword-only parameter (as a
        # functools.partial's keywords become) cannot take the connection, and one
        # with a default (def h(job, dry_run=False)) is the handler's own option.
        transactional = signature is not None and _takes_a_second_argument(signature)
    if transactional and is_async(func):
        raise InvalidJobError(
            "transactional",
            f"the handler of {job_type!r} is async, and transactional completion hands a handler a sync "
            "connection inside the transaction that records its success; make it a plain def to keep "
            "(job, conn), or take only (job) (or pass transactional=False) and write through your own "
            "async connection, outside the completion",
        )
    if signature is not None:
        _check_callable_as_handler(job_type, signature, bool(transactional))
    return HandlerSpec(
        type=job_type,
        func=func,
        max_attempts=max_attempts,
        backoff=backoff or DEFAULT_BACKOFF,
        timeout=timeout,
        transactional=bool(transactional),
        concurrency=concurrency,
        rate_limit=rate_limit,
        cron=cron,
        timezone=timezone,
        catch_up=catch_up,
        queue=queue,
    )


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature, or None where Python cannot tell it (some built-in callables)."""
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _takes_a_second_argument(signature: inspect.Signature) -> bool:
    """Whether a second positional argument is required: ``def h(job, conn)``."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in signature.parameters.values() if p.kind in positional and p.default is p.empty]
    return len(required) >= 2


def _check_callable_as_handler(job_type: str, signature: inspect.Signature, transactional: bool) -> None:
    """Refuse a handler the worker could not call: every attempt would fail with a TypeError until the job died."""
    call = "handler(job, conn)" if transactional else "handler(job)"
    try:
        signature.bind(*([None] * (2 if transactional else 1)))
    except TypeError as exc:
        raise InvalidJobError(
            "handler", f"the handler of {job_type!r} cannot be called as {call}, as the worker calls it: {exc}"
        ) from None
