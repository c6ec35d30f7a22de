"""One error shape: every failure is RFC 9457 problem details, and nothing internal leaks."""

from __future__ import annotations

import gzip
import io
import json
from decimal import Decimal

import psycopg
import pytest
from flask import Flask
from werkzeug.test import EnvironBuilder, run_wsgi_app

from relay_core import ConfigurationError

from .helpers import assert_problem, refused_job_errors


def test_unknown_route_is_a_404_problem(client) -> None:
    for path in ("/nope", "/api", "/api/admin", "/api/admin/jobs/1/explode"):
        body = assert_problem(client.get(path), 404)
        assert body["type"] == "about:blank" and body["instance"] == path


def test_wrong_method_is_a_405_problem_with_allow(client, admin) -> None:
    response = client.delete("/api/admin/jobs/1", headers=admin)
    assert_problem(response, 405)
    assert "GET" in response.headers["Allow"]
    assert_problem(client.get("/api/auth/login"), 405)
    assert_problem(client.put("/metrics"), 405)


def test_malformed_body_is_400_and_wrong_type_is_415(client, admin) -> None:
    body = assert_problem(
        client.post("/api/admin/jobs", headers=admin, data="{not json", content_type="application/json"), 400
    )
    assert "JSON" in body["detail"]
    assert_problem(client.post("/api/admin/jobs", headers=admin, data="type=x"), 415)
    assert_problem(client.post("/api/auth/login", data="{}", content_type="text/plain"), 415)


def test_a_number_too_long_to_read_is_named_not_called_invalid_json(client, admin, db) -> None:
    for number in ("1" * 4301, "-" + "1" * 4301, "1" + "0" * 4400 + ".5"):
        data = '{"type": "t", "payload": {"n": ' + number + "}}"
        response = client.post("/api/admin/jobs", headers=admin, data=data, content_type="application/json")
        body = assert_problem(response, 422, "validation")
        assert "4,300 digits" in body["errors"][0]["detail"], body
        assert "not valid JSON" not in json.dumps(body)
    data = '{"type": "t", "payload": {"n": ' + "1" * 4300 + "}}"
    assert client.post("/api/admin/jobs", headers=admin, data=data, content_type="application/json").status_code == 201
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1


@pytest.mark.parametrize("escaped", ["\\ud83d", "\\udc00x", "\\ud83d\\ud83d"])
def test_half_a_surrogate_pair_is_named_not_called_invalid_json(client, admin, db, escaped: str) -> None:
    """Valid JSON (JavaScript writes it for a string cut inside an emoji), but no text: a 422 naming it."""
    for path, data in (
        ("/api/admin/jobs", '{"type": "t", "payload": {"to": "' + escaped + '"}}'),
        ("/api/auth/login", '{"username": "ops", "password": "' + escaped + '"}'),
    ):
        response = client.post(path, headers=admin, data=data, content_type="application/json")
        body = assert_problem(response, 422, "validation")
        assert "half of a UTF-16 surrogate pair" in body["errors"][0]["detail"], body
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0
    broken = '{"type": "t", "payload": {"to": "\\u12"}}'
    response = client.post("/api/admin/jobs", headers=admin, data=broken, content_type="application/json")
    assert assert_problem(response, 400)["detail"] == "The body is not valid JSON."


@pytest.mark.parametrize("number", ["1e400", "-1e99999999999999999999", "NaN", "Infinity"])
def test_a_number_no_float_holds_is_refused_saying_how_to_send_it(client, admin, db, number: str) -> None:
    """1e400 is valid JSON, read as infinity: "should be a finite number" told a client its finite number was not."""
    data = '{"type": "t", "payload": {"v": ' + number + "}}"
    assert refused_job_errors(client, admin, db, data) == [
        {
            "field": "payload.v",
            "in": "body",
            "detail": "must be a finite number: not NaN or Infinity, and one past a float's range (1e400) as a string",
        }
    ]


@pytest.mark.parametrize(
    "number", ["1e-400", "12345678901234567.5", "0.10000000000000000001", "1e-99999999999999999999"]
)
def test_a_number_a_float_would_change_is_refused_not_stored_changed(client, admin, db, number: str) -> None:
    """Read as a float, 1e-400 was stored as 0.0 and 12345678901234567.5 as 12345678901234568."""
    data = '{"type": "t", "payload": {"amount": ' + number + "}}"
    assert refused_job_errors(client, admin, db, data) == [
        {
            "field": "body",
            "in": "body",
            "detail": f"holds numbers a float would change ({number}): send them as strings",
        }
    ]


