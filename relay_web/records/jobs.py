"""Records of the job endpoints: filters, pages, one job, enqueue and bulk actions."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, JsonValue, StringConstraints, field_validator

from relay_core import JobDetail
from relay_core.jsonb import UnreadableJson
from relay_core.monitor import MAX_PAGE, JobSummary

from .common import (
    BIGINT_MAX,
    HEADER_TEXT,
    BodyRecord,
    JobId,
    JobIdParameter,
    JobType,
    Moment,
    NewJobType,
    QueryRecord,
    QueueName,
    Record,
    StatusName,
    integer,
    parameter_integer,
    parse_moment,
    text,
)
from .payload import Payload

DEFAULT_PAGE = 50

Priority = integer(-32768, 32767)
MaxAttempts = integer(1, 1000)
PageSize = parameter_integer(1, MAX_PAGE)

Search = Annotated[text(1, 200), Field(description="Case-insensitive substring of the type or the last error.")]
#: A header arrives decoded as ISO-8859-1: "café" would be stored as "cafÃ©", and a
#: control character as given. Printable ASCII is refused nothing on the way.
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=HEADER_TEXT)]


#: The deepest nesting of a stored document (payload, progress, result) the API writes out.
#: pydantic, which writes every answer, stops near 254 levels; a handler's return value
#: may nest deeper (a payload the API or Relay.enqueue takes nests at most 100), and the
#: job then answered 500 for as long as it was kept, a cancel of it after its commit.
SHOWN_DEPTH = 200
TOO_DEEP_TO_SHOW = str(UnreadableJson(f"nested deeper than the admin API writes ({SHOWN_DEPTH} levels)"))


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` holds arrays and objects nested more than ``limit`` levels (a loop, not a recursion)."""
    containers = [(value, 1)] if isinstance(value, (dict, list)) else []
    while containers:
        container, depth = containers.pop()
        if depth > limit:
            return True
        members = container.values() if isinstance(container, dict) else container
        containers.extend((member, depth + 1) for member in members if isinstance(member, (dict, list)))
    return False


def _shown(value: Any) -> Any:
    return TOO_DEEP_TO_SHOW if nested_deeper_than(value, SHOWN_DEPTH) else value


#: A stored document as the API writes it: whole, or a note saying it nests too deeply to.
StoredJson = Annotated[JsonValue, BeforeValidator(_shown)]


class JobFilterFields(QueryRecord):
    """Filters shared by listing and bulk actions; each narrows, none means all."""

    queue: QueueName | None = None
    type: JobType | None = None
    q: Search | None = None


class JobListQuery(JobFilterFields):
    """``GET /api/admin/jobs`` parameters. One given empty (``queue=&type=``) is as if not given:
    scripts and forms send every parameter they know of, filled in or not."""

    #: Read by the endpoint layer. Only a read says so: for an action, an empty filter
    #: taken as none would widen what it changes.
    empty_means_absent: ClassVar[bool] = True

    status: StatusName | None = None
    limit: PageSize = Field(default=DEFAULT_PAGE, description=f"Page size, at most {MAX_PAGE}.")
    cursor: str | None = Field(
        default=None,
        pattern=r"^[1-9][0-9]{0,18}$",
        max_length=19,
        description="Opaque: pass the previous page's next_cursor to read the page after it.",
    )

    @field_validator("cursor")
    @classmethod
    def _cursor_in_range(cls, value: str | None) -> str | None:
        if value is not None and int(value) > BIGINT_MAX:
            raise ValueError("is not a cursor this API returned")
        return value


class JobPath(QueryRecord):
    """A job id in the URL."""

    job_id: JobIdParameter


#: relay.jobs.lease_token is a PostgreSQL integer.
LEASE_TOKEN_MAX = 2**31 - 1


class RequeueQuery(QueryRecord):
    """``POST /api/admin/jobs/{job_id}/requeue`` parameters."""

    seen_lease_token: parameter_integer(0, LEASE_TOKEN_MAX) | None = Field(  # type: ignore[valid-type]
        default=None,
        description=(
            "The job's lease_token as the caller read it. Every claim changes it: a job claimed since "
            "(requeued by someone else meanwhile, run, and ended again) is left as it is, with 409, "
            "so a requeue sent twice does not run the job twice."
        ),
    )


class JobSummaryRecord(Record):
    """One job in a listing; ``last_error`` is cut to its first 500 characters."""

    id: JobId
    type: str
    queue: str
    priority: int
    status: StatusName
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    claimed_by: str | None
    last_error: str | None

    @classmethod
    def of(cls, job: JobSummary) -> JobSummaryRecord:
        """The record of a listing row."""
        return cls(**vars(job))


class JobPageRecord(Record):
    """A page of jobs, newest first."""

    jobs: list[JobSummaryRecord]
    limit: int
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last page.")


