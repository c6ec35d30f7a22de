"""Base records and field types shared by every request and response.

Every input is parsed into one of these before use and every output is built
as one; unknown fields are refused both ways. The OpenAPI document is
generated from these same classes, so the spec cannot drift from the code.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from relay_core.monitor import QUEUE_NAME_PATTERN
from relay_core.validation import BIGINT_MAX, CANONICAL_NUMBER

StatusName = Literal["queued", "claimed", "succeeded", "dead", "cancelled"]


def _plain_text(value: str) -> str:
    # PostgreSQL text cannot hold NUL, and a lone surrogate cannot be sent as
    # UTF-8: refuse both here so they are a 422, never a database error.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text") from None
    return value


#: The pattern of text without NUL characters, as OpenAPI clients see it.
NO_NUL = r"^[^\x00]*$"
#: Printable ASCII, space included: what an HTTP header value should hold (RFC 9110 section 5.5).
HEADER_TEXT = r"^[\x20-\x7e]+$"


def text(min_length: int, max_length: int) -> Any:
    """Text of ``min_length`` to ``max_length`` characters, without NUL characters or lone surrogates.

    The lengths sit with the string's own constraints: given with ``Field``
    on top of the validator, pydantic checks them after it and counts
    "items" in its message instead of characters.
    """
    return Annotated[
        str,
        StringConstraints(min_length=min_length, max_length=max_length, pattern=NO_NUL),
        AfterValidator(_plain_text),
    ]


def _integral(value: Any) -> Any:
    # JSON Schema calls 5.0 an integer, so a client generated from the spec may
    # send it; strict records would refuse it. Whole floats become ints here;
    # anything else (5.5, "5", true) still fails the strict int check.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(ge: int, le: int) -> Any:
    """An integer in ``[ge, le]`` for a strict JSON body, accepting 5.0 as JSON Schema does."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


QueueName = Annotated[
    str,
    Field(
        pattern=QUEUE_NAME_PATTERN,
        description="1-63 of a-z, 0-9, '_', '.', '-', not starting with '.' or '-'.",
        examples=["default"],
    ),
]

JobType = Annotated[text(1, 200), Field(examples=["send_email"])]

#: A character Python's str.strip() keeps and relay_core allows in a type (no control character).
_VISIBLE = r"[^\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
#: A job type's text: no control character (C0, DEL or C1), and one that str.strip() keeps at
#: either end, as relay_core requires; spelled so JSON Schema, pydantic's regex engine
#: and relay_core's check_type agree on it.
JOB_TYPE_TEXT = rf"^{_VISIBLE}(?:[^\x00-\x1f\x7f-\x9f]*{_VISIBLE})?$"


#: The type of a new job: relay_core refuses an empty one, control characters and whitespace at either end.
NewJobType = Annotated[
    str,
    StringConstraints(min_length=1, max_length=200, pattern=JOB_TYPE_TEXT),
    AfterValidator(_plain_text),
    Field(examples=["send_email"]),
]

JobId = Annotated[int, Field(ge=1, le=BIGINT_MAX, examples=[42])]


#: RFC 3339's date-time: a full date, a time, and a UTC offset, in the digits 0-9 (a str
#: pattern's \d matches every script's digits, which RFC 3339 does not allow).
DATE_TIME = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def _date_time_text(value: Any) -> Any:
    # pydantic reads a string of digits as Unix seconds (or milliseconds, when
    # large), so "1700000000" would schedule a job at a moment the client never
    # wrote. Text must be a date-time, read here; other JSON types fail the strict check.
    if not isinstance(value, str):
        return value
    if not DATE_TIME.fullmatch(value):
        raise ValueError("must be an RFC 3339 date-time with a UTC offset, such as 2026-12-01T09:30:00Z")
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError:
        # Python's own reason names its internals ("offset must be a timedelta ...").
        raise ValueError(
            "is not a moment that exists: the month must be 01-12, the day one that month has,"
            " the hour 00-23, minutes and seconds 00-59, and the UTC offset between -23:59 and +23:59"
        ) from None


#: A moment given by a client: RFC 3339 text with its UTC offset.
Moment = Annotated[AwareDatetime, BeforeValidator(_date_time_text)]


def _canonical_digits(value: Any) -> Any:
    # pydantic's lax mode reads "2_2", " 5", "22.0" and "+5" as integers; a
    # parameter must be spelled as Relay writes numbers, or it is refused.
    if isinstance(value, str) and not CANONICAL_NUMBER.fullmatch(value):
        raise ValueError("must be a whole number in plain digits 0-9 (no sign, space, point or leading zero)")
    return value


def parameter_integer(ge: int, le: int) -> Any:
    """An integer in ``[ge, le]`` read from a URL path or query string, spelled canonically."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_canonical_digits)]


#: A job id in a URL.
JobIdParameter = Annotated[parameter_integer(1, BIGINT_MAX), Field(examples=[42])]


class Record(BaseModel):
    """A response record: immutable, and exactly the fields it declares."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class QueryRecord(BaseModel):
    """Query-string or path parameters: text on the wire, coerced to types, unknown names refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BodyRecord(BaseModel):
    """A JSON request body: strict types (no "5" for 5), unknown fields refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FieldError(Record):
    """One bad field of a request."""

    field: str = Field(description="The parameter or body member at fault (dotted for nested members).")
    in_: Literal["query", "path", "header", "body"] = Field(alias="in", serialization_alias="in")
    detail: str

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ProblemRecord(Record):
    """RFC 9457 problem details: the body of every error response."""

    type: str = Field(description="A URI naming the kind of problem; about:blank means only the status matters.")
    title: str
    status: int = Field(ge=400, le=599)
    detail: str
    instance: str | None = Field(default=None, description="The path the problem happened on.")
    errors: list[FieldError] | None = Field(default=None, description="Each bad field, for validation problems.")
    job_id: JobId | None = Field(default=None, description="The job an illegal transition was asked of.")
    current_status: StatusName | None = Field(default=None, description="That job's state at the time.")
    allowed_from: list[StatusName] | None = Field(default=None, description="The states the action is allowed from.")
    retry_after: int | None = Field(default=None, description="Seconds to wait before trying again (also a header).")
    action: Literal["requeue", "cancel"] | None = Field(
        default=None, description="The bulk action that stopped part way (bulk-incomplete problems)."
    )
    changed: int | None = Field(
        default=None, ge=0, description="How many jobs the bulk action changed before it stopped; they stay changed."
    )


def parse_moment(value: Any) -> datetime | None:
    """A timestamp from a job's stored error history, in UTC; None when it is not one.

    Relay's workers write ISO 8601 text from the database clock, but the
    history is JSON anyone with SQL access can write: text that is no
    timestamp, or one a datetime cannot hold in UTC (9999-12-31 23:00 at
    -05:00 is year 10000 there), is shown as unknown instead of failing the page.
    """
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        return None