def test_numbers_a_float_keeps_are_stored_as_their_values(client, admin, db) -> None:
    data = (
        '{"type": "t", "payload": {"a": 0.1, "b": 2.50, "c": 1E+2, "d": -0.0, "e": 5e-324, "f": 12345678901234567,'
        ' "g": 0e99999999999999999999}}'
    )
    response = client.post("/api/admin/jobs", headers=admin, data=data, content_type="application/json")
    assert response.status_code == 201, response.get_json()
    (stored,) = db.execute("SELECT payload::text FROM relay.jobs").fetchone()
    assert json.loads(stored, parse_float=Decimal) == {
        "a": Decimal("0.1"),
        "b": Decimal("2.5"),
        "c": Decimal("100"),
        "d": Decimal("-0.0"),
        "e": Decimal("5e-324"),
        "f": 12345678901234567,
        "g": Decimal("0"),
    }


@pytest.mark.parametrize("depth", [150, 300, 5000])
def test_a_payload_nested_too_deeply_is_named_not_called_invalid_json(client, admin, db, depth: int) -> None:
    """Past the parser's own recursion limit as well as past Relay's: the same 422 naming the limit."""
    data = '{"type": "t", "payload": ' + "[" * depth + "]" * depth + "}"
    response = client.post("/api/admin/jobs", headers=admin, data=data, content_type="application/json")
    body = assert_problem(response, 422, "validation")
    assert "100 levels" in json.dumps(body) and "not valid JSON" not in json.dumps(body), body
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


def test_a_compressed_body_is_415_not_invalid_json(client, admin, db) -> None:
    for coding in ("gzip", "br", "deflate, gzip"):
        response = client.post(
            "/api/admin/jobs",
            headers={**admin, "Content-Encoding": coding},
            data=gzip.compress(b'{"type": "t"}'),
            content_type="application/json",
        )
        body = assert_problem(response, 415)
        assert "Content-Encoding" in body["detail"]
        assert response.headers["Accept-Encoding"] == "identity"
    identity = client.post("/api/admin/jobs", headers={**admin, "Content-Encoding": "identity"}, json={"type": "t"})
    assert identity.status_code == 201
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 1


def test_body_that_is_not_an_object_is_422(client, admin) -> None:
    for payload in ("[]", "null", "42", '"x"'):
        response = client.post("/api/admin/jobs", headers=admin, data=payload, content_type="application/json")
        assert_problem(response, 422, "validation")


def test_oversized_body_is_413(client, admin) -> None:
    response = client.post("/api/admin/jobs", headers=admin, json={"type": "t", "payload": "x" * (2 * 1024 * 1024)})
    assert_problem(response, 413)


def test_a_raised_payload_limit_raises_the_request_limit_with_it(make_app, auth) -> None:
    """RELAY_MAX_PAYLOAD_BYTES=4 MiB allowed a 2 MiB payload, but every request over 1 MiB was refused with 413."""
    client = make_app(RELAY_MAX_PAYLOAD_BYTES=4 * 1024 * 1024).test_client()
    auth.client = client
    headers = auth.headers("admin")
    created = client.post("/api/admin/jobs", headers=headers, json={"type": "t", "payload": "x" * (2 * 1024 * 1024)})
    assert created.status_code == 201, created.get_json()
    # Past the payload limit but inside the request limit: the 422 that names the payload.
    over = client.post("/api/admin/jobs", headers=headers, json={"type": "t", "payload": "x" * (5 * 1024 * 1024)})
    assert assert_problem(over, 422, "validation")["errors"][0]["field"] == "payload"
    assert_problem(
        client.post("/api/admin/jobs", headers=headers, json={"type": "t", "payload": "x" * (13 * 1024 * 1024)}), 413
    )
    with pytest.raises(ConfigurationError, match="RELAY_MAX_PAYLOAD_BYTES must be at least 1"):
        make_app(RELAY_MAX_PAYLOAD_BYTES=0)
    with pytest.raises(ConfigurationError, match="RELAY_MAX_PAYLOAD_BYTES must be at most 33554432"):
        make_app(RELAY_MAX_PAYLOAD_BYTES=32 * 1024 * 1024 + 1)


