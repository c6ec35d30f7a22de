"""Checks every enqueue before anything is written.

A refused enqueue raises :class:`InvalidJobError` naming the field, and the
database is never touched.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import repeat
from typing import Any

from .errors import InvalidJobError
from .finite import finite_real as finite_real  # shared with relay_web, which imports validation

QUEUE_NAME = re.compile(r"^[a-z0-9_][a-z0-9_.-]{0,62}$")
MAX_TYPE_LENGTH = 200
MAX_IDEMPOTENCY_KEY_LENGTH = 200
PRIORITY_RANGE = (-32768, 32767)
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 1024
#: The largest RELAY_MAX_PAYLOAD_BYTES: jsonb holds at most 256 MiB, and a JSON
#: text can take six times its size as jsonb (``[0,0,...]``: 2 bytes of text,
#: 12 of jsonb per element). Past it, a payload under the limit could still be
#: refused by the database, as an error that aborts the caller's transaction.
MAX_PAYLOAD_BYTES_LIMIT = 32 * 1024 * 1024
#: The most one ``enqueue_many`` sends, in characters: its payloads, types,
#: queues and keys, and ``BATCH_JOB_OVERHEAD_CHARS`` per job for the rest. They
#: go as array parameters of one message, which PostgreSQL holds in at most
#: 1 GB: this many characters take at most half of that (4 bytes each in
#: UTF-8, or a quote escaped as two in an array's text).
MAX_BATCH_CHARS = 128 * 1024 * 1024
#: Per job of a batch: its run_at, priority and max_attempts as text, and the
#: arrays' separators and quotes, with room to spare.
BATCH_JOB_OVERHEAD_CHARS = 64
#: Arrays and objects nested deeper than this are refused. Python reads JSON
#: recursively, so a payload near the interpreter's recursion limit could be
#: written but would fail every worker that claims it and every page that shows it.
MAX_PAYLOAD_DEPTH = 100
#: Job ids are PostgreSQL bigints.
BIGINT_MAX = 2**63 - 1
#: A whole number as Relay writes one: ASCII digits, no sign, space,
#: underscore, decimal point or leading zero.
CANONICAL_NUMBER = re.compile(r"0|[1-9][0-9]*")
#: What JSON's encoder writes as arrays and objects.
CONTAINERS = (dict, list, tuple)
#: Members of an array or object past which their types are looked at as a set first.
SCALAR_RUN = 16
#: One encoder for every payload (json.dumps with options builds a new one per call).
PAYLOAD_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class NewJob:
    """An enqueue that passed validation, ready for the insert statement."""

    type: str
    payload_json: str
    queue: str
    priority: int
    run_at: datetime | None
    max_attempts: int
    idempotency_key: str | None

    def params(self) -> dict[str, Any]:
        """Parameters of the ``job_insert`` / ``job_insert_keyed`` statements, but ``notify`` and ``published``,
        which the client adds."""
        return {
            "type": self.type,
            "payload": self.payload_json,
            "queue": self.queue,
            "priority": self.priority,
            "run_at": self.run_at,
            "max_attempts": self.max_attempts,
            "idempotency_key": self.idempotency_key,
        }


#: Control characters (C0, DEL and C1): no job type holds one on purpose, a newline in one
#: would not survive a form (browsers send it back as CRLF), and a C1 one (CSI, NEL) is a
#: terminal escape or a line break to whoever reads the type in a log.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_type(job_type: Any) -> str:
    """A job type is a non-empty string of at most 200 characters, with no control characters
    and no whitespace at either end."""
    if not isinstance(job_type, str) or not job_type.strip():
        raise InvalidJobError("type", "must be a non-empty string")
    if len(job_type) > MAX_TYPE_LENGTH:
        raise InvalidJobError("type", f"must be at most {MAX_TYPE_LENGTH} characters, got {len(job_type)}")
    control = CONTROL_CHARACTER.search(job_type)
    if control:
        raise InvalidJobError(
            "type", f"must not contain control characters (a newline, a tab, NUL), found {control.group()!r}"
        )
    if not is_unicode_text(job_type):
        raise InvalidJobError("type", "contains a lone surrogate, which is not valid Unicode text")
    if job_type != job_type.strip():
        # " send_email" is no handler's type: its jobs would fail every attempt.
        raise InvalidJobError("type", f"must not start or end with whitespace, got {job_type!r}")
    return job_type


def is_unicode_text(text: str) -> bool:
    """Whether ``text`` can be sent as UTF-8: no lone surrogates (which Python strings may hold)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_queue(queue: Any) -> str:
    """Queue names are lowercase letters, digits, '_', '.', '-' (1-63 chars)."""
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise InvalidJobError(
            "queue",
            f"{queue!r} is not a valid queue name (use 1-63 of a-z, 0-9, '_', '.', '-', not starting with '.' or '-')",
        )
    return queue


