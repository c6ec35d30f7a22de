"""The ``@endpoint`` decorator: one declaration drives checking, parsing and the spec.

A view declares who may call it and the records of its path, query, headers,
body and responses. The decorator checks the token, parses every input into
its record (422 problem listing each bad field otherwise), calls the view
with the records, and serialises the record it returns. The OpenAPI document
reads the same declarations, so the spec cannot drift from the code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

from flask import Response, json, request
from pydantic import BaseModel, ValidationError

from relay_core.validation import MAX_PAYLOAD_DEPTH

from . import auth
from .bodies import read_body, scan_body
from .problems import Problem, validation_problem
from .records.common import HEADER_TEXT, JOB_TYPE_TEXT, NO_NUL

#: The view keyword argument each input arrives as.
KWARGS = {"path": "path", "query": "query", "header": "headers"}

#: Problems every endpoint may answer.
COMMON_PROBLEMS = (500, 503)


@dataclass(frozen=True)
class Reply:
    """A view's answer when it needs another status or extra headers."""

    record: BaseModel
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


#: Methods whose requests are not checked for a body they should not carry.
BODILESS_METHODS = ("GET", "HEAD", "OPTIONS")


@dataclass(frozen=True)
class Endpoint:
    """Everything the app and the spec know about one view."""

    summary: str
    description: str
    tag: str
    role: str | None = None
    refresh: bool = False
    path: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    headers: type[BaseModel] | None = None
    body: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel] | None] = field(default_factory=dict)
    media_type: str = "application/json"
    problems: tuple[int, ...] = ()
    response_headers: dict[int, dict[str, str]] = field(default_factory=dict)
    security: str | None = None
    #: Probes and scrapers: a query string (an uptime checker's cache buster) is ignored, not refused.
    ignores_query: bool = False
    #: A body sent to an endpoint without one is ignored, not refused (see ``_sent_a_body``): for
    #: the token refresh, whose clients often send the refresh token in a body as well.
    ignores_body: bool = False

    def all_problems(self, method: str = "GET") -> list[int]:
        """Every error status this endpoint can answer to ``method``, for the spec."""
        found = set(self.problems) | set(COMMON_PROBLEMS)
        if not self.body and not self.ignores_body and method not in BODILESS_METHODS:
            found.update({413, 422})  # a body it does not take: refused, or too large to read
        if self.role or self.refresh:
            found.add(401)
        if self.role == "admin":
            found.add(403)
        if self.path or self.query or self.headers or self.body or not self.ignores_query:
            found.add(422)  # a bad field, or a query parameter this endpoint does not know
        if self.body:
            found.update({400, 413, 415})
        return sorted(found)