def _chunked(app: Flask, headers: dict[str, str], body: bytes) -> tuple[str, dict, bytes]:
    """POST a body without Content-Length, as gunicorn hands a chunked request to the app."""
    environ = EnvironBuilder(
        path="/api/admin/jobs",
        method="POST",
        input_stream=io.BytesIO(body),
        headers={**headers, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
    ).get_environ()
    del environ["CONTENT_LENGTH"]
    environ["wsgi.input_terminated"] = True
    chunks, status, response_headers = run_wsgi_app(app, environ, buffered=True)
    return status, dict(response_headers), b"".join(chunks)


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "t", "payload": "' + b"x" * (2 * 1024 * 1024) + b'"}',
        # Cut at the limit, this one would read as a whole, valid document.
        b'{"type": "t"}' + b" " * (2 * 1024 * 1024),
    ],
)
def test_oversized_chunked_body_is_413_not_read_cut_short(app, admin, db, body: bytes) -> None:
    status, headers, text = _chunked(app, admin, body)
    assert status.startswith("413"), text
    assert headers["Content-Type"] == "application/problem+json"
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0


def test_chunked_body_up_to_the_limit_is_read_whole(app, admin, db) -> None:
    body = b'{"type": "t"}'
    status, _, text = _chunked(app, admin, body + b" " * (1024 * 1024 - len(body)))
    assert status.startswith("201"), text


def test_validation_problem_lists_each_bad_field(client, admin) -> None:
    response = client.post(
        "/api/admin/jobs", headers=admin, json={"type": 5, "priority": "high", "queue": "UPPER", "extra": 1}
    )
    body = assert_problem(response, 422, "validation")
    assert sorted(e["field"] for e in body["errors"]) == ["extra", "priority", "queue", "type"]
    assert all(e["in"] == "body" and e["detail"] for e in body["errors"])


def test_text_too_long_or_empty_is_counted_in_characters(client, admin) -> None:
    login = "/api/auth/login"
    cases = [
        (client.get("/api/admin/jobs?type=" + "t" * 201, headers=admin), "type", "at most 200 characters"),
        # Empty in a listing's query string is as if not given; in an action's body it is refused.
        (client.post("/api/admin/jobs/requeue", headers=admin, json={"q": ""}), "q", "at least 1 character"),
        (client.post(login, json={"username": "u" * 151, "password": "p"}), "username", "at most 150 characters"),
        (client.post(login, json={"username": "u", "password": "p" * 1025}), "password", "at most 1024 characters"),
        (
            client.post("/api/admin/jobs", headers={**admin, "Idempotency-Key": "k" * 201}, json={"type": "t"}),
            "Idempotency-Key",
            "at most 200 characters",
        ),
    ]
    for response, field, detail in cases:
        body = assert_problem(response, 422, "validation")
        (error,) = [e for e in body["errors"] if e["field"] == field]
        assert detail in error["detail"], error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("secret internals: SELECT password_hash FROM relay.users"),
        psycopg.errors.SyntaxError("syntax error at or near SELECT"),
        KeyError("relay.jobs"),
    ],
)
def test_unexpected_errors_are_a_bare_500(make_app, error: Exception, caplog) -> None:
    app: Flask = make_app()

    @app.get("/boom")
    def boom() -> None:
        raise error

    response = app.test_client().get("/boom")
    body = assert_problem(response, 500, "internal")
    assert set(body) == {"type", "title", "status", "detail", "instance"}
    assert "unhandled error" in caplog.text  # the details went to the log instead


def test_every_problem_has_the_same_members(client, admin, viewer) -> None:
    responses = [
        client.get("/missing"),
        client.post("/healthz"),
        client.get("/api/admin/jobs"),
        client.post("/api/admin/jobs/1/requeue", headers=viewer),
        client.get("/api/admin/jobs?limit=0", headers=admin),
        client.get("/api/admin/jobs/1", headers=admin),
    ]
    for response in responses:
        body = response.get_json()
        assert response.mimetype == "application/problem+json"
        assert list(body)[:5] == ["type", "title", "status", "detail", "instance"]
        assert body["status"] == response.status_code


@pytest.mark.parametrize("job_type", ["send\u009b31memail", "send\u0085email", "send\nemail", "\u0080"])
def test_a_job_type_with_a_control_character_is_refused_as_relay_core_refuses_it(
    client, admin, db, job_type: str
) -> None:
    """C1 control characters (U+0080 to U+009F: CSI, NEL) passed the API and were stored, while
    the message of the refusal for C0 ones says a type holds no control characters."""
    data = json.dumps({"type": job_type})
    assert [error["field"] for error in refused_job_errors(client, admin, db, data)] == ["type"]
