"""What became of one run of a job, before it is written down."""

from __future__ import annotations

import json
import re
import traceback as tb
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..job import Job
from ..names import type_name
from ..validation import ESCAPED_NUL, colliding_keys, storable_text

MAX_TRACEBACK_CHARS = 8000
MAX_MESSAGE_CHARS = 2000
MAX_RESULT_BYTES = 64 * 1024


class Kind(StrEnum):
    """How a run ended."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"  # failed, attempts left: back to queued after a delay
    DEAD = "dead"  # failed for good
    SNOOZED = "snoozed"  # back to queued later, attempt not spent
    COMMITTED = "committed"  # transactional success, already written by the run itself
    CANCELLED = "cancelled"  # stopped after an admin asked it to


@dataclass
class Outcome:
    """A finished run waiting for the completer to record it."""

    job: Job
    kind: Kind
    duration: float
    delay: float = 0.0
    message: str | None = None
    error: dict[str, Any] | None = None
    result: str | None = None  # the handler's return value as JSON text
    #: False for a job that ended before its handler was called: its attempt never ran.
    handler_started: bool = True
    #: Seconds the handler's thread may go on after the outcome is written (a shutdown's
    #: grace, see ``shutdown.record_overdue``): the job keeps them as its ``claimed_until``,
    #: so a requeue does not start it beside that thread, and the claim counts it against
    #: its type's ``concurrency`` until then.
    runs_on: float = 0.0
    #: When the completer first found the job's row locked by another session (monotonic), if it has.
    locked_since: float | None = field(default=None, compare=False)
    #: ``error`` as JSON, made once: the completer measures it for its batch, then sends it.
    _error_json: str | None = field(default=None, init=False, repr=False, compare=False)

    def text_bytes(self) -> int:
        """How many bytes this outcome adds to its completion statement: its result, its message and
        its error-history entry as JSON (which repeats the message beside the traceback, and escapes
        control characters in six bytes each), as UTF-8."""
        texts = [self.result or "", self.message or ""]
        if self.error:
            texts.append(self.error_json())
        return sum(len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")) for text in texts)

    def error_json(self) -> str:
        """The error-history entry as JSON text for ``job_fail_many``, its text as UTF-8 rather
        than escaped: ``\\uXXXX`` took six bytes for a character of two or three."""
        if self._error_json is None:
            self._error_json = json.dumps(self.error or {}, default=str, ensure_ascii=False)
        return self._error_json


#: How json.dumps names a value it cannot encode.
_UNSERIALIZABLE = re.compile(r"Object of type (\w{1,200}) is not JSON serializable")


def result_json(value: Any, limit: int = MAX_RESULT_BYTES) -> str | None:
    """A handler's return value as JSON text; None for None, a marker when it cannot be kept."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except TypeError as exc:
        # The value the encoder met, not the whole result's type: {"at": datetime(...)} said "dict".
        met = _UNSERIALIZABLE.fullmatch(str(exc))
        return json.dumps({"unstored_result": f"not JSON-serializable: {met[1] if met else type_name(value)}"})
    except ValueError as exc:
        # NaN or an infinity anywhere in it, or an integer past the digits Python writes: say which,
        # not the type of the whole value (a dict holding a NaN is JSON's but for the NaN).
        return json.dumps({"unstored_result": f"not storable as JSON: {str(exc)[:200]}"})
    except RecursionError:
        return json.dumps({"unstored_result": "nested too deeply"})
    if "\\u0000" in text and ESCAPED_NUL.search(text):
        return json.dumps({"unstored_result": "contains NUL characters"})
    if "{" in text and (collision := colliding_keys(value)) is not None:
        return json.dumps({"unstored_result": f"has keys that JSON cannot tell apart: {collision}"})
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: jsonb would refuse the whole completion
        return json.dumps({"unstored_result": "contains text that is not valid Unicode"})
    if size > limit:
        return json.dumps({"unstored_result": f"over {limit} bytes"})
    return text


def describe(exc: BaseException, job: Job, worker_id: str) -> tuple[str, dict[str, Any]]:
    """A failed attempt's last_error line and its error-history entry."""
    # A class made at run time may have any name: kept to what a type's name reasonably is.
    name = type_name(exc)
    try:
        text = str(exc)
    except BaseException:  # even a KeyboardInterrupt from __str__ must not end the slot
        text = f"<unprintable {name}>"
    message = f"{name}: {text}" if text else name
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    try:
        trace = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException as failure:  # it reads the error's __notes__, __cause__ and __context__: code of the handler's
        trace = f"<the traceback could not be formatted: doing so raised {type_name(failure)}>"
    if len(trace) > MAX_TRACEBACK_CHARS:
        trace = "…" + trace[-(MAX_TRACEBACK_CHARS - 1) :]
    # PostgreSQL text cannot hold NUL, nor can UTF-8 hold lone surrogates (how
    # Python spells undecodable bytes, as in file names); keep the rest intact.
    message = storable_text(message)
    trace = storable_text(trace)
    entry = {
        "attempt": job.attempt,
        "worker": worker_id,
        "type": name,
        "message": message,
        "traceback": trace,
    }
    return message, entry