#: A NUL character as the JSON encoder writes it: ``\u0000`` whose backslash is not itself
#: escaped (``"C:\\u0000"`` in JSON is a backslash followed by "u0000", which jsonb stores).
ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def check_payload(payload: Any, max_bytes: int) -> str:
    """Serialise the payload to JSON, refusing what JSON cannot carry or what is too big."""
    try:
        text = PAYLOAD_ENCODER.encode(payload)
    except (TypeError, ValueError) as exc:
        raise InvalidJobError("payload", f"is not JSON-serializable: {exc}") from None
    except RecursionError:
        raise InvalidJobError("payload", f"is nested deeper than {MAX_PAYLOAD_DEPTH} levels") from None
    # Keys are only where objects are, and depth can pass the limit only with more
    # containers than the limit: two looks at the text spare a list of scalars the walk.
    if "{" in text or text.count("[") > MAX_PAYLOAD_DEPTH:
        problem = payload_problem(payload)
        if problem is not None:
            raise InvalidJobError("payload", problem)
    if "\\u0000" in text and ESCAPED_NUL.search(text):
        raise InvalidJobError("payload", "must not contain NUL characters (PostgreSQL jsonb cannot store them)")
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJobError("payload", "contains a lone surrogate, which is not valid Unicode text") from None
    size = len(encoded)
    if size > max_bytes:
        raise InvalidJobError(
            "payload", f"is {size} bytes as JSON, over the limit of {max_bytes} (RELAY_MAX_PAYLOAD_BYTES)"
        )
    return text


def payload_problem(value: Any, depth: int = 1) -> str | None:
    """What makes ``value`` a payload Relay refuses past what the encoder checks: nesting deeper than
    MAX_PAYLOAD_DEPTH, or a dict key that is not a string; None if nothing.

    JSON's objects have string keys only, and Python's encoder turns an int,
    float, bool or None key into one without a word: ``{1: "a", "1": "b"}``
    would be stored as ``{"1": "b"}``, the first value lost, and a handler
    reading ``payload[1]`` finds nothing. Recursive, but never past the
    depth limit.
    """
    if isinstance(value, dict):
        if not all(map(isinstance, value, repeat(str))):
            key = next(key for key in value if not isinstance(key, str))
            return f"has a key that is not a string: {repr(key)[:40]} ({type(key).__name__})"
        members = value.values()
    elif isinstance(value, (list, tuple)):
        members = value
    else:
        return None
    if depth > MAX_PAYLOAD_DEPTH:
        return f"is nested deeper than {MAX_PAYLOAD_DEPTH} levels"
    if scalars_only(members):
        return None
    for member in members:
        if isinstance(member, CONTAINERS) and (problem := payload_problem(member, depth + 1)) is not None:
            return problem
    return None


def scalars_only(members: Any) -> bool:
    """Whether a long run of members holds no dict, list or tuple, told by their types' set (built at C speed)."""
    return len(members) > SCALAR_RUN and not any(issubclass(kind, CONTAINERS) for kind in set(map(type, members)))


