"""Relay's exceptions: one tree rooted in :class:`RelayError`.

Handlers raise :class:`PermanentFailure` or :class:`Snooze` to steer the
outcome of their job; everything else a handler raises is a retryable failure.
"""

from __future__ import annotations

from .backoff import MAX_DELAY_SECONDS, usable_delay


class RelayError(Exception):
    """Base of every error Relay raises."""


class ConfigurationError(RelayError):
    """Relay is missing a setting it needs (a DSN, a secret) or one is invalid."""


class InvalidJobError(RelayError, ValueError):
    """An enqueue was refused before anything was written.

    ``field`` names the argument at fault so an API can report it per field.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class MigrationError(RelayError):
    """The schema could not be brought up to date."""


class JobNotFound(RelayError, LookupError):
    """No job has this id."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} does not exist")
        self.job_id = job_id


#: The admin actions that change a job's state, in the past tense.
ACTIONS_DONE = {"requeue": "requeued", "cancel": "cancelled"}


class IllegalTransition(RelayError):
    """The state machine does not allow this change for the job's current state."""

    def __init__(self, job_id: int, current: str, action: str, allowed_from: tuple[str, ...]) -> None:
        self.job_id = job_id
        self.current = current
        self.action = action
        self.allowed_from = allowed_from
        super().__init__(f"cannot {action} job {job_id}: it is {current}, and {self.rule}")

    @property
    def rule(self) -> str:
        """Which states allow the action, as a sentence's end: "only dead or cancelled jobs can be requeued"."""
        allowed = " or ".join(self.allowed_from)
        done = ACTIONS_DONE.get(self.action)
        return f"only {allowed} jobs can be {done}" if done else f"{self.action} is allowed only for {allowed} jobs"


class ChangedSince(IllegalTransition):
    """The job's state allows the action, but the job has run again since the person asking was shown it.

    Two presses of Requeue on one dead job (two tabs, two people on call): the
    first runs it again, and once it has ended dead again the second would run
    it once more, though nobody who pressed saw that run.
    """

    @property
    def rule(self) -> str:
        return f"it has run again since it was shown, so the {self.action} was not done"


class BulkActionStopped(RelayError):
    """A bulk action failed part way: the batches before the failure are committed, the rest unchanged.

    ``changed`` says how many jobs it did change; ``__cause__`` is the
    database's error. The same action again goes on where it stopped, since
    the jobs it changed no longer match it.
    """

    def __init__(self, action: str, changed: int) -> None:
        self.action = action
        self.changed = changed
        super().__init__(f"{action} stopped part way: {changed} job(s) {self.done} before it")

    @property
    def done(self) -> str:
        """The action in the past tense: "requeued"."""
        return ACTIONS_DONE.get(self.action, self.action)


class HandlerNotFound(RelayError):
    """A worker claimed a job whose type it has no handler for."""


class LeaseLost(RelayError):
    """This worker no longer holds the job's lease; another run owns it now."""


class SuccessNotRecorded(RelayError):
    """A transactional handler's success could not be written in its transaction; its work was rolled back."""


class JobTimeout(RelayError):
    """A handler ran past its timeout; the attempt counts as failed."""


class PermanentFailure(RelayError):
    """Raised by a handler: this job can never succeed, make it dead now."""


class Snooze(RelayError):
    """Raised by a handler: run this job again after ``seconds`` without spending an attempt."""

    def __init__(self, seconds: float) -> None:
        # Raised inside a handler, the ValueError is that attempt's failure, with this message.
        if not usable_delay(seconds):  # "10" or None raised TypeError; True passed as 1 s
            raise ValueError(f"snooze seconds must be a number from 0 to {MAX_DELAY_SECONDS:.0f}, got {seconds!r}")
        super().__init__(f"snoozed for {seconds}s")
        self.seconds = float(seconds)


class JobCancelled(RelayError):
    """Raised by a handler (or for it) when an admin asked its running job to stop.

    A handler that raises anything after cancellation was requested ends the
    job ``cancelled`` rather than failed.
    """
