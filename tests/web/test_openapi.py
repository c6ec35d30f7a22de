"""The OpenAPI document: complete, generated from the records, and true of the live app.

The fuzz run generates requests from /api/openapi.json (valid and invalid
ones) and checks every answer against the same document: no 500, only
documented statuses, content types, headers and bodies.
"""

from __future__ import annotations

import re
from typing import Any

import schemathesis
from flask import Flask
from flask_jwt_extended import create_access_token
from hypothesis import HealthCheck, settings

from relay_core.monitor import MAX_PAGE
from relay_web import create_app
from relay_web.records.jobs import EnqueueBody

from .conftest import SECRET

#: Examples per operation: enough to find shape bugs, small enough for CI (about 15 s in all).
FUZZ_EXAMPLES = 150

# The document needs no database; requests go to each test's own app (see test_fuzz).
SPEC_APP = create_app(
    {"TESTING": True, "RELAY_DATABASE_URL": "postgresql://unused@127.0.0.1:1/unused", "JWT_SECRET_KEY": SECRET}
)
schema = schemathesis.openapi.from_wsgi("/api/openapi.json", SPEC_APP)

with SPEC_APP.app_context():
    # Access tokens are checked by signature and claims only, so one token serves every test's app.
    ADMIN_TOKEN = create_access_token(identity="1", additional_claims={"role": "admin", "username": "fuzz"})


@schema.auth()
class AdminToken:
    """Authenticate generated requests as an admin (schemathesis still tries them without)."""

    def get(self, case: Any, context: Any) -> str:
        return ADMIN_TOKEN

    def set(self, case: Any, data: str, context: Any) -> None:
        case.headers = case.headers or {}
        case.headers["Authorization"] = f"Bearer {data}"


@schema.parametrize()
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzz(case: Any, app: Flask) -> None:
    case.call_and_validate(app=app)


def _document(client) -> dict[str, Any]:
    response = client.get("/api/openapi.json")
    assert response.status_code == 200 and response.mimetype == "application/json"
    return response.get_json()


def test_every_route_is_described(app: Flask, client) -> None:
    doc = _document(client)
    described = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    for rule in app.url_map.iter_rules():
        if rule.endpoint in ("static", "api.spec.openapi") or rule.endpoint.startswith("dashboard."):
            continue  # the dashboard's HTML pages are not part of the JSON API
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert (path, method.lower()) in described, f"{method} {rule.rule} is not in the document"


def test_the_document_refuses_query_parameters_as_every_api_endpoint_does(client) -> None:
    """docs/api.md: an unknown query parameter is a 422; the document's own view took any."""
    for query in ("x=1", "x=1&x=2"):
        response = client.get(f"/api/openapi.json?{query}")
        assert response.status_code == 422 and response.mimetype == "application/problem+json", query
        assert response.get_json()["errors"] == [{"field": "x", "in": "query", "detail": "is not a known parameter"}]


def test_errors_are_documented_as_problems(client) -> None:
    doc = _document(client)
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            errors = {s: r for s, r in operation["responses"].items() if int(s) >= 400}
            assert "500" in errors and "503" in errors, (method, path)
            for status, response in errors.items():
                assert response["content"] == {
                    "application/problem+json": {"schema": {"$ref": "#/components/schemas/ProblemRecord"}}
                }, (method, path, status)
            if operation["security"]:
                assert "401" in errors, (method, path)


def test_refused_query_parameters_are_documented(client, auth) -> None:
    """An endpoint that refuses a query parameter it does not know lists that 422 in the document."""
    doc = _document(client)
    admin = auth.headers("admin")
    refresh = {"Authorization": f"Bearer {auth.tokens('admin')['refresh_token']}"}
    calls = [("get", path, admin) for path, ops in doc["paths"].items() if "get" in ops and "{" not in path]
    calls.append(("post", "/api/auth/refresh", refresh))
    refused = []
    for method, path, headers in calls:
        response = getattr(client, method)(f"{path}?unknown=1", headers=headers)
        if response.status_code == 422:
            refused.append(path)
            assert "422" in doc["paths"][path][method]["responses"], (method, path)
    assert {"/api/admin/stats", "/api/admin/queues", "/api/admin/workers", "/api/auth/refresh"} <= set(refused)


def test_document_comes_from_the_records(client) -> None:
    doc = _document(client)
    params = {p["name"]: p for p in doc["paths"]["/api/admin/jobs"]["get"]["parameters"]}
    assert set(params) == {"status", "queue", "type", "q", "limit", "cursor"}
    assert params["limit"]["schema"]["maximum"] == MAX_PAGE
    assert params["status"]["schema"]["enum"] == ["queued", "claimed", "succeeded", "dead", "cancelled"]
    body = doc["components"]["schemas"]["EnqueueBody"]
    assert body["additionalProperties"] is False
    assert set(body["properties"]) == set(EnqueueBody.model_fields)
    enqueue = doc["paths"]["/api/admin/jobs"]["post"]
    assert {"201", "200", "409", "422", "403"} <= set(enqueue["responses"])
    assert [p["name"] for p in enqueue["parameters"]] == ["Idempotency-Key"]
    assert doc["components"]["securitySchemes"]["bearerAuth"]["bearerFormat"] == "JWT"
    assert doc["paths"]["/api/auth/login"]["post"]["security"] == []


def test_a_bulk_filter_is_optional_but_never_null_in_the_document(client) -> None:
    """The server refuses a filter given as null (it widened the action to every job before):
    the document must not offer null, nor name null as a default a generated client would send."""
    doc = _document(client)
    for name in ("RequeueFilter", "CancelFilter"):
        body = doc["components"]["schemas"][name]
        assert body.get("required", []) == [], name
        for field, schema in body["properties"].items():
            assert "default" not in schema and "anyOf" not in schema, (name, field, schema)
            assert schema["type"] == "string", (name, field, schema)
    assert "description" in doc["components"]["schemas"]["CancelFilter"]["properties"]["queue"]


def test_descriptions_are_plain_paragraphs_and_say_what_the_server_does(client) -> None:
    """Docstrings kept their 4-space indentation, which Markdown renders as code; and the enqueue's
    description said a run_at the first job was not given answers 409, where the server (and
    docs/api.md) says so only while the first job has never been claimed."""
    spec = client.get("/api/openapi.json").get_json()
    operations = [op for path in spec["paths"].values() for op in path.values()]
    indented = [op["summary"] for op in operations if re.search(r"^ {4}", op.get("description", ""), re.M)]
    assert not indented, indented
    enqueue = spec["paths"]["/api/admin/jobs"]["post"]
    assert "run_at it gives while the first job has never been claimed" in " ".join(enqueue["description"].split())
    assert "Idempotency-Key" in enqueue["responses"]["409"]["description"]