class ErrorEntryRecord(Record):
    """One failed attempt in a job's error history."""

    attempt: int | None = None
    at: datetime | None = None
    worker: str | None = None
    type: str | None = Field(default=None, description="The exception type the handler raised.")
    message: str | None = None
    traceback: str | None = None

    @classmethod
    def of(cls, entry: Any) -> ErrorEntryRecord:
        """An entry of the stored history; unknown keys are dropped, odd values shown as text."""
        if not isinstance(entry, dict):
            return cls(message=str(entry))
        attempt = entry.get("attempt")
        texts = {k: entry.get(k) for k in ("worker", "type", "message", "traceback")}
        return cls(
            attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
            at=parse_moment(entry.get("at")),
            **{k: v if v is None or isinstance(v, str) else str(v) for k, v in texts.items()},
        )


class JobRecord(Record):
    """Everything about one job: payload, attempts, lease, worker, timings and error history."""

    id: JobId
    type: str
    queue: str
    priority: int
    payload: StoredJson
    status: StatusName
    attempts: int
    max_attempts: int
    run_at: datetime
    lease_token: int = Field(description="Fencing token of the latest claim.")
    claimed_by: str | None = Field(description="The worker holding the lease, or that held it last.")
    claimed_until: datetime | None = Field(
        description="When the current lease runs out. On a job not claimed: when the thread of a handler "
        "still running as its worker shut down stops at the latest, with the worker's process (a requeue makes "
        "the job due no earlier, and keeps this while it is ahead)."
    )
    idempotency_key: str | None
    last_error: str | None
    errors: list[ErrorEntryRecord]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None = Field(
        description="When an admin asked the running handler to stop; it becomes cancelled when it does."
    )
    progress: StoredJson = Field(description="What the running handler last reported, if anything.")
    result: StoredJson = Field(description="The handler's return value, stored with its success.")

    @classmethod
    def of(cls, job: JobDetail) -> JobRecord:
        """The record of a stored job."""
        fields = vars(job).copy()
        fields["errors"] = [ErrorEntryRecord.of(e) for e in (job.errors or [])]
        return cls(**fields)


class EnqueueBody(BodyRecord):
    """``POST /api/admin/jobs``: a job to add."""

    type: NewJobType
    payload: Payload = Field(default_factory=dict, description="Any JSON value; the handler's input. null means {}.")
    run_at: Moment | None = Field(default=None, description="Earliest run time, with a UTC offset; now if null.")
    queue: QueueName = "default"
    priority: Priority = Field(default=0, description="Lower runs first.")
    max_attempts: MaxAttempts | None = Field(
        default=None,
        description="Default: the handler's max_attempts as workers published it for the type, else 20.",
    )

    @field_validator("payload")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        # Relay.enqueue stores a None payload as {}: say so here, so the job a
        # repeated Idempotency-Key is compared with is the one that was stored.
        return {} if value is None else value


class IdempotencyHeaders(QueryRecord):
    """Request headers of ``POST /api/admin/jobs``."""

    idempotency_key: IdempotencyKey | None = Field(
        default=None,
        alias="Idempotency-Key",
        description="Repeat a request with the same key and the first job is returned, not a second one made.",
    )


def _filter_given(value: Any) -> Any:
    # A bulk action's filter given as null is refused, not read as left out: a script
    # sending {"queue": $Q} with Q unset cancelled every queued job in every queue.
    if value is None:
        raise ValueError("must not be null: leave it out to match every value")
    return value


def _no_default(schema: dict[str, Any]) -> None:
    # The None that stands for "left out" is no value a client may send: the schema says
    # the field is optional (not required), not that null is its default.
    schema.pop("default", None)


#: A bulk action's filter: left out, it matches every value; given, it must be a value, not null.
#: Its default None stands for "left out": pydantic never validates it, and the schema omits it.
Given = BeforeValidator(_filter_given)


def left_out(description: str | None = None) -> Any:
    """A bulk filter's default: None when left out, which the OpenAPI schema does not show."""
    described = {} if description is None else {"description": description}  # else the type's own stands
    return Field(default=None, json_schema_extra=_no_default, **described)


class RequeueFilter(BodyRecord):
    """Bulk requeue: every dead or cancelled job matching all given filters."""

    status: Annotated[Literal["dead", "cancelled"], Given] = left_out("Both when omitted.")
    queue: Annotated[QueueName, Given] = left_out()
    type: Annotated[JobType, Given] = left_out()
    q: Annotated[Search, Given] = left_out()


class CancelFilter(BodyRecord):
    """Bulk cancel: every queued job matching all given filters."""

    queue: Annotated[QueueName, Given] = left_out()
    type: Annotated[JobType, Given] = left_out()
    q: Annotated[Search, Given] = left_out()


class BulkResultRecord(Record):
    """What a bulk action changed."""

    action: Literal["requeue", "cancel"]
    changed: int = Field(ge=0, description="How many jobs changed state.")