def colliding_keys(value: Any) -> str | None:
    """Keys of one dict in ``value`` that JSON writes as the same string (``1`` and ``"1"``), described; else None.

    Only such keys lose a value when encoded: ``{200: 5, 404: 1}`` is kept as
    ``{"200": 5, "404": 1}``. Without recursion: ``value`` may nest as deep
    as the encoder takes, which need not be within what Python recursion reaches.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if not all(map(isinstance, item, repeat(str))):
                written: dict[str, Any] = {}
                for key in item:
                    text = key if isinstance(key, str) else json.dumps(key)
                    if text in written:
                        return f"{written[text]!r} and {key!r} are both {text!r} in JSON"[:200]
                    written[text] = key
            members = item.values()
        elif isinstance(item, (list, tuple)):
            members = item
        else:
            continue
        if not scalars_only(members):
            stack.extend(member for member in members if isinstance(member, CONTAINERS))
    return None


def check_run_at(run_at: Any) -> datetime | None:
    """``run_at`` is None (now) or a timezone-aware datetime whose UTC instant a datetime can hold."""
    if run_at is None:
        return None
    if not isinstance(run_at, datetime):
        raise InvalidJobError("run_at", f"must be a datetime, got {type(run_at).__name__}")
    if run_at.tzinfo is None or run_at.tzinfo.utcoffset(run_at) is None:
        raise InvalidJobError("run_at", "must be timezone-aware (a naive datetime's time zone is a guess)")
    try:
        # In UTC: a bulk enqueue sends run_at as text in an array, and PostgreSQL
        # reads no offset of 16 hours or more, nor one with seconds or microseconds.
        return run_at.astimezone(UTC)
    except OverflowError:
        # PostgreSQL would store such an instant (year 0 or 10000 in UTC), but
        # no Python datetime can hold it, so every later read of the job fails.
        raise InvalidJobError("run_at", "must fall between the years 1 and 9999 in UTC") from None


def check_job_id(job_id: Any) -> int:
    """A job id: an int (not a bool) from 1 up to PostgreSQL's bigint."""
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 1 <= job_id <= BIGINT_MAX:
        raise InvalidJobError("job_id", f"must be an int from 1 to {BIGINT_MAX}, got {job_id!r}")
    return job_id


def check_priority(priority: Any) -> int:
    """Priorities are integers that fit a smallint; lower runs first."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidJobError("priority", f"must be an integer, got {type(priority).__name__}")
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise InvalidJobError("priority", f"must be between {low} and {high}")
    return priority


def check_max_attempts(max_attempts: Any) -> int:
    """At least one attempt, at most 1000."""
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts <= 1000:
        raise InvalidJobError("max_attempts", "must be an integer between 1 and 1000")
    return max_attempts


def check_idempotency_key(key: Any) -> str | None:
    """None, or a non-empty string of at most 200 characters."""
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        raise InvalidJobError(
            "idempotency_key", f"must be a non-empty string of at most {MAX_IDEMPOTENCY_KEY_LENGTH} characters"
        )
    if "\x00" in key:
        # PostgreSQL text cannot hold it; said as it is, not as a length the key is within.
        raise InvalidJobError("idempotency_key", "must not contain a NUL character ('\\x00')")
    if not is_unicode_text(key):
        raise InvalidJobError("idempotency_key", "contains a lone surrogate, which is not valid Unicode text")
    return key


def check_seconds(field_name: str, value: Any, *, most: float | None = None, too_long: str | None = None) -> float:
    """A positive, finite number of seconds, at most ``most`` when given (``too_long`` says so).

    Compared before any conversion: ``float(10**400)`` raises OverflowError,
    while Python compares an integer of any size with a float exactly.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidJobError(field_name, "must be a positive number of seconds")
    if value > (sys.float_info.max if most is None else most):
        limit = "is too large a number of seconds" if most is None else f"must be at most {most:g} seconds"
        raise InvalidJobError(field_name, too_long or limit)
    return float(value)


def new_job(
    job_type: Any,
    payload: Any,
    *,
    queue: Any,
    priority: Any,
    run_at: Any,
    max_attempts: Any,
    idempotency_key: Any,
    max_payload_bytes: int,
) -> NewJob:
    """Validate every field of an enqueue; raise on the first bad one."""
    return NewJob(
        type=check_type(job_type),
        payload_json=check_payload(payload, max_payload_bytes),
        queue=check_queue(queue),
        priority=check_priority(priority),
        run_at=check_run_at(run_at),
        max_attempts=check_max_attempts(max_attempts),
        idempotency_key=check_idempotency_key(idempotency_key),
    )


def positive_number(text: str) -> int | None:
    """``text`` as an id (1 up to PostgreSQL's bigint) when it is written canonically, else None.

    Python's int() also reads "2_2", " 5", "+5" and "٥", so a mistyped id
    would name a real job; only the spelling Relay itself writes is a number.
    """
    if len(text) > len(str(BIGINT_MAX)) or not CANONICAL_NUMBER.fullmatch(text):
        return None
    number = int(text)
    return number if 1 <= number <= BIGINT_MAX else None


def storable_text(text: str) -> str:
    """``text`` with what PostgreSQL text cannot hold escaped: NUL, and lone surrogates."""
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
