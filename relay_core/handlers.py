"""Handler registrations: what a worker runs for each job type, and how."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backoff import DEFAULT_BACKOFF, Backoff
from .validation import check_max_attempts, check_seconds, check_type

DEFAULT_MAX_ATTEMPTS = 20


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


def make_spec(
    job_type: str,
    func: Callable[..., Any],
    *,
    max_attempts: int,
    backoff: Backoff | None,
    timeout: float | None,
    transactional: bool | None,
) -> HandlerSpec:
    """Validate a registration; ``transactional`` defaults to "the handler takes a conn"."""
    check_type(job_type)
    check_max_attempts(max_attempts)
    if timeout is not None:
        check_seconds("timeout", timeout)
    if transactional is None:
        params = [p for p in inspect.signature(func).parameters.values() if p.kind != p.VAR_KEYWORD]
        transactional = len(params) >= 2
    return HandlerSpec(
        type=job_type,
        func=func,
        max_attempts=max_attempts,
        backoff=backoff or DEFAULT_BACKOFF,
        timeout=timeout,
        transactional=bool(transactional),
    )