def _detail(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "is invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    if error.get("type") == "extra_forbidden":
        message = "is not a known field"
    if error.get("type") == "finite_number":
        # Also what a number past a float's range gets: JSON allows 1e400, and it reads as infinity.
        message = "must be a finite number: not NaN or Infinity, and one past a float's range (1e400) as a string"
    if error.get("type") == "string_pattern_mismatch":
        pattern = error.get("ctx", {}).get("pattern")
        if pattern == NO_NUL:
            message = "must not contain NUL characters"
        elif pattern == HEADER_TEXT:
            message = "must be printable ASCII (letters, digits, punctuation, spaces)"
        elif pattern == JOB_TYPE_TEXT:
            message = (
                "must contain a visible character, no control characters (a newline, a tab, NUL) "
                "and no whitespace at either end"
            )
    return message


def _field_errors(exc: ValidationError, where: str) -> list[dict[str, Any]]:
    errors = []
    for error in exc.errors(include_url=False, include_input=False):
        loc = [str(part) for part in error.get("loc", ())]
        errors.append({"field": ".".join(loc) or where, "in": where, "detail": _detail(dict(error))})
    return errors


def _single_values(pairs: Any, where: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    values: dict[str, str] = {}
    errors: list[dict[str, Any]] = []
    for name in pairs:
        given = pairs.getlist(name)
        if len(given) > 1:
            errors.append({"field": name, "in": where, "detail": "give it once"})
        values[name] = given[0]
    return values, errors


def _valid_but_refused(reason: str, raw: bytes) -> None:
    # Three limits of the JSON parser refuse valid JSON, and saying "not valid
    # JSON" would send a client looking for a syntax error that is not there.
    # Numbers of up to 4,300 digits are read (Python's own limit for
    # int <-> str); a longer one is "out of range". Arrays and objects nested
    # past the parser's recursion limit are refused before Relay's own
    # payload depth check could name the limit, so it is named here. A \u
    # escape of half a UTF-16 surrogate pair is valid JSON (JavaScript writes
    # one for a string cut inside an emoji) but no text: a 422 like any other
    # text that is not valid Unicode.
    if "surrogate" in reason or "hex escape" in reason:
        try:
            json.loads(raw)
        except (ValueError, RecursionError):
            return  # broken JSON after all (``\u12"``)
        detail = "has a string with half of a UTF-16 surrogate pair (a lone \\ud800-\\udfff); send both halves"
        raise validation_problem([{"field": "body", "in": "body", "detail": detail}])
    if reason.startswith("number out of range"):
        where = reason.removeprefix("number out of range").strip()
        detail = f"has a number with more than 4,300 digits ({where}); send it as a string"
        raise validation_problem([{"field": "body", "in": "body", "detail": detail}])
    if reason.startswith("recursion limit exceeded"):
        detail = f"nests arrays and objects too deeply; a payload may nest at most {MAX_PAYLOAD_DEPTH} levels"
        raise validation_problem([{"field": "body", "in": "body", "detail": detail}])


def _parse_body(model: type[BaseModel]) -> BaseModel:
    if not request.is_json:
        raise Problem(415, "Unsupported Media Type", "Send the body as application/json.")
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity"):
        # Relay does not decompress bodies; say so (RFC 9110 section 15.5.16)
        # rather than read the compressed bytes as broken JSON.
        raise Problem(
            415,
            "Unsupported Media Type",
            "Send the body without Content-Encoding: Relay does not decompress request bodies.",
            headers={"Accept-Encoding": "identity"},
        )
    raw = read_body()
    try:
        body = model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        invalid = [e for e in exc.errors(include_url=False) if e.get("type") == "json_invalid"]
        if invalid:
            _valid_but_refused(str(invalid[0].get("ctx", {}).get("error", "")), raw)
            raise Problem(400, "Bad Request", "The body is not valid JSON.") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in exc.errors(include_url=False)):
            raise validation_problem([{"field": "body", "in": "body", "detail": "must be a JSON object"}]) from None
        raise validation_problem(_field_errors(exc, "body")) from None
    scan = scan_body(raw)
    errors = [{"field": key, "in": "body", "detail": "give it once"} for key in scan.repeated]
    if scan.repeated_nested:
        named = ", ".join(json.dumps(key) for key in scan.repeated_nested)
        errors.append({"field": "body", "in": "body", "detail": f"repeats a key within one object: {named}"})
    if scan.inexact:
        shown = ", ".join(number if len(number) <= 40 else number[:37] + "..." for number in scan.inexact[:5])
        errors.append(
            {
                "field": "body",
                "in": "body",
                "detail": f"holds numbers a float would change ({shown}): send them as strings",
            }
        )
    if errors:
        raise validation_problem(errors)
    return body


def _sent_a_body() -> bool:
    """Whether the request carries a body that says something: anything but none, or ``{}``.

    An endpoint without a body reads nothing from one, so ``{"dry_run": true}``
    sent to a cancel would be ignored and the job cancelled. Refused, as an
    unknown query parameter is, nothing happens. An empty object or ``null``,
    which some HTTP clients send with every POST, asks for nothing and passes.
    """
    if request.method in BODILESS_METHODS:
        return False
    raw = read_body()
    if not raw.strip():
        return False
    try:
        return json.loads(raw) not in ({}, None)
    except (ValueError, RecursionError):
        return True


def undecodable_query() -> list[dict[str, Any]]:
    """An error for a query string that is not UTF-8 once percent-decoded, else none.

    Werkzeug reads such bytes as U+FFFD, so ``?type=%ff`` searched for a
    replacement character and answered an empty page instead of saying the
    request was wrong.
    """
    try:
        unquote_to_bytes(request.query_string).decode("utf-8")
    except UnicodeDecodeError:
        return [{"field": "query", "in": "query", "detail": "is not valid UTF-8 once percent-decoded"}]
    return []


def unknown_query_parameters() -> list[dict[str, Any]]:
    """The request's query parameters as errors, for a view that takes none."""
    return [{"field": name, "in": "query", "detail": "is not a known parameter"} for name in request.args]


def _parse_inputs(spec: Endpoint, view_args: dict[str, Any]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    errors: list[dict[str, Any]] = []
    sources: list[tuple[str, type[BaseModel] | None, dict[str, Any]]] = []
    if spec.path:
        sources.append(("path", spec.path, dict(view_args)))
    if not spec.ignores_query and (undecodable := undecodable_query()):
        raise validation_problem(undecodable)
    if spec.query:
        values, repeated = _single_values(request.args, "query")
        errors.extend(repeated)
        if getattr(spec.query, "empty_means_absent", False):
            # Only the record's own parameters: an unknown one (``?stauts=``) is still named.
            known = spec.query.model_fields
            values = {name: value for name, value in values.items() if value != "" or name not in known}
        sources.append(("query", spec.query, values))
    elif not spec.ignores_query:
        errors.extend(unknown_query_parameters())
    if spec.headers:
        names = [f.alias or n for n, f in spec.headers.model_fields.items()]
        sources.append(("header", spec.headers, {n: request.headers[n] for n in names if n in request.headers}))
    for where, model, values in sources:
        try:
            parsed[KWARGS[where]] = model.model_validate(values)  # type: ignore[union-attr]
        except ValidationError as exc:
            errors.extend(_field_errors(exc, where))
    if not spec.body and not spec.ignores_body and _sent_a_body():
        errors.append({"field": "body", "in": "body", "detail": "this endpoint takes no body; send none"})
    if errors:
        raise validation_problem(errors)
    if spec.body:
        parsed["body"] = _parse_body(spec.body)
    return parsed


def _respond(spec: Endpoint, result: Any) -> Response:
    if isinstance(result, Response):
        return result
    reply = result if isinstance(result, Reply) else Reply(result, min(spec.responses or {200: None}))
    body = json.dumps(reply.record.model_dump(mode="json", by_alias=True))
    response = Response(body, status=reply.status, mimetype=spec.media_type)
    for name, value in reply.headers.items():
        response.headers[name] = value
    return response


def endpoint(**declaration: Any) -> Callable[[Callable[..., Any]], Callable[..., Response]]:
    """Declare a view: ``summary``, ``tag``, ``role``, ``path``/``query``/``headers``/``body`` records, ``responses``.

    The view receives the parsed records as keyword arguments named ``path``,
    ``query``, ``headers``, ``body`` and, when authenticated, ``claims``.
    """

    def wrap(view: Callable[..., Any]) -> Callable[..., Response]:
        # cleandoc: a description keeps no docstring indentation, which Markdown reads as a code block.
        doc = inspect.cleandoc(view.__doc__ or "")
        spec = Endpoint(summary=declaration.pop("summary", doc.split("\n")[0]), description=doc, **declaration)

        @functools.wraps(view)
        def run(**view_args: Any) -> Response:
            kwargs: dict[str, Any] = {}
            if spec.role:
                kwargs["claims"] = auth.require(spec.role)
            elif spec.refresh:
                kwargs["claims"] = auth.refresh_claims()
            kwargs.update(_parse_inputs(spec, view_args))
            return _respond(spec, view(**kwargs))

        run.relay_endpoint = spec  # type: ignore[attr-defined]
        return run

    return wrap
