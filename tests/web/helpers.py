"""Assertions shared by the web tests."""

from __future__ import annotations

from typing import Any

from relay_web.records.common import ProblemRecord

#: Text that must never reach a client: stack traces, SQL, driver and class names.
LEAKS = ("Traceback", "psycopg", "SELECT ", "UPDATE ", "relay.jobs", 'File "', "Exception", "Error(")


def assert_problem(response: Any, status: int, slug: str | None = None) -> dict[str, Any]:
    """The response is an RFC 9457 problem with this status (and type), in the shape the OpenAPI
    document promises (no undeclared member), and leaks nothing."""
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    body = response.get_json()
    ProblemRecord.model_validate(body)
    assert body["status"] == status
    if slug is not None:
        assert body["type"] == f"urn:relay:problem:{slug}", body
    text = response.get_data(as_text=True)
    for leak in LEAKS:
        assert leak not in text, f"{leak!r} leaked: {text}"
    return body


def refused_job_errors(client: Any, admin: dict[str, str], db: Any, data: str) -> list[dict[str, Any]]:
    """POST ``data`` (raw JSON) as a job: refused with a 422 and nothing stored; the field errors."""
    response = client.post("/api/admin/jobs", headers=admin, data=data, content_type="application/json")
    body = assert_problem(response, 422, "validation")
    assert db.execute("SELECT count(*) FROM relay.jobs").fetchone()[0] == 0
    return body["errors"]
